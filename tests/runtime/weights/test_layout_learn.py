"""runtime/weights/layout_learn.py on synthetic coded outputs: a data-tiled pack with padding
is found and a shuffle that is no strided view is not; bf16 and float32 packs of a narrow
encoder from its two runs; packs in slices; codes past the positive floats; the scan's cost
and its deadline. (Through a compiled encoder: test_repack.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdiree.runtime.weights.layout import Layout, Region, to_bf16
from sdiree.runtime.weights.layout_codes import (
    ALIGN,
    MODULI,
    SPAN,
    Decoder,
    bases_of,
    code16_words,
    code_words,
)
from sdiree.runtime.weights.layout_learn import BudgetSpent, learn_entry


def _codes(pieces, bases):
    """The uint8 bytes of a coded output made of (param, element indices or -1) pieces."""
    words = []
    for k, e in pieces:
        codes = code_words(bases[k], bases[k] + int(e.max()) + 1) if e.max() >= 0 else []
        words.append(np.where(e >= 0, np.take(codes, np.maximum(e, 0)) if len(codes) else 0, 0))
    return np.concatenate(words).astype(np.uint32).view(np.uint8)


def _narrow_runs(pieces, bases):
    """Two runs' coded output of a narrow encoder: (param, element indices or -1, dtype)
    pieces, each element's index as its two residues, in bf16 or float32 units."""
    runs = []
    for modulus in MODULI:
        out = []
        for k, e, dtype in pieces:
            u = code16_words((bases[k] + np.maximum(e, 0)) % modulus)
            u = np.where(e >= 0, u, 0).astype(np.uint16)
            out.append(u.view(np.uint8) if dtype == "bf16" else
                       (u.astype(np.uint32) << 16).view(np.uint8))  # fmt: skip
        runs.append(np.concatenate(out))
    return runs


@pytest.mark.parametrize("aligned", [False, True])
def test_a_narrow_encoders_bf16_and_float32_packs_are_found_from_two_runs(tmp_path, aligned):
    """bf16 contractions' encoders round what they pack to bf16, which keeps 16 bits of a
    code: coded twice, one residue a run, each bf16 region is found in halves and
    a float32 one (a bias) in words, side by side without running on into each other; and
    each re-packs its weight as the encoder would (bf16 rounded to nearest even). Also with
    each weight's codes from a multiple of ALIGN, as residue_inputs gives them (unused codes
    between weights)."""
    # w [N=69990, K=4] packed as [N1, K1=2, N0=16, K0=2] (bf16 pairs), N padded to 70000
    shapes = {"b": (20,), "w": (69990, 4), "v": (4, 4)}
    bases = {"b": 0, "w": 20, "v": 20 + 69990 * 4}  # past the first modulus
    if aligned:
        bases = bases_of({k: (s, np.float32) for k, s in shapes.items()}, ALIGN)
        assert bases == {"b": 0, "w": 32, "v": 280000}
    tiled = Region("w", 0, (69990, 4), ((0, 16, 4375), (1, 2, 2), (0, 1, 16), (1, 1, 2)))
    want = tiled.pack(np.arange(69990 * 4), fill=-1)
    shuffled = np.random.default_rng(0).permutation(16)
    shuffled[0] = 0
    pieces = [("b", np.arange(20), "f32"), ("w", want, "bf16"), ("v", shuffled, "bf16")]
    runs = _narrow_runs(pieces, bases)
    regions, failed, _ = learn_entry(runs[0], Decoder(bases, shapes), shapes, coded2=runs[1])
    assert [(r.param, r.offset, r.dtype) for r in regions] == [("b", 0, "f32"), ("w", 80, "bf16")]
    assert regions[1].size() == len(want) and failed == {"v"}
    np.testing.assert_array_equal(regions[1].pack(np.arange(69990 * 4), fill=-1), want)
    w = np.random.default_rng(1).standard_normal((69990, 4)).astype(np.float32)
    np.testing.assert_array_equal(regions[1].cast(regions[1].pack(w)), to_bf16(tiled.pack(w)))
    assert [Region.from_json(r.to_json()) for r in regions] == regions
    # a layout with bf16 regions is format 2, which a reader of format 1 refuses
    for kept, version in ((regions, 2), (regions[:1], 1)):
        Layout({"e": kept}, complete=True).save(tmp_path / "l.json")
        assert json.loads((tmp_path / "l.json").read_text())["version"] == version
        assert Layout.load(tmp_path / "l.json").entries == {"e": kept}


