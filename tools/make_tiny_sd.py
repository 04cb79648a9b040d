"""Write a tiny Stable Diffusion 1.x pipeline with random weights, in diffusers format.

Real classes at toy sizes (UNet2DConditionModel with cross-attention blocks, a four-block
AutoencoderKL so latents are 1/8 of the image, CLIPTextModel, a CLIP BPE tokenizer with a small
vocabulary of its own, SD 1.5's scheduler config), deterministic from a seed. Tests compile and
run it in place of a downloaded model: the loading code reads it from disk exactly as it would
read a real one. Needs the compile extra (torch, diffusers, transformers).

    python tools/make_tiny_sd.py OUT_DIR [--seed 0] [--size 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_tokenizer import write_tiny_clip_tokenizer  # noqa: E402

# SD 1.5's scheduler_config.json (PNDM, scaled-linear betas, steps offset 1).
SD15_SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "prediction_type": "epsilon",
    "trained_betas": None,
}


def save_sd_pipeline(out_dir: Path, *, vae, text_encoder, tokenizer, unet) -> Path:
    """Assemble an SD 1.x StableDiffusionPipeline with SD 1.5's scheduler and save it."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=PNDMScheduler.from_config(SD15_SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    # Keep SD 1.5's scheduler file as it is on the hub, keys PNDM ignores (clip_sample) included.
    sched_path = Path(out_dir) / "scheduler" / "scheduler_config.json"
    saved = json.loads(sched_path.read_text())
    sched_path.write_text(json.dumps({**saved, **SD15_SCHEDULER_CONFIG}, indent=2) + "\n")
    return Path(out_dir)


def make_tiny_sd(out_dir: Path, seed: int = 0, size: int = 64) -> Path:
    """Build the tiny pipeline and save it to out_dir; returns out_dir."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out_dir = Path(out_dir)
    tok_dir = out_dir / "tokenizer"
    write_tiny_clip_tokenizer(tok_dir, seed=seed)
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=32,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=size // 8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=size,
    )
    return save_sd_pipeline(
        out_dir, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=64, help="image height/width in pixels")
    args = parser.parse_args(argv)
    make_tiny_sd(args.out_dir, seed=args.seed, size=args.size)
    print(f"wrote tiny SD 1.x pipeline to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
