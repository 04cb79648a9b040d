"""Write a diffusers SD 1.x/2.x or SDXL folder as one checkpoint file in the original (LDM/SGM)
key layout.

A test helper: it makes the kind of file people download (`dreamshaper_8.safetensors`,
`v2-1_768-ema-pruned.ckpt`) from a tiny model made in the tests, so sdiree's single-file path
can be compared with the folder it came from. Its renaming is the inverse of what
sdiree.runtime.checkpoints.ldm_layout does, written independently from the LDM model's module
names, and the tests check it against diffusers' own `from_single_file`.

SD 2.x text encoders are written as OpenCLIP stores them: fused q/k/v projections, one more
transformer layer than SD 2.x uses (OpenCLIP-H has 24, SD 2.x takes the 23rd layer's output),
`text_projection` and `logit_scale`.

SDXL folders are written as Stability's generative-models (SGM) repository saves them
(sd_xl_base_1.0.safetensors): the UNet under `model.diffusion_model.` with its added embedding
as `label_emb.0.0`/`label_emb.0.2`, the CLIP ViT-L text encoder in Hugging Face's names under
`conditioner.embedders.0.transformer.`, the OpenCLIP bigG one under
`conditioner.embedders.1.model.` (fused q/k/v, every layer, `text_projection` as OpenCLIP
multiplies by it: [width, projection], the transpose of the Linear weight), and the VAE under
`first_stage_model.`. `--variant refiner-only` writes only the second text encoder, under
`conditioner.embedders.0.model.` as the SDXL refiner holds it (for refusal tests).

    python tools/to_single_file.py MODEL_DIR OUT.safetensors [--fp16] [--variant pruned|full-ema|bare]
    python tools/to_single_file.py MODEL_DIR OUT.ckpt [--global-step 875000]
    python tools/to_single_file.py SDXL_DIR OUT.safetensors [--fp16]

Variants: `pruned` (default) holds the weights and the buffers a pruned release keeps (the DDPM
schedule, CLIP's position_ids); `full-ema` adds EMA weights (`model_ema.*`, each one the
weight plus a small offset, so a test sees which set was read) as training checkpoints do;
`bare` holds the weights alone. A `.ckpt`/`.pt` name writes a torch zip checkpoint
({"state_dict": ..., "global_step": ...}, as Lightning saves), any other name safetensors.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _load(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{folder} has no .safetensors weights")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _rename(name: str, table: dict) -> str:
    for new, old in table.items():
        if name == new or name.startswith(new + "."):
            return old + name[len(new) :]
    raise KeyError(name)


def unet_to_ldm(sd: dict, config: dict) -> dict:
    per = config["layers_per_block"] + 1
    attn_levels = {int(m[1]) for k in sd if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", k))}
    top = {
        "conv_in": "input_blocks.0.0",
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
    }
    out = {}
    for key, t in sd.items():
        if m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"input_blocks.{1 + int(m[1]) * per + int(m[2])}.0.{_rename(m[3], UNET_RESNET)}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
            new = f"input_blocks.{1 + int(m[1]) * per + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
            new = f"input_blocks.{(int(m[1]) + 1) * per}.0.op.{m[2]}"
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.+)", key):
            new = f"middle_block.{2 * int(m[1])}.{_rename(m[2], UNET_RESNET)}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", key):
            new = f"middle_block.1.{m[1]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"output_blocks.{int(m[1]) * per + int(m[2])}.0.{_rename(m[3], UNET_RESNET)}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
            new = f"output_blocks.{int(m[1]) * per + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
            level = int(m[1])
            slot = 2 if level in attn_levels else 1
            new = f"output_blocks.{level * per + per - 1}.{slot}.conv.{m[2]}"
        elif m := re.fullmatch(r"add_embedding\.linear_([12])\.(.+)", key):
            new = f"label_emb.0.{0 if m[1] == '1' else 2}.{m[2]}"  # SGM: Sequential(Linear, SiLU, Linear)
        else:
            new = _rename(key, top)
        out["model.diffusion_model." + new] = t
    return out


def vae_to_ldm(sd: dict, config: dict) -> dict:
    levels = len(config["block_out_channels"])
    out = {}
    for key, t in sd.items():
        if m := re.fullmatch(r"(encoder|decoder)\.conv_norm_out\.(.+)", key):
            new = f"{m[1]}.norm_out.{m[2]}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = (
                f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
            )
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
            new = f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            rest = m[3].replace("conv_shortcut", "nin_shortcut")
            new = f"decoder.up.{levels - 1 - int(m[1])}.block.{m[2]}.{rest}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
            new = f"decoder.up.{levels - 1 - int(m[1])}.upsample.conv.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)", key):
            rest = m[3].replace("conv_shortcut", "nin_shortcut")
            new = f"{m[1]}.mid.block_{int(m[2]) + 1}.{rest}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(\w+)", key):
            new = f"{m[1]}.mid.attn_1.{VAE_ATTN[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":
                t = t.reshape(*t.shape, 1, 1)  # LDM's attention projections are 1x1 convolutions
        else:
            new = key  # conv_in, conv_out, quant_conv, post_quant_conv
        out["first_stage_model." + new] = t
    return out


def clip_to_ldm(sd: dict) -> dict:
    out = {}
    for key, t in sd.items():
        name = key[len("text_model.") :] if key.startswith("text_model.") else key
        out["cond_stage_model.transformer.text_model." + name] = t
    return out


def open_clip_to_ldm(
    sd: dict,
    config: dict,
    rng: np.random.Generator,
    p: str = "cond_stage_model.model.",
    sdxl: bool = False,
) -> dict:
    """OpenCLIP's layout of a CLIPTextModel(WithProjection). SD 2.x (default): one more layer than
    the model uses, random, and a random projection; sdxl: every layer, and the model's own
    projection (OpenCLIP's x @ P: the Linear weight transposed)."""
    sd = {(k[len("text_model.") :] if k.startswith("text_model.") else k): v for k, v in sd.items()}
    width = config["hidden_size"]
    dtype = sd["embeddings.token_embedding.weight"].dtype
    out = {
        p + "token_embedding.weight": sd["embeddings.token_embedding.weight"],
        p + "positional_embedding": sd["embeddings.position_embedding.weight"],
        p + "ln_final.weight": sd["final_layer_norm.weight"],
        p + "ln_final.bias": sd["final_layer_norm.bias"],
    }
    block = {
        "layer_norm1": "ln_1",
        "layer_norm2": "ln_2",
        "self_attn.out_proj": "attn.out_proj",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
    }
    layers = config["num_hidden_layers"]
    for i in range(layers):
        base = f"encoder.layers.{i}."
        r = f"{p}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[r + f"attn.in_proj_{kind}"] = np.concatenate(
                [sd[f"{base}self_attn.{n}_proj.{kind}"] for n in "qkv"], axis=0
            )
        for new, old in block.items():
            for kind in ("weight", "bias"):
                out[r + f"{old}.{kind}"] = sd[f"{base}{new}.{kind}"]
    if sdxl:
        out[p + "text_projection"] = np.ascontiguousarray(sd["text_projection.weight"].T)
        out[p + "logit_scale"] = np.array(4.6052, dtype=dtype)
        return out
    # OpenCLIP-H's last layer, which SD 2.x does not use: random, like the first one's shapes
    last = f"{p}transformer.resblocks.{layers}."
    for key in [k for k in out if k.startswith(f"{p}transformer.resblocks.0.")]:
        shape = out[key].shape
        out[last + key.split("resblocks.0.", 1)[1]] = rng.standard_normal(shape).astype(dtype)
    out[p + "text_projection"] = rng.standard_normal((width, width)).astype(dtype)
    out[p + "logit_scale"] = np.array(4.6052, dtype=dtype)
    return out


