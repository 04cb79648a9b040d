"""The manifest: the versioned contract between `sdiree compile` and `sdiree run`.

compile writes `manifest.json` last, after every file it names is in place; run reads it here,
refuses a schema it does not know, and checks every file against its sha256 before use.
Paths in the manifest are relative to the artifact directory (shared parameter archives live in
a sibling directory, hence `../params/...`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .fileutil import sha256_file

# 2 added a submodule's `extra_parameters` ([{path, scope}]): archives loaded beside
# `parameters` (weights derived at export, weights encoded at compile). Version 1 is still read.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"


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
class SubmoduleDecl:
    name: str
    vmfb: str
    parameters: str | None
    scope: str | None
    functions: dict[str, FunctionDecl]
    extra_parameters: tuple[tuple[str, str], ...] = ()  # (path, scope)

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
    def image(self) -> dict:
        return self.data["image"]

    def path(self, relative: str) -> Path:
        return (self.root / relative).resolve()


def parse_manifest(root: Path, data: dict) -> Manifest:
    version = data.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise UserError(
            f"{root / MANIFEST_NAME} has schema version {version!r}; this sdiree reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}: recompile the model with this sdiree"
        )
    subs = {}
    try:
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
                s["vmfb"],
                s.get("parameters"),
                s.get("scope"),
                fns,
                tuple((e["path"], e["scope"]) for e in s.get("extra_parameters", ())),
            )
        for key in ("target", "dtype", "image", "files"):
            data[key]  # noqa: B018  (presence check)
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{root / MANIFEST_NAME} is malformed (missing {e}); recompile the model"
        ) from None
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
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); recompile the model") from None
    return parse_manifest(root, data)


def check_files(manifest: Manifest, cache_path: Path | None = None) -> None:
    """Check every file the manifest lists against its sha256.

    The cache (size and mtime of files already verified) keeps repeated runs cheap; a file whose
    size or mtime changed is hashed again.
    """
    cache = {}
    if cache_path and cache_path.is_file():
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    new_cache = {}
    for rel, digest in manifest.data["files"].items():
        p = manifest.path(rel)
        if not p.is_file():
            raise UserError(f"{p} is listed in the manifest but missing; recompile the model")
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns, digest]
        if cache.get(str(p)) != stamp and sha256_file(p) != digest:
            raise UserError(
                f"{p} does not match its sha256 in the manifest (modified or corrupt); "
                "recompile the model"
            )
        new_cache[str(p)] = stamp
    if cache_path:
        from .fileutil import atomic_write_json

        with contextlib.suppress(OSError):  # a read-only artifact dir just means no cache
            atomic_write_json(cache_path, new_cache)
