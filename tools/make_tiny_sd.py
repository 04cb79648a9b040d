"""Write a tiny Stable Diffusion 1.x or 2.x pipeline with random weights, in diffusers format.

Real classes at toy sizes (UNet2DConditionModel with cross-attention blocks, a four-block
AutoencoderKL so latents are 1/8 of the image, CLIPTextModel, a CLIP BPE tokenizer with a small
vocabulary of its own, the real model's scheduler config), deterministic from a seed. Tests
compile and run it in place of a downloaded model: the loading code reads it from disk exactly
as it would read a real one. Needs the compile extra (torch, diffusers, transformers).

`--family sd2` gives SD 2.1's architecture features: the OpenCLIP-H text encoder as diffusers
stores it (a CLIPTextModel with gelu, its tokenizer padding with "!"), UNet transformers with
linear projections, a head count per block and attention upcast, and SD 2.1's v-prediction
DDIM scheduler config.

`--family sdxl` gives SDXL's (StableDiffusionXLPipeline): two text encoders, a CLIPTextModel
(quick_gelu) and a CLIPTextModelWithProjection (gelu, its tokenizer padding with "!"), whose
penultimate hidden states together are the UNet's cross-attention width; a UNet with
`addition_embed_type` "text_time" (the second encoder's pooled projection and six size/crop
ids), a first level without attention, `transformer_layers_per_block` and linear projections;
SDXL's EulerDiscreteScheduler config, its VAE scaling 0.13025 with `force_upcast`, and
`force_zeros_for_empty_prompt` in model_index.json. `--turbo` gives SDXL-Turbo's scheduler
config instead (EulerAncestral, "trailing" timesteps).

`--inpaint` makes the family's inpainting model instead, as stable-diffusion-inpainting is laid
out: a StableDiffusionInpaintPipeline folder whose UNet takes 9 input channels (latents, the
mask, the masked image's latents) and still predicts 4.

    python tools/make_tiny_sd.py OUT_DIR [--family sd1|sd2|sdxl] [--inpaint] [--turbo] [--seed 0]
        [--size 64]
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


# SD 2.1's scheduler_config.json (768x768, v-prediction): DDIM, the same betas as SD 1.5, with
# the timestep spacing and offset its DDIM schedule uses written out.
SD21_SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "clip_sample": False,
    "prediction_type": "v_prediction",
    "trained_betas": None,
}
# SDXL base 1.0's scheduler_config.json: Euler with SD's betas, "leading" timesteps.
SDXL_SCHEDULER_CONFIG = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
# SDXL-Turbo's: the same with EulerAncestral and "trailing" timesteps (1-4 steps, guidance 0).
SDXL_TURBO_SCHEDULER_CONFIG = {**SDXL_SCHEDULER_CONFIG, "timestep_spacing": "trailing"}
SCHEDULERS = {
    "sd1": ("PNDMScheduler", SD15_SCHEDULER_CONFIG),
    "sd2": ("DDIMScheduler", SD21_SCHEDULER_CONFIG),
    "sdxl": ("EulerDiscreteScheduler", SDXL_SCHEDULER_CONFIG),
    "sdxl-turbo": ("EulerAncestralDiscreteScheduler", SDXL_TURBO_SCHEDULER_CONFIG),
}
# An inpainting UNet's input: 4 latent channels, 1 mask channel, 4 masked-image latent channels.
INPAINT_CHANNELS = 9


def save_sd_pipeline(
    out_dir: Path, *, vae, text_encoder, tokenizer, unet, family: str = "sd1"
) -> Path:
    """Assemble a StableDiffusionPipeline (StableDiffusionInpaintPipeline for a 9-channel UNet)
    with the family's real scheduler config and save it."""
    import diffusers
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

    sched_class, sched_config = SCHEDULERS[family]
    inpaint = unet.config.in_channels == INPAINT_CHANNELS
    pipe = (StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline)(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=getattr(diffusers, sched_class).from_config(sched_config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    # Keep the scheduler file as it is on the hub, keys the class ignores (clip_sample) included.
    sched_path = Path(out_dir) / "scheduler" / "scheduler_config.json"
    saved = json.loads(sched_path.read_text())
    sched_path.write_text(json.dumps({**saved, **sched_config}, indent=2) + "\n")
    return Path(out_dir)


def make_tiny_sd(
    out_dir: Path,
    seed: int = 0,
    size: int = 64,
    family: str = "sd1",
    inpaint: bool = False,
    turbo: bool = False,
) -> Path:
    """Build the tiny pipeline of a family (sd1, sd2, sdxl), or its inpainting model (or
    SDXL-Turbo's scheduler), and save it to out_dir; returns out_dir."""
    if family == "sdxl":
        if inpaint:
            raise ValueError("no tiny SDXL inpainting model: SDXL inpainting is not supported")
        return make_tiny_sdxl(out_dir, seed=seed, size=size, turbo=turbo)
    if turbo:
        raise ValueError("--turbo is an SDXL variant (--family sdxl)")
    if family == "sd2":
        return make_tiny_sd2(out_dir, seed=seed, size=size, inpaint=inpaint)
    import torch
    from diffusers import UNet2DConditionModel
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
        in_channels=INPAINT_CHANNELS if inpaint else 4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = _tiny_vae(size)
    return save_sd_pipeline(
        out_dir, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet
    )


def _tiny_vae(size: int, **config):
    """SD's AutoencoderKL layout (four blocks: latents 1/8 of the image) at toy widths."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        **config,
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


def make_tiny_sd2(out_dir: Path, seed: int = 0, size: int = 64, inpaint: bool = False) -> Path:
    """A tiny SD 2.1 (v-prediction): SD 2.1's architecture features at toy sizes."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out_dir = Path(out_dir)
    tok_dir = out_dir / "tokenizer"
    # OpenCLIP's tokenizer, as SD 2.x ships it, pads with "!" rather than the end token.
    write_tiny_clip_tokenizer(tok_dir, seed=seed, pad_token="!")
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=3,  # SD 2.x: OpenCLIP-H's 24 layers less the last, 23
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=32,
            hidden_act="gelu",  # OpenCLIP; SD 1.x's CLIP ViT-L has quick_gelu
            layer_norm_eps=1e-5,
            # SD 2.x's text_encoder/config.json has these placeholder ids; eos 2 makes
            # transformers pool at the largest token id (the end token), as for SD 2.x
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=size // 8,
        in_channels=INPAINT_CHANNELS if inpaint else 4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        # SD 2.x's [5, 10, 20, 20]: a head count per block (diffusers' name for it)
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        upcast_attention=True,
        norm_num_groups=8,
    )
    return save_sd_pipeline(
        out_dir,
        vae=_tiny_vae(size),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        family="sd2",
    )


def make_tiny_sdxl(
    out_dir: Path, seed: int = 0, size: int = 64, turbo: bool = False, width_2: int = 32
) -> Path:
    """A tiny SDXL base (or, with turbo, SDXL-Turbo's scheduler): SDXL's architecture at toy
    sizes. width_2: the second text encoder's hidden size (the first's is 32); another width than
    the first's lets diffusers' from_single_file tell the two apart by shape, as it does at full
    size (768 and 1280)."""
    import diffusers
    import torch
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
    )

    out_dir = Path(out_dir)
    write_tiny_clip_tokenizer(out_dir / "tokenizer", seed=seed)
    # SDXL's second tokenizer (OpenCLIP bigG's) has the same vocabulary and pads with "!".
    write_tiny_clip_tokenizer(out_dir / "tokenizer_2", seed=seed, pad_token="!")
    tokenizer = CLIPTokenizer.from_pretrained(out_dir / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(out_dir / "tokenizer_2")

    def clip_config(hidden_act: str, eos_token_id: int, width: int = 32) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,  # penultimate hidden states: the first layer's
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=16,
            hidden_act=hidden_act,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=1,
        )

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(clip_config("quick_gelu", tokenizer.eos_token_id))
    # SDXL's text_encoder_2/config.json has the placeholder eos_token_id 2: it pools at the
    # largest id, the end token
    text_encoder_2 = CLIPTextModelWithProjection(clip_config("gelu", 2, width_2))
    time_dim = 8
    unet = UNet2DConditionModel(
        sample_size=size // 8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32 + width_2,  # the two encoders' widths together (768 + 1280)
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        # the pooled projection and six time ids, each as a sinusoidal embedding
        projection_class_embeddings_input_dim=16 + 6 * time_dim,
        norm_num_groups=8,
    )
    vae = _tiny_vae(size, scaling_factor=0.13025, force_upcast=True)
    sched_class, sched_config = SCHEDULERS["sdxl-turbo" if turbo else "sdxl"]
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=getattr(diffusers, sched_class).from_config(sched_config),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    sched_path = out_dir / "scheduler" / "scheduler_config.json"
    saved = json.loads(sched_path.read_text())
    sched_path.write_text(json.dumps({**saved, **sched_config}, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=("sd1", "sd2", "sdxl"), default="sd1")
    parser.add_argument("--turbo", action="store_true", help="SDXL-Turbo's scheduler config")
    parser.add_argument(
        "--inpaint", action="store_true", help="the inpainting model (9-channel UNet)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=64, help="image height/width in pixels")
    args = parser.parse_args(argv)
    make_tiny_sd(
        args.out_dir,
        seed=args.seed,
        size=args.size,
        family=args.family,
        inpaint=args.inpaint,
        turbo=args.turbo,
    )
    label = {"sd1": "SD 1.x", "sd2": "SD 2.x (v-prediction)", "sdxl": "SDXL"}[args.family]
    label += "-Turbo" if args.turbo else ""
    kind = "inpainting pipeline" if args.inpaint else "pipeline"
    print(f"wrote tiny {label} {kind} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
