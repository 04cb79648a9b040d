"""runtime/weights/layout.py and repack.py: a few replaced weights re-packed in numpy by the
encoder's learned layout give what running the encoder gives.

The layout inference on synthetic codes (a data-tiled pack with padding is found; a shuffle
that is no strided view is not), then through the compiled tiny cpu artifact: the learned
layout is complete, a LoRA-like change re-packed in numpy makes the image the encoder path
makes, bit for bit, and a weight whose layout did not verify sends the run to the encoder.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from llvm_cpu import laid_out_cpu_fp32

from sdiree.runtime.cpu_features import host_cpu_features
from sdiree.runtime.device_select import choose_device
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.session import Session
from sdiree.runtime.weights import layout, repack
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.layout import (
    LEARNER_VERSION,
    SPAN,
    Layout,
    Region,
    _Decoder,
    code16_index,
    code16_words,
    code_index,
    code_words,
    learn_entry,
    to_bf16,
)
from sdiree.runtime.weights.overrides import WeightOverrides


def _codes(pieces, bases):
    """The uint8 bytes of a coded output made of (param, element indices or -1) pieces."""
    words = []
    for k, e in pieces:
        codes = code_words(bases[k], bases[k] + int(e.max()) + 1) if e.max() >= 0 else []
        words.append(np.where(e >= 0, np.take(codes, np.maximum(e, 0)) if len(codes) else 0, 0))
    return np.concatenate(words).astype(np.uint32).view(np.uint8)


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
    i = np.array([0, 1, layout.SPAN16 - 1, layout.SPAN16, layout.CODES16 - 1])
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
    """write_coded_archive builds a chunk's codes from one period of them (code16_digit_words)
    and float32 codes as one arange: the same words as coding element by element, across the
    sign's boundary and the digits' periods."""
    C = layout.CODES16
    for a, b in [(0, 5), (SPAN - 3, SPAN + 3), (SPAN + 9, SPAN + 70000), (1000, 1000 + (1 << 20))]:
        i = np.arange(a, b, dtype=np.int64)
        base, sign = layout.CODE_BASE, layout.SIGN
        want = np.where(i < SPAN, base + i, sign + base + i - SPAN).astype(np.uint32)
        np.testing.assert_array_equal(code_words(a, b), want)
        np.testing.assert_array_equal(code_index(want), i)
    for digit in (0, 1):
        for a, b in [(0, 3), (C - 2, C + 2), (5 * C + 7, 9 * C + 1), (C * C - C - 5, C * C)]:
            i = np.arange(a, b, dtype=np.int64)
            want = code16_words(i // C**digit % C).astype(np.uint32) << 16
            np.testing.assert_array_equal(layout.code16_digit_words(a, b, digit), want)


def test_two_runs_units_decode_as_their_digits_say():
    """_Units.index of two runs (a table lookup per unit): the code index where both runs hold
    a digit's code, -1 where both are zero, NONCODE where a unit holds anything else."""
    rng = np.random.default_rng(3)
    C = layout.CODES16
    d = rng.integers(0, C, (2, 4000))
    runs = [code16_words(x) for x in d]
    runs[0][:50] = 0  # zero in one run only: something else
    runs[0][50:100], runs[1][50:100] = 0, 0
    runs[1][100:150] = rng.integers(0, 0x80, 50)  # subnormal bf16: no code
    for itemsize in (2, 4):
        units = [r.view(np.uint8) if itemsize == 2 else (r.astype(np.uint32) << 16).view(np.uint8)
                 for r in runs]  # fmt: skip
        got = layout._Units(units, itemsize).index(0, 4000)
        want = np.where((code16_index(runs[0]) >= 0) & (code16_index(runs[1]) >= 0),
                        d[1] * C + d[0], layout.NONCODE)  # fmt: skip
        want[50:100] = -1
        np.testing.assert_array_equal(got, want)
    wide = [(r.astype(np.uint32) << 16 | 1).view(np.uint8) for r in runs]  # low half not zero
    assert (layout._Units(wide, 4).index(0, 4000) == layout.NONCODE).all()


