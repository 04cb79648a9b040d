"""Turn a single-file checkpoint into a diffusers model folder in the compile cache, once.

`sdiree compile model.safetensors` compiles what `materialize` writes: the file's tensors read
torch-free (sdiree.runtime.checkpoints: safetensors or torch zip, never running a pickle's
code), its family detected from its keys, renamed to the diffusers layout and checked tensor
by tensor against the model a config builds (on torch's meta device: no memory), then written
with that config, a tokenizer and a scheduler as a diffusers folder named after the file's
stem (so artifacts are `artifacts/<stem>/...`). The configs come from the presets shipped in
specs/models/ (SD 1.5 and its inpainting model, SD 2.1 at 768 with v-prediction, SD 2.1-base at
512 with epsilon, SD 2 inpainting, SDXL base 1.0 with both its text encoders and tokenizers; the
real CLIP BPE vocabulary built from its merges) or, like
diffusers' `from_single_file(..., config=DIR)`, from a diffusers folder of the same
architecture. A file holding EMA weights beside the trained ones gives the trained ones, as
diffusers, A1111 and ComfyUI load it.

The folder is keyed by the file's sha256 (cached by file stamp) and the options, written to a
temporary name and renamed, and reused while they are unchanged. `single_file.json` in it
records where it came from (file name, sha256: A1111's "Model hash" is its first 10 digits).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np

from sdiree.runtime.checkpoints.detect import Detected, check_shapes, detect
from sdiree.runtime.checkpoints.ldm_layout import convert
from sdiree.runtime.checkpoints.read import read_tensors
from sdiree.runtime.checkpoints.safetensors_file import write_safetensors
from sdiree.runtime.errors import UserError
from sdiree.runtime.families import load_families
from sdiree.runtime.fileutil import (
    atomic_write_json,
    cached_sha256,
    pid_alive,
    read_json_dict,
    sha256_file,
    sha256_json,
)
from sdiree.runtime.tokenizer import _BYTE_CHARS
from sdiree.runtime.weights.sources import align_text_prefix

from .model_source import check_config, read_json_object

SOURCE_FILE = "single_file.json"
SCHEMA_VERSION = 1
# Bumped when what materialize writes for the same inputs changes: old folders are not reused.
CONVERTER_REVISION = 1
# The weights file of a component by its library (model_index.json's first entry).
LIBRARY_WEIGHT_FILES = {
    "diffusers": "diffusion_pytorch_model.safetensors",
    "transformers": "model.safetensors",
}
SCHEDULER_CONFIG = {"scheduler": "scheduler_config.json"}
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
CLIP_VOCAB_SIZE = 49408
BOS, EOS, EOW = "<|startoftext|>", "<|endoftext|>", "</w>"
_TMP_RE = re.compile(r"^\.([0-9a-f]{16})\.(\d+)\.tmp$")


def presets_dir() -> Path:
    return Path(str(resources.files("sdiree.specs"))) / "models"


def weighted_components(family: str) -> tuple[str, ...]:
    """The components with weights of a family's pipeline: the UNet, the VAE and each text
    encoder (SDXL: text_encoder and text_encoder_2), in that order."""
    fam = load_families().families[family]
    subs = fam.submodules or {}
    encoders = [
        subs.get(te["submodule"], {}).get("component", te["submodule"]) for te in fam.text_encoders
    ]
    return ("unet", "vae", *encoders)


def tokenizer_folders(family: str) -> tuple[str, ...]:
    return tuple(te["tokenizer"] for te in load_families().families[family].text_encoders)


def config_files(family: str) -> dict[str, str]:
    """{component: its config file name} of a family's single-file folder."""
    return {**{c: "config.json" for c in weighted_components(family)}, **SCHEDULER_CONFIG}


def source_info(model_dir: Path) -> dict | None:
    """What a materialized folder came from ({"file", "sha256", ...}), or None for a folder
    that was not made from a single file."""
    info = read_json_dict(Path(model_dir) / SOURCE_FILE)
    return info if info.get("sha256") else None


