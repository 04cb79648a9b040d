"""tools/make_random_sd.py: SD 1.5, SD 2.1 and SDXL-architecture folders with random weights at
the real sizes (parameter counts checked on the meta device, nothing written), and narrowed
writes that sdiree recognises as their family and diffusers loads tensor for tensor."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import make_random_sd  # noqa: E402  (tools/ is on sys.path: tests/conftest.py)

# The released models' parameter counts (diffusers/transformers classes), as published for
# runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1 and
# stabilityai/stable-diffusion-xl-base-1.0.
REAL_COUNTS = {
    "sd15": {"unet": 859_520_964, "text_encoder": 123_060_480, "vae": 83_653_863},
    "sd21": {"unet": 865_910_724, "text_encoder": 340_387_840, "vae": 83_653_863},
    "sdxl": {
        "unet": 2_567_463_684,
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
        "vae": 83_653_863,
    },
}
SDIREE_FAMILY = {"sd15": "sd1", "sd21": "sd2", "sdxl": "sdxl"}
PIPELINES = {
    "sd15": "StableDiffusionPipeline",
    "sd21": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
}
NARROW = 16  # every width / 16: the real depth, a few MB of weights


@pytest.mark.parametrize("family", sorted(REAL_COUNTS))
def test_full_size_parameter_counts_are_the_real_models(family):
    assert make_random_sd.parameter_counts(family) == REAL_COUNTS[family]


@pytest.mark.parametrize("family", sorted(REAL_COUNTS))
def test_narrowed_write_is_its_family_and_loads_in_diffusers(tmp_path, family):
    import diffusers
    import torch
    from safetensors.torch import load_file

    from sdiree.compile.model_source import open_model
    from sdiree.runtime.tokenizer import ClipTokenizer

    out = make_random_sd.make_random_sd(tmp_path / family, family=family, narrow=NARROW)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    source = open_model(out)
    assert source.family.name == make_random_sd.FAMILIES[family][1] == SDIREE_FAMILY[family]
    index, configs = make_random_sd.read_preset(family, NARROW)
    assert source.index["_class_name"] == PIPELINES[family]

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(out, local_files_only=True)
    for comp in make_random_sd.WEIGHTED:
        if comp not in index:
            continue
        module = getattr(pipe, comp)
        fname = make_random_sd.WEIGHT_FILES[index[comp][0]]
        written = load_file(out / comp / fname)
        loaded = module.state_dict()
        assert written.keys() == loaded.keys(), comp
        for key, tensor in written.items():
            assert tensor.dtype == torch.float32
            # transformers loads the config's torch_dtype (SDXL's text encoders: float16)
            assert torch.equal(loaded[key], tensor.to(loaded[key].dtype)), key
        # a layer left uninitialised (to_empty's garbage) or all-zero would show here
        assert all(torch.isfinite(t).all() for t in written.values()), comp
        weight = next(t for k, t in written.items() if k.endswith("weight") and t.dim() == 2)
        assert weight.std() > 0, comp
        written_config = json.loads((out / comp / "config.json").read_text())
        assert written_config == configs[comp], comp  # the preset's, as it is

    for te in source.family.text_encoders:
        tok = ClipTokenizer.from_dir(out / te["tokenizer"])
        ids = tok.encode("a lighthouse at dusk").ids
        assert ids[0] == 49406 and 49407 in ids and max(ids) == 49407
    pads = {
        comp: pipe.components[comp].pad_token for comp in pipe.components if "tokenizer" in comp
    }
    expected = {"sd15": {"tokenizer": "<|endoftext|>"}, "sd21": {"tokenizer": "!"}}.get(
        family, {"tokenizer": "<|endoftext|>", "tokenizer_2": "!"}
    )
    assert pads == expected


def test_fp16_writes_the_same_weights_in_half_precision(tmp_path):
    import torch
    from safetensors.torch import load_file

    fp32 = make_random_sd.make_random_sd(tmp_path / "a", family="sdxl", narrow=NARROW, seed=3)
    fp16 = make_random_sd.make_random_sd(
        tmp_path / "b", family="sdxl", narrow=NARROW, seed=3, dtype="fp16"
    )
    for comp, fname in (
        ("unet", "diffusion_pytorch_model.safetensors"),
        ("text_encoder_2", "model.safetensors"),
    ):
        full, half = load_file(fp32 / comp / fname), load_file(fp16 / comp / fname)
        assert full.keys() == half.keys()
        for key in full:
            assert half[key].dtype == torch.float16
            assert torch.equal(half[key], full[key].to(torch.float16)), key
    for comp in make_random_sd.WEIGHTED:
        assert (fp16 / comp / "config.json").read_bytes() == (
            fp32 / comp / "config.json"
        ).read_bytes()


def test_diffusers_components_are_written_one_layer_at_a_time():
    """The memory bound that lets SDXL's UNet be written in little RAM: while the layer-wise
    stream runs, at most one layer's tensors are off the meta device."""
    index, configs = make_random_sd.read_preset("sdxl", NARROW)
    unet = make_random_sd.build(index, "unet", configs["unet"], "meta")
    names = list(unet.state_dict())
    layers = [m for m in unet.modules() if list(m.parameters(recurse=False))]
    seen = 0
    for _ in make_random_sd._layerwise_tensors(unet, names):
        live = [m for m in layers if not next(m.parameters(recurse=False)).is_meta]
        assert len(live) == 1
        seen += 1
    assert seen == len(names)
    assert all(p.is_meta for p in unet.parameters())


def test_narrowing_refuses_a_width_it_does_not_divide():
    with pytest.raises(ValueError, match="not divisible by 3"):
        make_random_sd.read_preset("sd15", 3)


def test_make_sd15_random_is_the_sd15_family(monkeypatch, tmp_path):
    import make_sd15_random

    calls = []
    monkeypatch.setattr(make_random_sd, "make_random_sd", lambda *a, **k: calls.append((a, k)))
    assert make_sd15_random.main([str(tmp_path / "m"), "--seed", "5"]) == 0
    assert calls == [((tmp_path / "m",), {"family": "sd15", "seed": 5, "dtype": "fp32"})]


@pytest.mark.parametrize("script", ["make_random_sd.py", "make_sd15_random.py"])
def test_scripts_run_from_anywhere(tmp_path, script):
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(make_random_sd.__file__).parent
    proc = subprocess.run(
        [sys.executable, str(tools / script), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--dtype" in proc.stdout and ("--family" in proc.stdout) == (
        script == "make_random_sd.py"
    )
