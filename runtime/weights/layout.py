"""How a parameter encoder lays out each weight, learned once, so a few changed weights (a
LoRA) are re-packed in numpy instead of by re-running the encoder over all of them.

On cpu the encoder's output is a repack (data tiling: tiles, padding, transposes) of each
weight, written at fixed places of one entry. `learn` runs the encoder once on *coded* weights:
every float32 element replaced by a distinct normal float (positive, then negative: 4.26G
codes, SDXL's UNet takes 3.3G) whose bits are its index, so each output element names the
element it was copied from (0: padding). Each stretch of one weight's
codes is described as a strided view of the zero-padded weight (`Region.levels`: per output
axis, the weight dimension it walks, its step and its count), checked against the codes
element for element, and then against the compile's own encoded archive on the real weights.
The layout is `complete` when every other byte is the same in both runs (alignment gaps),
i.e. no weight reaches the output in a way not described; only then is it used, and only for
weights all of whose regions verified. Anything else goes through the encoder.

A bf16 artifact's encoder (`narrow`) rounds the weights it packs to bf16, which keeps 16 bits of
a code: it runs twice, each element's index written as one base-65,024 digit a run, each digit a
normal bf16 number (exact through the rounding); a bf16 pack's elements are read two bytes at a
time, a float32 pack's (biases) four. Such a region (`Region.dtype` "bf16") re-packs a weight as
its bf16 rounding, to nearest even, as the encoder does.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CODE_BASE = 0x00800000  # the smallest normal float32: codes are normal numbers, never NaN
CODE_END = 0x7F800000  # +inf: codes stay below
SIGN = 0x80000000  # codes past the positive normals go on with the negative ones
SPAN = CODE_END - CODE_BASE
CODES = 2 * SPAN
# A narrow encoder (bf16 contractions) rounds what it packs to bf16, which keeps 16 bits of a
# code: its weights are coded twice, each element's index as two base-CODES16 digits, each a
# bf16 number (exact in float32 and bf16) that names its digit the same way (code16_words).
CODE16_BASE, CODE16_END, SIGN16 = 0x0080, 0x7F80, 0x8000
SPAN16 = CODE16_END - CODE16_BASE
CODES16 = 2 * SPAN16
NONCODE = -2  # a unit neither zero nor a code (of two runs)
# 2: regions may be bf16 (Region.dtype); written only then, so a reader of 1 that would take
# them for float32 refuses the layout (and runs the encoder) instead
FORMAT_VERSION, FORMATS_READ = 2, (1, 2)
# The learner: 2 reads bf16 packs. A layout an older one left incomplete is learned again
# (Layout.settled: by the compile, and for the user cache's by the runtime).
LEARNER_VERSION = 2
# A bf16 weight recomputed from bf16-rounded ones (a pruned bf16 artifact's, through the
# Winograd inverse) is within this share of its largest magnitude, not that weight's rounding
BF16_TOLERANCE = 2.0**-6
PAD, FOREIGN = -1, -2
SCAN_MIN, SCAN_MAX = 1 << 10, 1 << 22  # words decoded at once while scanning
# Seconds one layout may take to learn; past them it is given up as incomplete (no pruning, the
# encoder for a LoRA), as the full-size bf16 UNet on an avx512_bf16 CPU would take hours
# (compile/NOTES.md). The fp32 SD 1.5 UNet's takes ~450 s.
BUDGET_ENV, BUDGET_DEFAULT_S = "SDIREE_LAYOUT_BUDGET_S", 1800.0


def narrow_dtype(dtype: str) -> bool:
    """Whether an artifact of this dtype packs weights in bf16: cpu's bf16 demotes every
    contraction's inputs to bf16, and its encoder rounds the packed weights (learn(narrow))."""
    return dtype == "bf16"


class BudgetSpent(Exception):
    """learn_entry ran past its deadline."""


def budget_s() -> float:
    """The layout budget in seconds: $SDIREE_LAYOUT_BUDGET_S, else BUDGET_DEFAULT_S."""
    try:
        return float(os.environ.get(BUDGET_ENV) or BUDGET_DEFAULT_S)
    except ValueError:
        return BUDGET_DEFAULT_S