def materialize(
    path: Path,
    cache_dir: Path,
    config_dir: Path | None = None,
    prediction_type: str | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """The diffusers folder of a single-file checkpoint, written under cache_dir if not there
    yet; UserError (nothing written) for a file or config sdiree does not take."""
    path, cache_dir = Path(path), Path(cache_dir)
    say = say or (lambda _msg: None)
    where = str(path)
    # Everything is checked before anything is written (the file memory-mapped: cheap).
    tf = read_tensors(path)
    det = detect(tf.tensors, tf.extras, where, prediction_type)
    if config_dir is not None:
        config_dir = Path(config_dir)
        if not (config_dir / "model_index.json").is_file():
            raise UserError(
                f"--config {config_dir} is not a diffusers model folder (no model_index.json)"
            )
    config_root = config_dir or presets_dir() / det.preset
    config_name = f"--config {config_dir}" if config_dir else f"sdiree's {det.preset} config"
    index, configs = _read_configs(config_root, det, prediction_type, where, config_name)
    # The UNet's layers per block are read from its keys, so a config of another shape is
    # reported by the first tensor that differs rather than as keys with no place.
    conv = convert(
        tf.tensors,
        text_layers=configs["text_encoder"].get("num_hidden_layers"),
        text_layers_2=configs.get("text_encoder_2", {}).get("num_hidden_layers"),
    )
    if conv.unknown:
        more = f" and {len(conv.unknown) - 1} more" if len(conv.unknown) > 1 else ""
        raise UserError(
            f"{where}: tensor {conv.unknown[0]}{more} has no place in an {det.label} model; "
            "is the checkpoint damaged or of another architecture?"
        )
    components = _checked(conv.components, _expected_shapes(index, configs), where, config_name)

    _make_dir(cache_dir)
    _remove_stale(cache_dir)
    sha = _file_sha256(path, cache_dir)
    key = sha256_json(
        {
            "sha256": sha,
            "name": path.stem,
            "config": _folder_digest(config_dir, det.family) if config_dir else None,
            "prediction_type": prediction_type,
            "revision": CONVERTER_REVISION,
        }
    )[:16]
    stem = path.stem
    dest = cache_dir / key / stem
    if read_json_dict(dest / SOURCE_FILE).get("key") == key:
        return dest
    dtypes = {c: sorted({str(t.dtype) for t in ts.values()}) for c, ts in components.items()}
    all_dtypes = ", ".join(sorted({d for ds in dtypes.values() for d in ds}))
    prediction = configs["scheduler"].get("prediction_type", "epsilon")
    kind = f"{det.label} inpainting" if det.inpainting else det.label
    say(
        f"{path.name}: {kind} checkpoint ({tf.format}, {all_dtypes}; {prediction}); writing it "
        f"as a diffusers folder in {dest.parent}"
    )
    if det.has_ema:
        say("  it also holds EMA weights (model_ema.*): the UNet's own are used, as diffusers does")
    if conv.other:
        shown = ", ".join(conv.other[:3]) + (", ..." if len(conv.other) > 3 else "")
        say(f"  {len(conv.other)} tensors outside the model are left out ({shown})")
    info = {
        "schema_version": SCHEMA_VERSION,
        "key": key,
        "file": path.name,
        "sha256": sha,
        "size": os.path.getsize(path),
        "format": tf.format,
        "family": det.family,
        "inpainting": det.inpainting,
        "config": str(config_dir.resolve()) if config_dir else f"preset:{det.preset}",
        "prediction_type": prediction,
        "prediction_source": (
            det.prediction_source if prediction_type or not config_dir else "--config"
        ),
        "ema": conv.ema,
        "has_ema": det.has_ema,
        "dtypes": dtypes,
        "left_out": len(conv.other),
    }
    tokenizers = {}  # {folder: (source, copied as it is)}
    for name in tokenizer_folders(det.family):
        tokenizer = config_root / name
        copy = any((tokenizer / f).is_file() for f in ("vocab.json", "tokenizer.json"))
        # a preset, or a --config folder without one: CLIP's own BPE with the preset's configs
        tokenizers[name] = (tokenizer if copy else presets_dir() / det.preset / name, copy)
    _write(cache_dir, key, stem, tokenizers, index, configs, components, info)
    return dest


def _make_dir(cache_dir: Path) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create {cache_dir} for the converted checkpoint ({e.strerror or e}); "
            "set SDIREE_CACHE to a writable folder"
        ) from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write to {cache_dir} for the converted checkpoint; set SDIREE_CACHE to a "
            "writable folder"
        )


