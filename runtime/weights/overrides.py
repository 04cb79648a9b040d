"""Parameter providers that serve replaced tensors in place of an artifact's own.

A `WeightOverrides` holds, per parameter scope, the tensors to load instead of the archive's
(same names, shapes and dtypes, checked by `sources`). `LoadedWeights` builds the providers a
Session's context loads from: a scope without replacements is the archive as compiled; a scope
with some is an index whose untouched entries still point into the archive's memory map (no
copy) and whose replaced ones point at the new arrays. What compile derived from the weights is
derived again from the replaced ones: Winograd-transformed 3x3 weights (cpu) and channels-last
filters (cuda's UNet) in numpy (derived.py), and a target's encoded (pre-packed) weights by
running the parameter encoder the artifact keeps, once per set of weights: cached under the user
cache when the set has a digest (a weights file, a VAE), else written to a temp file that is
unlinked as soon as it is mapped (LoRA merges).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..fileutil import remove_stale_temps, sha256_json, temp_path_for, user_cache_dir
from ..manifest import Manifest
from ..residency import file_identity
from .archive import Archive
from .derived import base_key, derived_weight
from .encoder import encoder_device
from .imported import add_importable
from .pages import load_archive, store_encoded
from .repack import REPACK_ENV, layout_for, repacked_index

ENCODED_CACHE = "encoded"  # under the user cache: <key>/<submodule>.encoded.irpa
# Sets of encoded weights kept there, the most recently used first: each is as large as the
# artifact's own encoded archives (~12 GB for SD 1.5 on cpu).
KEEP_ENV, KEEP_DEFAULT = "SDIREE_ENCODED_KEEP", 2


@dataclass
class WeightOverrides:
    """Replacement tensors {scope: {key: array}} in the archives' dtypes, and a digest of
    where they came from ("" when they are not worth caching, e.g. LoRA strengths)."""

    tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    digest: str = ""

    def __bool__(self) -> bool:
        return any(self.tensors.values())

    def scopes(self) -> set[str]:
        return {s for s, t in self.tensors.items() if t}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LoadedWeights:
    """The parameter providers of one context: the artifact's archives for `submodules`, with
    `overrides` served in place of their tensors. Keeps alive what the providers point into."""

    def __init__(
        self,
        manifest: Manifest,
        submodules: tuple[str, ...],
        overrides: WeightOverrides | None,
        device,
        report: Callable[[str], None] = say,
        importable: bool = False,
    ):
        import iree.runtime as rt

        self.manifest = manifest
        self.overrides = overrides or WeightOverrides()
        self.report = report
        self._keep: list = []
        changed = self.overrides.scopes()
        # (path, scope) of every archive the submodules load, the VAE's shared one once
        archives = dict.fromkeys(
            (manifest.path(path), scope)
            for name in submodules
            for path, scope in manifest.submodules[name].archives()
        )
        by_scope: dict[str, list[Path]] = {}
        for path, scope in archives:
            by_scope.setdefault(scope, []).append(path)
        encoded_scopes = {
            manifest.submodules[n].encoder.scope: n
            for n in submodules
            if manifest.submodules[n].encoder and manifest.submodules[n].scope in changed
        }
        for name in submodules:
            sub = manifest.submodules[name]
            if sub.scope in changed and sub.encoder is None and _has_encoded(sub):
                raise UserError(
                    f"{manifest.root} was compiled by an older sdiree that did not keep its "
                    f"parameter encoders, which other weights need on {manifest.target}; "
                    "recompile it with this sdiree to use --weights, --vae or --lora"
                )
        self.indices: dict[str, object] = {}
        # the files each scope's pages are mapped from, as residency names them
        self.file_ids: dict[str, set] = {
            scope: {i for i in map(file_identity, paths) if i is not None}
            for scope, paths in by_scope.items()
        }
        for scope, paths in by_scope.items():
            if scope in encoded_scopes:
                continue  # computed below from the replaced weights
            if scope in changed:  # what the module loads by name: never a read-back key
                self.indices[scope] = self._replaced_index(
                    scope, paths, {}, self._keep, read_back=False
                )
            else:
                index = rt.ParameterIndex()
                for p in paths:
                    if importable:  # page-aligned copies the device imports (imported.py)
                        add_importable(index, p, self._keep)
                    else:
                        load_archive(index, p)
                self.indices[scope] = index
        for scope, name in encoded_scopes.items():
            enc_device = encoder_device(manifest.submodules[name].encoder, device)
            self.indices[scope] = self._encoded_index(name, enc_device)

    def _mapped(self, scope: str, path: Path) -> None:
        """Note that scope's pages are (also) mapped from the file at path."""
        ident = file_identity(path)
        if ident is not None:
            self.file_ids.setdefault(scope, set()).add(ident)

    def providers(self) -> list:
        return [index.create_provider(scope=scope) for scope, index in self.indices.items()]

    # -- replaced tensors ----------------------------------------------------------------
    def _replaced_index(
        self, scope: str, paths: list[Path], derived: dict, keep: list, read_back: bool = True
    ):
        """An index over scope's archives with the overrides in place, Winograd weights
        derived from them, and the `derived` keys ({key: (shape, dtype)}, not in any archive
        the artifact holds) computed from the weights. What the index points into is appended
        to keep, which must live as long as the index. Without read_back, keys a pruned
        archive dropped (weights/recover.py) are left out unless replaced: no module names
        them, only an encoder reads them."""
        import iree.runtime as rt

        replaced = self.overrides.tensors.get(scope, {})
        index = rt.ParameterIndex()
        originals = [Archive(p) for p in paths]
        keep += originals

        def weight(key: str) -> np.ndarray:
            if key in replaced:
                return replaced[key]
            for a in originals:
                if key in a.entries:
                    return a.array(key)
            raise KeyError(key)

        for archive in originals:
            for key, e in archive.entries.items():
                base = base_key(key)
                if key in derived:
                    continue  # computed below (an archive of them may be there too)
                if key in replaced:
                    _add_array(index, key, replaced[key], keep)
                elif e.recovered and not read_back:
                    continue  # the artifact dropped it, and no module names it
                elif base is not None and base in replaced:
                    _add_array(index, key, derived_weight(key, weight(base), e.shape), keep)
                elif e.splat is not None:
                    index.add_splat(key, np.frombuffer(e.splat, np.uint8).copy(), e.length)
                elif e.recovered:  # the artifact dropped it: read back from the encoded
                    _add_array(index, key, archive.array(key), keep)
                else:
                    handle, offset = archive.raw(key).file_storage
                    index.add_from_file_handle(key, handle, e.length, offset)
        for key, (shape, dtype) in derived.items():
            base, u = base_key(key), None
            if base not in replaced:  # unchanged: as the compile encoded it, where kept so
                u = next((x for a in originals if (x := a.read_back(key, shape, dtype)) is not None),
                         None)  # fmt: skip
            if u is None:
                u = derived_weight(key, weight(base), shape)
            if u.shape != shape:
                raise UserError(
                    f"{self.manifest.root}: derived weight {key} should be {list(shape)}, the "
                    f"weights give {list(u.shape)}; recompile the artifact"
                )
            _add_array(index, key, u, keep)
        return index

    # -- encoded weights -----------------------------------------------------------------
    def _encoded_index(self, name: str, device):
        """The index of submodule name's encoded weights, computed from the replaced weights
        by the artifact's kept encoder (or taken from the cache)."""
        import iree.runtime as rt

        m = self.manifest
        sub = m.submodules[name]
        enc = sub.encoder
        cache_dir = user_cache_dir() / ENCODED_CACHE
        cached = None
        if self.overrides.digest:
            # one folder per artifact (its encoders) and set of weights, for all its submodules
            encoders = {
                n: m.data["files"][s.encoder.vmfb] for n, s in m.submodules.items() if s.encoder
            }
            key = sha256_json({"encoders": encoders, "weights": self.overrides.digest})[:24]
            cached = cache_dir / key / f"{name}.encoded.irpa"
        index = rt.ParameterIndex()
        if cached is not None and cached.is_file():
            self.report(f"{name}: encoded weights from the cache ({cached.parent})")
            load_archive(index, cached)
            self._mapped(enc.scope, cached)
            os.utime(cached.parent)  # recently used: pruned last
            return index
        if cached is None and os.environ.get(REPACK_ENV, "1") != "0":
            fast = self._repacked_index(name, device)
            if fast is not None:
                return fast
        own = [(m.path(p), s) for p, s in sub.archives() if s == sub.scope]
        keep: list = []  # the encoder's inputs (derived weights too): freed once it ran
        source = self._replaced_index(sub.scope, [p for p, _ in own], enc.derived, keep)
        where = cached if cached is not None else cache_dir / f"{name}.encoded.irpa"
        where.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(where.parent)
        self.report(
            f"{name}: encoding the replaced weights for {m.target} "
            + ("(once per weights file; cached)" if cached else "(for this run only)")
        )
        t0 = time.perf_counter()
        if cached is not None:
            _prune(cache_dir, keep=cached.parent)
        with _disk_full_is_user_error(where.parent, name):
            self._encode(name, enc, source, sub.scope, cached, where, index, device)
        self.report(f"{name}: encoded in {time.perf_counter() - t0:.1f}s")
        return index

    def _repacked_index(self, name: str, device):
        """The replaced weights re-packed in numpy over the compiled encoded ones (a few
        tensors, a LoRA), or None where the encoder's learned layout does not cover them."""
        sub = self.manifest.submodules[name]
        layout = layout_for(self.manifest, name, device, self.report)
        if layout is None:
            return None
        t0 = time.perf_counter()
        replaced = self.overrides.tensors.get(sub.scope, {})
        index = repacked_index(self.manifest, name, layout, replaced, self._keep)
        if index is None:
            self.report(
                f"{name}: too many weights, or some the encoder's layout does not cover, to "
                "re-pack; encoding"
            )
            return None
        self.report(f"{name}: re-packed {len(replaced)} weights in {time.perf_counter() - t0:.1f}s")
        return index

    def _encode(self, name, enc, source, scope, cached, where, index, device) -> None:
        """Run the encoder and load its output into index: kept paged (each distinct page
        once) at cached, or for this run only (unlinked once mapped, not worth paging)."""
        from .encoder import run_encoder

        m = self.manifest
        raw = temp_path_for(where.with_name(f"{where.stem}.raw{where.suffix}"))
        try:
            run_encoder(
                m.path(enc.vmfb), [source.create_provider(scope=scope)], enc.scope, raw, device
            )
            if cached is not None:
                store_encoded(raw, cached)
                load_archive(index, cached)
                self._mapped(enc.scope, cached)
            else:
                index.load(str(raw))  # mapped: the file can go now, its pages stay ours
                self._mapped(enc.scope, raw)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(raw)


