"""Which model a single-file checkpoint holds, read from its keys and shapes; one line when it is
not one sdiree takes, or when its shapes disagree with the config chosen for it.

SD 1.x has CLIP ViT-L as its text encoder (`cond_stage_model.transformer.*`) and convolution
projections in its UNet transformers; SD 2.x has OpenCLIP-H (`cond_stage_model.model.*`) and
linear projections; an inpainting UNet takes 9 input channels (latents, mask, masked image) in
`input_blocks.0.0`. The UNet's cross-attention width is the text encoder's. SDXL (two text
encoders under `conditioner.embedders.*`, `label_emb` conditioning), SD 3, Flux, ControlNets,
the x4 upscaler, depth-to-image and InstructPix2Pix files are recognised and refused, as are
files that are not whole models (a LoRA, a VAE, an embedding, a diffusers-layout file).

Prediction type: no key says whether an SD 2.x checkpoint predicts noise (2.x-base, 512) or
velocity (2.0/2.1, 768). diffusers 0.42's from_single_file takes the stabilityai/
stable-diffusion-2-1 configs for every SD 2.x file (v-prediction); its legacy loader reads
epsilon when a Lightning checkpoint's global_step is 875000 (the 2.x-base release). sdiree does
both: v-prediction, epsilon for global_step 875000, and `--prediction-type` overrides either.
SD 1.x and the inpainting models of both (stable-diffusion-inpainting, stable-diffusion-2-
inpainting, 512) are epsilon. SDXL is epsilon, or v-prediction where the file holds a `v_pred`
key (the marker SDXL v-prediction fine-tunes carry for AUTOMATIC1111).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..families import load_families
from .ldm_layout import (
    CLIP_PREFIXES,
    OPEN_CLIP_PREFIXES,
    SDXL_OPEN_CLIP_PREFIX,
    UNET_PREFIX,
    VAE_PREFIXES,
)

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
SD2_BASE_GLOBAL_STEP = 875000  # the SD 2.x-base checkpoints' step, as diffusers' legacy loader
CONV_IN = UNET_PREFIX + "input_blocks.0.0.weight"
WHOLE = "sdiree compiles whole-model checkpoints (UNet, VAE and text encoder in one file)"
# SGM's (SDXL's) keys: the UNet's added conditioning and the two text encoders' prefixes
LABEL_EMB = UNET_PREFIX + "label_emb."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SGM_OPEN_CLIP_0 = "conditioner.embedders.0.model."  # the refiner's only text encoder
SDXL_BASE = (
    "an SDXL base checkpoint holds CLIP ViT-L (conditioner.embedders.0.transformer.*) and "
    "OpenCLIP ViT-bigG (conditioner.embedders.1.model.*)"
)


@dataclass(frozen=True)
class Detected:
    family: str  # a specs/families.json name: "sd1", "sd2"
    label: str  # "SD 1.x"
    inpainting: bool
    preset: str  # the shipped config (specs/models/<preset>) of this kind of checkpoint
    prediction_type: str
    prediction_source: str  # why that prediction type
    in_channels: int
    context_dim: int
    text_encoder: str  # "clip", "open_clip" or "clip+open_clip" (SDXL)
    has_ema: bool  # model_ema.* weights beside the UNet's


def _refuse(where: str, what: str) -> UserError:
    supported = load_families().supported_names()
    return UserError(f"{where}: {what}; sdiree compiles these model families only: {supported}")


def _has(keys, *needles: str) -> bool:
    return any(n in k for k in keys for n in needles)


def _refuse_foreign(where: str, keys: list[str]) -> None:
    """UserError for a file of a model family or kind sdiree does not take."""
    if not keys:
        raise UserError(f"{where} holds no tensors; {WHOLE}")
    fams = load_families()
    pipelines = fams.refused_pipelines
    if _has(keys, "joint_blocks."):
        raise _refuse(where, f"it holds {pipelines['StableDiffusion3Pipeline']}")
    if _has(keys, "double_blocks.", "single_blocks."):
        raise _refuse(where, f"it holds {pipelines['FluxPipeline']}")
    if _has(keys, "control_model.", "input_hint_block."):
        raise _refuse(where, "it holds a ControlNet")
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys) or _has(
        keys, ".lora_down.", ".lora_up.", ".lora_A.", ".lora_B.", ".hada_w1_a", ".lokr_w1"
    ):
        raise UserError(f"{where} is a LoRA, not a model checkpoint; {WHOLE}")
    if _has(keys, "string_to_param", "emb_params") or set(keys) <= {"clip_l", "clip_g"}:
        raise UserError(f"{where} is a textual-inversion embedding, not a model; {WHOLE}")
    if "edm_mean" in keys or "edm_std" in keys:
        raise _refuse(where, "it holds Playground v2.5 (an EDM model: edm_mean/edm_std)")
    if not any(k.startswith(UNET_PREFIX) for k in keys):
        if any(k.startswith(("encoder.conv_in", "decoder.conv_in")) for k in keys):
            raise UserError(f"{where} is a VAE on its own, not a whole model; {WHOLE}")
        if _has(keys, "down_blocks.", "text_model.", "mid_block."):
            raise UserError(
                f"{where} holds diffusers-layout weights, not a single-file checkpoint's; "
                "pass the diffusers folder it belongs to instead"
            )
        raise UserError(
            f"{where} holds no Stable Diffusion UNet (no {UNET_PREFIX}* tensors); {WHOLE}"
        )


def _first(tensors: dict, pattern: str) -> np.ndarray | None:
    rx = re.compile(pattern)
    for k in sorted(tensors):
        if rx.fullmatch(k):
            return tensors[k]
    return None


def _text_encoder(tensors: dict) -> tuple[str, int | None]:
    """("clip" | "open_clip" | "", its hidden size when its token embedding is there)."""
    for kind, prefixes in (("clip", CLIP_PREFIXES), ("open_clip", OPEN_CLIP_PREFIXES)):
        for prefix in prefixes:
            if any(k.startswith(prefix) for k in tensors):
                emb = tensors.get(prefix + "text_model.embeddings.token_embedding.weight")
                emb = emb if emb is not None else tensors.get(prefix + "token_embedding.weight")
                if emb is None:
                    emb = tensors.get(prefix + "embeddings.token_embedding.weight")
                return kind, (int(emb.shape[-1]) if emb is not None and emb.ndim == 2 else None)
    return "", None


def detect(
    tensors: dict[str, np.ndarray],
    extras: dict | None = None,
    where: str = "the checkpoint",
    prediction_type: str | None = None,
) -> Detected:
    """The family, variant and prediction type of an LDM-layout checkpoint; UserError in one
    line for one sdiree does not take."""
    keys = list(tensors)
    _refuse_foreign(where, keys)
    pipelines = load_families().refused_pipelines
    conv_in = tensors.get(CONV_IN)
    if conv_in is None or conv_in.ndim != 4:
        raise UserError(f"{where} has no UNet input convolution ({CONV_IN}); is it damaged?")
    in_channels = int(conv_in.shape[1])
    if any(k.startswith((LABEL_EMB, SDXL_OPEN_CLIP_PREFIX)) for k in keys):
        return _detect_sdxl(tensors, where, in_channels, prediction_type)
    if in_channels == 5:
        raise _refuse(where, f"it holds {pipelines['StableDiffusionDepth2ImgPipeline']}")
    if in_channels == 7:
        raise _refuse(where, f"it holds {pipelines['StableDiffusionUpscalePipeline']}")
    if in_channels == 8:
        raise _refuse(where, "it holds an InstructPix2Pix model (8-channel UNet)")
    if in_channels not in (4, 9):
        raise _refuse(where, f"its UNet takes {in_channels} input channels (SD takes 4, or 9)")
    if not any(k.startswith(VAE_PREFIXES) for k in keys):
        raise UserError(f"{where} has no VAE (no first_stage_model.* tensors); {WHOLE}")
    kind, hidden = _text_encoder(tensors)
    if not kind:
        raise UserError(f"{where} has no text encoder (no cond_stage_model.* tensors); {WHOLE}")

    to_k = _first(tensors, re.escape(UNET_PREFIX) + r".*\.attn2\.to_k\.weight")
    context_dim = int(to_k.shape[-1]) if to_k is not None and to_k.ndim == 2 else 0
    proj_in = _first(tensors, re.escape(UNET_PREFIX) + r".*\.proj_in\.weight")
    linear = None if proj_in is None else proj_in.ndim == 2
    family = "sd1" if kind == "clip" else "sd2"
    fams = load_families()
    label = fams.families[family].label
    if linear is not None and linear != (family == "sd2"):
        unet_like = "SD 2.x (linear projections)" if linear else "SD 1.x (convolution projections)"
        raise UserError(
            f"{where} mixes model families: its text encoder is {label}'s "
            f"({'CLIP' if kind == 'clip' else 'OpenCLIP'}) but its UNet looks like {unet_like}; "
            "re-download the checkpoint"
        )
    if hidden and context_dim and hidden != context_dim:
        raise UserError(
            f"{where}: the UNet's cross-attention width {context_dim} does not match the text "
            f"encoder's hidden size {hidden}: they come from different models; re-download the "
            "checkpoint"
        )
    inpainting = in_channels == 9
    _check_prediction_type(prediction_type)
    step = (extras or {}).get("global_step")
    if prediction_type is not None:
        source = "--prediction-type"
    elif family == "sd2" and not inpainting and step == SD2_BASE_GLOBAL_STEP:
        prediction_type, source = "epsilon", f"global_step {step}: SD 2.x-base"
    elif family == "sd2" and not inpainting:
        prediction_type, source = "v_prediction", "SD 2.x default, as diffusers'"
    else:
        prediction_type, source = "epsilon", f"{label}{' inpainting' * inpainting} default"
    if family == "sd1":
        preset = "sd15-inpainting" if inpainting else "sd15"
    elif inpainting:
        preset = "sd2-inpainting"
    else:
        preset = "sd21-base" if prediction_type == "epsilon" else "sd21"
    return Detected(
        family=family,
        label=label,
        inpainting=inpainting,
        preset=preset,
        prediction_type=prediction_type,
        prediction_source=source,
        in_channels=in_channels,
        context_dim=context_dim,
        text_encoder=kind,
        has_ema=any(k.startswith("model_ema.diffusion_model") for k in keys),
    )


def _check_prediction_type(prediction_type: str | None) -> None:
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise UserError(
            f"--prediction-type {prediction_type!r} is not one of {', '.join(PREDICTION_TYPES)}"
        )


def _width(tensors: dict, key: str) -> int | None:
    t = tensors.get(key)
    return int(t.shape[-1]) if t is not None and t.ndim == 2 else None


def _detect_sdxl(
    tensors: dict, where: str, in_channels: int, prediction_type: str | None
) -> Detected:
    """An SGM-layout file (`label_emb` or `conditioner.embedders.1.*`): SDXL base, or refused
    naming what it holds instead."""
    keys = list(tensors)
    clip = any(k.startswith(SDXL_CLIP_PREFIX) for k in keys)
    big_g = any(k.startswith(SDXL_OPEN_CLIP_PREFIX) for k in keys)
    refiner = any(k.startswith(SGM_OPEN_CLIP_0) for k in keys)
    if refiner and not clip:
        raise _refuse(
            where,
            "it is an SDXL refiner (one OpenCLIP ViT-bigG text encoder, "
            "conditioner.embedders.0.model.*, and no CLIP ViT-L); sdiree compiles SDXL base "
            "models and their fine-tunes, not the refiner",
        )
    if not (clip and big_g):
        found = [
            p + "*"
            for p in (SDXL_CLIP_PREFIX, SDXL_OPEN_CLIP_PREFIX)
            if any(k.startswith(p) for k in keys)
        ]
        has = " and ".join(found) if found else "no text encoder"
        raise UserError(
            f"{where} has SDXL's UNet conditioning ({LABEL_EMB}*) but {has}; {SDXL_BASE}: "
            "is it damaged or cut short?"
        )
    if in_channels != 4:
        what = "an SDXL inpainting model" if in_channels == 9 else "an SDXL variant"
        raise _refuse(
            where, f"it holds {what} ({in_channels}-channel UNet); sdiree takes SDXL base files"
        )
    if not any(k.startswith(VAE_PREFIXES) for k in keys):
        raise UserError(f"{where} has no VAE (no first_stage_model.* tensors); {WHOLE}")
    label = load_families().families["sdxl"].label
    to_k = _first(tensors, re.escape(UNET_PREFIX) + r".*\.attn2\.to_k\.weight")
    context_dim = int(to_k.shape[-1]) if to_k is not None and to_k.ndim == 2 else 0
    h1 = _width(tensors, SDXL_CLIP_PREFIX + "text_model.embeddings.token_embedding.weight")
    h2 = _width(tensors, SDXL_OPEN_CLIP_PREFIX + "token_embedding.weight")
    if h1 and h2 and context_dim and h1 + h2 != context_dim:
        raise UserError(
            f"{where}: the UNet's cross-attention width {context_dim} is not the text encoders' "
            f"hidden sizes together ({h1} + {h2}): they come from different models; "
            "re-download the checkpoint"
        )
    _check_prediction_type(prediction_type)
    if prediction_type is not None:
        source = "--prediction-type"
    elif "v_pred" in tensors:
        prediction_type, source = "v_prediction", "the file's v_pred key"
    else:
        prediction_type, source = "epsilon", f"{label} default"
    return Detected(
        family="sdxl",
        label=label,
        inpainting=False,
        preset="sdxl",
        prediction_type=prediction_type,
        prediction_source=source,
        in_channels=in_channels,
        context_dim=context_dim,
        text_encoder="clip+open_clip",
        has_ema=any(k.startswith("model_ema.diffusion_model") for k in keys),
    )


def check_shapes(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, np.ndarray],
    where: str,
    component: str,
    config: str,
) -> None:
    """UserError naming the first tensor whose presence or shape differs from what config's
    model has (expected: {key: shape} in the model's order)."""
    fix = "the checkpoint does not match that config (pass --config DIR of its architecture)"
    for key, shape in expected.items():
        if key not in found:
            raise UserError(
                f"{where}: the {component} has no tensor {key} (shape {list(shape)}), which "
                f"{config} needs; {fix}"
            )
        if tuple(found[key].shape) != tuple(shape):
            raise UserError(
                f"{where}: {component} tensor {key} has shape {list(found[key].shape)}, but "
                f"{config} expects {list(shape)}; {fix}"
            )
    extra = [k for k in found if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UserError(
            f"{where}: {component} tensor {extra[0]}{more} has no place in {config}; {fix}"
        )
