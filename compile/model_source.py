"""A diffusers model folder on disk: validation, its configs, a content hash, and loading.

Nothing is downloaded: the folder is read exactly as diffusers' from_pretrained reads a model
it fetched earlier.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import atomic_write_json

# Submodule folders an SD 1.x pipeline needs, and the model_index.json key of each.
REQUIRED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
HASHED_SUFFIXES = {".json", ".safetensors", ".bin", ".txt", ".model"}
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass
class ModelSource:
    path: Path
    index: dict

    @property
    def name(self) -> str:
        return self.path.name

    def config(self, component: str) -> dict:
        folder = self.path / component
        for fname in ("config.json", "scheduler_config.json"):
            if (folder / fname).is_file():
                return json.loads((folder / fname).read_text())
        raise UserError(f"{folder} has no config.json; the model folder is incomplete")

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
        return [k for k, v in self.index.items() if not k.startswith("_") and v and v[0]]

    def load(self, component: str):
        """Instantiate a component with its library class (diffusers or transformers)."""
        library, cls_name = self.component_class(component)
        cls = getattr(importlib.import_module(library), cls_name)
        try:
            return cls.from_pretrained(self.path / component, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad model folder
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"could not load {component} from {self.path}: {msg}") from None


def open_model(path: Path) -> ModelSource:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"model folder {path} does not exist")
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise UserError(
            f"{path} is not a diffusers model folder (no model_index.json); pass the folder "
            "that holds model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/"
        )
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{index_path} is not valid JSON ({e})") from None
    for comp in REQUIRED:
        entry = index.get(comp)
        if not entry or not isinstance(entry, list) or entry[0] is None:
            raise UserError(f"{path}: model_index.json lists no '{comp}'; an SD model needs one")
        folder = path / comp
        if not folder.is_dir():
            raise UserError(f"{path} is missing the submodule folder '{comp}/'")
        if comp not in ("tokenizer", "scheduler") and not any(
            p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir()
        ):
            raise UserError(f"{folder} holds no weights (*.safetensors or *.bin)")
    return ModelSource(path=path, index=index)