def _prune(cache_dir: Path, keep: Path) -> None:
    """Remove the least recently used sets of encoded weights beyond $SDIREE_ENCODED_KEEP
    (2), counting the one about to be written (`keep`)."""
    try:
        limit = max(1, int(os.environ.get(KEEP_ENV, KEEP_DEFAULT)))
    except ValueError:
        limit = KEEP_DEFAULT
    sets = sorted(
        (d for d in cache_dir.iterdir() if d.is_dir() and d != keep),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    for d in sets[limit - 1 :]:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _disk_full_is_user_error(where: Path, name: str) -> Iterator[None]:
    """A full disk while writing the encoded weights (an OSError of a write, or a RuntimeError
    from iree): one line instead."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        text = str(e)
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if isinstance(e, RuntimeError) and "disk space" not in text and "No space" not in text:
            raise
        free = shutil.disk_usage(where).free / 2**30
        raise UserError(
            f"no space left in {where} ({free:.1f} GiB free) for {name}'s encoded weights; free "
            "space there or set SDIREE_CACHE elsewhere"
        ) from None


def _add_array(index, key: str, array: np.ndarray, keep: list) -> None:
    array = np.ascontiguousarray(array)
    keep.append(array)
    index.add_buffer(key, array.reshape(-1).view(np.uint8))


def _has_encoded(sub) -> bool:
    return any(scope.endswith("_encoded") for _, scope in sub.extra_parameters)
