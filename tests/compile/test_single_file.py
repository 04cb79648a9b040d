"""Single-file checkpoints: `sdiree compile model.safetensors` compiles the diffusers folder
compile/single_file.py writes from it.

The test files are made by tools/to_single_file.py from the tiny models, and that helper is
first checked against diffusers itself (from_single_file must load exactly the folder's
tensors); sdiree's conversion must then give back the folder's tensors bit for bit. The shipped
full-size presets are checked on torch's meta device with zero-memory stand-in tensors, against
diffusers' own converter. End to end, the single file's artifact makes the folder's image.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli_errors import assert_clean_failure, run_compile  # the compile CLI's helpers

from sdiree.compile.single_file import (
    SOURCE_FILE,
    _expected_shapes,
    materialize,
    presets_dir,
    source_info,
    write_clip_tokenizer,
)
from sdiree.runtime.checkpoints.detect import check_shapes, detect
from sdiree.runtime.checkpoints.ldm_layout import convert
from sdiree.runtime.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from to_single_file import (  # noqa: E402
    clip_to_ldm,
    open_clip_to_ldm,
    unet_to_ldm,
    vae_to_ldm,
    write_single_file,
)

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

WEIGHTS = {
    "unet": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
}
PRESETS = ("sd15", "sd15-inpainting", "sd21", "sd21-base", "sd2-inpainting")


@pytest.fixture(scope="module")
def tiny_inpaint(tiny_model, tmp_path_factory) -> Path:
    """The tiny SD 1.x model with a 9-channel inpainting UNet (random), as
    StableDiffusionInpaintPipeline lays it out."""
    folder = tmp_path_factory.mktemp("inpaint") / "tiny-inpaint"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "unet" / "config.json").read_text())
    config["in_channels"] = 9
    torch.manual_seed(1)
    diffusers.UNet2DConditionModel.from_config(config).save_pretrained(folder / "unet")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionInpaintPipeline"
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture(scope="module")
def models(tiny_model, tiny_sd2_model, tiny_inpaint):
    return {"sd1": tiny_model, "sd2": tiny_sd2_model, "inpaint": tiny_inpaint}


def folder_tensors(model: Path, weights: dict = WEIGHTS) -> dict:
    return {c: safetensors_numpy.load_file(str(model / c / f)) for c, f in weights.items()}


# (model, file name, variant, fp16): the kinds of file people download
FILES = {
    "sd1": ("sd1", "tiny.safetensors", "pruned", False),
    "sd1-ckpt-full-ema": ("sd1", "tiny-full.ckpt", "full-ema", False),
    "sd1-fp16-bare": ("sd1", "tiny-fp16.safetensors", "bare", True),
    "sd2": ("sd2", "tiny2.safetensors", "pruned", False),
    "sd2-ckpt": ("sd2", "tiny2.ckpt", "pruned", False),
    "inpaint": ("inpaint", "tiny-inpaint.safetensors", "pruned", False),
}


@pytest.fixture(scope="module")
def single_files(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("single-files")
    return {
        case: write_single_file(models[m], root / name, variant=variant, fp16=fp16)
        for case, (m, name, variant, fp16) in FILES.items()
    }


@pytest.mark.parametrize("case", ["sd1", "sd1-ckpt-full-ema", "sd2", "inpaint"])
def test_helper_files_load_in_diffusers_as_the_folder(case, models, single_files):
    """Independence: diffusers' from_single_file reads the helper's files as the folder."""
    model = models[FILES[case][0]]
    cls = (
        diffusers.StableDiffusionInpaintPipeline
        if case == "inpaint"
        else diffusers.StableDiffusionPipeline
    )
    ours = cls.from_single_file(str(single_files[case]), config=str(model), local_files_only=True)
    ref = cls.from_pretrained(model, local_files_only=True)
    for comp in WEIGHTS:
        a, b = getattr(ours, comp).state_dict(), getattr(ref, comp).state_dict()
        assert set(a) == set(b), comp
        for k in b:
            assert torch.equal(a[k], b[k]), (comp, k)


@pytest.mark.parametrize("case", list(FILES))
def test_materialized_folder_is_the_original(case, models, single_files, tmp_path):
    model = models[FILES[case][0]]
    fp16 = FILES[case][3]
    messages = []
    out = materialize(single_files[case], tmp_path / "cache", config_dir=model, say=messages.append)
    assert out.name == single_files[case].stem
    want, got = folder_tensors(model), folder_tensors(out)
    for comp in WEIGHTS:
        assert set(got[comp]) == set(want[comp]), comp
        for k, v in want[comp].items():
            v = v.astype(np.float16) if fp16 and v.dtype == np.float32 else v
            assert got[comp][k].dtype == v.dtype and np.array_equal(got[comp][k], v), (comp, k)
    for rel in ["model_index.json", "unet/config.json", "scheduler/scheduler_config.json"]:
        assert json.loads((out / rel).read_text()) == json.loads((model / rel).read_text()), rel
    for p in (model / "tokenizer").iterdir():
        assert (out / "tokenizer" / p.name).read_bytes() == p.read_bytes()
    info = source_info(out)
    import hashlib

    assert info["sha256"] == hashlib.sha256(single_files[case].read_bytes()).hexdigest()
    assert info["file"] == single_files[case].name and info["config"] == str(model.resolve())
    assert info["has_ema"] == (case == "sd1-ckpt-full-ema") and info["ema"] is False
    assert any("writing it as a diffusers folder" in m for m in messages)


def test_reused_while_unchanged_and_keyed_by_options(tiny_model, single_files, tmp_path):
    cache = tmp_path / "cache"
    first = materialize(single_files["sd1"], cache, config_dir=tiny_model)
    stamp = (first / "unet" / WEIGHTS["unet"]).stat().st_mtime_ns
    said = []
    again = materialize(single_files["sd1"], cache, config_dir=tiny_model, say=said.append)
    assert again == first and not said
    assert (first / "unet" / WEIGHTS["unet"]).stat().st_mtime_ns == stamp
    v = materialize(
        single_files["sd1"], cache, config_dir=tiny_model, prediction_type="v_prediction"
    )
    assert v != first
    sched = json.loads((v / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "v_prediction"
    assert source_info(v)["prediction_type"] == "v_prediction"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_config_of_another_family_or_shape_is_refused(
    tiny_model, tiny_sd2_model, single_files, tmp_path
):
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="is an SD 1.x checkpoint, but --config .* is an SD 2.x"):
        materialize(single_files["sd1"], cache, config_dir=tiny_sd2_model)
    wider = tmp_path / "wider"
    shutil.copytree(tiny_model, wider)
    config = json.loads((wider / "unet" / "config.json").read_text())
    config["block_out_channels"] = [16, 64]
    (wider / "unet" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        materialize(single_files["sd1"], cache, config_dir=wider)
    assert "unet tensor conv_in.weight has shape [32, 4, 3, 3], but --config" in str(e.value)
    assert "expects [16, 4, 3, 3]" in str(e.value)
    # the shipped SD 1.5 config, for a file whose shapes are the tiny model's
    with pytest.raises(UserError, match=r"sdiree's sd15 config expects \[320, 4, 3, 3\]"):
        materialize(single_files["sd1"], cache)
    assert not cache.exists()  # nothing written for a refused file


def meta_models(preset: str):
    root = presets_dir() / preset
    index = json.loads((root / "model_index.json").read_text())
    configs = {
        c: json.loads((root / c / f).read_text())
        for c, f in {
            "unet": "config.json",
            "vae": "config.json",
            "text_encoder": "config.json",
            "scheduler": "scheduler_config.json",
        }.items()
    }
    return index, configs, _expected_shapes(index, configs)


def synthetic_ldm(configs: dict, shapes: dict) -> dict[str, np.ndarray]:
    """A full-size LDM-layout state dict of zero-memory fp16 stand-ins."""
    z = {
        c: {k: np.broadcast_to(np.float16(0), s) for k, s in sd.items()} for c, sd in shapes.items()
    }
    out = {**unet_to_ldm(z["unet"], configs["unet"]), **vae_to_ldm(z["vae"], configs["vae"])}
    te = configs["text_encoder"]
    if te["hidden_act"] == "quick_gelu":
        out.update(clip_to_ldm(z["text_encoder"]))
    else:
        out.update(open_clip_to_ldm(z["text_encoder"], te, np.random.default_rng(0)))
    return out


# Keys of the real released files (diffusers' single_file_utils keys its detection on some).
REAL_KEYS = {
    "sd15": {
        "model.diffusion_model.output_blocks.11.0.skip_connection.weight": (320, 640, 1, 1),
        "model.diffusion_model.input_blocks.3.0.op.weight": (320, 320, 3, 3),
        "model.diffusion_model.output_blocks.2.1.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.output_blocks.5.2.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": (320, 320, 1, 1),
        "first_stage_model.decoder.up.1.upsample.conv.weight": (256, 256, 3, 3),
        "first_stage_model.encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        "cond_stage_model.transformer.text_model.final_layer_norm.weight": (768,),
    },
    "sd21": {
        "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight": (
            320,
            1024,
        ),
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": (320, 320),
        "cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight": (3072, 1024),
        "cond_stage_model.model.positional_embedding": (77, 1024),
        "cond_stage_model.model.text_projection": (1024, 1024),
    },
}
# Tensors per component in SD's releases (v1-5-pruned-emaonly.safetensors: 1131 with CLIP's
# position_ids; SD 2.x's text encoder: 23 layers of 16, plus 4).
COUNTS = {"sd15": (686, 248, 196), "sd21": (686, 248, 372)}


@pytest.mark.parametrize("preset", PRESETS)
def test_full_size_presets_convert_key_by_key(preset):
    index, configs, shapes = meta_models(preset)
    ldm = synthetic_ldm(configs, shapes)
    for key, shape in REAL_KEYS.get(preset, {}).items():
        assert ldm[key].shape == shape, key
    det = detect(ldm, where=preset)
    assert det.preset == (preset if preset != "sd21-base" else "sd21")  # 2.x: v-prediction
    conv = convert(
        ldm,
        text_layers=configs["text_encoder"]["num_hidden_layers"],
        unet_layers_per_block=configs["unet"]["layers_per_block"],
    )
    assert not conv.unknown and not conv.other
    counts = tuple(len(shapes[c]) for c in ("unet", "vae", "text_encoder"))
    if preset in COUNTS:
        assert counts == COUNTS[preset]
    for comp, want in shapes.items():
        check_shapes(want, conv.components[comp], preset, comp, preset)
    # diffusers' own converter, on meta tensors, names and shapes them the same way
    from diffusers.loaders import single_file_utils as sfu

    meta = {k: torch.empty(v.shape, dtype=torch.float16, device="meta") for k, v in ldm.items()}
    theirs = {
        "unet": sfu.convert_ldm_unet_checkpoint(meta, configs["unet"]),
        "vae": sfu.convert_ldm_vae_checkpoint(meta, configs["vae"]),
    }
    if det.text_encoder == "clip":
        te = sfu.convert_ldm_clip_checkpoint(meta)
    else:
        import transformers

        with torch.device("meta"):
            model = transformers.CLIPTextModel(
                transformers.CLIPTextConfig.from_dict(configs["text_encoder"])
            )
        te = sfu.convert_open_clip_checkpoint(model, meta)
        te.pop("text_projection.weight", None)
    theirs["text_encoder"] = {k.removeprefix("text_model."): v for k, v in te.items()}
    theirs["text_encoder"].pop("embeddings.position_ids", None)
    for comp, sd in theirs.items():
        ours = conv.components[comp]
        assert set(sd) == set(ours), (comp, sorted(set(sd) ^ set(ours))[:4])
        for k, v in sd.items():
            assert tuple(v.shape) == ours[k].shape, (comp, k)


def test_clip_tokenizer_is_clips_real_vocabulary(tmp_path):
    transformers = pytest.importorskip("transformers")
    from sdiree.runtime.tokenizer import ClipTokenizer

    for preset, pad in (("sd15", 49407), ("sd21", 0)):
        out = tmp_path / preset
        write_clip_tokenizer(out, presets_dir() / preset / "tokenizer")
        hf = transformers.CLIPTokenizer.from_pretrained(str(out))
        assert len(hf) == 49408
        ids = hf("a photo of a cat", padding="max_length", max_length=77).input_ids
        assert ids[:7] == [49406, 320, 1125, 539, 320, 2368, 49407]
        assert ids[7] == pad  # SD 2.x's OpenCLIP tokenizer pads with "!" (id 0)
        ours = ClipTokenizer.from_dir(out)
        for prompt in (
            "a photo of a cat",
            "A Lighthouse at DUSK, oil painting!!",
            "jekyll 🐈 über",
        ):
            want = hf(prompt, padding="max_length", max_length=77, truncation=True).input_ids
            assert list(ours.encode(prompt).ids) == want, prompt


def test_open_model_takes_a_file(tiny_model, single_files, tmp_path):
    from sdiree.compile.model_source import open_model

    model = open_model(single_files["sd1"], cache_dir=tmp_path / "c", config_dir=tiny_model)
    assert model.name == "tiny" and model.family.name == "sd1"
    assert (tmp_path / "c") in model.path.parents
    # without --config: the shipped preset of the detected family (SD 2.x: 2.1 at 768)
    with pytest.raises(UserError, match="sdiree's sd21 config expects"):
        open_model(single_files["sd2"], cache_dir=tmp_path / "c")
    with pytest.raises(UserError, match="--prediction-type is for a single-file checkpoint"):
        open_model(tiny_model, prediction_type="epsilon")


def test_sd2_preset_follows_the_prediction_type(tiny_sd2_model, single_files, tmp_path):
    """SD 2.x: 2.1 (768, v-prediction) by default; 2.x-base (512, epsilon) when asked or when
    a .ckpt's global_step is the 2.x-base release's (the tiny model's shapes then differ from
    the preset's, which names it)."""
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="sdiree's sd21 config expects"):
        materialize(single_files["sd2"], cache)
    with pytest.raises(UserError, match="sdiree's sd21-base config expects"):
        materialize(single_files["sd2"], cache, prediction_type="epsilon")
    base = write_single_file(tiny_sd2_model, tmp_path / "base.ckpt", global_step=875000)
    with pytest.raises(UserError, match="sdiree's sd21-base config expects"):
        materialize(base, cache)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-checkpoint",))


