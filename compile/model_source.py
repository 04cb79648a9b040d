"""A diffusers model folder on disk: its family, validation, its configs, a content hash, and
loading.

Nothing is downloaded: the folder is read exactly as diffusers' from_pretrained reads a model
it fetched earlier. Everything the compiler reads from the folder is checked here, before any
file is written, so a damaged or foreign folder is one clear error rather than a traceback.
The family (specs/families.json) is read first, from model_index.json and the configs that
tell families apart: a family sdiree does not compile, or a mix of them, is refused before
the folder's files are checked against what that family needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from sdiree.runtime.errors import UserError
from sdiree.runtime.families import Family, load_families
from sdiree.runtime.fileutil import atomic_write_json

# Submodule folders an SD 1.x pipeline needs, and the model_index.json key of each.
REQUIRED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
HASHED_SUFFIXES = {".json", ".safetensors", ".bin", ".txt", ".model"}
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# The files from_pretrained reads, in its order of preference: one file or the shards its index
# names. A variant's are named `<stem>.<variant>.<ext>`, its index `<name>.index.<variant>.json`.
WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)
# A model's folder in the Hugging Face hub cache (~/.cache/huggingface/hub): its files are in
# snapshots/<revision>/, refs/main names the revision last downloaded.
HF_REPO_PREFIX = "models--"
# Libraries a component may come from: importing a module named by a downloaded file runs its
# code, so only these two are imported.
LIBRARIES = ("diffusers", "transformers")
TOKENIZER_NEEDS = ("vocab.json", "merges.txt")
REDOWNLOAD = "re-download or re-save the model"

# The config keys the compiler reads, per component: (key, kind, required). A missing optional
# key takes the default its reader gives it.
CONFIG_KEYS = {
    "unet": (
        ("sample_size", "size", True),
        ("in_channels", "size", True),
        ("cross_attention_dim", "size", True),
    ),
    "vae": (("block_out_channels", "sizes", True), ("scaling_factor", "number", False)),
    "text_encoder": (("hidden_size", "size", True), ("max_position_embeddings", "size", False)),
    "text_encoder_2": (
        ("hidden_size", "size", True),
        ("max_position_embeddings", "size", False),
        ("projection_dim", "size", True),
    ),
    "scheduler": (
        ("num_train_timesteps", "size", False),
        ("beta_start", "number", False),
        ("beta_end", "number", False),
        ("beta_schedule", "text", False),
        ("prediction_type", "text", False),
    ),
}
KINDS = {
    "size": "a positive integer",
    "sizes": "a non-empty list of positive integers",
    "number": "a finite number",
    "text": "a string",
}


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _fits(value, kind: str) -> bool:
    if kind == "size":
        return _is_size(value)
    if kind == "sizes":
        return isinstance(value, list) and len(value) > 0 and all(map(_is_size, value))
    if kind == "number":
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    return isinstance(value, str)


def _json_type(value) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file that must hold an object; UserError naming the file when it does not."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing; the model folder is incomplete: {REDOWNLOAD}"
        ) from None
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, unreadable
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is not valid JSON ({why}); it is damaged: {REDOWNLOAD}") from None
    if not isinstance(data, dict):
        raise UserError(
            f"{path} holds a JSON {_json_type(data)}, not the object {what} should be; {REDOWNLOAD}"
        )
    return data


def check_config(config: dict, component: str, path: Path) -> dict:
    """config, after checking the type of every key the compiler reads (CONFIG_KEYS)."""
    for key, kind, required in CONFIG_KEYS.get(component, ()):
        if key not in config:
            if required:
                raise UserError(
                    f"{path} has no '{key}' ({KINDS[kind]}), which sdiree compile needs; "
                    f"is this an SD 1.x {component}? {REDOWNLOAD}"
                )
            continue
        if not _fits(config[key], kind):
            shown = json.dumps(config[key])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise UserError(
                f"{path}: '{key}' is {shown}, but must be {KINDS[kind]}; fix the file or "
                f"{REDOWNLOAD}"
            )
    return config


def _is_pair(entry) -> bool:
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)


@dataclass
class ModelSource:
    path: Path
    index: dict
    family: Family | None = None

    @property
    def name(self) -> str:
        """The folder's name; a Hugging Face cache snapshot's is its repository's (`<name>` of
        `models--<org>--<name>/snapshots/<revision>`), not the revision's hash."""
        repo = self.path.parent.parent
        if self.path.parent.name == "snapshots" and repo.name.startswith(HF_REPO_PREFIX):
            return repo.name.split("--")[-1]
        return self.path.name

    def config(self, component: str) -> dict:
        """The component's config.json (scheduler: scheduler_config.json), its keys checked."""
        fname = "scheduler_config.json" if component == "scheduler" else "config.json"
        path = self.path / component / fname
        return check_config(read_json_object(path, f"{component}'s config"), component, path)

    def check_classes(self) -> None:
        """The classes model_index.json names exist in their libraries and are the family's.
        This imports diffusers and transformers (seconds), so bad input that needs no import
        to find says so first."""
        index_path = self.path / "model_index.json"
        for comp in required_components(self.family):
            _check_class(index_path, comp, *self.index[comp])
        for comp, classes in self.family.classes.items():
            if self.index[comp][1] not in classes:
                raise UserError(
                    f"{index_path}: '{comp}' is a {self.index[comp][1]}, but an "
                    f"{self.family.label} model has a {' or '.join(classes)} there; is this the "
                    "right folder?"
                )

    def component_class(self, component: str) -> tuple[str, str]:
        library, cls = self.index[component]
        return library, cls

    def content_hash(self, cache_path: Path | None = None) -> str:
        """sha256 over the relative path and bytes of every config and weight file.

        With cache_path, a hash is reused while every file keeps its size and mtime, so an
        unchanged recompile does not read gigabytes of weights again.
        """
        files = [self.path / "model_index.json"]
        for comp in self.components():
            files += sorted(p for p in (self.path / comp).rglob("*") if p.suffix in HASHED_SUFFIXES)
        stamp = [
            [str(p.relative_to(self.path)), p.stat().st_size, p.stat().st_mtime_ns] for p in files
        ]
        key = str(self.path.resolve())
        cache = {}
        if cache_path and cache_path.is_file():
            with contextlib.suppress(OSError, json.JSONDecodeError):
                cache = json.loads(cache_path.read_text())
        if cache.get(key, {}).get("stamp") == stamp:
            return cache[key]["sha256"]
        digest = self._hash_files(files)
        if cache_path:
            cache[key] = {"stamp": stamp, "sha256": digest}
            with contextlib.suppress(OSError):
                atomic_write_json(cache_path, cache)
        return digest

    def _hash_files(self, files: list[Path]) -> str:
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(self.path)).encode() + b"\0")
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
        return h.hexdigest()

    def components(self) -> list[str]:
        """The index's components: its [library, class] entries (not "_class_name", the
        [null, null] of an absent part, or options such as "requires_safety_checker": false)."""
        return [k for k, v in self.index.items() if not k.startswith("_") and _is_pair(v)]

    def load(self, component: str, dtype=None):
        """Instantiate a component with its library class (diffusers or transformers), in
        dtype (a torch dtype; default: its files' own, files_dtype)."""
        library, cls_name = self.component_class(component)
        cls = getattr(importlib.import_module(library), cls_name)
        # Never the config's torch_dtype: transformers 5 loads a model in that dtype by default,
        # and SDXL's released text-encoder configs say float16 over float32 files (the export
        # casts to the compile's dtype itself).
        folder = self.path / component
        options = {
            "dtype" if library == "transformers" else "torch_dtype": dtype or files_dtype(folder)
        }
        if variant := weight_variant(folder):
            options["variant"] = variant  # a folder of only fp16 files, say
        try:
            model, info = cls.from_pretrained(
                folder, local_files_only=True, output_loading_info=True, **options
            )
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad model folder
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"could not load {component} from {self.path}: {msg}") from None
        # Both libraries fill a parameter the files lack with random values, with no more than
        # a logged warning: the artifact would compile and make noise.
        if missing := sorted(info.get("missing_keys") or ()):
            total = sum(1 for _ in model.state_dict())
            raise UserError(
                f"{folder}'s weights lack {len(missing)} of the {total} tensors its config "
                f"needs (e.g. '{missing[0]}'): the file is another component's or another "
                f"model's, or damaged; {REDOWNLOAD}"
            )
        return model