def test_a_pack_coded_past_the_positive_floats_is_found():
    shapes = {"big": (SPAN + 4,), "w": (20, 3)}
    bases = {"big": 0, "w": SPAN + 4}  # w's codes are all negative floats
    tiled = Region("w", 0, (20, 3), ((0, 16, 2), (1, 1, 3), (0, 1, 16)))
    want = tiled.pack(np.arange(60), fill=-1)
    regions, failed, _ = learn_entry(_codes([("w", want)], bases), Decoder(bases, shapes), shapes)
    assert [(r.param, r.levels) for r in regions] == [("w", tiled.levels)] and not failed


def test_scanning_past_stray_codes_costs_what_it_reads():
    """Stray codes (a weight's real bytes that read as codes: one not float32) each end a short
    stretch; the scan still decodes each word a few times, not a window of millions."""
    shapes = {"w": (20, 3), "v": (1 << 20,), "u": (1 << 20,)}
    bases = {"w": 0, "v": 60, "u": 60 + (1 << 20)}
    tiled = Region("w", 0, (20, 3), ((0, 16, 2), (1, 1, 3), (0, 1, 16)))
    n = 1 << 18
    at = np.linspace(0, n - 1, 500).astype(int)
    v, u = np.full(n, -1), np.full(n, -1)
    v[at[::2]] = np.arange(1, 251) * 37  # v's and u's codes in turn, none the first element
    u[at[1::2]] = np.arange(1, 251) * 41
    packed = _codes([("w", tiled.pack(np.arange(60), fill=-1))], bases).view(np.uint32)
    strays = np.maximum(*(_codes([(k, e)], bases).view(np.uint32) for k, e in (("v", v), ("u", u))))
    coded = np.concatenate([packed, strays]).view(np.uint8)
    decoder, decoded = Decoder(bases, shapes), [0]
    plain = decoder.decode

    def counting(words):
        decoded[0] += len(words)
        return plain(words)

    decoder.decode = counting
    regions, failed, _ = learn_entry(coded, decoder, shapes)
    assert [r.param for r in regions] == ["w"] and failed == {"v", "u"}
    assert decoded[0] < 8 * len(coded) // 4


def test_learn_entry_stops_at_its_deadline():
    shapes = {"w": (20, 3)}
    coded = _codes([("w", np.arange(60))], {"w": 0})
    regions, _, _ = learn_entry(coded, Decoder({"w": 0}, shapes), shapes, deadline=1e18)
    assert [r.param for r in regions] == ["w"]
    with pytest.raises(BudgetSpent):
        learn_entry(coded, Decoder({"w": 0}, shapes), shapes, deadline=0.0)


def test_a_padded_tiled_pack_is_found_and_a_shuffle_is_not():
    shapes = {"w": (20, 3), "v": (4, 4)}
    bases = {"w": 0, "v": 60}
    # w [N=20, K=3] packed as [N1=2, K=3, N0=16] with N padded to 32
    tiled = Region("w", 0, (20, 3), ((0, 16, 2), (1, 1, 3), (0, 1, 16)))
    want = tiled.pack(np.arange(60), fill=-1)
    shuffled = np.random.default_rng(0).permutation(16)
    shuffled[0] = 0  # starts at element 0, as a pack does
    gap = np.full(16, -1)
    coded = _codes([("w", want), ("w", gap), ("v", shuffled)], bases)
    regions, failed, _ = learn_entry(coded, Decoder(bases, shapes), shapes)
    assert [(r.param, r.offset) for r in regions] == [("w", 0)]
    np.testing.assert_array_equal(regions[0].pack(np.arange(60), fill=-1), want)
    assert failed == {"v"}


