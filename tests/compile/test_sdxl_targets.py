"""The tiny SDXL on all four targets: the manifest carries the family's recipe (two text
encoders with penultimate hidden states, the UNet's text_embeds and time_ids, the VAE's
precision), cpu and lavapipe modules match torch (`verify`), rocm and cuda fp16 compile and
load with the VAE upcast to fp32; and what SDXL folders get wrong is refused in one line."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from test_sd2_targets import assert_gpu_modules_load, assert_modules_match_torch

from sdiree.compile.plan import CompileOptions, resolve
from sdiree.compile.report import Reporter
from sdiree.runtime.errors import UserError
from sdiree.runtime.families import load_families
from sdiree.runtime.manifest import check_files, load_manifest

SUBMODULES = {"text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder"}


def sdxl_manifest(out, target, dtype):
    m = load_manifest(out)
    check_files(m)
    d = m.data
    assert (m.family, m.pipeline, d["model"]["pipeline_class"]) == (
        "sdxl",
        "text2img",
        "StableDiffusionXLPipeline",
    )
    assert (d["target"]["name"], d["dtype"]) == (target, dtype)
    assert set(m.submodules) == SUBMODULES
    assert [(te["submodule"], te["tokenizer"], te["pooled"]) for te in d["text_encoders"]] == [
        ("text_encoder", "tokenizer", "pooled_output"),
        ("text_encoder_2", "tokenizer_2", "text_embeds"),
    ]
    assert all(te["hidden_states"] == "penultimate" for te in d["text_encoders"])
    # transformers pools the second (eos_token_id 2) at the largest id; the first at its EOS
    assert [te.get("pooled_at") for te in d["text_encoders"]] == [None, "largest_id"]
    assert "tokenizer_2/vocab.json" in d["files"]
    assert d["conditioning"] == {
        "text_embeds": "text_encoder_2",
        "time_ids": ["original_size", "crops_coords_top_left", "target_size"],
        "zero_empty_negative": True,
    }
    assert d["vae_scaling"]["factor"] == 0.13025
    family = load_families().family("sdxl")
    for name, sub in m.submodules.items():
        assert list(sub.functions) == family.submodules[name]["functions"], name
    unet = m.submodules["unet"].functions
    # the two encoders' widths together, the pooled projection, six ids; both halves at once
    assert [(t.name, t.shape) for t in unet["denoise_cfg"].inputs[2:]] == [
        ("encoder_hidden_states", (2, 77, 64)),
        ("text_embeds", (2, 16)),
        ("time_ids", (2, 6)),
    ]
    assert unet["denoise"].inputs[0].shape[0] == unet["denoise_cfg"].inputs[0].shape[0] == 1
    return m


@pytest.mark.parametrize(
    "target,arch,dtype", [("cpu", "host", "fp32"), ("vulkan-spirv", "lavapipe", "fp32")]
)
def test_sdxl_modules_match_torch(compiled_sdxl, target, arch, dtype):
    out = compiled_sdxl.get(target, arch, dtype)
    m = sdxl_manifest(out, target, dtype)
    assert m.data["vae_precision"] == {
        "dtype": "fp32",
        "upcast": False,
        "config": {"force_upcast": True},
    }
    assert_modules_match_torch(out, dtype, SUBMODULES)


@pytest.mark.parametrize(
    "target,arch,dtype", [("rocm", "gfx942", "fp16"), ("cuda", "sm_80", "fp16")]
)
def test_sdxl_gpu_targets_compile_and_load_with_an_fp32_vae(compiled_sdxl, target, arch, dtype):
    m = sdxl_manifest(compiled_sdxl.get(target, arch, dtype), target, dtype)
    # force_upcast: the VAE computes in fp32 in the fp16 build, everything else in fp16
    assert m.data["vae_precision"] == {
        "dtype": "fp32",
        "upcast": True,
        "config": {"force_upcast": True},
    }
    for name, sub in m.submodules.items():
        want = "float32" if name.startswith("vae") else "float16"
        for fn in sub.functions.values():
            floats = {t.dtype for t in fn.inputs if t.dtype.startswith("float")} - {"float32"}
            assert floats <= {want} and (want == "float32") == (not floats), (name, fn.name)
    assert_gpu_modules_load(m, target)


def _resolve(model, tmp_path, **kw):
    said = io.StringIO()
    plan = resolve(
        CompileOptions(model_dir=model, out=tmp_path / "out", **kw), Reporter(stream=said)
    )
    return plan, said.getvalue()


def test_vae_precision_is_decided_and_said_before_anything_is_written(tiny_sdxl_model, tmp_path):
    plan, said = _resolve(tiny_sdxl_model, tmp_path, target="rocm")
    assert plan.dtype == "fp16" and plan.vae_upcast
    assert plan.submodule_export_dtype("vae_decoder") == "fp32"
    assert plan.submodule_export_dtype("unet") == "fp16"
    assert "VAE: compiled in fp32, not fp16" in said and "force_upcast" in said
    assert plan.submodules == tuple(load_families().family("sdxl").submodules)
    plan, said = _resolve(tiny_sdxl_model, tmp_path, target="cpu")  # fp32: nothing to decide
    assert not plan.vae_upcast and "VAE:" not in said
    assert not (tmp_path / "out").exists()


def test_an_fp16_safe_vae_stays_fp16(tiny_sdxl_model, tmp_path):
    model = tmp_path / "fp16-fix"
    shutil.copytree(tiny_sdxl_model, model)
    cfg_path = model / "vae" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "force_upcast": False}))
    plan, said = _resolve(model, tmp_path, target="rocm")
    assert plan.dtype == "fp16" and not plan.vae_upcast
    assert plan.submodule_export_dtype("vae_encoder") == "fp16"
    assert "VAE: compiled in fp16 (vae/config.json force_upcast: false" in said


def test_sd1_vae_is_never_upcast(tiny_model, tmp_path):
    plan, said = _resolve(tiny_model, tmp_path, target="rocm")
    assert plan.dtype == "fp16" and not plan.vae_upcast and "VAE:" not in said


def _one_line(model, tmp_path, *args) -> str:
    """The UserError `sdiree compile` prints for these options (its CLI is tested on the same
    refusals in test_families.py); resolve() writes nothing."""
    out = tmp_path / "art"
    opts = dict(zip(args[::2], args[1::2], strict=True))
    with pytest.raises(UserError) as info:
        resolve(
            CompileOptions(model_dir=model, target="cpu", out=out, **opts),
            Reporter(stream=io.StringIO()),
        )
    assert not out.exists()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_an_sdxl_unet_with_one_text_encoder_is_refused_before_export(tiny_sdxl_model, tmp_path):
    model = tmp_path / "mixed"
    shutil.copytree(tiny_sdxl_model, model)
    index = json.loads((model / "model_index.json").read_text())
    for part in ("text_encoder_2", "tokenizer_2"):
        index.pop(part)
        shutil.rmtree(model / part)
    index["_class_name"] = "StableDiffusionPipeline"
    (model / "model_index.json").write_text(json.dumps(index))
    msg = _one_line(model, tmp_path)
    assert "mixes model families" in msg and "text_time" in msg and "1 text encoder" in msg
    # named an SDXL pipeline, it lacks the second encoder
    index["_class_name"] = "StableDiffusionXLPipeline"
    (model / "model_index.json").write_text(json.dumps(index))
    msg = _one_line(model, tmp_path)
    assert "lists no 'text_encoder_2'" in msg and "SDXL" in msg


def test_a_size_sdxl_cannot_use_is_one_line(tiny_sdxl_model, tmp_path):
    msg = _one_line(tiny_sdxl_model, tmp_path, "height", 100)
    assert "--height 100" in msg and "multiple of 8" in msg and "SDXL" in msg


def test_sdxl_folder_is_read_without_a_traceback(tiny_sdxl_model, tmp_path):
    """model_index.json's force_zeros_for_empty_prompt (a bool among the [library, class]
    pairs) is an option, not a component."""
    from sdiree.compile.model_source import open_model

    model = open_model(tiny_sdxl_model)
    assert model.family.name == "sdxl"
    assert model.index["force_zeros_for_empty_prompt"] is True
    assert "force_zeros_for_empty_prompt" not in model.components()
    with pytest.raises(UserError):  # and a broken second encoder config is one line too
        bad = tmp_path / "bad-te2"
        shutil.copytree(tiny_sdxl_model, bad)
        (bad / "text_encoder_2" / "config.json").write_text("{}")
        resolve(CompileOptions(model_dir=bad, target="cpu"), Reporter(stream=io.StringIO()))


def test_a_second_encoder_of_another_width_is_one_line(tiny_sdxl_model, tmp_path):
    model = tmp_path / "other-te2"
    shutil.copytree(tiny_sdxl_model, model)
    cfg_path = model / "text_encoder_2" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "projection_dim": 24}))
    msg = _one_line(model, tmp_path)
    assert "projection_class_embeddings_input_dim 64" in msg and "projection_dim 24" in msg