def weight_files(folder: Path) -> list[Path]:
    """The weight files from_pretrained reads from a component folder: its plain ones, or
    where it has none, those of its one variant (weight_variant); [] where it has none of
    WEIGHT_FILES (from_pretrained's own error then says why)."""
    variant = weight_variant(folder)
    for name in WEIGHT_FILES:
        single, index = _variant_names(name, variant)
        index = folder / index
        if index.is_file():
            weight_map = read_json_object(index, "a sharded checkpoint's index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise UserError(f"{index} has no 'weight_map' of file names; {REDOWNLOAD}")
            return [folder / f for f in dict.fromkeys(weight_map.values())]
        if (folder / single).is_file():
            return [folder / single]
    return []


def weight_variant(folder: Path) -> str | None:
    """The variant a component folder's weights are to be read as: the one variant its files
    are of where it has no plain ones (a download of only a repository's fp16 files:
    `diffusion_pytorch_model.fp16.safetensors`, `model.fp16.safetensors`); None where it has
    plain files or none at all; UserError where its files are of several variants."""
    if any(
        (folder / a).is_file() or (folder / b).is_file()
        for a, b in map(_variant_names, WEIGHT_FILES)
    ):
        return None
    found = set()
    for path in folder.iterdir() if folder.is_dir() else ():
        for name in WEIGHT_FILES:
            stem, ext = name.rsplit(".", 1)
            single = re.fullmatch(re.escape(stem) + r"\.(\w+)\." + ext, path.name)
            index = re.fullmatch(re.escape(name) + r"\.index\.(\w+)\.json", path.name)
            if m := single or index:
                found.add(m[1])
    if len(found) > 1:
        raise UserError(
            f"{folder} holds the weights of several variants ({', '.join(sorted(found))}) and "
            "no plain ones; keep the files of one variant"
        )
    return found.pop() if found else None


def _variant_names(name: str, variant: str | None = None) -> tuple[str, str]:
    """The single file and index names of one of WEIGHT_FILES, as variant or plain."""
    if variant is None:
        return name, f"{name}.index.json"
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}", f"{name}.index.{variant}.json"