def _remove_stale(cache_dir: Path) -> None:
    """Temp folders of conversions killed midway (their process is gone)."""
    for p in cache_dir.iterdir():
        m = _TMP_RE.match(p.name)
        if m and p.is_dir() and (int(m.group(2)) == os.getpid() or not pid_alive(int(m[2]))):
            shutil.rmtree(p, ignore_errors=True)


def _file_sha256(path: Path, cache_dir: Path) -> str:
    """The file's sha256, remembered by its stamp so a recompile does not read it again."""
    cache_path = cache_dir / ".file-hashes.json"
    cache = read_json_dict(cache_path)
    digest = cached_sha256(path, str(path.resolve()), cache)
    with contextlib.suppress(OSError):
        atomic_write_json(cache_path, cache)
    return digest


def _folder_digest(folder: Path, family: str) -> str:
    """sha256 over the config and tokenizer files materialize takes from a --config folder."""
    files = [folder / "model_index.json"]
    files += [folder / c / f for c, f in config_files(family).items()]
    for name in tokenizer_folders(family):
        tok = folder / name
        files += sorted(p for p in tok.iterdir() if p.is_file()) if tok.is_dir() else []
    return sha256_json([[str(p.relative_to(folder)), sha256_file(p)] for p in files if p.is_file()])


def _read_configs(
    root: Path, det: Detected, prediction_type: str | None, where: str, config_name: str
) -> tuple[dict, dict]:
    """model_index.json and the components' configs of root, checked against the family the
    checkpoint's keys gave (prediction_type written into the scheduler's)."""
    index = read_json_object(root / "model_index.json", "a pipeline's model_index.json")
    wanted = config_files(det.family)
    # the folder's own family first (from the configs it has), then the ones the file needs
    named = {c: "config.json" for c, v in index.items() if isinstance(v, list)}
    found = {}
    for comp, fname in {**named, **wanted}.items():
        p = root / comp / fname
        if p.is_file():
            found[comp] = check_config(read_json_object(p, f"{comp}'s config"), comp, p)
    family = load_families().detect(index, found, str(root))
    if family.name != det.family:
        raise UserError(
            f"{where} is an {det.label} checkpoint, but {config_name} is an {family.label} "
            "model; pass --config DIR of a model of the checkpoint's family"
        )
    configs = {}
    for comp, fname in wanted.items():
        p = root / comp / fname
        configs[comp] = found.get(comp) or check_config(
            read_json_object(p, f"{comp}'s config"), comp, p
        )
    if prediction_type is not None:
        configs["scheduler"] = {**configs["scheduler"], "prediction_type": prediction_type}
    return index, configs


def _expected_shapes(index: dict, configs: dict) -> dict[str, dict[str, tuple]]:
    """{component: {tensor name: shape}} of the models the configs describe, built on torch's
    meta device (no memory, no weights)."""
    import diffusers
    import torch
    import transformers

    shapes = {}
    with torch.device("meta"):
        for comp in configs:
            if comp == "scheduler":
                continue
            library, cls_name = index[comp][0], index[comp][1]
            if library == "diffusers":
                model = getattr(diffusers, cls_name).from_config(configs[comp])
            else:
                cls = getattr(transformers, cls_name)
                model = cls(cls.config_class.from_dict(configs[comp]))
            shapes[comp] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes


