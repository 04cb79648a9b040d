"""Encoded weights for a few replaced tensors without running the encoder (a LoRA on cpu).

The submodule's encoded archive as compiled is mapped copy-on-write, and only the packed
copies of the replaced tensors (and of the Winograd weights derived from replaced 3x3 convs)
are written over it, re-packed in numpy by the encoder's learned layout (`layout`): the pages
they touch become private memory, the rest stays the artifact's file. The layout is learned
at compile (one encoder run on coded weights, `<submodule>.layout.json` in the artifact) for
the submodules a LoRA changes; artifacts compiled before learn it at their first LoRA and keep
it in the user cache. Where it is not complete or a replaced tensor's layout did not verify,
the caller runs the encoder instead.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..fileutil import remove_stale_temps, sha256_json, temp_path_for, user_cache_dir
from .archive import Archive
from .derived import base_key, derived_weight
from .layout import Layout, narrow_dtype, repack
from .layout_codes import codable
from .layout_learn import BUDGET_ENV, learn, temp_disk
from .pages import entry_views, splat_entries

LAYOUT_CACHE = "encoded-layouts"  # under the user cache: <submodule>-<key>.json
REPACK_ENV = "SDIREE_ENCODED_REPACK"  # "0": always run the encoder (A/B, debugging)
# The most of the packed weights re-packed in numpy (a fraction); more goes to the encoder.
# SD 1.5, tools/PERFORMANCE.md (twenty-third session): a LoRA on every linear layer is 0.24 of
# the fp32 UNet's packs and 0.32 of the bf16 one's (F(2x2) convs weigh less there), and on bf16
# re-packs in 5.6 s at a 3.3 GB peak against the encoder's 68 s and 7.9 GB; with the convs too
# (0.99) the encoder wins (8.1 GB against 13.4).
SHARE_ENV, SHARE_DEFAULT = "SDIREE_REPACK_MAX_SHARE", 0.4


def _encoded_path(manifest, sub) -> Path | None:
    paths = [manifest.path(p) for p, s in sub.archives() if s == sub.encoder.scope]
    return paths[0] if len(paths) == 1 else None


def layout_for(manifest, name: str, device, report: Callable[[str], None]) -> Layout | None:
    """The learned layout of submodule name's encoder: the artifact's own (learned at
    compile), else from the user cache, else learned now (artifacts compiled before)."""
    sub = manifest.submodules[name]
    encoded = _encoded_path(manifest, sub)
    if sub.encoder is None or encoded is None:
        return None
    if sub.encoder.layout is not None:
        return Layout.load(manifest.path(sub.encoder.layout))
    files = manifest.data.get("files", {})
    rel = next(p for p, s in sub.archives() if s == sub.encoder.scope)
    key = sha256_json({"encoder": files.get(sub.encoder.vmfb), "encoded": files.get(rel)})[:24]
    cache = user_cache_dir() / LAYOUT_CACHE / f"{name}-{key}.json"
    layout = Layout.load(cache) if cache.is_file() else None
    if layout is not None and layout.settled:
        return layout  # else an older learner's incomplete one (a bf16 artifact's): again
    own = [manifest.path(p) for p, s in sub.archives() if s == sub.scope]
    cache.parent.mkdir(parents=True, exist_ok=True)
    narrow = narrow_dtype(manifest.dtype)
    need, free = learning_disk(own, sub.encoder.derived, encoded, narrow, cache.parent)
    if need > free:
        report(
            f"{name}: not learning how the encoder packs its weights: that takes "
            f"~{need / 2**30:.1f} GiB of temp disk in {cache.parent}, {free / 2**30:.1f} GiB "
            "free there; the encoder runs instead"
        )
        return None
    report(f"{name}: learning how the encoder packs its weights (once per artifact)")
    t0 = time.perf_counter()
    remove_stale_temps(cache.parent)
    layout = learn_layout(
        manifest.path(sub.encoder.vmfb),
        own,
        sub.encoder.derived,
        encoded,
        sub.scope,
        sub.encoder.scope,
        device,
        temp_path_for(cache.with_suffix(".irpa")),
        narrow=narrow,
    )
    if layout is None:
        return None
    layout.save(cache)
    report(
        f"{name}: layout learned in {time.perf_counter() - t0:.1f}s "
        f"({'complete' if layout.complete else 'incomplete'}, "
        f"{len(layout.unverified)} weights not verified"
        f"{f', given up past {BUDGET_ENV}' if layout.gave_up else ''})"
    )
    return layout


def learning_disk(
    own: list[Path], derived: dict, encoded: Path, narrow: bool, where: Path
) -> tuple[int, int]:
    """(the temp disk learning the layout of encoded takes, layout_learn.temp_disk, for the
    weights of the archives `own` and the `derived` ones ({key: (shape, dtype)}); the disk
    free where its temp files go), in bytes."""
    n = sum(
        int(np.prod(e.shape, dtype=np.int64))
        for p in own
        for e in Archive(p).entries.values()
        if e.dtype == np.float32
    )
    n += sum(
        int(np.prod(s, dtype=np.int64)) for s, d in derived.values() if np.dtype(d) == np.float32
    )
    return temp_disk(encoded, n, narrow), _free_bytes(where)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def learn_layout(
    encoder_vmfb: Path,
    own: list[Path],
    derived: dict[str, tuple[tuple[int, ...], str]],
    encoded: Path,
    in_scope: str,
    out_scope: str,
    device,
    work: Path,
    derived_archives: list[Path] = (),
    narrow: bool = False,
) -> Layout | None:
    """layout_learn.learn over a submodule's weights (its archives `own`) and the `derived` ones
    ({key: (shape, dtype)}), read from derived_archives where given (compile), else computed
    from their base weights (run time). None when an archive lacks shapes, no weight is
    float32 or they have more elements than there are codes. `narrow`: the encoder packs
    weights in bf16 (layout.narrow_dtype)."""
    archives = [Archive(p) for p in own]
    derived_from = [Archive(p) for p in derived_archives]
    params: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for a in archives:
        for k, e in a.entries.items():
            if e.dtype is None or e.shape is None:
                return None
            params[k] = (e.shape, e.dtype)
    for k, (shape, dtype) in derived.items():
        params[k] = (tuple(shape), np.dtype(dtype))
    if not codable(params, narrow):  # fp16, or a model past the codes: the encoder it is
        return None

    def weight(k: str) -> np.ndarray:
        for a in (*archives, *derived_from):
            if k in a.entries:
                return a.array(k)
        return derived_weight(k, weight(base_key(k)), params[k][0])

    return learn(encoder_vmfb, in_scope, params, weight, set(derived), encoded, out_scope, device,
                 work, narrow)  # fmt: skip


def repacked_index(
    manifest, name: str, layout: Layout, replaced: dict[str, np.ndarray], keep: list
):
    """The index of submodule name's encoded weights with `replaced` ({key: array} of its
    scope) re-packed over the compiled ones, or None when the layout does not cover them."""
    import iree.runtime as rt

    sub = manifest.submodules[name]
    derived = {d: shape for d, (shape, _) in sub.encoder.derived.items() if base_key(d) in replaced}
    if not layout.covers([*replaced, *derived]):
        return None
    # Each re-packed page becomes private memory, every packed copy apart: past a share of
    # the archive (a LoRA on every layer, a whole checkpoint) the encoder's file-backed
    # output costs less memory.
    by_param = layout.regions_of()
    total = sum(r.size() for rs in layout.entries.values() for r in rs)
    touched = sum(r.size() for p in [*replaced, *derived] for _, r in by_param.get(p, ()))
    if total and touched > float(os.environ.get(SHARE_ENV, SHARE_DEFAULT)) * total:
        return None
    encoded = _encoded_path(manifest, sub)
    views = entry_views(encoded, private=True)
    weights = dict(replaced)
    for d, shape in derived.items():
        weights[d] = derived_weight(d, replaced[base_key(d)], shape)
    repack(layout, views, weights)
    index = rt.ParameterIndex()
    for key, pattern, length in splat_entries(encoded):
        index.add_splat(key, np.frombuffer(pattern, np.uint8).copy(), length)
    for key, view in views.items():
        keep.append(view)
        index.add_buffer(key, view)
    return index
