"""Drop from an artifact the original weights that its encoded archives already hold.

With encoded parameters (cpu, and the GPU targets' fp32 modules that have an encoder) a module
loads by name only the few original tensors that no encoder consumes (norms, biases); every other weight reaches it packed, from
`<submodule>.encoded.irpa`. Keeping the whole original archive beside the packed copies
doubles the disk (SD 1.5: 5.5 GB of 13.8). So, for each archive of a scope whose every
encoded submodule has a complete learned layout, the artifact keeps:
- the keys a module names (their bytes appear in one of the vmfbs that load the archive: an
  upper bound, a key that merely looks named is kept too);
- any key the layouts cannot give back as it was (checked here against the original: exactly
  for a packed copy, within 1e-5 of the largest magnitude for a Winograd inverse), or, from a
  bf16 artifact's bf16 packs, as its bf16 rounding (exactly the original rounded to nearest
  even; within 2^-6 of the largest magnitude through a Winograd inverse: ~2^-7 measured);
and lists the rest in `<archive>.pruned.json`, which the runtime's Archive reads back from the
encoded archives (sdiree.runtime.weights.recover) when a LoRA, `--weights` or an embedding
needs them. The pruned archive is proven to load: every module that reads it is loaded with it
before it replaces the full one; where that cannot be done here (no device of a GPU target's
driver on this machine), the archive stays whole. The compile cache keeps the full archive (a
hardlink in the artifact before), so recompiles read from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sdiree.runtime.fileutil import (
    atomic_write_json,
    link_or_copy,
    sha256_file,
    sha256_json,
    temp_path_for,
)
from sdiree.runtime.weights import irpa_writer
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.derived import DERIVED_PARAMS
from sdiree.runtime.weights.layout import BF16_TOLERANCE, Layout, from_bf16, to_bf16
from sdiree.runtime.weights.pages import release_pages
from sdiree.runtime.weights.recover import FORMAT_VERSION, Recoverer, sidecar_path

STATE_KEY = "pruned"  # in the build state: {archive name: {"key", "from", "sha256", "sidecar"}}
# a Winograd weight read back by the pseudo-inverse: within this share of its largest magnitude
# (from bf16 packs: layout.BF16_TOLERANCE)
WINOGRAD_TOLERANCE = 1e-5


@dataclass
class ArchiveUse:
    """One original archive an artifact links in: where it is, where its full copy is."""

    local: Path
    source: Path
    digest: str  # sha256 of the full archive
    scope: str
    users: list[str] = field(default_factory=list)  # submodules that load it


def _sources(out: Path, results: dict, scope: str, scopes: dict) -> list[dict] | None:
    """[{"encoded", "layout"}] of every submodule of scope, or None when one lacks an encoded
    archive or a complete layout (then nothing of the scope can be read back)."""
    found = []
    for sub in (s for s, sc in scopes.items() if sc == scope):
        enc = results[sub].get("encoded")
        layout = enc and enc["encoder"].get("layout")
        if not layout:
            return None
        learned = Layout.load(out / layout)
        if learned is None or not learned.complete:
            return None
        found.append({"encoded": enc["path"], "layout": layout})
    return found or None


def _raw_sources(use: ArchiveUse, uses: list[ArchiveUse]) -> list[dict]:
    """The scope's other original archives, as raw sources: a 3x3 weight whose Winograd
    transform a module reads unpacked (an untiled product) is read back from there."""
    return [{"archive": u.local.name} for u in uses if u.scope == use.scope and u is not use]


def _prune_key(use: ArchiveUse, results: dict, sources: list[dict], uses=()) -> str:
    """What a pruned archive depends on: the full archive, the modules that load it, and the
    encoded archives and layouts (and the raw archives, by their full digests) it is read back
    from."""
    encoded = {e["encoder"].get("layout"): e for r in results.values() if (e := r.get("encoded"))}
    digests = {u.local.name: u.digest for u in uses}
    read_from = [
        [s["archive"], digests[s["archive"]]] if "archive" in s else
        [s["encoded"], encoded[s["layout"]]["sha256"], encoded[s["layout"]]["encoder"]["layout_sha256"]]
        for s in sources
    ]  # fmt: skip
    return sha256_json(
        {
            "version": FORMAT_VERSION,
            "from": use.digest,
            "vmfbs": sorted(results[u]["vmfb_sha256"] for u in use.users),
            "sources": read_from,
        }
    )


def is_pruned(local: Path, digest: str, state: dict, intact) -> bool:
    """Whether the artifact holds at local a pruned copy, intact, of the full archive whose
    sha256 is digest."""
    rec = state.get(STATE_KEY, {}).get(local.name)
    return bool(
        rec
        and rec.get("from") == digest
        and intact(local, rec["sha256"])
        and intact(sidecar_path(local), rec["sidecar"])
    )


def prune(out: Path, uses: list[ArchiveUse], results: dict, scopes: dict, driver: str, state: dict,
          report, intact) -> dict[Path, str]:  # fmt: skip
    """Prune each archive of uses that can be; {artifact path: sha256} of what changed (the
    pruned archives and their sidecars). `scopes`: {submodule: its weights' scope}."""
    done = state.setdefault(STATE_KEY, {})
    changed: dict[Path, str] = {}
    for use in uses:
        sources = _sources(out, results, use.scope, scopes)
        if sources is None:
            _keep_whole(use, done, intact)
            continue
        sources += _raw_sources(use, uses)
        key = _prune_key(use, results, sources, uses)
        rec = done.get(use.local.name)
        if rec and rec.get("key") == key and is_pruned(use.local, use.digest, state, intact):
            report.reused("prune", use.local.name)
            changed[use.local] = rec["sha256"]
            changed[sidecar_path(use.local)] = rec["sidecar"]
            continue
        with report.stage("prune", use.local.name):
            kept = _prune_one(out, use, results, sources, driver, report)
        if kept is None:  # nothing to drop, or the pruned archive did not load
            _keep_whole(use, done, intact)
            continue
        done[use.local.name] = {"key": key, "from": use.digest, **kept}
        changed[use.local] = kept["sha256"]
        changed[sidecar_path(use.local)] = kept["sidecar"]
    return changed


def _keep_whole(use: ArchiveUse, done: dict, intact) -> None:
    """The artifact holds use's full archive (a pruned copy an earlier build left goes)."""
    done.pop(use.local.name, None)
    sidecar_path(use.local).unlink(missing_ok=True)
    if not intact(use.local, use.digest):
        link_or_copy(use.source, use.local)


def _close(got: np.ndarray, want: np.ndarray, rounded: bool = False) -> bool:
    """got is want (rounded: want's bf16 rounding), or a Winograd inverse's within tolerance."""
    if rounded and got.shape == want.shape and want.dtype == np.float32:
        want = from_bf16(to_bf16(want)).reshape(want.shape)
    if np.array_equal(got, want):
        return True
    if got.shape != want.shape or not np.issubdtype(want.dtype, np.floating):
        return False
    tol = BF16_TOLERANCE if rounded else WINOGRAD_TOLERANCE
    if want.size == 0:
        return True
    if want.dtype == np.float32 and got.dtype == np.float32:
        # In float32 (no float64 copies of GBs of weights): a rounded difference is within
        # 2**-24 of the exact one, so scaled up by 2**-23 it is never below it.
        diff = float(np.abs(np.subtract(got, want)).max()) * (1 + 2.0**-23)
        return diff <= tol * float(np.abs(want).max())
    w = np.asarray(want, np.float64)
    return bool(np.abs(np.asarray(got, np.float64) - w).max() <= tol * float(np.abs(w).max()))


def named_in(key: str, named: bytes) -> bool:
    """Whether key's bytes appear in the vmfbs (an upper bound of what a module names) other
    than as the start of a weight derived from it (`c.weight` in `c.weight_winograd`, which an
    untiled product reads itself, or in `l.weight_panels`: the weight is then read back from
    that)."""
    k = key.encode()
    if not key.endswith("weight"):
        return k in named
    stem = k[: -len("weight")]
    return named.count(k) > sum(named.count(stem + p.encode()) for p in DERIVED_PARAMS)


def _prune_one(out: Path, use: ArchiveUse, results: dict, sources: list[dict], driver: str,
               report) -> dict | None:  # fmt: skip
    from .param_encoder import loads_with

    full = Archive(use.source)
    named = b"".join((out / results[u]["vmfb"]).read_bytes() for u in use.users)
    recoverer = Recoverer(out, sources)
    dropped: dict[str, dict] = {}
    for key, e in full.entries.items():
        if named_in(key, named) or e.splat is not None or e.dtype is None or e.shape is None:
            continue
        try:
            got = recoverer.array(key, e.shape, e.dtype)
        except KeyError:
            continue
        want = full.array(key)
        if _close(got, want, key in recoverer.rounded):
            dropped[key] = {"shape": list(e.shape), "dtype": e.dtype.name}
            if key in recoverer.rounded:
                dropped[key]["rounded"] = "bf16"  # read back as its bf16 rounding
        release_pages(want)  # one pass over GBs of mapped weights: keep the RSS to one tensor
    del recoverer
    if not dropped:
        return None
    tmp = temp_path_for(use.local)
    try:
        _write_subset(full, [k for k in full.entries if k not in dropped], tmp)
        for user in use.users:
            archives = [(use.scope if p == use.local else s, tmp if p == use.local else p)
                        for p, s in results[user]["loads"]]  # fmt: skip
            try:
                loads = loads_with(out / results[user]["vmfb"], archives, driver)
            except (RuntimeError, ValueError) as e:  # no such device here (a GPU target)
                report.say(f"[prune {use.local.name}] cannot load {user} on this machine to "
                           f"check it ({str(e).splitlines()[0][:120]}): kept whole")  # fmt: skip
                return None
            if not loads:
                report.say(f"[prune {use.local.name}] {user} does not load without the dropped "
                           "weights: kept whole")  # fmt: skip
                return None
        sidecar = sidecar_path(use.local)
        atomic_write_json(sidecar, {"version": FORMAT_VERSION, "keys": dropped, "from": sources})
        os.replace(tmp, use.local)  # the sidecar first: a full archive beside it is still right
    finally:
        tmp.unlink(missing_ok=True)
    kept_bytes = sum(e.length for k, e in full.entries.items() if k not in dropped)
    all_bytes = sum(e.length for e in full.entries.values())
    rounded = sum(1 for d in dropped.values() if d.get("rounded"))
    report.say(
        f"[prune {use.local.name}] {len(dropped)} of {len(full.entries)} weights read back from "
        f"the encoded archives{f' ({rounded} as their bf16 rounding)' if rounded else ''}: "
        f"{all_bytes / 1e9:.3f} -> {kept_bytes / 1e9:.3f} GB kept"
    )
    return {"sha256": sha256_file(use.local), "sidecar": sha256_file(sidecar)}


def _write_subset(full: Archive, keys: list[str], path: Path) -> None:
    """An archive at path with `keys` of full, bytes and metadata as they are there (copied
    file to file: the kept entries were read whole into memory here before)."""
    plan = []
    for key in keys:
        e = full.entries[key]
        meta = bytes(full.raw(key).metadata or b"")
        plan.append(irpa_writer.Entry(key, e.length, meta, e.splat))
    src = os.open(full.path, os.O_RDONLY)
    try:
        with irpa_writer.created(path, plan) as (dst, offsets):
            for key, at in offsets.items():
                e = full.entries[key]
                irpa_writer.copy_range(src, e.offset, dst, at, e.length)
    finally:
        os.close(src)
