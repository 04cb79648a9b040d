"""The user's weight files as replacements for an artifact's own: `--weights`, `--vae`, `--lora`.

`--weights FILE` is a checkpoint of the artifact's architecture (a single file in the original
layout, SGM's for SDXL, or a diffusers folder): every tensor of the text encoder(s), UNet and VAE
is taken from it,
checked key by key and shape by shape against what the artifact was compiled with. `--vae FILE`
replaces the VAE alone. LoRAs are merged (runtime/lora) into whichever weights are loaded,
tensor by tensor, so the peak stays near one submodule's weights plus the LoRA files. Same
dtype and layout: the file's own memory map is used (no copy); else the tensor is cast once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..fileutil import cached_sha256, read_json_dict, user_cache_dir
from ..manifest import Manifest
from .archive import Archive
from .derived import base_key
from .overrides import WeightOverrides

# The model component each parameter scope holds, as checkpoints and LoRAs name them.
SCOPE_COMPONENTS = {
    "text_encoder": "text_encoder",
    "text_encoder_2": "text_encoder_2",  # SDXL's second
    "unet": "unet",
    "vae": "vae",
}
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.")
FILE_HASHES = "file-hashes.json"  # under the user cache: {path: [stamp..., sha256]}


@dataclass
class LoraRequest:
    path: Path
    strength: float
    name: str = ""
    te_strength: float | None = None  # the text encoder's, where it differs (A1111 tags)

    def __post_init__(self):
        self.name = self.name or self.path.stem


@dataclass
class Provenance:
    """What the image was made with, for its PNG parameters (A1111's names)."""

    model: str | None = None
    model_hash: str | None = None  # sha256[:10] of the checkpoint file ("AutoV2")
    vae: str | None = None
    vae_hash: str | None = None
    lora_hashes: list[tuple[str, str]] = field(default_factory=list)

    def png_fields(self) -> dict[str, str]:
        out = {}
        if self.vae:
            out["VAE hash"] = self.vae_hash or ""
            out["VAE"] = self.vae
        if self.lora_hashes:
            # a1111_parameters quotes a value holding commas, as A1111 writes this one
            out["Lora hashes"] = ", ".join(f"{n}: {h}" for n, h in self.lora_hashes)
        return out


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered in the user cache by its stamp (a multi-GB checkpoint is
    hashed once, not on every run)."""
    cache_path = user_cache_dir() / FILE_HASHES
    cache = read_json_dict(cache_path)
    key = str(Path(path).resolve())
    before = dict(cache)
    digest = cached_sha256(Path(path), key, cache)
    if cache != before:
        from ..fileutil import atomic_write_json

        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache_path, cache)
        except OSError:
            pass  # no cache: hashed again next time
    return digest


class ArtifactWeights:
    """The artifact's own weights by scope: {key: (shape, dtype)} and read-only arrays."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.archives: dict[str, Archive] = {}
        for sub in manifest.submodules.values():
            if sub.parameters and sub.scope in SCOPE_COMPONENTS and sub.scope not in self.archives:
                self.archives[sub.scope] = Archive(manifest.path(sub.parameters))

    def keys(self, scope: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {
            k: (e.shape, e.dtype)
            for k, e in self.archives[scope].entries.items()
            if base_key(k) is None
        }

    def array(self, scope: str, key: str) -> np.ndarray:
        return self.archives[scope].array(key)


def match_component(
    scope: str,
    given: dict[str, np.ndarray],
    targets: dict[str, tuple[tuple[int, ...], np.dtype]],
    what: str,
) -> dict[str, np.ndarray]:
    """given's tensors under the artifact's keys (targets), in the artifact's dtypes; one line
    naming the first missing or differing tensor when given is another architecture."""
    given = align_text_prefix(given, targets)
    out = {}
    for key, (shape, dtype) in targets.items():
        if key not in given:
            raise UserError(
                f"{what} has no tensor {key} ({scope}), which this artifact's model has: it is not "
                "a checkpoint of the same architecture; use an artifact compiled for its family"
            )
        t = given[key]
        if tuple(t.shape) != tuple(shape):
            raise UserError(
                f"{what}: {scope} tensor {key} is {list(t.shape)}, the artifact's is "
                f"{list(shape)}: another architecture; use an artifact compiled for it"
            )
        out[key] = t if t.dtype == dtype and t.flags.c_contiguous else t.astype(dtype)
    return out


def align_text_prefix(given: dict, targets: dict) -> dict:
    """transformers 5.6 names CLIPTextModel's weights without the `text_model.` that files
    (and transformers 4) have, and CLIPTextModelWithProjection's with it (never its
    `text_projection`): strip or add it, key by key, to match the artifact's keys."""
    out = {}
    for k, v in given.items():
        if k not in targets:
            if "text_model." + k in targets:
                k = "text_model." + k
            elif k.startswith("text_model.") and k.removeprefix("text_model.") in targets:
                k = k.removeprefix("text_model.")
        out[k] = v
    return out


def check_strength(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{where}: strength {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"{where}: strength {text} is not a finite number")
    return value


def parse_lora_option(text: str) -> LoraRequest:
    """`FILE[:STRENGTH]` of --lora (strength 1.0 when left out)."""
    path, sep, strength = text.rpartition(":")
    if not sep or "/" in strength or "\\" in strength or not strength.strip():
        return LoraRequest(Path(text), 1.0)
    return LoraRequest(Path(path), check_strength(strength, f"--lora {text}"))


Reporter = Callable[[str], None]


def _text_layers(targets: dict) -> int | None:
    """How many transformer layers the artifact's text encoder has (SD 2.x keeps 23 of
    OpenCLIP-H's 24)."""
    found = [int(m.group(1)) for k in targets if (m := _LAYER.search(k))]
    return max(found) + 1 if found else None


def read_model_file(
    path: Path, manifest: Manifest, targets_te: dict, targets_te2: dict | None = None
) -> dict[str, dict]:
    """The components of a --weights file or diffusers folder, as diffusers names them."""
    from ..checkpoints.detect import detect
    from ..checkpoints.ldm_layout import convert
    from ..checkpoints.read import read_tensors
    from ..families import load_families

    path = Path(path)
    if path.is_dir():
        return _read_diffusers_folder(
            path, ("unet", "vae", "text_encoder", *(["text_encoder_2"] if targets_te2 else []))
        )
    tf = read_tensors(path)
    found = detect(tf.tensors, tf.extras, where=str(path))
    if found.family != manifest.family:
        mine = load_families().families.get(manifest.family)
        raise UserError(
            f"{path} is an {found.label} checkpoint, but this artifact was compiled for "
            f"{mine.label if mine else manifest.family} models; use an artifact of its family"
        )
    in_channels = manifest.image.get("unet_in_channels", manifest.image["latent_channels"])
    if found.in_channels != in_channels:
        kind = "an inpainting" if found.inpainting else "an ordinary (not inpainting)"
        raise UserError(
            f"{path} is {kind} checkpoint ({found.in_channels}-channel UNet), this artifact's "
            f"UNet takes {in_channels} channels; use an artifact compiled for that kind"
        )
    return convert(
        tf.tensors,
        text_layers=_text_layers(targets_te),
        text_layers_2=_text_layers(targets_te2 or {}),
    ).components


def _read_diffusers_folder(path: Path, components) -> dict[str, dict]:
    from ..checkpoints.read import read_tensors

    out = {}
    for comp in components:
        files = sorted((path / comp).glob("*.safetensors"))
        if not files:
            raise UserError(
                f"{path / comp} holds no .safetensors weights; --weights takes a single-file "
                "checkpoint or a diffusers folder saved as safetensors"
            )
        tensors: dict = {}
        for f in files:
            tensors.update(read_tensors(f).tensors)
        out[comp] = tensors
    return out


def read_vae_file(path: Path) -> dict[str, np.ndarray]:
    """A VAE's tensors as diffusers names them, from a VAE file in the original layout
    (`encoder.down.0...`, as vae-ft-mse-840000 ships), a diffusers AutoencoderKL file, or a
    whole single-file checkpoint (its VAE is taken)."""
    from ..checkpoints.ldm_layout import VAE_PREFIXES, convert
    from ..checkpoints.read import read_tensors

    tf = read_tensors(path)
    keys = list(tf.tensors)
    if any(k.startswith(VAE_PREFIXES) for k in keys):
        vae = convert(tf.tensors).components["vae"]
    elif any(k.startswith(("encoder.down.", "decoder.up.")) for k in keys):
        vae = convert({VAE_PREFIXES[0] + k: v for k, v in tf.tensors.items()}).components["vae"]
    elif any(k.startswith(("encoder.down_blocks.", "decoder.up_blocks.")) for k in keys):
        vae = dict(tf.tensors)
    else:
        raise UserError(
            f"{path} holds no VAE weights (neither the original `encoder.down.*` layout nor "
            "diffusers' `encoder.down_blocks.*`); pass a VAE file to --vae"
        )
    return vae


def build_overrides(
    manifest: Manifest,
    weights: Path | None = None,
    vae: Path | None = None,
    loras: list[LoraRequest] | None = None,
    report: Reporter | None = None,
) -> tuple[WeightOverrides, Provenance, list[str]]:
    """Replacement tensors for the artifact from the user's files: (overrides, what to record
    in the PNG, warnings). Every file is checked against the artifact before any work."""
    loras = loras or []
    own = ArtifactWeights(manifest)
    prov = Provenance()
    warnings: list[str] = []
    tensors: dict[str, dict[str, np.ndarray]] = {}
    digest_parts: list[str] = []
    if weights is not None:
        te2 = own.keys("text_encoder_2") if "text_encoder_2" in own.archives else None
        te = own.keys("text_encoder") if "text_encoder" in own.archives else {}  # or partial
        given = read_model_file(weights, manifest, te, te2)
        for scope, comp in SCOPE_COMPONENTS.items():
            if scope in own.archives:
                tensors[scope] = match_component(
                    scope, given.get(comp, {}), own.keys(scope), str(weights)
                )
        prov.model = Path(weights).stem
        if Path(weights).is_file():
            sha = file_sha256(Path(weights))
            prov.model_hash = sha[:10]
            digest_parts.append(sha)
        else:
            digest_parts.append(f"folder:{Path(weights).resolve()}")
    if vae is not None:
        tensors["vae"] = match_component("vae", read_vae_file(vae), own.keys("vae"), str(vae))
        sha = file_sha256(Path(vae))
        prov.vae, prov.vae_hash = Path(vae).name, sha[:10]
        digest_parts.append("vae:" + sha)
    if loras:
        _merge_loras(manifest, own, tensors, loras, prov, warnings)
    digest = "" if loras else "+".join(digest_parts)
    return WeightOverrides(tensors, digest), prov, warnings


def _merge_loras(manifest, own, tensors, loras, prov, warnings) -> None:
    from ..checkpoints.read import read_tensors
    from ..lora import LoraSpec, lora_short_hash, plan_loras

    specs = []
    for req in loras:
        if not Path(req.path).is_file():
            raise UserError(f"LoRA file {req.path} does not exist")
        tf = read_tensors(req.path)
        specs.append(LoraSpec(req.name, tf.tensors, tf.metadata, req.strength, req.te_strength))
        prov.lora_hashes.append((req.name, lora_short_hash(Path(req.path))))
    comps = ("unet", "text_encoder")
    targets = {c: {k: shape for k, (shape, _) in own.keys(c).items()} for c in comps}
    plan = plan_loras(specs, targets)
    warnings += plan.warnings()
    for comp in plan.components:
        scope = comp  # LoRAs name the UNet and text encoder; their scopes have those names
        current = tensors.setdefault(scope, {})
        for key in plan.keys(comp):
            base = current.get(key)
            if base is None:
                base = own.array(scope, key)
            current[key] = plan.merged(comp, key, base)