@dataclass(frozen=True)
class Region:
    """One packed copy of `param` at byte `offset` of an encoded entry: the weight (shape
    `shape`, unit dimensions dropped) zero-padded, then read from `origin` (an index into it;
    a slice of a weight, e.g. one tile element of a split Winograd conv's, starts past 0) as a
    strided view with one axis per level (dim, step, count), outermost first."""

    param: str
    offset: int
    shape: tuple[int, ...]
    levels: tuple[tuple[int, int, int], ...]
    origin: tuple[int, ...] = ()  # () is every dim's 0
    dtype: str = "f32"  # the packed copy's elements: "f32", or "bf16" (rounded to nearest even)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    def cast(self, packed: np.ndarray) -> np.ndarray:
        """A float32 packed copy in the region's element type (bf16: its uint16 bits)."""
        return to_bf16(packed) if self.dtype == "bf16" else packed

    def start(self) -> tuple[int, ...]:
        return self.origin or (0,) * len(self.shape)

    def padded(self) -> tuple[int, ...]:
        reach = [o + 1 for o in self.start()]
        for d, step, count in self.levels:
            reach[d] += step * (count - 1)
        return tuple(max(s, r) for s, r in zip(self.shape, reach, strict=True))

    def size(self) -> int:
        return int(np.prod([c for _, _, c in self.levels], dtype=np.int64))

    def pack(self, w: np.ndarray, fill=0) -> np.ndarray:
        """The packed copy of w (any shape whose non-unit dims are `shape`), flat."""
        return np.ascontiguousarray(self.strided(w, fill)).reshape(-1)

    def strided(self, w: np.ndarray, fill=0) -> np.ndarray:
        """The packed copy of w as a strided view (one axis per level) of w, padded."""
        w = np.asarray(w).reshape(self.shape)
        padded = self.padded()
        if padded != self.shape:
            p = np.full(padded, fill, w.dtype)
            p[tuple(slice(0, s) for s in self.shape)] = w
            w = p
        else:
            w = np.ascontiguousarray(w)
        return self.view(w, writeable=False)

    def view(self, padded: np.ndarray, writeable: bool) -> np.ndarray:
        """The region's strided view (one axis per level) of an array of shape padded()."""
        at = padded[tuple(slice(o, None) for o in self.start())]
        strides = [padded.strides[d] * step for d, step, _ in self.levels]
        return np.lib.stride_tricks.as_strided(
            at, [c for _, _, c in self.levels], strides, writeable=writeable
        )

    def to_json(self) -> list:
        j = [self.param, self.offset, list(self.shape), [list(x) for x in self.levels]]
        if self.dtype != "f32":
            return [*j, list(self.origin), self.dtype]
        return j + [list(self.origin)] if any(self.origin) else j

    @staticmethod
    def from_json(j) -> Region:
        origin = tuple(int(x) for x in j[4]) if len(j) > 4 and any(j[4]) else ()
        dtype = str(j[5]) if len(j) > 5 else "f32"
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"region of unknown element type {dtype!r}")
        levels = tuple(tuple(x) for x in j[3])
        return Region(str(j[0]), int(j[1]), tuple(j[2]), levels, origin, dtype)


