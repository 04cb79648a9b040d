"""The LDM-layout renaming gives back exactly the diffusers folder a single file was made from
(tools/to_single_file.py, itself checked against diffusers' from_single_file in
tests/compile/test_single_file.py), as views, in the file's dtype."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime.checkpoints.ldm_layout import convert, layers_per_block

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from to_single_file import to_ldm  # noqa: E402

safetensors_numpy = pytest.importorskip("safetensors.numpy")
WEIGHTS = {
    "unet": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
}


def folder_tensors(model: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for comp, name in WEIGHTS.items():
        sd = safetensors_numpy.load_file(str(model / comp / name))
        if comp == "text_encoder":  # either transformers layout: compare without the prefix
            sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
        out[comp] = sd
    return out


def text_layers(model: Path) -> int:
    return json.loads((model / "text_encoder" / "config.json").read_text())["num_hidden_layers"]


def assert_same(converted: dict, want: dict, cast=None) -> None:
    for comp, tensors in want.items():
        got = converted[comp]
        assert set(got) == set(tensors), (comp, sorted(set(got) ^ set(tensors))[:5])
        for k, v in tensors.items():
            v = v if cast is None else v.astype(cast)
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, (comp, k)
            assert np.array_equal(got[k], v), (comp, k)


@pytest.mark.parametrize("which", ["sd1", "sd2"])
def test_converts_back_to_the_folder_exactly(which, tiny_model, tiny_sd2_model):
    model = tiny_model if which == "sd1" else tiny_sd2_model
    ldm = to_ldm(model)
    conv = convert(ldm, text_layers=text_layers(model))
    assert conv.text_encoder == ("clip" if which == "sd1" else "open_clip")
    assert not conv.unknown and not conv.other and not conv.ema
    assert_same(conv.components, folder_tensors(model))
    assert "betas" in conv.ignored  # the DDPM buffers a pruned file keeps


def test_tensors_are_views_of_the_file(tiny_sd2_model):
    ldm = to_ldm(tiny_sd2_model)
    conv = convert(ldm)
    unet = conv.components["unet"]
    assert np.shares_memory(
        unet["conv_in.weight"], ldm["model.diffusion_model.input_blocks.0.0.weight"]
    )
    fused = ldm["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"]
    te = conv.components["text_encoder"]
    for n, part in enumerate("qkv"):
        q = te[f"encoder.layers.0.self_attn.{part}_proj.weight"]
        assert np.shares_memory(q, fused)
        d = fused.shape[0] // 3
        assert np.array_equal(q, fused[n * d : (n + 1) * d])
    vae_q = conv.components["vae"]["encoder.mid_block.attentions.0.to_q.weight"]
    assert vae_q.ndim == 2  # the 1x1 convolution as a linear weight
    assert np.shares_memory(vae_q, ldm["first_stage_model.encoder.mid.attn_1.q.weight"])


def test_open_clip_extra_layer_kept_or_dropped(tiny_sd2_model):
    ldm = to_ldm(tiny_sd2_model)
    n = text_layers(tiny_sd2_model)
    kept = convert(ldm).components["text_encoder"]
    assert f"encoder.layers.{n}.mlp.fc1.weight" in kept  # OpenCLIP-H's last layer
    conv = convert(ldm, text_layers=n)
    assert f"encoder.layers.{n}.mlp.fc1.weight" not in conv.components["text_encoder"]
    dropped = [k for k in conv.ignored if k.startswith("cond_stage_model.model.")]
    assert f"cond_stage_model.model.transformer.resblocks.{n}.mlp.c_fc.weight" in dropped
    assert "cond_stage_model.model.text_projection" in dropped


def test_ema_weights_only_when_asked(tiny_model):
    ldm = to_ldm(tiny_model, variant="full-ema")
    assert sum(k.startswith("model_ema.") for k in ldm) > 100
    want = folder_tensors(tiny_model)
    plain = convert(ldm)
    assert not plain.ema
    assert_same(plain.components, want)  # as diffusers' from_single_file: the non-EMA UNet
    ema = convert(ldm, use_ema=True)
    assert ema.ema
    unet = ema.components["unet"]
    for k, v in want["unet"].items():
        assert np.array_equal(unet[k], v + np.float32(0.01)), k


def test_fp16_file_stays_fp16(tiny_model):
    conv = convert(to_ldm(tiny_model, fp16=True))
    assert_same(conv.components, folder_tensors(tiny_model), cast=np.float16)


def test_unknown_and_other_keys_are_reported(tiny_model):
    ldm = to_ldm(tiny_model, variant="bare")
    ldm["model.diffusion_model.input_blocks.1.7.weird.weight"] = np.zeros(1, np.float32)
    ldm["first_stage_model.encoder.mystery.weight"] = np.zeros(1, np.float32)
    ldm["cond_stage_model.transformer.text_model.extra.weight"] = np.zeros(1, np.float32)
    ldm["something_else"] = np.zeros(1, np.float32)
    conv = convert(ldm)
    assert sorted(conv.unknown) == sorted(
        [
            "model.diffusion_model.input_blocks.1.7.weird.weight",
            "first_stage_model.encoder.mystery.weight",
            "cond_stage_model.transformer.text_model.extra.weight",
        ]
    )
    assert conv.other == ["something_else"]


def test_layers_per_block_from_keys():
    keys = [f"input_blocks.{i}.0.in_layers.0.weight" for i in range(1, 12)]
    keys += [
        "input_blocks.3.0.op.weight",
        "input_blocks.6.0.op.weight",
        "input_blocks.9.0.op.weight",
    ]
    assert layers_per_block(keys) == 2  # SD's num_res_blocks
    assert layers_per_block(["input_blocks.1.0.x", "input_blocks.2.0.op.weight"]) == 1
