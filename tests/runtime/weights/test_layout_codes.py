"""runtime/weights/layout_codes.py: every coded element names its index, in one run's float32
words or a narrow encoder's two runs of bf16 residues; coded inputs are the codes they say,
built a period at a time; a coded output's units decode back to (weight, element)."""

from __future__ import annotations

import numpy as np

from sdiree.runtime.weights.layout import to_bf16
from sdiree.runtime.weights.layout_codes import (
    ALIGN,
    CODE_BASE,
    CODES,
    MODULI,
    NONCODE,
    SIGN,
    SPAN,
    SPAN16,
    Decoder,
    Units,
    bases_of,
    code16_index,
    code16_words,
    code_index,
    code_words,
    index_of_residues,
    residue_inputs,
    residue_words,
)


def test_codes_run_on_into_the_negative_floats_and_nothing_else_is_one():
    i = np.array([0, 1, SPAN - 1, SPAN, SPAN + 7, 2 * SPAN - 1])
    w = np.concatenate([code_words(a, a + 1) for a in i])
    assert not np.isnan(w.view(np.float32)).any() and np.isfinite(w.view(np.float32)).all()
    assert (np.abs(w.view(np.float32)) >= np.finfo(np.float32).tiny).all()  # normal numbers
    assert (w.view(np.float32)[3:] < 0).all()
    np.testing.assert_array_equal(code_index(w), i)
    others = np.array([0, 1, 0x007FFFFF, 0x7F800000, 0x7FC00000, 0x80000000, 0xFF800000],
                      np.uint64).astype(np.uint32)  # fmt: skip
    np.testing.assert_array_equal(code_index(others), -1)


def test_bf16_codes_are_exact_bf16_numbers_and_nothing_else_is_one():
    i = np.array([0, 1, SPAN16 - 1, SPAN16, MODULI[0] - 1])
    u = code16_words(i)
    as_f32 = (u.astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(as_f32).all() and (np.abs(as_f32) >= np.finfo(np.float32).tiny).all()
    np.testing.assert_array_equal(to_bf16(as_f32), u)  # rounding to bf16 keeps them
    np.testing.assert_array_equal(code16_index(u), i)
    others = np.array([0, 1, 0x007F, 0x7F80, 0x7FC0, 0x8000, 0xFF80], np.uint16)
    np.testing.assert_array_equal(code16_index(others), -1)
    ties = np.array([1 + 2**-8, 1 + 2**-7 + 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8)], np.float32)
    np.testing.assert_array_equal(to_bf16(ties), [0x3F80, 0x3F82, 0x3F81, 0xBF80])  # to even


def test_coded_inputs_are_each_elements_code_chunk_by_chunk():
    """Float32 codes are one arange and a run's residues one period rolled and resized: the
    same words as coding element by element, across the sign's boundary and the periods."""
    for a, b in [(0, 5), (SPAN - 3, SPAN + 3), (SPAN + 9, SPAN + 70000), (1000, 1000 + (1 << 20))]:
        i = np.arange(a, b, dtype=np.int64)
        want = np.where(i < SPAN, CODE_BASE + i, SIGN + CODE_BASE + i - SPAN).astype(np.uint32)
        np.testing.assert_array_equal(code_words(a, b), want)
        np.testing.assert_array_equal(code_index(want), i)
    C = MODULI[0]
    for run in (0, 1):
        for a, b in [(0, 3), (C - 2, C + 2), (5 * C + 7, 9 * C + 1), (C * C - C - 5, C * C)]:
            i = np.arange(a, b, dtype=np.int64)
            want = code16_words(i % MODULI[run]).astype(np.uint32) << 16
            np.testing.assert_array_equal(residue_words(a, b, run), want)


def test_two_runs_residues_name_every_index_below_their_product():
    """The moduli are coprime: every index below their product is named by its two residues
    and by no other (checked around the periods' joins and the product's end)."""
    M = MODULI[0] * MODULI[1]
    assert np.gcd(*MODULI) == 1 and M >= 4_228_000_000
    rng = np.random.default_rng(2)
    x = np.concatenate([np.arange(3 * MODULI[0]), M - 1 - np.arange(1000),
                        rng.integers(0, M, 100_000)])  # fmt: skip
    a, b = (x % m for m in MODULI)
    np.testing.assert_array_equal(index_of_residues(a, b), x)
    assert (index_of_residues(np.array([-1, 0, 0]), np.array([0, -1, MODULI[1]])) == -1).all()


def test_a_narrow_runs_inputs_are_each_weights_residues_from_one_array():
    """residue_inputs: each float32 weight's entry holds its elements' residues (its indices
    among all coded elements, each weight's first at a multiple of ALIGN), all of them views
    of one array at 64-byte-aligned addresses (iree copies a parameter elsewhere: layout_codes
    .ALIGN); a param of another type is its real bytes."""
    params = {"a": ((3, 70000), np.float32), "i": ((5,), np.int64), "b": ((7,), np.float32),
              "c": ((2, 65030), np.float32)}  # fmt: skip
    real = np.arange(5, dtype=np.int64) * 3
    assert bases_of(params) == {"a": 0, "b": 210000, "c": 210007}
    bases = bases_of(params, ALIGN)
    assert bases == {"a": 0, "b": 210000, "c": 210016}
    for run in (0, 1):
        entries = dict(residue_inputs(params, {"i": real}.__getitem__, run).items())
        assert set(entries) == set(params)
        np.testing.assert_array_equal(np.frombuffer(entries["i"].file_view, np.int64), real)
        starts = set()
        for k, base in bases.items():
            n = int(np.prod(params[k][0]))
            got = np.frombuffer(entries[k].file_view, np.uint32)
            np.testing.assert_array_equal(got, residue_words(base, base + n, run))
            addr = got.__array_interface__["data"][0]
            assert addr % 64 == 0
            at = next(a for a in range(base % MODULI[run], 1 << 24, MODULI[run]) if a % ALIGN == 0)
            starts.add(addr - 4 * at)  # where the one array starts
        assert len(starts) == 1


