"""Coded weights, by which layout_learn.py finds where an encoder copies each weight element.

Every float32 element is replaced by a distinct normal float (positive, then negative: 4.26G
codes, SDXL's UNet takes 3.3G) whose bits are its index, so each output element names the
element it was copied from (0: padding). A bf16 artifact's encoder (`narrow`) rounds the
weights it packs to bf16, which keeps 16 bits of a code: it runs twice, element x holding x mod
65,024 in the first run and x mod 65,023 in the second, each a normal bf16 number (exact
through the rounding); the two coprime residues name x (MODULI). A run's inputs are then
periodic: every weight reads its codes from one array of a period and a weight of them, at its
own offset (residue_inputs): 118 MB of memory for SDXL's UNet instead of a 10.3 GB temp file
of its weights' size. A bf16 pack's elements are read two bytes at a time, a float32 pack's
(biases) four.

coded_inputs gives the encoder its coded inputs; Units and Decoder read its output back, unit
by unit, as (weight, element).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np

CODE_BASE = 0x00800000  # the smallest normal float32: codes are normal numbers, never NaN
CODE_END = 0x7F800000  # +inf: codes stay below
SIGN = 0x80000000  # codes past the positive normals go on with the negative ones
SPAN = CODE_END - CODE_BASE
CODES = 2 * SPAN
# A narrow encoder (bf16 contractions) rounds what it packs to bf16, which keeps 16 bits of a
# code: its weights are coded twice, each element's index as a residue (MODULI, below), each a
# bf16 number (exact in float32 and bf16) that names its residue the same way (code16_words).
CODE16_BASE, CODE16_END, SIGN16 = 0x0080, 0x7F80, 0x8000
SPAN16 = CODE16_END - CODE16_BASE
CODES16 = 2 * SPAN16
# A narrow encoder's two runs: element x holds x mod MODULI[run] as a bf16 code. Coprime, so
# the pair names every x below their product: x = a + C * ((b - a) mod (C - 1)).
MODULI = (CODES16, CODES16 - 1)
# A narrow run's inputs are one array in memory (residue_inputs). iree 3.13's local-task driver
# uses a parameter's host memory as it is only at a 64-byte-aligned address; elsewhere it copies
# it into a new buffer, and an SD 1.5 UNet run took 85.9 s instead of 24.2 (compile/NOTES.md,
# sixty-fifth session). So a narrow run's weights start their codes at multiples of ALIGN
# elements (bases_of), and each reads them from a 64-byte-aligned place of that array.
ALIGN = 16
NONCODE = -2  # a unit neither zero nor a code (of two runs)
PAD, FOREIGN = -1, -2  # Decoder.elements: padding, another weight's code


def code_words(start: int, stop: int) -> np.ndarray:
    """The uint32 code words of code indices [start, stop) (stop <= CODES)."""
    if stop <= SPAN or start >= SPAN:  # one side of the sign: consecutive words
        first = CODE_BASE + start if stop <= SPAN else SIGN + CODE_BASE + start - SPAN
        return np.arange(first, first + stop - start, dtype=np.uint32)
    i = np.arange(start, stop, dtype=np.int64)
    return np.where(i < SPAN, CODE_BASE + i, SIGN + CODE_BASE + i - SPAN).astype(np.uint32)


def residue_words(start: int, stop: int, run: int) -> np.ndarray:
    """uint32 words of indices [start, stop), each holding its index mod MODULI[run] as a bf16
    code (code16_words) in its high half: one period of them rolled and resized."""
    period = _residue_period(run)
    return np.resize(np.roll(period, -(start % len(period))), stop - start)


def code16_words(i: np.ndarray) -> np.ndarray:
    """The uint16 bf16 code of each residue in i (int64, < CODES16): the normal bf16 numbers,
    positive then negative."""
    i = np.asarray(i, np.int64)
    return np.where(i < SPAN16, CODE16_BASE + i, SIGN16 + CODE16_BASE + i - SPAN16).astype(
        np.uint16
    )


def code16_index(u: np.ndarray) -> np.ndarray:
    """The residue (int64) of each uint16 bf16 code, -1 where it is none."""
    w = u.astype(np.int64)
    mag = w & (SIGN16 - 1)
    ok = (mag >= CODE16_BASE) & (mag < CODE16_END)
    return np.where(ok, mag - CODE16_BASE + np.where(w >= SIGN16, SPAN16, 0), -1)


@functools.cache
def _residue_of() -> np.ndarray:
    """code16_index of every uint16, int32: one gather per unit instead of six passes."""
    return code16_index(np.arange(1 << 16, dtype=np.uint16)).astype(np.int32)


@functools.cache
def _residue_period(run: int) -> np.ndarray:
    """The words of one period of run's residues (residue_words)."""
    return code16_words(np.arange(MODULI[run])).astype(np.uint32) << 16


