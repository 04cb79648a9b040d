"""compile/model_source: the configs resolve() reads come back checked, and model_index.json
entries that are not components are tolerated. (Bad folders through the CLI:
tests/compile/test_cli_errors.py.)"""

from __future__ import annotations

import json
import shutil

import pytest

from sdiree.compile.model_source import REQUIRED, check_config, open_model
from sdiree.runtime.errors import UserError


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def test_configs_of_a_good_model_are_returned(tiny_model):
    model = open_model(tiny_model)
    configs = {c: model.config(c) for c in ("unet", "vae", "text_encoder", "scheduler")}
    assert configs["unet"]["sample_size"] == 8
    assert len(configs["vae"]["block_out_channels"]) == 4
    assert configs["scheduler"]["num_train_timesteps"] == 1000


@pytest.mark.parametrize(
    "component,key,value,says",
    [
        ("vae", "block_out_channels", 5, "a non-empty list of positive integers"),
        ("vae", "block_out_channels", [], "a non-empty list of positive integers"),
        ("vae", "block_out_channels", [16, "32"], "a non-empty list of positive integers"),
        ("vae", "scaling_factor", float("nan"), "a finite number"),
        ("unet", "sample_size", "64", "a positive integer"),
        ("unet", "sample_size", True, "a positive integer"),
        ("unet", "sample_size", [64, 64], "a positive integer"),
        ("unet", "in_channels", 0, "a positive integer"),
        ("unet", "cross_attention_dim", None, "a positive integer"),
        ("text_encoder", "hidden_size", 32.5, "a positive integer"),
        ("text_encoder", "max_position_embeddings", -77, "a positive integer"),
        ("scheduler", "num_train_timesteps", "1000", "a positive integer"),
        ("scheduler", "beta_schedule", 1, "a string"),
    ],
)
def test_mistyped_config_key(tiny_model, component, key, value, says):
    good = open_model(tiny_model).config(component)
    with pytest.raises(UserError) as info:
        check_config({**good, key: value}, component, tiny_model / component / "config.json")
    assert f"'{key}' is " in str(info.value) and f"must be {says}" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "component,key",
    [("unet", "sample_size"), ("unet", "in_channels"), ("vae", "block_out_channels")]
    + [("text_encoder", "hidden_size"), ("unet", "cross_attention_dim")],
)
def test_missing_config_key(model_copy, component, key):
    path = model_copy / component / "config.json"
    data = json.loads(path.read_text())
    del data[key]
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=f"config.json has no '{key}'"):
        open_model(model_copy).config(component)


def test_optional_keys_may_be_absent(model_copy):
    """Older SD 1.x VAE configs have no scaling_factor; the manifest then uses SD's 0.18215."""
    path = model_copy / "vae" / "config.json"
    data = json.loads(path.read_text())
    del data["scaling_factor"]
    path.write_text(json.dumps(data))
    assert "scaling_factor" not in open_model(model_copy).config("vae")


def test_non_component_entries_are_tolerated(model_copy):
    index_path = model_copy / "model_index.json"
    index = json.loads(index_path.read_text())
    before = open_model(model_copy).content_hash()
    index.update(
        force_zeros_for_empty_prompt=True, requires_safety_checker=False, image_processor="x"
    )
    index["feature_extractor"] = [None, None]
    index_path.write_text(json.dumps(index))
    model = open_model(model_copy)
    assert sorted(model.components()) == sorted(REQUIRED)
    assert model.content_hash() != before  # model_index.json changed; no crash hashing it


@pytest.mark.parametrize(
    "entry,says",
    [
        (["diffusers", "NoSuchModel"], "names class NoSuchModel, which diffusers does not have"),
        (["diffusers", "logging"], "names class logging, which diffusers does not have"),
        (["torch", "nn"], "comes from library 'torch'"),
        (["diffusers"], "must be a [library, class] pair"),
        ({"library": "diffusers"}, "must be a [library, class] pair"),
        ([None, None], "lists no 'unet'"),
    ],
)
def test_bad_unet_entry(model_copy, entry, says):
    index_path = model_copy / "model_index.json"
    index = json.loads(index_path.read_text())
    index["unet"] = entry
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError) as info:
        open_model(model_copy)
    assert says in str(info.value)