def _checked(components: dict, expected: dict, where: str, config_name: str) -> dict:
    """The components in the models' key order, each checked key by key and shape by shape; a
    text encoder's keys prefixed with `text_model.` where the installed transformers wants it
    (transformers 5.6 dropped it from CLIPTextModel, not from CLIPTextModelWithProjection, whose
    `text_projection` never had it)."""
    out = {}
    for comp, want in expected.items():
        have = components.get(comp, {})
        if comp.startswith("text_encoder"):
            have = align_text_prefix(have, want)
        check_shapes(want, have, where, comp.replace("_", " "), config_name)
        out[comp] = {k: have[k] for k in want}
    return out


def clip_vocab(merges: list[str]) -> dict[str, int]:
    """CLIP's vocabulary from its BPE merges: the 256 byte characters, the same with `</w>`, one
    token per merge, then the start and end tokens."""
    chars = list(_BYTE_CHARS.values())  # the byte alphabet, in CLIP order
    tokens = chars + [c + EOW for c in chars] + [m.replace(" ", "") for m in merges] + [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}


def write_clip_tokenizer(out: Path, config_src: Path) -> None:
    """vocab.json and merges.txt of CLIP's real BPE (specs/models/clip-bpe/merges.txt.gz), and
    the preset's tokenizer configs, into out."""
    text = gzip.decompress((presets_dir() / "clip-bpe" / "merges.txt.gz").read_bytes()).decode()
    merges = [line for line in text.split("\n")[1:] if line]
    vocab = clip_vocab(merges)
    if len(vocab) != CLIP_VOCAB_SIZE:
        raise UserError(
            f"{presets_dir() / 'clip-bpe'} holds {len(merges)} merges, not CLIP's; reinstall sdiree"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "merges.txt").write_text(text, encoding="utf-8")
    for name in TOKENIZER_CONFIGS:
        shutil.copyfile(config_src / name, out / name)


def _write(
    cache_dir: Path,
    key: str,
    stem: str,
    tokenizers: dict[str, tuple[Path, bool]],
    index: dict,
    configs: dict,
    components: dict[str, dict[str, np.ndarray]],
    info: dict,
) -> None:
    tmp_root = cache_dir / f".{key}.{os.getpid()}.tmp"
    final_root = cache_dir / key
    shutil.rmtree(tmp_root, ignore_errors=True)
    tmp = tmp_root / stem
    try:
        tmp.mkdir(parents=True)
        atomic_write_json(tmp / "model_index.json", index)
        for comp, config in configs.items():
            (tmp / comp).mkdir()
            fname = SCHEDULER_CONFIG.get(comp, "config.json")
            atomic_write_json(tmp / comp / fname, config)
        for comp, tensors in components.items():
            fname = LIBRARY_WEIGHT_FILES[index[comp][0]]
            write_safetensors(tmp / comp / fname, tensors, {"format": "pt"})
        for name, (source, copy) in tokenizers.items():
            if copy:
                (tmp / name).mkdir()
                for p in source.iterdir():
                    if p.is_file():
                        shutil.copyfile(p, tmp / name / p.name)
            else:
                write_clip_tokenizer(tmp / name, source)
        atomic_write_json(tmp / SOURCE_FILE, info)
        if read_json_dict(final_root / stem / SOURCE_FILE).get("key") != key:
            shutil.rmtree(final_root, ignore_errors=True)  # damaged by hand: replaced
            try:
                os.rename(tmp_root, final_root)
            except OSError:
                if read_json_dict(final_root / stem / SOURCE_FILE).get("key") != key:
                    raise  # not another process's finished copy of the same conversion
    except OSError as e:
        raise UserError(
            f"cannot write the converted checkpoint to {cache_dir} ({e.strerror or e}); free "
            "some disk space or set SDIREE_CACHE to another folder"
        ) from None
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