def index_of_residues(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The index (int64) named by the residues a (run 0) and b (run 1), int32; -1 where
    either is none (negative, or b past its modulus)."""
    out = b.astype(np.int64)
    out -= a
    out %= MODULI[1]
    out *= MODULI[0]
    out += a
    out[(a < 0) | (b < 0) | (b >= MODULI[1])] = -1
    return out


def code_index(words: np.ndarray) -> np.ndarray:
    """The code index (int64) of each uint32 word, -1 where it is no code (zero, a
    subnormal, inf or NaN of either sign)."""
    w = words.astype(np.int64)
    mag = w & (SIGN - 1)
    ok = (mag >= CODE_BASE) & (mag < CODE_END)
    return np.where(ok, mag - CODE_BASE + np.where(w >= SIGN, SPAN, 0), -1)


def codable(params: dict[str, tuple[tuple[int, ...], np.dtype]], narrow: bool = False) -> bool:
    """Whether params have float32 weights to code, and no more of their elements than codes
    (two residues' worth where narrow)."""
    n = [int(np.prod(s, dtype=np.int64)) for s, d in params.values() if np.dtype(d) == np.float32]
    if narrow:  # each weight's codes start at a multiple of ALIGN
        return bool(n) and sum(n) + (ALIGN - 1) * len(n) <= min(CODES, MODULI[0] * MODULI[1])
    return bool(n) and sum(n) <= CODES


def bases_of(params: dict[str, tuple[tuple[int, ...], np.dtype]], align: int = 1) -> dict[str, int]:
    """{float32 key: the index of its first element among all coded elements}, in order, each
    a multiple of align (a narrow run's: ALIGN; the codes between weights are nobody's)."""
    bases, at = {}, 0
    for key, (shape, dtype) in params.items():
        if np.dtype(dtype) == np.float32:
            at = -(-at // align) * align
            bases[key] = at
            at += int(np.prod(shape, dtype=np.int64))
    if at > CODES:
        raise ValueError(f"more than {CODES} float32 elements to code")
    return bases


def write_coded_archive(
    params: dict[str, tuple[tuple[int, ...], np.dtype]], weight, path: Path
) -> dict[str, int]:
    """Write at path an archive of every param, the float32 ones coded (each element's bits
    the code of its index among all coded elements, code_words), the others with their real
    bytes (`weight(key)`); returns bases_of(params). Written a chunk at a time, so the SD
    1.5-size UNet's 7.8 GB of coded inputs never sit in memory."""
    from .irpa_writer import Entry, created, pwrite_all

    plan = [
        Entry(key, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        for key, (shape, dtype) in params.items()
    ]
    bases = bases_of(params)
    chunk = 1 << 22  # elements
    with created(path, plan) as (fd, offsets):
        for key, (shape, _) in params.items():
            if key not in bases:
                w = np.ascontiguousarray(weight(key)).reshape(-1).view(np.uint8)
                pwrite_all(fd, w, offsets[key])
                continue
            n, at = int(np.prod(shape, dtype=np.int64)), bases[key]
            for i in range(0, n, chunk):
                codes = code_words(at + i, at + min(n, i + chunk))
                pwrite_all(fd, codes.view(np.uint8), offsets[key] + 4 * i)
    return bases


def residue_inputs(params, weight, run: int):
    """A narrow encoder's inputs for run `run` (0, 1) as an in-memory rt.ParameterIndex:
    every float32 weight an entry of one array that holds a period of the run's residues
    (residue_words) and as many more as the largest weight has elements, read from its first
    index's residue on (SDXL's UNet: 118 MB for its 10.3 GB of weights); the other params their
    real bytes (`weight(key)`)."""
    import iree.runtime as rt

    bases = bases_of(params, ALIGN)
    sizes = {k: int(np.prod(params[k][0], dtype=np.int64)) for k in bases}
    period = MODULI[run]
    # A weight may read its residues from any index of its base's class mod the period: run
    # 0's period is a multiple of ALIGN, so that is its base's; run 1's is odd, so one of the
    # next ALIGN - 1 periods puts it at a multiple of ALIGN.
    more = 0 if period % ALIGN == 0 else (ALIGN - 1) * period
    words = _aligned_copy(residue_words(0, period + more + max(sizes.values(), default=0), run))
    index = rt.ParameterIndex()
    for key in params:
        if key in bases:
            at = bases[key] % period
            while at % ALIGN:
                at += period
            index.add_buffer(key, words[at : at + sizes[key]].view(np.uint8))
        else:
            index.add_buffer(key, np.ascontiguousarray(weight(key)).reshape(-1).view(np.uint8))
    return index


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    """a copied to memory at a 64-byte-aligned address."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    at = -raw.ctypes.data % 64
    out = raw[at : at + a.nbytes].view(a.dtype)
    out[:] = a
    return out


@contextlib.contextmanager
def coded_inputs(scope: str, params, weight, path: Path, run: int | None = None):
    """([parameter provider of scope], bases_of(params)) for an encoder run on coded params:
    one run's float32 codes (run None) from an archive written at path (removed on exit) and
    mapped as encoder.input_providers maps them; a narrow encoder's run `run` from memory
    (residue_inputs). Drop the providers before the block ends."""
    from .encoder import input_providers

    if run is not None:
        sources = [residue_inputs(params, weight, run).create_provider(scope=scope)]
        yield sources, bases_of(params, ALIGN)
        sources.clear()
        return
    try:
        bases = write_coded_archive(params, weight, path)
        with input_providers([(scope, path)]) as sources:
            yield sources, bases
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


class Units:
    """An entry's coded output as units: float32 words coded by one run (`code_words`), or, from
    two runs' bf16 residues (residue_words, run 0 first), float32 words (`itemsize` 4; a
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
        out = index_of_residues(*(self._residue(r[a:b]) for r in self.runs))
        none = out < 0
        out[none] = np.where(self.nonzero(a, b)[none], NONCODE, -1)
        return out

    def _residue(self, u: np.ndarray) -> np.ndarray:
        """int32 residue of each unit (code16_index), -1 where none."""
        if self.itemsize == 2:
            return _residue_of()[u]
        return np.where((u & 0xFFFF) == 0, _residue_of()[u >> 16], -1)

    def halves(self, a: int, b: int) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Two runs' uint16 code halves of units [a, b) (a float32 word's high half), and
        where each word's low half is zero in both runs (None for bf16 units)."""
        if self.itemsize == 2:
            return [r[a:b] for r in self.runs], None
        halves = [r[a:b].view(np.uint16) for r in self.runs]  # little-endian: low half first
        low_zero = halves[0][0::2] == 0
        low_zero &= halves[1][0::2] == 0
        return [h[1::2] for h in halves], low_zero


def _is_code16(u: np.ndarray) -> np.ndarray:
    """Where uint16 u is a bf16 code (code16_words): its magnitude in [CODE16_BASE,
    CODE16_END), in three uint16 passes."""
    t = u & (SIGN16 - 1)
    t -= CODE16_BASE  # wraps below it
    return t < SPAN16


def _folded16(u: np.ndarray) -> np.ndarray:
    """uint16 code16_index(u) + CODE16_BASE where u is a code: the negative codes (sign bit
    set) are past the positive ones, SIGN16 - SPAN16 below their bits."""
    s = u >> 15
    s *= SIGN16 - SPAN16
    return u - s


class Decoder:
    """Maps output codes back to (param index, element index)."""

    def __init__(self, bases: dict[str, int], shapes: dict[str, tuple[int, ...]]):
        order = sorted(bases, key=bases.get)
        self.keys = order
        self.starts = np.array([bases[k] for k in order], np.int64)
        self.sizes = np.array([int(np.prod(shapes[k], dtype=np.int64)) for k in order], np.int64)
        # the weights' codes are consecutive from 0 (write_coded_archive), or with gaps of
        # less than ALIGN before each (a narrow run's) that no input holds: a code that appears
        # is some weight's iff it is below the end of the last
        ends = self.starts + self.sizes
        gaps = self.starts[1:] - ends[:-1]
        assert not len(order) or (
            0 <= self.starts[0] < ALIGN and ((gaps >= 0) & (gaps < ALIGN)).all()
        )
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

    def elements(self, units: Units, a: int, b: int, p: int) -> np.ndarray:
        """int32 element indices of weight p in units [a, b) (PAD for padding), cut at the first
        code of another weight (FOREIGN ends a region). Decoded in chunks (regions reach 200M
        units) of 128K units, whose temporaries stay in a core's cache: 2.6x as fast as 16M."""
        start, size = int(self.starts[p]), int(self.sizes[p])
        one_side = start + size <= SPAN or start >= SPAN
        if len(units.runs) == 1 and units.itemsize == 4 and one_side:
            classify = self._by_word(units.runs[0], start, size)
        elif len(units.runs) == 2:
            classify = self._by_residues(units, start, size)
        else:
            classify = self._by_index(units, start, size)
        out = np.empty(b - a, np.int32)
        chunk = 1 << 17
        for c in range(a, b, chunk):
            mine, e, foreign = classify(c, min(b, c + chunk))
            hit = np.flatnonzero(foreign)
            stop = int(hit[0]) if len(hit) else len(mine)
            out[c - a : c - a + stop] = np.where(mine[:stop], e[:stop], PAD)
            if len(hit):
                return out[: c - a + stop]
        return out

    def _by_index(self, units: Units, start: int, size: int):
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

    def _by_residues(self, units: Units, start: int, size: int):
        """_by_index for two runs' residues, in uint32: the index a residue pair names is
        below MODULI[0] * MODULI[1] < 2**32, so each unit takes a few 4-byte passes instead of
        index_of_residues' int64 ones and its division (the bf16 UNet's layout decodes ~1G
        units)."""
        m0, m1 = MODULI
        # folded codes (_folded16) are residues + CODE16_BASE, and so is every index below
        first, size = np.uint32(start + CODE16_BASE), np.uint32(size)
        total = np.uint32(self.total + CODE16_BASE)
        past1 = code16_words(np.array([m1]))[0]  # run 1's code past its residues

        def classify(c: int, d: int):
            (u0, u1), low_zero = units.halves(c, d)
            ok = _is_code16(u0)
            ok &= _is_code16(u1)
            ok &= u1 != past1
            if low_zero is not None:
                ok &= low_zero
            f0 = _folded16(u0)
            k = np.subtract(_folded16(u1), f0, dtype=np.int32)  # b - a, in (-m0, m1): mod m1
            neg = k >> 31  # without a division, by adding m1 where negative (a masked add
            neg &= m1  # is ~10x slower)
            k += neg
            x = k.view(np.uint32)
            x *= m0
            x += f0  # the index + CODE16_BASE, where ok
            e = x - first  # wraps: below `size` only for this weight's
            mine = e < size
            mine &= ok
            foreign = x < total
            foreign &= ok
            foreign ^= mine  # mine is a part of it: first + e < first + size <= total
            if not ok.all():  # a unit that is no code and not zero: something else
                other = units.nonzero(c, d)
                np.greater(other, ok, out=other)  # and not ok
                foreign |= other
            return mine, e.view(np.int32), foreign

        return classify