def bad_files(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    truncated = root / "truncated.safetensors"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    text = root / "notes.safetensors"
    text.write_text("not a model at all\n")
    evil = root / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": Evil()}, evil)
    sdxl = root / "sdxl.safetensors"
    safetensors_numpy.save_file(
        {
            "conditioner.embedders.1.model.token_embedding.weight": np.zeros((8, 4), np.float16),
            "model.diffusion_model.label_emb.0.0.weight": np.zeros((4, 4), np.float16),
            "model.diffusion_model.input_blocks.0.0.weight": np.zeros((4, 4, 3, 3), np.float16),
        },
        str(sdxl),
    )
    return {
        "truncated": (truncated, "is truncated (header says"),
        "not-a-checkpoint": (text, "is a text file, not a checkpoint"),
        "code": (evil, "contains code (posix.system), which sdiree never runs"),
        "sdxl-one-encoder": (sdxl, "an SDXL base checkpoint holds CLIP ViT-L"),
    }


def test_bad_files_one_line_nothing_written(single_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("SDIREE_CACHE", str(cache))
    for case, (path, says) in bad_files(tmp_path, single_files["sd1"]).items():
        out = tmp_path / f"out-{case}"
        assert_clean_failure(run_compile(path, "--target", "cpu", "--out", out), says)
        assert not out.exists(), case
        assert not cache.exists(), case
    assert not (tmp_path / "pwned-by-checkpoint").exists()
    proc = run_compile(tmp_path, "--target", "cpu", "--config", tmp_path, "--out", tmp_path / "o")
    assert_clean_failure(proc, "--config is for a single-file checkpoint")


def entry_bytes(archive, key: str) -> bytes:
    """An archive entry's bytes (encoded archives have no dtype metadata), or its splat; a
    pruned archive's dropped entry as read back from the encoded archives."""
    e = archive.entries[key]
    if e.recovered:
        return archive.array(key).tobytes()
    if e.splat is not None:
        return e.splat + e.length.to_bytes(8, "little")
    with open(archive.path, "rb") as f:
        f.seek(e.offset)
        return f.read(e.length)


def test_single_file_compiles_to_the_folders_image(
    compiled, single_files, tiny_model, compile_cache
):  # fmt: skip
    """End to end: the single file (with --config, the tiny model's own tokenizer) compiled to
    <artifacts root>/<stem>/..., and its image against the folder's artifact's. Its artifacts
    root is the session's compile cache; the build cache of the folder's compile is reused
    whatever the root, as every compile keeps it in the user cache ($SDIREE_CACHE)."""
    from parity import psnr, sdiree_images

    from sdiree.compile.driver import CompileOptions, compile_model
    from sdiree.compile.report import Reporter

    folder_art = compiled.get("cpu", "host", "fp32")
    root = compile_cache
    log = io.StringIO()
    manifest = compile_model(
        CompileOptions(
            model_dir=single_files["sd1"],
            target="cpu",
            arch="host",
            dtype="fp32",
            artifacts_root=root,
            config_dir=tiny_model,
        ),
        Reporter(stream=log),
    )
    art = manifest.parent
    assert art == root.absolute() / "tiny" / "cpu-host-fp32-64x64-b1"
    assert "SD 1.x checkpoint" in log.getvalue()
    folders = list((root / "tiny" / "single-file").glob(f"*/tiny/{SOURCE_FILE}"))
    assert len(folders) == 1
    # the same weights reach the modules: every archive the two artifacts load, tensor by tensor
    from sdiree.runtime.weights.archive import Archive

    names = sorted(p.name for p in art.glob("*.irpa"))
    assert names == sorted(p.name for p in folder_art.glob("*.irpa")) and names
    for name in names:
        a, b = Archive(art / name), Archive(folder_art / name)
        assert set(a.entries) == set(b.entries), name
        for key in b.entries:
            assert entry_bytes(a, key) == entry_bytes(b, key), (name, key)
    args = ("euler", 10, 7.5, 42, "a lighthouse at dusk", "", 1)
    ours, _ = sdiree_images(art, *args)
    ref, _ = sdiree_images(folder_art, *args)
    assert psnr(ours, ref) >= 60.0


def test_config_without_tokenizer_gets_clips(tiny_model, single_files, tmp_path):
    config = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, config)
    shutil.rmtree(config / "tokenizer")
    out = materialize(single_files["sd1"], tmp_path / "cache", config_dir=config)
    vocab = json.loads((out / "tokenizer" / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 49408 and vocab["<|endoftext|>"] == 49407