def check_weight_file(path: Path) -> None:
    """UserError where a weight file is not whole: a Git LFS pointer or a page a failed
    download saved (any format); a safetensors file whose header is damaged or whose tensors
    run past its end. Only headers are read."""
    from sdiree.runtime.checkpoints.read import failed_download
    from sdiree.runtime.checkpoints.safetensors_file import checked_header

    if not path.is_file():
        raise UserError(f"{path} is missing; {REDOWNLOAD}")
    if problem := failed_download(path):
        raise UserError(problem)
    if path.suffix == ".safetensors":
        checked_header(path)


def files_dtype(folder: Path):
    """The dtype a component loads in: its safetensors files' float dtype where they all have
    the same half one, else float32. In the files' dtype the loader maps the tensors without
    a copy (SDXL's fp16 UNet: 0.5 GB instead of 15 GB in float32), and no tensor is rounded."""
    import torch

    from .weight_source import read_header

    found = set()
    for path in (p for p in weight_files(folder) if p.suffix == ".safetensors"):
        found |= {t.dtype for t in read_header(path).values() if t.dtype.is_floating_point}
    return found.pop() if found in ({torch.float16}, {torch.bfloat16}) else torch.float32


def open_model(
    path: Path,
    *,
    cache_dir: Path | None = None,
    config_dir: Path | None = None,
    prediction_type: str | None = None,
    say=None,
    check_classes: bool = True,
) -> ModelSource:
    """A diffusers folder, or a single-file checkpoint converted to one in cache_dir (default:
    the user cache) with config_dir's or the shipped configs (compile/single_file.py). Without
    check_classes the caller runs ModelSource.check_classes itself, after its own cheaper
    checks."""
    path = Path(path)
    if path.is_file():
        path = _single_file_folder(path, cache_dir, config_dir, prediction_type, say)
    elif config_dir is not None or prediction_type is not None:
        option = "--config" if config_dir is not None else "--prediction-type"
        raise UserError(
            f"{option} is for a single-file checkpoint; {path} is not a file (a diffusers "
            "folder's own configs and scheduler_config.json say these)"
        )
    if not path.is_dir():
        raise UserError(
            f"model {path} does not exist (pass a diffusers folder or a checkpoint file)"
        )
    if (snapshot := hf_snapshot(path)) is not None:
        if say:
            say(f"{path} is a Hugging Face cache folder: compiling its snapshot {snapshot.name}")
        path = snapshot
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise UserError(
            f"{path} is not a diffusers model folder (no model_index.json); pass the folder "
            "that holds model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/"
        )
    index = read_json_object(index_path, "a pipeline's model_index.json")
    families = load_families()
    family = families.detect(index, _configs_for_detection(path, families), str(path))
    required = required_components(family)
    tokenizers = [te["tokenizer"] for te in family.text_encoders]
    for comp in required:  # every part named before any folder is looked into
        entry = index.get(comp)
        if not entry or (isinstance(entry, list) and entry[0] is None):
            raise UserError(
                f"{path}: model_index.json lists no '{comp}'; an {family.label} model needs one"
            )
        if not _is_pair(entry):
            raise UserError(
                f"{index_path}: '{comp}' is {json.dumps(entry)[:60]}, but must be a "
                f'[library, class] pair such as ["diffusers", "UNet2DConditionModel"]'
            )
    for comp in required:
        folder = path / comp
        if not folder.is_dir():
            raise UserError(f"{path} is missing the submodule folder '{comp}/'")
        if comp not in (*tokenizers, "scheduler"):
            if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir()):
                raise UserError(f"{folder} holds no weights (*.safetensors or *.bin)")
            for file in weight_files(folder):
                check_weight_file(file)
    for tokenizer in tokenizers:
        for name in TOKENIZER_NEEDS:
            if not (path / tokenizer / name).is_file():
                raise UserError(
                    f"{path / tokenizer} has no {name}; sdiree needs a CLIP BPE tokenizer "
                    f"({' and '.join(TOKENIZER_NEEDS)})"
                )
        read_json_object(path / tokenizer / "vocab.json", "a tokenizer vocabulary")
    source = ModelSource(path=path, index=index, family=family)
    if check_classes:
        source.check_classes()
    return source


