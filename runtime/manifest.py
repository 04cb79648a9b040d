"""The manifest: the versioned contract between `sdiree compile` and `sdiree run`.

compile writes `manifest.json` last, after every file it names is in place; run reads it here,
refuses a schema it does not know or a shape it cannot use, and checks every file against its
sha256 before use. An artifact directory is self-contained: every path in the manifest is
relative to it and stays inside it (no `..`, nothing absolute), so the directory can be copied
or moved on its own. The sha256 checks are cached in `.verified.json` in the artifact, keyed by
each file's size, mtime, ctime and inode; where the artifact is read-only the cache lives in the
user cache (`$SDIREE_CACHE/.verified/`, see fileutil.user_cache_dir).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import UserError
from .families import DEFAULT_FAMILY
from .fileutil import (
    atomic_write_json,
    cached_sha256,
    read_json_dict,
    user_cache_dir,
)

# 2 added a submodule's `extra_parameters` ([{path, scope}]): archives loaded beside
# `parameters` (weights derived at export, weights encoded at compile). 3 added a submodule's
# `encoder` ({vmfb, scope, derived}): the parameter encoder kept to encode other weights.
# 4: an encoded archive may be paged (each distinct page once, sdiree.runtime.weights.pages;
# its `extra_parameters` entry says `"layout": "pages"`), which older readers cannot load.
# A 4's `encoder` may name its `layout` (a JSON file, sdiree.runtime.weights.layout: how it
# packs each weight, learned at compile); readers that do not know it learn it at first use.
# 5: an original archive may be pruned (compile/prune.py): the keys it lacks are listed in
# `<archive>.pruned.json` (one of `files`) and read back from the encoded archives
# (sdiree.runtime.weights.recover); an older reader would find them missing.
# 6: an `encoder` may name the IREE `driver` it runs on where that is not the modules' (a GPU
# artifact's encoder is compiled for the host CPU); an older reader would run it on the GPU.
# Versions 1 to 5 are still read (the runtime tells the layouts apart by content).
SCHEMA_VERSION = 6
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6)
MANIFEST_NAME = "manifest.json"
DEFAULT_PIPELINE = "text2img"  # of manifests from before families were recorded
HASH_CACHE = ".verified.json"  # in the artifact: {path: [size, mtime, ctime, inode, sha256]}


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_json(cls, d: dict) -> TensorDecl:
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class FunctionDecl:
    name: str
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]


@dataclass(frozen=True)
class EncoderDecl:
    """A kept parameter encoder: it computes the `scope` archive (the submodule's encoded
    weights) from the submodule's weights and the `derived` ones ({key: (shape, dtype)}),
    which the runtime recomputes from the weights."""

    vmfb: str
    scope: str
    derived: dict[str, tuple[tuple[int, ...], str]]
    layout: str | None = None  # how it packs each weight (weights/layout.py), learned at compile
    driver: str | None = None  # the IREE driver it runs on; None: the modules' own


@dataclass(frozen=True)
class SubmoduleDecl:
    name: str
    vmfb: str
    parameters: str | None
    scope: str | None
    functions: dict[str, FunctionDecl]
    extra_parameters: tuple[tuple[str, str], ...] = ()  # (path, scope)
    encoder: EncoderDecl | None = None

    def archives(self) -> list[tuple[str, str]]:
        """(archive path relative to the artifact, parameter scope) for every archive it loads."""
        main = [(self.parameters, self.scope)] if self.parameters else []
        return main + list(self.extra_parameters)


@dataclass
class Manifest:
    root: Path
    data: dict
    submodules: dict[str, SubmoduleDecl] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.data["target"]["name"]

    @property
    def arch(self) -> str:
        return self.data["target"]["arch"]

    @property
    def driver(self) -> str:
        return self.data["target"]["driver"]

    @property
    def dtype(self) -> str:
        return self.data["dtype"]

    @property
    def family(self) -> str:
        """The model family (specs/families.json); artifacts from before it was recorded are
        all SD 1.x."""
        return self.data.get("model", {}).get("family") or DEFAULT_FAMILY

    @property
    def pipeline(self) -> str:
        """The pipeline that runs the artifact (runtime/families.PIPELINES)."""
        return self.data.get("model", {}).get("pipeline") or DEFAULT_PIPELINE

    @property
    def image(self) -> dict:
        return self.data["image"]

    def path(self, relative: str) -> Path:
        return (self.root / relative).resolve()


# The keys the runtime reads, with the type each must have (a dict: its own required keys).
_SHAPE = {
    "model": {"name": str},  # "family", "pipeline": optional strings (older manifests: none)
    "target": {"name": str, "arch": str, "driver": str},
    "dtype": str,
    "image": {
        "height": int,
        "width": int,
        "batch_size": int,
        "latent_channels": int,
        "latent_height": int,
        "latent_width": int,
    },
    "scheduler": {"config": str},
    "text_encoders": list,
    "submodules": dict,
    "files": dict,
}


_KIND = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _invalid(root: Path, what: str) -> UserError:
    return UserError(
        f"{MANIFEST_NAME} in {root} is not a valid sdiree manifest: {what}; recompile, or copy "
        "the whole artifact directory"
    )


def _check_shape(root: Path, data, shape: dict, where: str = "") -> None:
    for key, want in shape.items():
        if key not in data:
            raise _invalid(root, f"missing '{where}{key}'")
        value = data[key]
        expected = dict if isinstance(want, dict) else want
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise _invalid(root, f"'{where}{key}' is not {_KIND[expected]}")
        if isinstance(want, dict):
            _check_shape(root, value, want, f"{where}{key}.")


def _check_inside(root: Path, rel) -> str:
    """rel, if it is a relative path that stays inside the artifact directory."""
    if not isinstance(rel, str) or not rel:
        raise _invalid(root, f"{rel!r} is not a file path")
    if (
        PurePosixPath(rel).is_absolute()
        or PureWindowsPath(rel).is_absolute()
        or PureWindowsPath(rel).drive
        or ".." in PurePosixPath(rel.replace("\\", "/")).parts
    ):
        raise UserError(
            f"{MANIFEST_NAME} in {root} names {rel!r}, outside the artifact directory; an "
            "artifact holds every file it needs (one compiled by an older sdiree does not): "
            "recompile it with `sdiree compile`"
        )
    return rel


def _encoder_decl(root: Path, e) -> EncoderDecl | None:
    if e is None:
        return None
    derived = {
        str(k): (tuple(int(x) for x in v["shape"]), str(v["dtype"]))
        for k, v in e["derived"].items()
    }
    layout = e.get("layout")
    return EncoderDecl(
        _check_inside(root, e["vmfb"]),
        str(e["scope"]),
        derived,
        None if layout is None else _check_inside(root, layout),
        None if e.get("driver") is None else str(e["driver"]),
    )


def parse_manifest(root: Path, data) -> Manifest:
    if not isinstance(data, dict):
        raise _invalid(root, f"a JSON {type(data).__name__}, not an object")
    version = data.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise UserError(
            f"{root / MANIFEST_NAME} has schema version {version!r}; this sdiree reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}: recompile the model with this sdiree"
        )
    _check_shape(root, data, _SHAPE)
    if not data["text_encoders"]:
        raise _invalid(root, "'text_encoders' is empty")
    subs = {}
    try:
        te = data["text_encoders"][0]
        _check_inside(root, te["tokenizer"])
        for name, s in data["submodules"].items():
            fns = {
                fname: FunctionDecl(
                    fname,
                    tuple(TensorDecl.from_json(t) for t in f["inputs"]),
                    tuple(TensorDecl.from_json(t) for t in f["outputs"]),
                )
                for fname, f in s["functions"].items()
            }
            subs[name] = SubmoduleDecl(
                name,
                _check_inside(root, s["vmfb"]),
                s.get("parameters") and _check_inside(root, s["parameters"]),
                s.get("scope"),
                fns,
                tuple(
                    (_check_inside(root, e["path"]), e["scope"])
                    for e in s.get("extra_parameters", ())
                ),
                _encoder_decl(root, s.get("encoder")),
            )
    except (KeyError, IndexError) as e:
        raise _invalid(root, f"missing {e}") from None
    except (TypeError, AttributeError, ValueError):
        raise _invalid(root, "a submodule or text encoder entry has the wrong shape") from None
    for key in ("family", "pipeline"):
        if not isinstance(data["model"].get(key, ""), str):
            raise _invalid(root, f"'model.{key}' is not a string")
    _check_inside(root, data["scheduler"]["config"])
    for rel, digest in data["files"].items():
        _check_inside(root, rel)
        if not isinstance(digest, str):
            raise _invalid(root, f"the sha256 of {rel} is not a string")
    return Manifest(root=root, data=data, submodules=subs)


def load_manifest(artifact_dir: Path) -> Manifest:
    root = Path(artifact_dir)
    if not root.is_dir():
        raise UserError(f"artifact directory {root} does not exist; run `sdiree compile` first")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise UserError(
            f"{root} has no {MANIFEST_NAME}: not a compiled artifact, or its compile did not "
            "finish; run `sdiree compile` again"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); recompile the model") from None
    return parse_manifest(root, data)


def user_hash_cache(root: Path) -> Path:
    """Where the sha256 cache of a read-only artifact directory lives instead."""
    key = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:24]
    return user_cache_dir() / ".verified" / f"{key}.json"


def check_files(manifest: Manifest, cache_path: Path | None = None) -> None:
    """Check every file the manifest lists against its sha256.

    With cache_path (in the artifact directory), a file whose stamp (size, mtime, ctime,
    inode) is the one recorded there when it was last verified is not hashed again. Where that
    directory cannot be written the cache is kept in the user cache instead.
    """
    caches = [cache_path, user_hash_cache(manifest.root)] if cache_path else []
    cache = {}
    for c in reversed(caches):
        cache.update(read_json_dict(c))
    for rel, digest in manifest.data["files"].items():
        p = manifest.path(rel)
        if not p.is_file():
            raise UserError(
                f"artifact {manifest.root} is incomplete: {rel} is missing; copy or move the "
                "whole artifact directory (it holds every file it needs)"
            )
        if cached_sha256(p, rel, cache) != digest:
            raise UserError(
                f"{p} does not match its sha256 in the manifest (modified or corrupt); "
                "recompile the model"
            )
    for c in caches:
        if _save_cache(c, {rel: cache[rel] for rel in manifest.data["files"]}):
            return


def _save_cache(path: Path, cache: dict) -> bool:
    if read_json_dict(path) == cache:
        return True
    if path.parent.exists() and not os.access(path.parent, os.W_OK):
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cache)
    except OSError:  # a read-only or full filesystem just means no cache there
        return False
    return True
