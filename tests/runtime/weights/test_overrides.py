"""runtime/weights/overrides.py: replaced tensors load in place of an artifact's own.

Through a compiled tiny artifact: the artifact's own weights given as replacements make the
image they make without (the cpu target re-encodes them with its kept encoder, and derives its
Winograd weights again); other weights change it, are encoded once and then read from the cache;
and an artifact without a kept encoder is refused in one line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sdiree.runtime.device_select import choose_device
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.session import Session
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.overrides import WeightOverrides

SCOPES = ("text_encoder", "unet", "vae")


def _generate(art, overrides=None):
    m = load_manifest(art)
    info, _ = choose_device(m, None)
    req = resolve_request(m, GenerationRequest(prompt="a red boat", steps=3, seed=11))
    session = Session(m, info, Text2Image.SUBMODULES, overrides)
    return Text2Image(m, session).generate(req, progress=None).images


def _own_weights(art, scale=1.0):
    out = {}
    for scope in SCOPES:
        a = Archive(art / f"{scope}.irpa")
        out[scope] = {
            k: (np.array(a.array(k)) * np.float32(scale)).astype(e.dtype)
            if e.dtype.kind == "f"
            else np.array(a.array(k))
            for k, e in a.entries.items()
        }
    return out


@pytest.mark.parametrize(
    "target,arch", [("cpu", "host"), ("vulkan-spirv", "lavapipe")], ids=["cpu", "lavapipe"]
)
def test_own_weights_as_replacements_make_the_same_image(
    compiled, target, arch, monkeypatch, tmp_path
):
    art = compiled.get(target, arch, "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    base = _generate(art)
    same = _generate(art, WeightOverrides(_own_weights(art), digest=""))
    # cpu: Winograd F(4x4) weights derived in numpy may differ from the export's in the last
    # bit, grown over 3 steps and the decode (1.003e-5 seen in CI): 1e-4 is still 40x under an
    # 8-bit pixel step and 10x under what a 2 % change of the weights does (next test)
    assert np.abs(same - base).max() < 1e-4
    assert not list((tmp_path / "cache").rglob("*.irpa"))  # a digest-less set is not cached


def test_other_weights_change_the_image_and_are_encoded_once(
    compiled, monkeypatch, tmp_path, capsys
):
    art = compiled.get("cpu", "host", "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    base = _generate(art)
    other = WeightOverrides(_own_weights(art, scale=1.02), digest="scaled-1.02")
    first = _generate(art, other)
    assert np.abs(first - base).max() > 1e-3
    assert "encoding the replaced weights" in capsys.readouterr().err
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.encoded.irpa"))
    assert cached == ["text_encoder.encoded.irpa", "unet.encoded.irpa", "vae_decoder.encoded.irpa"]
    again = _generate(art, other)
    assert "from the cache" in capsys.readouterr().err
    np.testing.assert_array_equal(again, first)
    # a third set of weights pushes the least recently used one out (2 sets are kept)
    for scale in (1.03, 1.04):
        _generate(art, WeightOverrides(_own_weights(art, scale=scale), digest=f"scaled-{scale}"))
    assert len([d for d in (tmp_path / "cache" / "encoded").iterdir() if d.is_dir()]) == 2


def test_only_the_replaced_scope_is_reencoded(compiled, monkeypatch, tmp_path, capsys):
    art = compiled.get("cpu", "host", "fp32")
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    unet_only = {"unet": _own_weights(art, scale=1.02)["unet"]}
    _generate(art, WeightOverrides(unet_only, digest="unet-only"))
    err = capsys.readouterr().err
    assert "unet: encoding" in err and "text_encoder: encoding" not in err
    assert "vae_decoder: encoding" not in err


def test_an_artifact_without_its_encoders_is_refused(compiled, tmp_path):
    art = tmp_path / "old"
    shutil.copytree(compiled.get("cpu", "host", "fp32"), art)
    data = json.loads((art / "manifest.json").read_text())
    for sub in data["submodules"].values():
        enc = sub.pop("encoder", None)
        if enc:
            data["files"].pop(enc["vmfb"])
    (art / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="did not keep its parameter encoders.*recompile"):
        _generate(art, WeightOverrides({"unet": _own_weights(art)["unet"]}, digest=""))


def test_cuda_channels_last_filters_are_derived_from_replaced_weights(compiled, monkeypatch):
    """cuda's UNet reads its convs' filters channels-last from a derived archive
    (`<conv>.weight_fhwc`, compile/exporters/fhwc.py): a replaced conv weight (--weights, a
    LoRA) serves its own filter there, transposed from the new weight; an untouched one is read
    from the artifact. (The index is built without a device: nothing of cuda's runs here.)"""
    from sdiree.runtime.weights import overrides

    art = compiled.get("cuda", "sm_80", "fp16")
    m = load_manifest(art)
    own = Archive(art / "unet.irpa")
    new = {
        k: (np.array(own.array(k)) * np.float16(-2)).astype(np.float16)
        for k in ("conv_in.weight", "down_blocks.0.resnets.0.conv1.weight")
    }
    served: dict[str, np.ndarray] = {}
    real = overrides._add_array
    monkeypatch.setattr(
        overrides,
        "_add_array",
        lambda i, k, a, keep: (served.__setitem__(k, a), real(i, k, a, keep)),
    )
    loaded = overrides.LoadedWeights(m, ("unet",), WeightOverrides({"unet": new}), device=None)
    for k, w in new.items():
        np.testing.assert_array_equal(served[k + "_fhwc"], w.transpose(0, 2, 3, 1))
    assert "down_blocks.0.resnets.0.conv2.weight_fhwc" not in served
    keys = {k for k, _ in loaded.indices["unet"].items()}
    assert "down_blocks.0.resnets.0.conv2.weight_fhwc" in keys and "conv_in.weight_fhwc" in keys
