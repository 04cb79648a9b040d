"""Learning an encoder's Layout (layout.py): it runs once on coded weights (twice for a bf16
artifact; layout_codes.py), and each stretch of one weight's codes in its output is described
as a Region, checked against the codes element for element, and then against the compile's own
encoded archive on the real weights. The layout is `complete` when every other byte is the
same in both runs (alignment gaps): no weight reaches the output in a way not described.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np

from .layout import BF16_TOLERANCE, Layout, Region, from_bf16, squeeze
from .layout_codes import NONCODE, PAD, Decoder, Units, coded_inputs

SCAN_MIN, SCAN_MAX = 1 << 10, 1 << 22  # words decoded at once while scanning
# Seconds one layout may take to learn; past them it is given up as incomplete (no pruning, the
# encoder for a LoRA), as the full-size bf16 UNet on an avx512_bf16 CPU would take hours
# (compile/NOTES.md). The SD 1.5 UNet's takes ~80 s (bf16) to ~120 s (fp32, AVX2) on a 2-core
# Xeon (tools/PERFORMANCE.md, sixty-sixth session).
BUDGET_ENV, BUDGET_DEFAULT_S = "SDIREE_LAYOUT_BUDGET_S", 1800.0


class BudgetSpent(Exception):
    """learn_entry ran past its deadline."""


def budget_s() -> float:
    """The layout budget in seconds: $SDIREE_LAYOUT_BUDGET_S, else BUDGET_DEFAULT_S."""
    try:
        return float(os.environ.get(BUDGET_ENV) or BUDGET_DEFAULT_S)
    except ValueError:
        return BUDGET_DEFAULT_S


def merged_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """shape, then every shape made by merging runs of adjacent dims (fewest merges first):
    a walk over contiguous elements may cross dims (a 3x3 kernel read as 9, a plain copy)."""
    n = len(shape)
    out = []
    for cuts in range(2 ** (n - 1) - 1, -1, -1):
        dims, cur = [], shape[0]
        for i in range(1, n):
            if cuts >> (i - 1) & 1:
                dims.append(cur)
                cur = shape[i]
            else:
                cur *= shape[i]
        dims.append(cur)
        out.append(tuple(dims))
    return sorted(dict.fromkeys(out), key=len, reverse=True)


def _steps(n: int, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(dim, step) of a flat-index stride n of a contiguous array of shape."""
    strides = np.cumprod((1, *shape[::-1]))[:-1][::-1]
    for d, st in enumerate(strides):
        if n >= st and n % st == 0:
            return d, n // int(st)
    return None


def _first(test, n: int, chunk: int = 1 << 17) -> int | None:
    """The first index i < n where test(a, b) (a bool array for [a, b)) is True, or None."""
    for a in range(0, n, chunk):
        hit = np.flatnonzero(test(a, min(n, a + chunk)))
        if len(hit):
            return a + int(hit[0])
    return None