def test_components_load_in_float32_whatever_their_config_says(model_copy):
    """SDXL's released text-encoder configs say torch_dtype float16 over float32 files, and
    transformers 5 loads in the config's dtype unless told: the compile must see the file's
    float32 values, not half-rounded ones."""
    import torch

    path = model_copy / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    config.update(torch_dtype="float16", dtype="float16")
    path.write_text(json.dumps(config))
    model = open_model(model_copy).load("text_encoder")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _as_variant(folder, variant: str) -> None:
    for p in folder.glob("*.safetensors"):
        p.rename(p.with_name(p.name.replace(".safetensors", f".{variant}.safetensors")))


def test_a_folder_of_one_variant_loads_its_files(tiny_model, model_copy):
    """A download of only a repository's fp16 files (`diffusion_pytorch_model.fp16.safetensors`,
    `model.fp16.safetensors`, no plain ones): every component is read from them, the same
    tensors as the plain files', and the compile's file ranges point into them."""
    import torch

    from sdiree.compile.model_source import weight_files, weight_variant
    from sdiree.compile.weight_source import WeightSource

    for comp in ("unet", "vae", "text_encoder"):
        _as_variant(model_copy / comp, "fp16")
    model = open_model(model_copy)
    for comp in ("unet", "vae", "text_encoder"):
        folder = model_copy / comp
        assert weight_variant(folder) == "fp16"
        (file,) = weight_files(folder)
        assert file.name.endswith(".fp16.safetensors")
        loaded = model.load(comp).state_dict()
        reference = open_model(tiny_model).load(comp).state_dict()
        assert loaded.keys() == reference.keys()
        assert all(torch.equal(loaded[k], reference[k]) for k in loaded)
        source = WeightSource.capture(model.load(comp), folder)
        ranges = [t for t in source.tensors.values() if not isinstance(t, torch.Tensor)]
        assert ranges and {t.path for t in ranges} == {file}


def test_plain_files_win_and_several_variants_are_refused(model_copy):
    from sdiree.compile.model_source import weight_files, weight_variant

    unet = model_copy / "unet"
    plain = unet / "diffusion_pytorch_model.safetensors"
    shutil.copy(plain, unet / "diffusion_pytorch_model.fp16.safetensors")
    assert weight_variant(unet) is None and weight_files(unet) == [plain]
    plain.rename(unet / "diffusion_pytorch_model.bf16.safetensors")
    with pytest.raises(UserError, match=r"several variants \(bf16, fp16\) and no plain ones"):
        open_model(model_copy)


def _hf_cache(tiny_model, root, revisions=("3f9a1c0",), main=None):
    """A model as the Hugging Face hub caches it: models--<org>--<name>/ with each revision's
    files in snapshots/<revision>/ as links into blobs/, and refs/main."""
    repo = root / "models--someone--tiny-sd"
    for rev in revisions:
        for src in tiny_model.rglob("*"):
            if src.is_file():
                rel = src.relative_to(tiny_model)
                blob = repo / "blobs" / f"{rev}-{str(rel).replace('/', '-')}"
                blob.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, blob)
                link = repo / "snapshots" / rev / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(blob)
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


def test_a_hugging_face_cache_folder_compiles_its_snapshot(tiny_model, tmp_path):
    """A diffusers user's model already sits in ~/.cache/huggingface/hub: the repository's
    folder (or its snapshots/) stands for the snapshot refs/main names, or its only one, whose
    weights are links into blobs/; the artifacts are named for the repository, not a hash."""
    repo = _hf_cache(tiny_model, tmp_path, main="3f9a1c0")
    snapshot = repo / "snapshots" / "3f9a1c0"
    said = []
    for given in (repo, repo / "snapshots", snapshot):
        model = open_model(given, say=said.append)
        assert model.path == snapshot and model.name == "tiny-sd"
    assert said == [
        f"{p} is a Hugging Face cache folder: compiling its snapshot 3f9a1c0"
        for p in (repo, repo / "snapshots")
    ]
    assert model.content_hash() == open_model(tiny_model).content_hash()
    (repo / "refs" / "main").unlink()
    assert open_model(repo).path == snapshot  # the only snapshot


def test_several_cached_snapshots_need_refs_main_or_a_choice(tiny_model, tmp_path):
    repo = _hf_cache(tiny_model, tmp_path, revisions=("aaa111", "bbb222"))
    with pytest.raises(UserError, match="holds 2 snapshots of the model and no refs/main"):
        open_model(repo)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb222\n")
    assert open_model(repo).path == repo / "snapshots" / "bbb222"
