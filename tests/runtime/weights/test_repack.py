"""runtime/weights/repack.py through the compiled tiny cpu artifact: the encoder's learned
layout (weights/layout.py, learned by layout_learn.py) is complete, a LoRA-like change
re-packed in numpy makes the image the encoder path makes, bit for bit, and a weight whose
layout did not verify, or a change past the share, sends the run to the encoder; a model past
the codes or past the learning budget learns no usable layout.
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
from sdiree.runtime.weights import layout_codes, layout_learn, repack
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.layout import LEARNER_VERSION, Layout
from sdiree.runtime.weights.overrides import WeightOverrides


def test_more_elements_than_codes_learn_no_layout(compiled, monkeypatch, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    unet = Archive(art / "unet.irpa")
    n = sum(int(np.prod(e.shape)) for e in unet.entries.values() if e.dtype == np.float32)
    monkeypatch.setattr(layout_codes, "CODES", n - 1)
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

    monkeypatch.setenv(layout_learn.BUDGET_ENV, "0")
    learned = repack.learn_layout(*args, device, tmp_path / "work.irpa")
    params = {k for a in own for k in Archive(a).entries}
    assert learned.gave_up and not learned.complete and not learned.entries
    assert learned.unverified == params and not learned.covers([next(iter(params))])
    assert not list(tmp_path.iterdir())

    monkeypatch.setenv(layout_learn.BUDGET_ENV, "3600")
    learned = repack.learn_layout(*args, device, tmp_path / "work.irpa")
    assert learned.complete and not learned.gave_up and learned.entries


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


def _without_layouts(art, old):
    """A copy of art as compiled before layouts were learned at compile: none in its manifest."""
    shutil.copytree(art, old)
    data = json.loads((old / "manifest.json").read_text())
    for sub in data["submodules"].values():
        if sub.get("encoder", {}).pop("layout", None):
            data["files"].pop(f"{sub['vmfb'][: -len('.vmfb')]}.layout.json")
    (old / "manifest.json").write_text(json.dumps(data))
    return old


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
    old = _without_layouts(art, tmp_path / "old")
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


def test_without_the_temp_disk_to_learn_a_layout_the_encoder_runs(
    compiled, monkeypatch, tmp_path, capsys
):
    """A LoRA on an artifact without a layout learns it into the user cache, which takes temp
    disk (coded copies of the encoded weights): with less free, the run says so and runs the
    encoder, for the same image, and learns nothing."""
    art = compiled.get(*laid_out_cpu_fp32())
    old = _without_layouts(art, tmp_path / "old")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(repack.SHARE_ENV, "1")
    monkeypatch.setattr(repack, "_free_bytes", lambda path: 1 << 20)
    lora = _lora_like(art)
    short = _image(old, lora)
    err = capsys.readouterr().err
    assert "unet: not learning how the encoder packs its weights: that takes ~" in err
    assert "unet: encoded in" in err and "learning how" not in err.replace("not learning how", "")
    assert not list((tmp_path / "cache" / repack.LAYOUT_CACHE).glob("unet-*.json"))
    np.testing.assert_array_equal(short, _image(art, lora))


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
