"""Model families at compile time: the family is read from the model folder before anything
else, a folder sdiree does not compile (another family, or parts of several) is refused in one
line with nothing written, and the family is what the compile plan and manifest carry.
The refused folders are fakes: model_index.json and configs, no weights."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sdiree.compile.model_source import open_model
from sdiree.runtime.errors import UserError

SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "force_zeros_for_empty_prompt": True,  # a bool entry: once a traceback in model_source
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
}
SDXL_UNET = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": 128,
    "in_channels": 4,
    "cross_attention_dim": 2048,
    "addition_embed_type": "text_time",
    "projection_class_embeddings_input_dim": 2816,
    "use_linear_projection": True,
}
CLIP_L = {"hidden_act": "quick_gelu", "hidden_size": 768, "max_position_embeddings": 77}


def fake_folder(root: Path, index: dict, configs: dict) -> Path:
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(index))
    for comp, cfg in configs.items():
        (root / comp).mkdir()
        name = "scheduler_config.json" if comp == "scheduler" else "config.json"
        (root / comp / name).write_text(json.dumps(cfg))
    return root


def sdxl(tmp_path, **index_changes):
    index = {k: v for k, v in {**SDXL_INDEX, **index_changes}.items() if v is not None}
    return fake_folder(
        tmp_path / "sdxl",
        index,
        {"unet": SDXL_UNET, "text_encoder": CLIP_L, "scheduler": {"prediction_type": "epsilon"}},
    )


REFUSED = {
    # an SDXL pipeline without its second text encoder
    "sdxl": (
        lambda p: sdxl(p, text_encoder_2=None, tokenizer_2=None),
        "model_index.json lists no 'text_encoder_2'; an SDXL model needs one",
    ),
    "sd3": (
        lambda p: fake_folder(
            p / "sd3",
            {
                "_class_name": "StableDiffusion3Pipeline",
                "transformer": ["diffusers", "SD3Transformer2DModel"],
                "text_encoder_3": ["transformers", "T5EncoderModel"],
            },
            {"transformer": {"sample_size": 128}},
        ),
        "StableDiffusion3Pipeline, Stable Diffusion 3",
    ),
    "flux": (
        lambda p: fake_folder(
            p / "flux",
            {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
            {},
        ),
        "FluxPipeline, Flux",
    ),
    "upscaler": (
        lambda p: fake_folder(
            p / "up",
            {"_class_name": "StableDiffusionUpscalePipeline", "unet": ["diffusers", "U"]},
            {"unet": {"in_channels": 7}},
        ),
        "the Stable Diffusion x4 upscaler",
    ),
    "controlnet": (
        lambda p: fake_folder(
            p / "cn",
            {
                "_class_name": "StableDiffusionControlNetPipeline",
                "controlnet": ["diffusers", "ControlNetModel"],
            },
            {},
        ),
        "a ControlNet pipeline",
    ),
    # an SDXL UNet in an SD pipeline with one text encoder
    "mixed": (
        lambda p: sdxl(
            p,
            _class_name="StableDiffusionPipeline",
            text_encoder_2=None,
            tokenizer_2=None,
            force_zeros_for_empty_prompt=None,
        ),
        "mixes model families: model_index.json names StableDiffusionPipeline (SD 1.x or "
        'SD 2.x); unet/config.json looks like SDXL (addition_embed_type "text_time"',
    ),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_folders_are_one_line(tmp_path, kind):
    make, says = REFUSED[kind]
    with pytest.raises(UserError) as info:
        open_model(make(tmp_path))
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["sdxl", "mixed", "flux"])
def test_compile_refuses_before_writing_anything(tmp_path, kind):
    make, says = REFUSED[kind]
    model = make(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(model), "--target", "cpu"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SDIREE_CACHE": str(cache)},
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists() and not cache.exists()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_tiny_models_are_detected(tiny_model, tiny_sd2_model):
    assert open_model(tiny_model).family.name == "sd1"
    sd2 = open_model(tiny_sd2_model)
    assert sd2.family.name == "sd2"
    unet, te = sd2.config("unet"), sd2.config("text_encoder")
    # the SD 2.1 architecture features the tiny model must have
    assert unet["use_linear_projection"] and unet["upcast_attention"]
    assert isinstance(unet["attention_head_dim"], list) and len(set(unet["attention_head_dim"])) > 1
    assert te["hidden_act"] == "gelu"
    sched = sd2.config("scheduler")
    assert sched["prediction_type"] == "v_prediction" and sched["timestep_spacing"] == "leading"
    assert sched["steps_offset"] == 1
    tok = json.loads((tiny_sd2_model / "tokenizer" / "special_tokens_map.json").read_text())
    assert tok["pad_token"] == "!"  # OpenCLIP's padding


def test_a_unet_of_the_wrong_class_is_refused(tiny_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["unet"] = ["diffusers", "UNet2DModel"]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="'unet' is a UNet2DModel, but an SD 1.x model has a "):
        open_model(copy)


def test_a_prediction_type_the_family_does_not_use_is_refused(tiny_sd2_model, tmp_path):
    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    copy = tmp_path / "m"
    shutil.copytree(tiny_sd2_model, copy)
    path = copy / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "prediction_type": "flow"}))
    with pytest.raises(UserError, match="prediction_type 'flow' is not one an SD 2.x model uses"):
        resolve(CompileOptions(copy, "cpu", out=tmp_path / "out"), Reporter(stream=io.StringIO()))
    assert not (tmp_path / "out").exists()


def test_plan_carries_the_family_and_sd2_default_size(tiny_sd2_model, tmp_path):
    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    plan = resolve(
        CompileOptions(tiny_sd2_model, "cpu", out=tmp_path / "o"), Reporter(stream=io.StringIO())
    )
    assert plan.family.name == "sd2" and (plan.height, plan.width) == (64, 64)
    assert plan.submodules == tuple(plan.family.submodules)


def test_registry_submodules_are_what_the_exporters_make(
    tiny_model, tiny_sd2_model, tiny_sdxl_model
):
    """The family entries declare what compile/exporters build: the same component per
    submodule, and shape sources that are keys of the tiny models' configs."""
    from sdiree.compile.exporters import COMPONENTS
    from sdiree.runtime.families import load_families

    for model in (tiny_model, tiny_sd2_model, tiny_sdxl_model):
        source = open_model(model)
        fam = source.family
        assert {s: d["component"] for s, d in fam.submodules.items()}.items() <= COMPONENTS.items()
        for shape, where in fam.shapes.items():
            comp, key = where.split(".")
            assert key in source.config(comp), (fam.name, shape, where)
    assert all(f.supported for f in load_families().families.values())