def test_one_runs_words_decode_as_their_code_indices_say():
    """_Decoder.elements of float32 codes (by word ranges where the weight's codes are on one
    side of the sign): each unit's element of the weight or PAD, cut at the first code of
    another weight, as code_index and the weights' bases say, on either side of the sign."""
    rng = np.random.default_rng(4)
    shapes = {"big": (SPAN + 4,), "w": (5000,), "x": (300,)}
    bases = {"big": 0, "w": SPAN + 4, "x": SPAN + 5004}
    total = SPAN + 5304
    decoder = _Decoder(bases, shapes)
    for trial in range(60):
        key = ("big", "w", "x")[trial % 3]
        start, size = bases[key], shapes[key][0]
        lo = start if key != "big" else SPAN - 100  # big's around the sign
        own = lo + rng.permutation(min(size, 5000))[: rng.integers(1, 800)]
        edges = [c for c in (start - 1, start + size) if 0 <= c < total]  # the neighbours'
        other = np.concatenate([rng.integers(0, layout.CODES, 3), rng.choice(edges, 2)])
        units = np.concatenate([own, rng.permutation(other), own[:50]])
        words = np.where(units < SPAN, layout.CODE_BASE + units,
                         layout.SIGN + layout.CODE_BASE + units - SPAN).astype(np.uint32)  # fmt: skip
        words[rng.integers(0, len(words), 10)] = 0  # padding
        rel = code_index(words)
        is_own = (rel >= start) & (rel < start + size)
        foreign = np.flatnonzero(~is_own & (rel >= 0) & (rel < total))
        stop = int(foreign[0]) if len(foreign) else len(words)
        want = np.where(is_own, rel - start, -1)[:stop]
        got = decoder.elements(layout._Units([words.view(np.uint8)], 4), 0, len(words),
                               decoder.keys.index(key))  # fmt: skip
        np.testing.assert_array_equal(got, want)


