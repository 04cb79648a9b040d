"""Exports and compiled modules shared by every model of an architecture.

A submodule's exported MLIR holds no weights: the export traces shape-only placeholders
(compile/placeholders.py) and the weights are named parameters read from archives at run time.
So every model of one architecture (the same configs, parameter names, shapes and dtypes, and
buffers) exports the same MLIR for a given size, dtype and export choice: two SD 1.5
fine-tunes, or a model and its single-file checkpoint, differ only in their archives. And
iree-compile's output (the module and the parameter encoder it splits off) depends only on that
MLIR, the flags, the tuning specs and the compiler. Each kind is kept here under the sha256 of
what it depends on, so a second model of an architecture skips the export and iree-compile;
its parameters are written and encoded from its own weights as before.

    <root>/.exports/<key>.mlirbc, <key>.json      an export and its signature
    <root>/.modules/<key>.vmfb, <key>.encoder     a module and its encoder, where it has one
    <root>/.<kind>/<key>.record.json              written last: the entry is whole (sha256s)

<root> is the user cache (sdiree.runtime.fileutil.user_cache_dir: `$SDIREE_CACHE`, else
`${XDG_CACHE_HOME:-~/.cache}/sdiree`) for every compile, whatever its --out: a compile into
`artifacts/` and one with --out share it. Files are hardlinked out (copied across filesystems);
deleting these folders costs only the time to build again.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from sdiree.runtime.fileutil import (
    atomic_write_json,
    link_or_copy,
    remove_stale_temps,
    sha256_file,
)

CACHED = "compiled before for the same MLIR, flags and specs"  # why a module was reused


class BuildCache:
    def __init__(self, root: Path, kind: str):
        self.dir = Path(root) / f".{kind}"

    def _part(self, key: str, name: str) -> Path:
        return self.dir / f"{key[:32]}.{name}"

    def fetch(self, key: str, dests: dict[str, Path]) -> set[str] | None:
        """Put each part of key's entry at dests[part]. Returns the entry's parts, or None
        where there is no whole entry whose every part dests names (a damaged entry is
        removed, to be built and stored anew)."""
        record = self._part(key, "record.json")
        try:
            entry = json.loads(record.read_text())
            parts = dict(entry["parts"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if entry.get("key") != key or not set(parts) <= set(dests):
            return None
        if not all(_has(self._part(key, n), sha) for n, sha in parts.items()):
            for p in (record, *(self._part(key, n) for n in parts)):
                p.unlink(missing_ok=True)
            return None
        for name in parts:
            link_or_copy(self._part(key, name), dests[name])
        return set(parts)

    def store(self, key: str, parts: dict[str, Path]) -> None:
        """Keep the files parts names under key. Best effort: a cache that cannot be written
        costs only a later build."""
        with contextlib.suppress(OSError):
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.dir)
            shas = {}
            for name, path in parts.items():
                link_or_copy(path, self._part(key, name))
                shas[name] = sha256_file(self._part(key, name))
            atomic_write_json(self._part(key, "record.json"), {"key": key, "parts": shas})


def _has(path: Path, digest: str) -> bool:
    return path.is_file() and sha256_file(path) == digest