def test_a_weight_packed_in_slices_is_found_slice_by_slice():
    """A split Winograd conv's weight [16, C, O] reaches its matmuls as 16 slices, each packed
    (here tiled and padded) on its own and written in any order: each slice is a region that
    starts past the weight's element 0 (Region.origin); together they re-pack the weight and
    give it back."""
    from sdiree.runtime.weights.recover import unpack

    taps, c, o = 16, 3, 20
    shapes = {"u": (taps, c, o), "v": (4, 4)}
    bases = {"u": 0, "v": taps * c * o}
    order = [5, 0, 15, 9, *[k for k in range(taps) if k not in (5, 0, 15, 9)]]
    # slice k: [C=3, O=20] packed as [O1=2, C=3, O0=16], O padded to 32
    tiles = [Region("u", 0, (taps, c, o), ((2, 16, 2), (1, 1, 3), (2, 1, 16)), (k, 0, 0))
             for k in order]  # fmt: skip
    index = np.arange(taps * c * o)
    coded = _codes([("u", t.pack(index, fill=-1)) for t in tiles], bases)
    regions, failed, _ = learn_entry(coded, Decoder(bases, shapes), shapes)
    # one region a slice, or a run of slices written one after the other (6, 7, 8) as one
    assert not failed and [r.start()[0] for r in regions][:4] == order[:4]
    assert regions[1].origin == () and sum(r.size() for r in regions) == taps * 96
    u = np.random.default_rng(0).standard_normal((taps, c, o)).astype(np.float32)
    packed = np.concatenate([r.pack(u) for r in regions])
    np.testing.assert_array_equal(packed, np.concatenate([t.pack(u) for t in tiles]))
    back, covered = np.zeros(u.size, u.dtype), np.zeros(u.size, bool)
    at = 0
    for r in regions:
        part, seen = (a.reshape(-1) for a in unpack(r, packed[at : at + r.size()]))
        back, covered = np.where(seen, part, back), covered | seen
        at += r.size()
        assert covered.all() == (r is regions[-1])  # each slice's rows, once
    np.testing.assert_array_equal(back.reshape(u.shape), u)
    assert [Region.from_json(r.to_json()) for r in regions] == regions


def test_a_run_of_unpadded_slices_is_found_as_whole_rows():
    """An unpacked copy of a split Winograd conv's weight from slice 1 on (SD 1.5's conv_out
    with panels: its 36 slices [320, 4] copied raw as slice 0, all 36, then 1-35): read as a
    contiguous run, it has no level but the last dim's, so it is a region of whole slices, not
    a stray run of codes, and the weight's layout is complete."""
    taps, c, o = 6, 5, 4
    shapes = {"u": (taps, c, o), "v": (4, 4)}
    bases = {"u": 0, "v": taps * c * o}
    index = np.arange(taps * c * o)
    row = c * o
    pieces = [index[:row], index, index[row:], np.arange(16)]
    coded = _codes([("u", p) for p in pieces[:3]] + [("v", pieces[3])], bases)
    regions, failed, _ = learn_entry(coded, Decoder(bases, shapes), shapes)
    assert not failed
    u = np.random.default_rng(0).standard_normal((taps, c, o)).astype(np.float32)
    got = np.concatenate([r.pack(u) for r in regions if r.param == "u"])
    np.testing.assert_array_equal(got, np.concatenate([u.reshape(-1)[p] for p in pieces[:3]]))
    # a run that starts inside a slice is no region of whole slices
    coded = _codes([("u", index[row + 1 :]), ("v", pieces[3])], bases)
    assert learn_entry(coded, Decoder(bases, shapes), shapes)[1] == {"u"}