def from_bf16(u: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 bits (uint16)."""
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """The uint16 bits of float32 a rounded to bf16, to nearest even (as the encoder rounds)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = b >> 16  # in place from here: one temporary, not five (the layout check packs GBs)
    r &= 1
    r += b
    r += 0x7FFF
    r >>= 16
    return r.astype(np.uint16)


@dataclass
class Layout:
    """The regions of every encoded entry; `complete` when nothing else depends on weights."""

    entries: dict[str, list[Region]] = field(default_factory=dict)
    complete: bool = False
    unverified: set[str] = field(default_factory=set)  # params with a region that did not
    gave_up: bool = False  # learning ran past budget_s() (not saved: the layout is incomplete)
    learner: int = LEARNER_VERSION  # the learner that made it (1: one before bf16 packs)

    def regions_of(self) -> dict[str, list[tuple[str, Region]]]:
        out: dict[str, list[tuple[str, Region]]] = {}
        for entry, regions in self.entries.items():
            for r in regions:
                out.setdefault(r.param, []).append((entry, r))
        return out

    @property
    def settled(self) -> bool:
        """Complete, or learned by this learner: no reason to learn it again."""
        return self.complete or self.learner >= LEARNER_VERSION

    def narrow(self) -> bool:
        """Whether any region is a bf16 pack."""
        return any(r.dtype != "f32" for rs in self.entries.values() for r in rs)

    def covers(self, params) -> bool:
        """Whether every param in params can be re-packed here (regions verified, or none)."""
        return self.complete and not (set(params) & self.unverified)

    def save(self, path: Path) -> None:
        from ..fileutil import atomic_write_json

        atomic_write_json(
            path,
            {
                "version": FORMAT_VERSION if self.narrow() else 1,
                "learner": self.learner,
                "complete": self.complete,
                "unverified": sorted(self.unverified),
                "entries": {k: [r.to_json() for r in v] for k, v in self.entries.items()},
            },
        )

    @staticmethod
    def load(path: Path) -> Layout | None:
        try:
            d = json.loads(Path(path).read_text())
            if d.get("version") not in FORMATS_READ:
                return None
            entries = {k: [Region.from_json(r) for r in v] for k, v in d["entries"].items()}
            learner = int(d.get("learner", 1))
            return Layout(entries, bool(d["complete"]), set(d["unverified"]), learner=learner)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


def squeeze(shape) -> tuple[int, ...]:
    s = tuple(int(x) for x in shape if int(x) != 1)
    return s or (1,)


# -- codes --------------------------------------------------------------------------------
def code_words(start: int, stop: int) -> np.ndarray:
    """The uint32 code words of code indices [start, stop) (stop <= CODES)."""
    if stop <= SPAN or start >= SPAN:  # one side of the sign: consecutive words
        first = CODE_BASE + start if stop <= SPAN else SIGN + CODE_BASE + start - SPAN
        return np.arange(first, first + stop - start, dtype=np.uint32)
    i = np.arange(start, stop, dtype=np.int64)
    return np.where(i < SPAN, CODE_BASE + i, SIGN + CODE_BASE + i - SPAN).astype(np.uint32)


def code16_digit_words(start: int, stop: int, digit: int) -> np.ndarray:
    """uint32 words of code indices [start, stop), each holding base-CODES16 digit `digit` of
    its index as a bf16 code (code16_words) in its high half. Built from one period of the
    codes (digit 0 cycles through them, digit 1 repeats each CODES16 times), not per element:
    the coded inputs of a UNet are 1.6G words."""
    period = _code16_high()
    if digit == 0:
        return np.resize(np.roll(period, -(start % CODES16)), stop - start)
    unit = CODES16**digit
    q = np.arange(start // unit, (stop - 1) // unit + 1, dtype=np.int64)
    counts = np.minimum((q + 1) * unit, stop) - np.maximum(q * unit, start)
    return np.repeat(period[q % CODES16], counts)


def code16_words(i: np.ndarray) -> np.ndarray:
    """The uint16 bf16 code of each digit in i (int64, < CODES16): the normal bf16 numbers,
    positive then negative."""
    i = np.asarray(i, np.int64)
    return np.where(i < SPAN16, CODE16_BASE + i, SIGN16 + CODE16_BASE + i - SPAN16).astype(
        np.uint16
    )


def code16_index(u: np.ndarray) -> np.ndarray:
    """The digit (int64) of each uint16 bf16 code, -1 where it is none."""
    w = u.astype(np.int64)
    mag = w & (SIGN16 - 1)
    ok = (mag >= CODE16_BASE) & (mag < CODE16_END)
    return np.where(ok, mag - CODE16_BASE + np.where(w >= SIGN16, SPAN16, 0), -1)


@functools.cache
def _digit_of() -> np.ndarray:
    """code16_index of every uint16, int32: one gather per unit instead of six passes."""
    return code16_index(np.arange(1 << 16, dtype=np.uint16)).astype(np.int32)


@functools.cache
def _code16_high() -> np.ndarray:
    """The words of one period of digit codes (code16_digit_words)."""
    return code16_words(np.arange(CODES16)).astype(np.uint32) << 16


def code_index(words: np.ndarray) -> np.ndarray:
    """The code index (int64) of each uint32 word, -1 where it is no code (zero, a
    subnormal, inf or NaN of either sign)."""
    w = words.astype(np.int64)
    mag = w & (SIGN - 1)
    ok = (mag >= CODE_BASE) & (mag < CODE_END)
    return np.where(ok, mag - CODE_BASE + np.where(w >= SIGN, SPAN, 0), -1)


def codable(params: dict[str, tuple[tuple[int, ...], np.dtype]], narrow: bool = False) -> bool:
    """Whether params have float32 weights to code, and no more of their elements than codes
    (two digits' worth where narrow)."""
    n = [int(np.prod(s, dtype=np.int64)) for s, d in params.values() if np.dtype(d) == np.float32]
    return bool(n) and sum(n) <= (min(CODES, CODES16**2) if narrow else CODES)


def write_coded_archive(
    params: dict[str, tuple[tuple[int, ...], np.dtype]], weight, path: Path, digit=None
) -> dict[str, int]:
    """Write at path an archive of every param, the float32 ones coded (each element's bits
    the code of its index among all coded elements, code_words; or, given a digit, 0 or 1, that
    base-CODES16 digit of the index as a bf16 code, code16_words), the others with their real
    bytes (`weight(key)`); returns {coded key: first code index}. Written a chunk at a time, so
    the SD 1.5-size UNet's 7.8 GB of coded inputs never sit in memory."""
    import os

    import iree.runtime as rt

    from .pages import _pwrite

    plan = rt.ParameterIndex()
    for key, (shape, dtype) in params.items():
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        plan.add_buffer(key, np.zeros(n, np.uint8))  # never touched: costs no memory
    written = plan.create_archive_file(str(path))
    offsets = {k: int(e.file_storage[1]) for k, e in written.items()}
    del written, plan
    bases: dict[str, int] = {}
    at = 0
    chunk = 1 << 22  # elements
    fd = os.open(path, os.O_RDWR)
    try:
        for key, (shape, dtype) in params.items():
            n = int(np.prod(shape, dtype=np.int64))
            if np.dtype(dtype) == np.float32:
                if at + n > CODES:
                    raise ValueError(f"more than {CODES} float32 elements to code")
                for i in range(0, n, chunk):
                    a, b = at + i, at + min(n, i + chunk)
                    codes = code_words(a, b) if digit is None else code16_digit_words(a, b, digit)
                    _pwrite(fd, codes.view(np.uint8), offsets[key] + 4 * i)
                bases[key] = at
                at += n
            else:
                w = np.ascontiguousarray(weight(key)).reshape(-1).view(np.uint8)
                _pwrite(fd, w, offsets[key])
    finally:
        os.close(fd)
    return bases


class _Units:
    """An entry's coded output as units: float32 words coded by one run (`code_words`), or, from
    two runs' bf16 digits (`code16_words`, low digit first), float32 words (`itemsize` 4; a
    word's low half zero in both) or bf16 halves (2: weights packed in bf16). index(a, b): each
    unit's code index, -1 where it holds none; from two runs, NONCODE where it holds something
    else (a bf16 pair read as a word: no padding, it ends a float32 region)."""

    def __init__(self, runs: list[np.ndarray], itemsize: int):
        dtype = np.uint32 if itemsize == 4 else np.uint16
        self.runs = [r[: len(r) // itemsize * itemsize].view(dtype) for r in runs]
        self.itemsize = itemsize
        self.n = len(self.runs[0])

    def nonzero(self, a: int, b: int) -> np.ndarray:
        nz = self.runs[0][a:b] != 0
        for r in self.runs[1:]:
            nz |= r[a:b] != 0
        return nz

    def index(self, a: int, b: int) -> np.ndarray:
        if len(self.runs) == 1:
            return code_index(self.runs[0][a:b])
        lo, hi = (self._digit(r[a:b]) for r in self.runs)
        out = hi.astype(np.int64)
        out *= CODES16
        out += lo
        none = (lo < 0) | (hi < 0)
        out[none] = np.where(self.nonzero(a, b)[none], NONCODE, -1)
        return out

    def _digit(self, u: np.ndarray) -> np.ndarray:
        """int32 digit of each unit (code16_index), -1 where none."""
        if self.itemsize == 2:
            return _digit_of()[u]
        return np.where((u & 0xFFFF) == 0, _digit_of()[u >> 16], -1)


class _Decoder:
    """Maps output codes back to (param index, element index)."""

    def __init__(self, bases: dict[str, int], shapes: dict[str, tuple[int, ...]]):
        order = sorted(bases, key=bases.get)
        self.keys = order
        self.starts = np.array([bases[k] for k in order], np.int64)
        self.sizes = np.array([int(np.prod(shapes[k], dtype=np.int64)) for k in order], np.int64)
        # the weights' codes are consecutive from 0 (write_coded_archive): a code is some
        # weight's iff it is below the end of the last
        ends = self.starts + self.sizes
        assert not len(order) or (self.starts[0] == 0 and (self.starts[1:] == ends[:-1]).all())
        self.total = int(ends[-1]) if len(order) else 0

    def decode(self, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(param index or -1, element index) per code index (-1: none); -1/-1 for none."""
        if len(self.starts) == 0:  # nothing was coded
            none = np.full(len(rel), -1, np.int64)
            return none, none
        p = np.searchsorted(self.starts, rel, side="right") - 1
        pc = np.clip(p, 0, len(self.starts) - 1)
        elem = rel - self.starts[pc]
        ok = (rel >= 0) & (p >= 0) & (elem < self.sizes[pc])
        return np.where(ok, pc, -1), np.where(ok, elem, -1)

    def elements(self, units: _Units, a: int, b: int, p: int) -> np.ndarray:
        """int32 element indices of weight p in units [a, b) (PAD for padding), cut at the first
        code of another weight (FOREIGN ends a region). Decoded in chunks: regions reach 200M
        units."""
        start, size = int(self.starts[p]), int(self.sizes[p])
        one_side = start + size <= SPAN or start >= SPAN
        if len(units.runs) == 1 and units.itemsize == 4 and one_side:
            classify = self._by_word(units.runs[0], start, size)
        else:
            classify = self._by_index(units, start, size)
        out = np.empty(b - a, np.int32)
        chunk = 1 << 24
        for c in range(a, b, chunk):
            mine, e, foreign = classify(c, min(b, c + chunk))
            hit = np.flatnonzero(foreign)
            stop = int(hit[0]) if len(hit) else len(mine)
            out[c - a : c - a + stop] = np.where(mine[:stop], e[:stop], PAD)
            if len(hit):
                return out[: c - a + stop]
        return out

    def _by_index(self, units: _Units, start: int, size: int):
        """(c, d) -> (units of the weight, their element, another weight's code or a unit that
        is no code nor zero) for units [c, d), from their code indices."""
        size, total = np.uint64(size), np.uint64(self.total)

        def classify(c: int, d: int):
            rel = units.index(c, d)
            e = rel - start
            mine = e.view(np.uint64) < size  # 0 <= e < size
            return mine, e, ~mine & ((rel.view(np.uint64) < total) | (rel == NONCODE))

        return classify

    def _by_word(self, words: np.ndarray, start: int, size: int):
        """_by_index for one run's float32 codes (uint32 words) of a weight whose codes are on
        one side of the sign: its words are then one range of consecutive uint32 values, and
        every weight's words at most two, so each unit takes a few uint32 range tests instead
        of code_index's int64 passes (the fp32 UNet's layout decodes GBs)."""
        first = np.uint32(code_words(start, start + 1)[0])
        pos = min(self.total, SPAN)  # codes of some weight among the positive floats,
        neg = max(0, self.total - SPAN)  # and among the negative ones

        def classify(c: int, d: int):
            w = words[c:d]
            e = w - first  # wraps: below `size` only for this weight's words
            mine = e < size
            foreign = (w - np.uint32(CODE_BASE)) < pos
            if neg:
                foreign |= (w - np.uint32(SIGN + CODE_BASE)) < neg
            foreign &= ~mine
            return mine, e.view(np.int32), foreign

        return classify


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


def _first(test, n: int, chunk: int = 1 << 22) -> int | None:
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
    want = region.pack(np.arange(n, dtype=np.int32), fill=PAD)
    if not (len(E) >= len(want) and np.array_equal(E[: len(want)], want)):
        return False
    if not part:
        return True
    # Part of a weight (one of its slices, packed on their own): whole rows of it, each
    # element once; never a stray code or a few elements of a shuffle. A raw copy of slices
    # is one run, read as a 1-D shape: its rows are the weight's.
    inner = int(np.prod(region.shape[1:], dtype=np.int64)) if len(region.shape) > 1 else row
    got = np.sort(want[want >= 0])
    first = int(np.ravel_multi_index(region.start(), region.shape))
    return (
        inner is not None
        and first % inner == 0
        and len(got) % inner == 0
        and np.array_equal(got, np.arange(first, first + len(got)))
    )


def learn_entry(
    coded: np.ndarray,
    decoder: _Decoder,
    shapes: dict[str, tuple[int, ...]],
    release=None,
    deadline: float | None = None,
    coded2: np.ndarray | None = None,
):
    """(regions, failed params, unexplained byte spans) of one coded output entry (uint8),
    read front to back: one run's float32 codes, or with coded2 two runs' bf16 digits (a
    narrow encoder: weights packed in bf16 or float32). release(coded, start, end), if given,
    is told the bytes behind. Raises BudgetSpent once time.monotonic() passes deadline."""
    runs = [coded] if coded2 is None else [coded, coded2]
    # the units scanned (the finest), and where a code may start a float32 region instead
    fine = _Units(runs, 4 if coded2 is None else 2)
    wide = _Units(runs, 4) if coded2 is not None else None
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


def _region_at(units: _Units, j: int, decoder: _Decoder, shapes) -> Region | None:
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


def _run_of(decoder: _Decoder, units: _Units, j: int, p: int) -> int:
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


# -- learning and applying ----------------------------------------------------------------
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
    in bf16 (bf16 contractions), so it runs twice, on each digit of the codes.

    Memory: where the driver moves parameters through files (cpu) the coded inputs are read
    and the coded output written through file handles, and every mapping is read once with
    the pages behind the reader dropped (pages.release_pages), so the SD 1.5-size UNet learns
    in a few GB instead of its 7.8 GB of inputs plus the 11.5 GB output."""
    import contextlib

    from .encoder import file_io, input_providers, run_encoder
    from .pages import entry_views, zeroed_like

    coded_in = work.with_name(f".in-{work.name.lstrip('.')}")  # still a temp's name
    outs = [work, work.with_name(f".d1-{work.name.lstrip('.')}")][: 2 if narrow else 1]
    try:
        for digit, out in enumerate(outs):
            bases = write_coded_archive(params, weight, coded_in, digit if narrow else None)
            with input_providers([(in_scope, coded_in)], device) as sources:
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
            coded_in.unlink()
        shapes = {k: tuple(s) for k, (s, _) in params.items()}
        coded = [entry_views(o) for o in outs]
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

    decoder = _Decoder(bases, shapes)
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
    packed = region.pack(w)
    cast = region.cast(packed)
    got = real[region.offset : region.offset + cast.nbytes]
    if len(got) != cast.nbytes:
        return False
    if np.array_equal(got, cast.view(np.uint8)):
        return True
    if not approx:
        return False
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


def repack(layout: Layout, views: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> int:
    """Write each weight's packed copies into views ({entry: writable uint8}); bytes written."""
    by_param = layout.regions_of()
    written = 0
    for key, w in weights.items():
        for entry, r in by_param.get(key, ()):
            src = r.cast(r.strided(w))
            n = r.size() * src.itemsize
            dst = views[entry][r.offset : r.offset + n].view(src.dtype).reshape(src.shape)
            np.copyto(dst, src)  # straight into the (copy-on-write) pages: one copy
            written += n
    return written