def _narrow_runs(pieces, bases):
    """Two runs' coded output of a narrow encoder: (param, element indices or -1, dtype)
    pieces, each element's index as two base-CODES16 digits, in bf16 or float32 units."""
    runs = []
    for digit in (0, 1):
        out = []
        for k, e, dtype in pieces:
            idx = bases[k] + np.maximum(e, 0)
            u = code16_words(idx // layout.CODES16**digit % layout.CODES16)
            u = np.where(e >= 0, u, 0).astype(np.uint16)
            out.append(u.view(np.uint8) if dtype == "bf16" else
                       (u.astype(np.uint32) << 16).view(np.uint8))  # fmt: skip
        runs.append(np.concatenate(out))
    return runs


def test_a_narrow_encoders_bf16_and_float32_packs_are_found_from_two_digits(tmp_path):
    """bf16 contractions' encoders round what they pack to bf16, which keeps 16 bits of a
    code: coded twice, one base-CODES16 digit a run, each bf16 region is found in halves and
    a float32 one (a bias) in words, side by side without running on into each other; and
    each re-packs its weight as the encoder would (bf16 rounded to nearest even)."""
    # w [N=69990, K=4] packed as [N1, K1=2, N0=16, K0=2] (bf16 pairs), N padded to 70000
    shapes = {"b": (20,), "w": (69990, 4), "v": (4, 4)}
    bases = {"b": 0, "w": 20, "v": 20 + 69990 * 4}  # w's last codes need the high digit
    tiled = Region("w", 0, (69990, 4), ((0, 16, 4375), (1, 2, 2), (0, 1, 16), (1, 1, 2)))
    want = tiled.pack(np.arange(69990 * 4), fill=-1)
    shuffled = np.random.default_rng(0).permutation(16)
    shuffled[0] = 0
    pieces = [("b", np.arange(20), "f32"), ("w", want, "bf16"), ("v", shuffled, "bf16")]
    runs = _narrow_runs(pieces, bases)
    regions, failed, _ = learn_entry(runs[0], _Decoder(bases, shapes), shapes, coded2=runs[1])
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
    regions, failed, _ = learn_entry(_codes([("w", want)], bases), _Decoder(bases, shapes), shapes)
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
    decoder, decoded = _Decoder(bases, shapes), [0]
    plain = decoder.decode

    def counting(words):
        decoded[0] += len(words)
        return plain(words)

    decoder.decode = counting
    regions, failed, _ = learn_entry(coded, decoder, shapes)
    assert [r.param for r in regions] == ["w"] and failed == {"v", "u"}
    assert decoded[0] < 8 * len(coded) // 4


def test_more_elements_than_codes_learn_no_layout(compiled, monkeypatch, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    unet = Archive(art / "unet.irpa")
    n = sum(int(np.prod(e.shape)) for e in unet.entries.values() if e.dtype == np.float32)
    monkeypatch.setattr(layout, "CODES", n - 1)
    args = (art / "unet.encoder.vmfb", [art / "unet.irpa"], {}, art / "unet.encoded.irpa")
    learned = repack.learn_layout(*args, "unet", "unet_encoded", None, tmp_path / "work.irpa")
    assert learned is None and not list(tmp_path.iterdir())


def test_learning_past_its_budget_gives_up_as_incomplete(compiled, monkeypatch, tmp_path):
    """A layout that takes longer than $SDIREE_LAYOUT_BUDGET_S to learn is given up: an
    incomplete layout that covers nothing (so nothing is pruned by it and a LoRA runs the
    encoder), not a compile that runs for hours; its temp files removed. In budget, the same
    encoder's layout is complete (the text encoder's: no derived weights)."""
    from sdiree.runtime.weights.encoder import driver_device

    art = compiled.get("cpu", "host", "fp32")
    sub = load_manifest(art).submodules["text_encoder"]
    own = [art / p for p, s in sub.archives() if s == sub.scope]
    (encoded,) = [art / p for p, s in sub.archives() if s == sub.encoder.scope]
    args = (art / sub.encoder.vmfb, own, {}, encoded, sub.scope, sub.encoder.scope)
    device = driver_device("local-task")

    monkeypatch.setenv(layout.BUDGET_ENV, "0")
    learned = repack.learn_layout(*args, device, tmp_path / "work.irpa")
    params = {k for a in own for k in Archive(a).entries}
    assert learned.gave_up and not learned.complete and not learned.entries
    assert learned.unverified == params and not learned.covers([next(iter(params))])
    assert not list(tmp_path.iterdir())

    monkeypatch.setenv(layout.BUDGET_ENV, "3600")
    learned = repack.learn_layout(*args, device, tmp_path / "work.irpa")
    assert learned.complete and not learned.gave_up and learned.entries


def test_learn_entry_stops_at_its_deadline():
    shapes = {"w": (20, 3)}
    coded = _codes([("w", np.arange(60))], {"w": 0})
    regions, _, _ = learn_entry(coded, _Decoder({"w": 0}, shapes), shapes, deadline=1e18)
    assert [r.param for r in regions] == ["w"]
    with pytest.raises(layout.BudgetSpent):
        learn_entry(coded, _Decoder({"w": 0}, shapes), shapes, deadline=0.0)


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
    regions, failed, _ = learn_entry(coded, _Decoder(bases, shapes), shapes)
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
    regions, failed, _ = learn_entry(coded, _Decoder(bases, shapes), shapes)
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


def _image(art, overrides):
    m = load_manifest(art)
    info, _ = choose_device(m, None)
    req = resolve_request(m, GenerationRequest(prompt="a red boat", steps=3, seed=11))
    session = Session(m, info, Text2Image.SUBMODULES, overrides)
    return Text2Image(m, session).generate(req, progress=None).images


def _lora_like(art):
    """Attention, feed-forward and 3x3 conv weights of the UNet changed, as a LoRA does."""
    a = Archive(art / "unet.irpa")
    parts = ("attn1.to_q.weight", "attn2.to_k.weight", "ff.net.0.proj.weight", "conv1.weight")
    keys = [k for k in a.entries if k.endswith(parts)]
    rng = np.random.default_rng(5)
    changed = {}
    for k in keys:
        w = np.array(a.array(k))
        changed[k] = (w + 0.05 * rng.standard_normal(w.shape)).astype(w.dtype)
    return WeightOverrides({"unet": changed}, digest="")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_lora_repacked_in_numpy_makes_the_encoder_paths_image(
    compiled, monkeypatch, tmp_path, capsys, dtype
):
    """Also bf16 (its encoder packs weights in bf16, learned from two coded runs)."""
    art = (
        compiled.get(*laid_out_cpu_fp32())
        if dtype == "fp32"
        else compiled.get("cpu", "host", dtype)
    )
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(repack.SHARE_ENV, "1")  # this change is 47% of the tiny UNet's packs
    lora = _lora_like(art)
    monkeypatch.setenv(repack.REPACK_ENV, "0")
    encoded = _image(art, lora)
    assert "unet: encoding the replaced weights" in capsys.readouterr().err
    monkeypatch.setenv(repack.REPACK_ENV, "1")
    fast = _image(art, lora)
    err = capsys.readouterr().err
    assert "learning" not in err  # the layout was learned at compile
    assert "unet: re-packed" in err and "unet: encoding" not in err
    np.testing.assert_array_equal(fast, encoded)
    assert np.abs(fast - _image(art, None)).max() > 1e-3  # the change shows
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing written


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_compile_learns_each_lora_submodules_layout_and_the_runtime_the_same(
    compiled, monkeypatch, tmp_path, capsys, dtype
):
    """An artifact from before layouts were learned at compile (none in its manifest) learns
    the same layout at its first LoRA, once, into the user cache. bf16's too: complete, with
    bf16 packs where the CPU has bf16 ukernels (and the encoder then rounds to bf16)."""
    art = (
        compiled.get(*laid_out_cpu_fp32())
        if dtype == "fp32"
        else compiled.get("cpu", "host", dtype)
    )
    m = load_manifest(art)
    packs = set()
    for name in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        layout = Layout.load(m.path(m.submodules[name].encoder.layout))
        assert layout is not None and layout.complete and not layout.unverified, name
        packs |= {r.dtype for rs in layout.entries.values() for r in rs}
    assert packs == ({"f32"} if dtype == "fp32" else packs & {"f32", "bf16"})
    if dtype == "bf16" and "avx512_bf16" in host_cpu_features():
        assert "bf16" in packs
    old = tmp_path / "old"
    shutil.copytree(art, old)
    data = json.loads((old / "manifest.json").read_text())
    for sub in data["submodules"].values():
        if sub.get("encoder", {}).pop("layout", None):
            data["files"].pop(f"{sub['vmfb'][: -len('.vmfb')]}.layout.json")
    (old / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(repack.SHARE_ENV, "1")
    lora = _lora_like(art)
    fast = _image(old, lora)
    err = capsys.readouterr().err
    assert "unet: learning how the encoder packs" in err and "(complete, 0 weights not" in err
    learned = next((tmp_path / "cache" / repack.LAYOUT_CACHE).glob("unet-*.json"))
    assert Layout.load(learned).entries == Layout.load(art / "unet.layout.json").entries
    again = _image(old, lora)  # the layout now comes from the cache
    assert "learning" not in capsys.readouterr().err
    np.testing.assert_array_equal(again, fast)
    np.testing.assert_array_equal(fast, _image(art, lora))
    # one an older learner left there incomplete (bf16 before it read bf16 packs) is learned again
    stale = json.loads(learned.read_text())
    stale.pop("learner")
    learned.write_text(json.dumps({**stale, "complete": False}))
    np.testing.assert_array_equal(_image(old, lora), fast)
    assert "unet: learning how the encoder packs" in capsys.readouterr().err
    assert Layout.load(learned).complete and Layout.load(learned).learner == LEARNER_VERSION


def test_a_weight_whose_layout_did_not_verify_goes_through_the_encoder(
    compiled, monkeypatch, tmp_path, capsys
):
    art = compiled.get("cpu", "host", "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(repack.SHARE_ENV, "1")
    lora = _lora_like(art)
    learned = repack.layout_for

    def distrusted(*args):
        layout = learned(*args)
        layout.unverified.add(next(iter(lora.tensors["unet"])))
        return layout

    monkeypatch.setattr("sdiree.runtime.weights.overrides.layout_for", distrusted)
    fast_or_not = _image(art, lora)
    assert "does not cover, to re-pack; encoding" in capsys.readouterr().err
    monkeypatch.setenv(repack.REPACK_ENV, "0")
    np.testing.assert_array_equal(fast_or_not, _image(art, lora))


def test_a_change_past_the_share_goes_through_the_encoder(compiled, monkeypatch, tmp_path, capsys):
    art = compiled.get("cpu", "host", "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(repack.SHARE_ENV, "0.25")
    _image(art, _lora_like(art))
    err = capsys.readouterr().err
    assert "unet: too many weights" in err and "unet: encoded in" in err


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
    regions, failed, _ = learn_entry(coded, _Decoder(bases, shapes), shapes)
    assert not failed
    u = np.random.default_rng(0).standard_normal((taps, c, o)).astype(np.float32)
    got = np.concatenate([r.pack(u) for r in regions if r.param == "u"])
    np.testing.assert_array_equal(got, np.concatenate([u.reshape(-1)[p] for p in pieces[:3]]))
    # a run that starts inside a slice is no region of whole slices
    coded = _codes([("u", index[row + 1 :]), ("v", pieces[3])], bases)
    assert learn_entry(coded, _Decoder(bases, shapes), shapes)[1] == {"u"}