def hf_snapshot(path: Path) -> Path | None:
    """The snapshot to compile where path is a model's Hugging Face cache folder
    (`models--<org>--<name>`, or its `snapshots/`) rather than a snapshot: the revision
    refs/main names, else the only snapshot holding model_index.json; None where path is no
    such folder. UserError where several snapshots are there and no ref says which."""
    repo = path.parent if path.name == "snapshots" else path
    if not repo.name.startswith(HF_REPO_PREFIX) or not (repo / "snapshots").is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text(errors="replace").strip()
        if (snapshot / "model_index.json").is_file():
            return snapshot
    found = sorted(s for s in (repo / "snapshots").iterdir() if (s / "model_index.json").is_file())
    if len(found) > 1:
        raise UserError(
            f"{repo} holds {len(found)} snapshots of the model and no refs/main naming one; "
            f"pass the one to compile: {', '.join(str(s) for s in found)}"
        )
    return found[0] if found else None


def _single_file_folder(path: Path, cache_dir, config_dir, prediction_type, say) -> Path:
    """The diffusers folder materialized from a single-file checkpoint."""
    from sdiree.runtime.fileutil import user_cache_dir

    from .single_file import materialize  # it imports this module

    cache = Path(cache_dir) if cache_dir else user_cache_dir() / path.stem / "single-file"
    return materialize(path, cache, config_dir, prediction_type, say)


def required_components(family: Family) -> tuple[str, ...]:
    """The folders a family's pipeline needs: its submodules' components, tokenizers and the
    scheduler (SD 1.x: REQUIRED)."""
    comps = [s["component"] for s in family.submodules.values()]
    comps += [te["tokenizer"] for te in family.text_encoders] + ["scheduler"]
    order = {c: i for i, c in enumerate(REQUIRED)}
    return tuple(sorted(dict.fromkeys(comps), key=lambda c: order.get(c, len(order))))


def _configs_for_detection(path: Path, families) -> dict:
    """{component: its config.json, or None where absent or unreadable} for the components
    families are recognised by: detection decides on what it can read, and the config checks
    report the rest afterwards."""
    configs = {}
    for comp in dict.fromkeys(c for f in families.families.values() for c in f.recognise):
        try:
            data = json.loads((path / comp / "config.json").read_bytes())
        except (OSError, ValueError):
            data = None
        configs[comp] = data if isinstance(data, dict) else None
    return configs


def _check_class(index_path: Path, component: str, library: str, cls_name: str) -> None:
    """The class model_index.json names for a component exists in its library."""
    if library not in LIBRARIES:
        raise UserError(
            f"{index_path}: '{component}' comes from library '{library}'; sdiree loads "
            f"components from {' or '.join(LIBRARIES)} only"
        )
    try:
        cls = getattr(importlib.import_module(library), cls_name, None)
    except (ImportError, RuntimeError) as e:  # diffusers' lazy imports raise RuntimeError
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot import {library}.{cls_name} for {component} ({why})") from None
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise UserError(
            f"{index_path}: '{component}' names class {cls_name}, which {library} does not "
            "have; is this an SD 1.x diffusers folder? (a newer library version may be needed)"
        )