def test_two_runs_units_decode_as_their_residues_say():
    """Units.index of two runs (a table lookup per unit): the index the residues name where
    both runs hold a residue's code, -1 where both are zero, NONCODE where a unit holds
    anything else (a second run's code past its modulus included)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, MODULI[0] * MODULI[1], 4000)
    runs = [code16_words(x % m) for m in MODULI]
    runs[0][:50] = 0  # zero in one run only: something else
    runs[0][50:100], runs[1][50:100] = 0, 0
    runs[1][100:150] = rng.integers(0, 0x80, 50)  # subnormal bf16: no code
    runs[1][150:160] = code16_words(np.full(10, MODULI[1]))  # no residue of the second run
    for itemsize in (2, 4):
        units = [r.view(np.uint8) if itemsize == 2 else (r.astype(np.uint32) << 16).view(np.uint8)
                 for r in runs]  # fmt: skip
        got = Units(units, itemsize).index(0, 4000)
        want = x.copy()
        want[:50], want[100:160], want[50:100] = NONCODE, NONCODE, -1
        np.testing.assert_array_equal(got, want)
    wide = [(r.astype(np.uint32) << 16 | 1).view(np.uint8) for r in runs]  # low half not zero
    assert (Units(wide, 4).index(0, 4000) == NONCODE).all()


def test_one_runs_words_decode_as_their_code_indices_say():
    """Decoder.elements of float32 codes (by word ranges where the weight's codes are on one
    side of the sign): each unit's element of the weight or PAD, cut at the first code of
    another weight, as code_index and the weights' bases say, on either side of the sign."""
    rng = np.random.default_rng(4)
    shapes = {"big": (SPAN + 4,), "w": (5000,), "x": (300,)}
    bases = {"big": 0, "w": SPAN + 4, "x": SPAN + 5004}
    total = SPAN + 5304
    decoder = Decoder(bases, shapes)
    for trial in range(60):
        key = ("big", "w", "x")[trial % 3]
        start, size = bases[key], shapes[key][0]
        lo = start if key != "big" else SPAN - 100  # big's around the sign
        own = lo + rng.permutation(min(size, 5000))[: rng.integers(1, 800)]
        edges = [c for c in (start - 1, start + size) if 0 <= c < total]  # the neighbours'
        other = np.concatenate([rng.integers(0, CODES, 3), rng.choice(edges, 2)])
        units = np.concatenate([own, rng.permutation(other), own[:50]])
        words = np.where(units < SPAN, CODE_BASE + units,
                         SIGN + CODE_BASE + units - SPAN).astype(np.uint32)  # fmt: skip
        words[rng.integers(0, len(words), 10)] = 0  # padding
        rel = code_index(words)
        is_own = (rel >= start) & (rel < start + size)
        foreign = np.flatnonzero(~is_own & (rel >= 0) & (rel < total))
        stop = int(foreign[0]) if len(foreign) else len(words)
        want = np.where(is_own, rel - start, -1)[:stop]
        got = decoder.elements(Units([words.view(np.uint8)], 4), 0, len(words),
                               decoder.keys.index(key))  # fmt: skip
        np.testing.assert_array_equal(got, want)


def test_two_runs_classify_in_uint32_as_by_their_indices():
    """Decoder's two-run classify (uint32 passes, _by_residues) says for every unit what the
    int64 one from Units.index says (_by_index): the weight's units and their elements, and
    the units that end its region (another weight's code, a unit that is something else),
    for indices below and above 2**31, float32 words and bf16 halves."""
    rng = np.random.default_rng(5)
    shapes = {"a": (1000,), "w": ((1 << 31) - 64,), "z": (5000,)}  # a weight's elements: int32
    bases = {"a": 0, "w": 1008, "z": 1008 + (1 << 31) - 64 + 5}
    decoder = Decoder(bases, shapes)
    total = bases["z"] + 5000
    for key in shapes:
        start, size = bases[key], shapes[key][0]
        own = start + rng.integers(0, min(size, 1 << 20), 3000)
        if key == "w":
            own[:1000] = start + size - 1 - rng.integers(0, 1000, 1000)  # indices past 2**31
        other = rng.integers(0, MODULI[0] * MODULI[1], 500)  # others', and none's past total
        x = rng.permutation(np.concatenate([own, other]))
        runs = [code16_words(x % m) for m in MODULI]
        runs[0][:40] = 0  # zero in one run: something else
        runs[0][40:90], runs[1][40:90] = 0, 0  # padding
        runs[1][90:120] = rng.integers(1, 0x80, 30)  # a subnormal: no code
        runs[1][120:130] = code16_words(np.full(10, MODULI[1]))  # past the second's residues
        for itemsize in (2, 4):
            units = [r.view(np.uint8) if itemsize == 2 else (r.astype(np.uint32) << 16).view(np.uint8)
                     for r in runs]  # fmt: skip
            if itemsize == 4:
                units[1] = units[1].copy()
                units[1].view(np.uint32)[130:140] |= 1  # a low half not zero
            u = Units(units, itemsize)
            fast = decoder._by_residues(u, start, size)(0, u.n)
            slow = decoder._by_index(u, start, size)(0, u.n)
            np.testing.assert_array_equal(fast[0], slow[0])
            np.testing.assert_array_equal(fast[1][fast[0]], slow[1][slow[0]])
            np.testing.assert_array_equal(fast[2], slow[2])
            assert fast[0].sum() >= 2800 and fast[2].sum() >= 60
            assert int(total) == decoder.total