def ddpm_buffers() -> dict:
    """The schedule buffers LDM's LatentDiffusion saves (SD's scaled-linear betas)."""
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    alphas_cumprod = np.cumprod(1 - betas)
    return {
        "betas": betas.astype(np.float32),
        "alphas_cumprod": alphas_cumprod.astype(np.float32),
        "alphas_cumprod_prev": np.append(1.0, alphas_cumprod[:-1]).astype(np.float32),
        "sqrt_alphas_cumprod": np.sqrt(alphas_cumprod).astype(np.float32),
    }


def to_ldm(model_dir: Path, variant: str = "pruned", fp16: bool = False, seed: int = 0) -> dict:
    """The LDM-layout state dict of a diffusers SD folder."""
    model_dir = Path(model_dir)
    rng = np.random.default_rng(seed)
    te_config = json.loads((model_dir / "text_encoder" / "config.json").read_text())
    unet_config = json.loads((model_dir / "unet" / "config.json").read_text())
    vae_config = json.loads((model_dir / "vae" / "config.json").read_text())
    sd = {}
    sd.update(unet_to_ldm(_load(model_dir / "unet"), unet_config))
    sd.update(vae_to_ldm(_load(model_dir / "vae"), vae_config))
    te = _load(model_dir / "text_encoder")
    if (model_dir / "text_encoder_2").is_dir():
        te2_config = json.loads((model_dir / "text_encoder_2" / "config.json").read_text())
        te2 = _load(model_dir / "text_encoder_2")
        if variant == "refiner-only":  # the refiner's one text encoder, where SGM puts it
            sd.update(
                open_clip_to_ldm(te2, te2_config, rng, "conditioner.embedders.0.model.", True)
            )
        else:
            p = "conditioner.embedders.0.transformer."
            for key, t in clip_to_ldm(te).items():
                sd[p + key.split(".", 2)[2]] = t
            if variant != "bare":
                ids = np.arange(te_config.get("max_position_embeddings", 77), dtype=np.int64)
                sd[p + "text_model.embeddings.position_ids"] = ids[None]
            sd.update(
                open_clip_to_ldm(te2, te2_config, rng, "conditioner.embedders.1.model.", True)
            )
    elif te_config.get("hidden_act", "quick_gelu") == "quick_gelu":
        sd.update(clip_to_ldm(te))
        if variant != "bare":
            ids = np.arange(te_config.get("max_position_embeddings", 77), dtype=np.int64)
            sd["cond_stage_model.transformer.text_model.embeddings.position_ids"] = ids[None]
    else:
        sd.update(open_clip_to_ldm(te, te_config, rng))
    if fp16:
        sd = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in sd.items()}
    if variant in ("pruned", "full-ema", "refiner-only"):
        sd.update(ddpm_buffers())
    if variant == "full-ema":
        for key in [k for k in sd if k.startswith("model.diffusion_model.")]:
            ema = sd[key] + np.asarray(0.01, dtype=sd[key].dtype)
            sd["model_ema." + key[len("model.") :].replace(".", "")] = ema
        sd["model_ema.decay"] = np.array(0.9999, dtype=np.float32)
        sd["model_ema.num_updates"] = np.array(1000, dtype=np.int32)
    return sd


def write_single_file(
    model_dir: Path,
    out: Path,
    variant: str = "pruned",
    fp16: bool = False,
    global_step: int | None = None,
    seed: int = 0,
) -> Path:
    """Write model_dir as one LDM-layout file: torch zip for .ckpt/.pt, else safetensors."""
    sd = to_ldm(model_dir, variant=variant, fp16=fp16, seed=seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix in (".ckpt", ".pt", ".pth"):
        import torch

        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
        torch.save({"state_dict": state, "global_step": global_step or 0, "epoch": 0}, out)
    else:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--variant", choices=("pruned", "full-ema", "bare", "refiner-only"), default="pruned"
    )
    parser.add_argument("--fp16", action="store_true", help="fp32 weights written as fp16")
    parser.add_argument("--global-step", type=int, help="stored beside a .ckpt's state dict")
    args = parser.parse_args(argv)
    write_single_file(
        args.model_dir, args.out, variant=args.variant, fp16=args.fp16, global_step=args.global_step
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
