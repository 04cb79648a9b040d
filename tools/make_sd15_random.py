"""Write a Stable Diffusion 1.5-architecture pipeline with random weights at the real sizes.

Same classes and configs as runwayml/stable-diffusion-v1-5 (UNet 320/640/1280/1280 with
cross-attention dim 768 and 8 heads, 2 layers per block, sample size 64; CLIP ViT-L/14 text
encoder: hidden 768, 12 layers, 12 heads, MLP 3072, 77 positions, vocabulary 49408, quick_gelu;
the SD VAE: 128/256/512/512, 2 layers per block, 4 latent channels, scaling factor 0.18215), so
compile and run times, memory and parameter archive sizes are those of the real model (about
4 GB of fp32 safetensors), without downloading it. The images are noise: use it for performance
work, never for image quality.

The tokenizer is the small BPE tokenizer of ``tiny_tokenizer.py`` with its vocabulary padded to
49408 entries by unreachable filler tokens (``<|filler_N|>``: no merge produces them), placed
so that ``<|startoftext|>`` and ``<|endoftext|>`` get CLIP's real ids 49406 and 49407. The
text encoder therefore keeps the real vocab_size (a 49408 x 768 embedding table) and the real
config's special ids (bos 0, eos 2, pad 1: with eos_token_id 2 transformers pools at the argmax
id, which is <|endoftext|> here as in CLIP). Scheduler: SD 1.5's PNDM config, as make_tiny_sd.
Deterministic from the seed. Needs the compile extra (torch, diffusers, transformers).

    python tools/make_sd15_random.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_sd import save_sd_pipeline  # noqa: E402
from tiny_tokenizer import BOS, EOS, write_tiny_clip_tokenizer  # noqa: E402

CLIP_VOCAB_SIZE = 49408

# runwayml/stable-diffusion-v1-5 unet/config.json (architecture keys).
SD15_UNET_CONFIG = {
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ],
}

# runwayml/stable-diffusion-v1-5 vae/config.json.
SD15_VAE_CONFIG = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "scaling_factor": 0.18215,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

# openai/clip-vit-large-patch14's text config, as SD 1.5's text_encoder/config.json has it.
SD15_TEXT_CONFIG = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "vocab_size": CLIP_VOCAB_SIZE,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    "layer_norm_eps": 1e-05,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


def pad_vocabulary(tok_dir: Path, size: int = CLIP_VOCAB_SIZE) -> None:
    """Grow vocab.json to `size` ids with unreachable fillers; BOS and EOS take the last two."""
    path = tok_dir / "vocab.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in (BOS, EOS)]
    if len(tokens) + 2 > size:
        raise ValueError(f"the tokenizer already has {len(tokens) + 2} tokens (> {size})")
    tokens += [f"<|filler_{i}|>" for i in range(size - 2 - len(tokens))]
    tokens += [BOS, EOS]
    padded = {t: i for i, t in enumerate(tokens)}
    path.write_text(
        json.dumps(padded, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def make_sd15_random(out_dir: Path, seed: int = 0) -> Path:
    """Build the full-size random pipeline and save it to out_dir (fp32); returns out_dir."""
    import torch
    from diffusers import (
        AutoencoderKL,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out_dir = Path(out_dir)
    tok_dir = out_dir / "tokenizer"
    write_tiny_clip_tokenizer(tok_dir, seed=seed)
    pad_vocabulary(tok_dir)
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)
    if len(tokenizer) != CLIP_VOCAB_SIZE or tokenizer.eos_token_id != CLIP_VOCAB_SIZE - 1:
        raise RuntimeError(
            f"padded tokenizer has {len(tokenizer)} tokens, eos {tokenizer.eos_token_id}"
        )

    with torch.no_grad():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(**SD15_TEXT_CONFIG))
        torch.manual_seed(seed + 1)
        unet = UNet2DConditionModel(**SD15_UNET_CONFIG)
        torch.manual_seed(seed + 2)
        vae = AutoencoderKL(**SD15_VAE_CONFIG)
    return save_sd_pipeline(
        out_dir, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_sd15_random(args.out_dir, seed=args.seed)
    print(f"wrote SD 1.5-architecture pipeline with random weights to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