def infer_levels(E: np.ndarray, shape: tuple[int, ...]) -> tuple | None:
    """The levels (outermost first) of the region that E (element indices relative to the
    region's first; PAD, FOREIGN) starts with, or None. E[0] must be 0."""
    if len(E) == 0 or E[0] != 0:
        return None
    levels = []
    block = 1
    while block < len(E):
        starts = E[: len(E) // block * block : block]  # whole blocks only
        k = _first(lambda a, b, starts=starts: starts[1:][a:b] >= 0, len(starts) - 1)
        if k is None:
            break
        k += 1
        delta = int(starts[k])
        if delta <= 0 or delta % k:
            break
        step = delta // k

        def off(a, b, step=step, starts=starts):
            expect = np.arange(a, b, dtype=np.int64) * step
            return (starts[a:b] != expect) & (starts[a:b] != PAD)

        bad = _first(off, len(starts))
        count = len(starts) if bad is None else bad
        if count < 2:
            break
        ds = _steps(step, shape)
        if ds is None:
            return None
        levels.append((ds[0], ds[1], count))
        block *= count
    if not levels:
        levels = [(len(shape) - 1, 1, 1)]
    return tuple(reversed(levels))


def _check(region: Region, E: np.ndarray, part: bool = False, row: int | None = None) -> bool:
    """Whether region, packed from element indices, is how E starts. part: the region is one
    slice (or run of slices) of its weight; `row`: the elements of the weight's slice, which a
    1-D region's part must be whole slices of (other shapes: whole rows of their own)."""
    n = int(np.prod(region.shape, dtype=np.int64))
    if region.size() > len(E):
        return False
    # A region is its weight plus some padding. A candidate that walks one dim far past its
    # size (a contiguous run read as the last dim, SD 1.5's VAE conv_out: 2.7G elements
    # padded for a 147K weight) is none, and packing it to check would take GBs. In Python
    # integers: a wild candidate's (an AMX bf16x3 weight's lo parts) overflowed int64.
    if math.prod(region.padded()) > 8 * n + (1 << 20):
        return False
    # compared as a strided view (no packed copy: the check reads GBs of E for a bf16 UNet)
    want = region.strided(np.arange(n, dtype=np.int32), fill=PAD)
    packed = E[: region.size()]
    if not np.array_equal(packed.reshape(want.shape), want):
        return False
    if not part:
        return True
    # Part of a weight (one of its slices, packed on their own): whole rows of it, each
    # element once; never a stray code or a few elements of a shuffle. A raw copy of slices
    # is one run, read as a 1-D shape: its rows are the weight's.
    inner = int(np.prod(region.shape[1:], dtype=np.int64)) if len(region.shape) > 1 else row
    got = np.sort(packed[packed >= 0])
    first = int(np.ravel_multi_index(region.start(), region.shape))
    return (
        inner is not None
        and first % inner == 0
        and len(got) % inner == 0
        and np.array_equal(got, np.arange(first, first + len(got)))
    )


def learn_entry(
    coded: np.ndarray,
    decoder: Decoder,
    shapes: dict[str, tuple[int, ...]],
    release=None,
    deadline: float | None = None,
    coded2: np.ndarray | None = None,
):
    """(regions, failed params, unexplained byte spans) of one coded output entry (uint8),
    read front to back: one run's float32 codes, or with coded2 two runs' bf16 residues (a
    narrow encoder: weights packed in bf16 or float32). release(coded, start, end), if given,
    is told the bytes behind. Raises BudgetSpent once time.monotonic() passes deadline."""
    runs = [coded] if coded2 is None else [coded, coded2]
    # the units scanned (the finest), and where a code may start a float32 region instead
    fine = Units(runs, 4 if coded2 is None else 2)
    wide = Units(runs, 4) if coded2 is not None else None
    n = fine.n
    regions: list[Region] = []
    failed: set[str] = set()
    other: list[tuple[int, int]] = []
    pos = released = 0
    while pos < n:
        if deadline is not None and time.monotonic() > deadline:
            raise BudgetSpent
        if release is not None and pos - released >= 1 << 24:
            for r in runs:
                release(r, released * fine.itemsize, pos * fine.itemsize)
            released = pos
        # the next coded unit: read in windows that grow while none is found, so the search
        # costs what it skips, whether codes come close together or 100M units apart
        j, chunk = None, SCAN_MIN
        while pos < n:
            p, e = decoder.decode(fine.index(pos, pos + chunk))
            hit = np.flatnonzero(p >= 0)
            nz = np.flatnonzero(fine.nonzero(pos, pos + (int(hit[0]) if len(hit) else chunk)))
            if len(nz):
                other.append((pos * fine.itemsize, (pos + int(nz[-1]) + 1) * fine.itemsize))
            if len(hit):
                j = pos + int(hit[0])
                break
            pos += chunk
            chunk = min(2 * chunk, SCAN_MAX)
        if j is None:
            break
        p = int(decoder.decode(fine.index(j, j + 1))[0][0])
        region = None
        if wide is not None and j % 2:  # a float32 word's code is in its high half
            region = _region_at(wide, j // 2, decoder, shapes)
        if region is None:
            region = _region_at(fine, j, decoder, shapes)
        if region is None:
            failed.add(decoder.keys[p])
            pos = j + _run_of(decoder, fine, j, p)
            continue
        regions.append(region)
        pos = (region.offset + region.size() * region.itemsize) // fine.itemsize
    return regions, failed, other


def _region_at(units: Units, j: int, decoder: Decoder, shapes) -> Region | None:
    """The region that starts at unit j (a code), or None."""
    p, e = (int(x[0]) for x in decoder.decode(units.index(j, j + 1)))
    if p < 0:
        return None
    key = decoder.keys[p]
    shape = squeeze(shapes[key])
    size = int(np.prod(shape, dtype=np.int64))
    first = e  # a slice of the weight starts past its element 0
    if first and (len(shape) < 2 or first % shape[-1]):  # no slice: a stray code
        return None
    dtype = "f32" if units.itemsize == 4 else "bf16"
    # a region is its weight plus padding: read a little more than the weight, and more
    # only while the region may go on past what was read (up to 4x the weight). A slice (of
    # a split Winograd conv's 16 or 36) is read as one slice first: read as the whole weight,
    # each slice decoded the whole weight's worth, 16x the words (hours for a bf16 UNet).
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else None
    one = row if first else size
    for span in dict.fromkeys(x + (1 << 16) for x in (one, size, 4 * size)):
        end = min(units.n, j + span)
        E = decoder.elements(units, j, end, p)
        bounded = end == units.n or len(E) < end - j  # ends at the data's end or another weight
        rel = np.where(E >= 0, E - first, E) if first else E
        for cand in merged_shapes(shape):
            origin = tuple(int(x) for x in np.unravel_index(first, cand)) if first else ()
            levels = infer_levels(rel, cand) or ()
            # the outer levels may have run on into the weight's next slice: without them,
            # the region is the slice
            for k in range(len(levels)):
                r = Region(key, j * units.itemsize, cand, levels[k:], origin, dtype)
                if _check(r, E, part=bool(first or k), row=row):
                    return r
        if bounded:
            return None
    return None


def _run_of(decoder: Decoder, units: Units, j: int, p: int) -> int:
    """Length of the stretch of units from j holding weight p's codes or padding (windows
    growing as in learn_entry: a stretch may be one unit or 100M)."""
    at, chunk = j, SCAN_MIN
    while at < units.n:
        rel = units.index(at, at + chunk)
        pw, _ = decoder.decode(rel)
        bad = np.flatnonzero(((pw != p) & (pw >= 0)) | (rel == NONCODE))
        if len(bad):
            return at + int(bad[0]) - j
        at += chunk
        chunk = min(2 * chunk, SCAN_MAX)
    return units.n - j


def temp_disk(encoded: Path, coded_elements: int, narrow: bool) -> int:
    """Bytes of temp files that learn() writes beside work at its peak: each run's raw coded
    output (encoded's original entries), and one run's coded archive (4 bytes a coded element;
    a narrow encoder's runs read theirs from memory), with 1 % and 64 MiB to spare."""
    from .pages import raw_size

    need = raw_size(encoded) * (2 if narrow else 1) + (0 if narrow else 4 * coded_elements)
    return need + need // 100 + (64 << 20)


def learn(
    encoder_vmfb: Path,
    in_scope: str,
    params: dict[str, tuple[tuple[int, ...], np.dtype]],
    weight,
    derived: set[str],
    encoded: Path,
    out_scope: str,
    device,
    work: Path,
    narrow: bool = False,
) -> Layout:
    """Learn the layout of encoder_vmfb's output for the params {key: (shape, dtype)} of
    in_scope, and verify it against `encoded` (the archive it wrote from the real weights,
    `weight(key)`; `derived` keys are recomputed in numpy, so compared to 1e-5). `work`: a
    temp path (removed) for the coded inputs and output. `narrow`: the encoder packs weights
    in bf16 (bf16 contractions), so it runs twice, on each residue of the codes, whose inputs
    are one short array in memory (layout_codes.residue_inputs), not a file.

    Memory: one run's coded inputs are mapped (encoder.input_providers: clean page-cache
    pages, counted in the RSS while the encoder runs); where the driver moves parameters
    through files (cpu) the coded output is written through a file handle, and every mapping
    of it is read once with the pages behind the reader dropped (pages.release_pages), so the
    SD 1.5-size UNet's 11.5 GB output never stays resident."""
    import contextlib

    from ..host_memory import freed_heap_kept
    from .encoder import file_io, run_encoder
    from .pages import entry_views, zeroed_like

    coded_in = work.with_name(f".in-{work.name.lstrip('.')}")  # still a temp's name
    outs = [work, work.with_name(f".d1-{work.name.lstrip('.')}")][: 2 if narrow else 1]
    try:
        for run, out in enumerate(outs):
            coding = coded_inputs(in_scope, params, weight, coded_in, run if narrow else None)
            with coding as (sources, bases):
                # Through a file handle (file_io) the output is written raw (11.5 GB of disk
                # for SD 1.5, never mapped). Else, where the compiled archive is paged, its
                # layout is reused: the coded output takes the distinct pages only, each
                # packed copy written through both places (every region is still checked on
                # both).
                if not file_io(device) and zeroed_like(encoded, out):
                    into = entry_views(out, write=True)
                    run_encoder(encoder_vmfb, sources, out_scope, None, device, into=into)
                    del into
                else:
                    run_encoder(encoder_vmfb, sources, out_scope, out, device)
                del sources
        shapes = {k: tuple(s) for k, (s, _) in params.items()}
        coded = [entry_views(o) for o in outs]
        with freed_heap_kept():  # many large numpy temporaries: reused pages, not new ones
            return _analyse(coded, entry_views(encoded), params, bases, shapes, weight, derived)
    finally:
        for p in (coded_in, *outs):
            with contextlib.suppress(OSError):
                p.unlink()


def _analyse(coded_runs, real_views, params, bases, shapes, weight, derived) -> Layout:
    """The layout of the coded output's entries (coded_runs: one {entry: view} a run), each
    region checked on the real output; each mapping read front to back with what is behind
    dropped (pages.release_pages)."""
    from .pages import release_pages

    decoder = Decoder(bases, shapes)
    layout = Layout(complete=all(set(c) == set(real_views) for c in coded_runs))
    layout.unverified |= set(params) - set(bases)
    deadline = time.monotonic() + budget_s()
    for entry in coded_runs[0]:
        real = real_views.get(entry)
        runs = [c[entry] for c in coded_runs]
        try:
            regions, failed, _ = learn_entry(
                runs[0], decoder, shapes, release=release_pages, deadline=deadline,
                coded2=runs[1] if len(runs) > 1 else None,
            )  # fmt: skip
        except BudgetSpent:  # nothing of it is trusted: every weight goes through the encoder
            return Layout(complete=False, unverified=set(params), gave_up=True)
        layout.unverified |= failed
        by_param: dict[str, list[Region]] = {}
        for r in regions:
            by_param.setdefault(r.param, []).append(r)
        for param, rs in by_param.items():
            w = weight(param)  # once per weight (a derived one is computed)
            for r in rs:
                if real is None or not _matches(r, w, real, param in derived):
                    layout.unverified.add(param)
                if real is not None:
                    release_pages(real, r.offset, r.offset + r.size() * r.itemsize)
            release_pages(w)
            del w
        layout.entries[entry] = regions
        if real is None or not all(_rest_equal(regions, c, real) for c in runs):
            layout.complete = False
        for c in runs:
            release_pages(c)
        if real is not None:
            release_pages(real)
    return layout


def _matches(region: Region, w: np.ndarray, real: np.ndarray, approx: bool) -> bool:
    """Whether the real output holds region's packed copy of w (bit for bit; within bf16's or
    float32's tolerance where approx: w recomputed in numpy)."""
    w = np.ascontiguousarray(w, np.float32)
    nbytes = region.size() * region.itemsize
    got = real[region.offset : region.offset + nbytes]
    if len(got) != nbytes:
        return False
    # the weight's bits cast first, then compared as a strided view: no packed copy
    bits = region.strided(region.cast(w).view(np.uint16 if region.dtype == "bf16" else np.uint32))
    if np.array_equal(got.view(bits.dtype).reshape(bits.shape), bits):
        return True
    if not approx:
        return False
    packed = region.pack(w)
    if region.dtype == "bf16":
        ref = from_bf16(got.view(np.uint16)).astype(np.float64)
        return bool(np.abs(ref - packed).max() <= BF16_TOLERANCE * max(1e-30, np.abs(ref).max()))
    ref = got.view(packed.dtype).astype(np.float64)
    return bool(np.allclose(ref, packed, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(ref).max())))


def _rest_equal(regions: list[Region], coded: np.ndarray, real: np.ndarray) -> bool:
    """Whether every byte outside the regions is the same in the coded and the real output:
    nothing there depends on the coded weights. Compared a chunk at a time, the pages behind
    dropped."""
    from .pages import release_pages

    if len(coded) != len(real):
        return False
    gaps, at = [], 0
    for r in sorted(regions, key=lambda r: r.offset):
        if r.offset > at:
            gaps.append((at, r.offset))
        at = max(at, r.offset + r.size() * r.itemsize)
    gaps.append((at, len(coded)))
    chunk = 1 << 26
    for a, b in gaps:
        for c in range(a, b, chunk):
            d = min(b, c + chunk)
            if not np.array_equal(coded[c:d], real[c:d]):
                return False
            release_pages(coded, c, d)
            release_pages(real, c, d)
    return True
