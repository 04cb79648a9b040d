"""SDXL single-file checkpoints (Stability's SGM layout, as sd_xl_base_1.0.safetensors ships):
`sdiree compile model.safetensors` for the sdxl family.

The files are written by tools/to_single_file.py from tiny SDXL models. The helper is checked
against diffusers' own StableDiffusionXLPipeline.from_single_file first (on a tiny SDXL whose
two text encoders differ in width, as at full size: diffusers tells them apart by shape);
sdiree's conversion must then give back the folder's tensors bit for bit (safetensors fp32 and
fp16, a .ckpt through the safe unpickler). The shipped SDXL base preset is checked at full size
on zero-memory stand-ins against diffusers' converters. End to end, the single file compiled
with --config gives the folder's archives and image; and bad files are one line each.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import test_single_file as single_file_tests  # folder_tensors, entry_bytes
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

COMPONENTS = {
    "unet": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
    "text_encoder_2": "model.safetensors",
}


@pytest.fixture(scope="module")
def tiny_sdxl_wide(tmp_path_factory) -> Path:
    """A tiny SDXL whose second text encoder is 48 wide (the first: 32)."""
    from make_tiny_sd import make_tiny_sdxl

    return make_tiny_sdxl(tmp_path_factory.mktemp("wide") / "tiny-sdxl-wide", seed=3, width_2=48)


def folder_tensors(model: Path) -> dict:
    return single_file_tests.folder_tensors(model, COMPONENTS)


# (model, file name, variant, fp16)
FILES = {
    "sdxl": ("tiny", "tiny-sdxl.safetensors", "pruned", False),
    "sdxl-fp16-bare": ("tiny", "tiny-sdxl-fp16.safetensors", "bare", True),
    "sdxl-ckpt": ("tiny", "tiny-sdxl.ckpt", "pruned", False),
    "wide": ("wide", "tiny-sdxl-wide.safetensors", "pruned", False),
}


@pytest.fixture(scope="module")
def models(tiny_sdxl_model, tiny_sdxl_wide):
    return {"tiny": tiny_sdxl_model, "wide": tiny_sdxl_wide}


@pytest.fixture(scope="module")
def sdxl_files(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sdxl-files")
    return {
        case: write_single_file(models[m], root / name, variant=variant, fp16=fp16)
        for case, (m, name, variant, fp16) in FILES.items()
    }


def test_helper_file_loads_in_diffusers_as_the_folder(tiny_sdxl_wide, sdxl_files):
    """Independence: diffusers' from_single_file reads the helper's SGM file as the folder,
    every tensor of all four components equal."""
    cls = diffusers.StableDiffusionXLPipeline
    ours = cls.from_single_file(
        str(sdxl_files["wide"]), config=str(tiny_sdxl_wide), local_files_only=True
    )
    ref = cls.from_pretrained(tiny_sdxl_wide, local_files_only=True)
    for comp in COMPONENTS:
        a, b = getattr(ours, comp).state_dict(), getattr(ref, comp).state_dict()
        assert set(a) == set(b), comp
        for k in b:
            assert not a[k].is_meta and torch.equal(a[k], b[k]), (comp, k)


@pytest.mark.parametrize("case", list(FILES))
def test_materialized_folder_is_the_original(case, models, sdxl_files, tmp_path):
    model = models[FILES[case][0]]
    fp16 = FILES[case][3]
    said = []
    out = materialize(sdxl_files[case], tmp_path / "cache", config_dir=model, say=said.append)
    want, got = folder_tensors(model), folder_tensors(out)
    for comp in COMPONENTS:
        assert set(got[comp]) == set(want[comp]), comp
        for k, v in want[comp].items():
            v = v.astype(np.float16) if fp16 and v.dtype == np.float32 else v
            assert got[comp][k].dtype == v.dtype and np.array_equal(got[comp][k], v), (comp, k)
    for rel in ["model_index.json", "unet/config.json", "text_encoder_2/config.json"]:
        assert json.loads((out / rel).read_text()) == json.loads((model / rel).read_text()), rel
    for tok in ("tokenizer", "tokenizer_2"):  # both tokenizers, from --config
        for p in (model / tok).iterdir():
            assert (out / tok / p.name).read_bytes() == p.read_bytes(), (tok, p.name)
    info = source_info(out)
    assert info["family"] == "sdxl" and info["prediction_type"] == "epsilon"
    assert info["sha256"] == hashlib.sha256(sdxl_files[case].read_bytes()).hexdigest()
    assert any("SDXL checkpoint" in m for m in said)


def test_preset_of_another_size_named(sdxl_files, tiny_model, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match=r"sdiree's sdxl config expects \[320, 4, 3, 3\]"):
        materialize(sdxl_files["sdxl"], cache)  # the shipped full-size SDXL base config
    with pytest.raises(UserError, match="is an SDXL checkpoint, but --config .* is an SD 1.x"):
        materialize(sdxl_files["sdxl"], cache, config_dir=tiny_model)
    assert not cache.exists()


def synthetic_sgm(configs: dict, shapes: dict) -> dict[str, np.ndarray]:
    """A full-size SGM-layout state dict of zero-memory fp16 stand-ins."""
    z = {
        c: {k: np.broadcast_to(np.float16(0), s) for k, s in sd.items()} for c, sd in shapes.items()
    }
    out = {**unet_to_ldm(z["unet"], configs["unet"]), **vae_to_ldm(z["vae"], configs["vae"])}
    for key, t in clip_to_ldm(z["text_encoder"]).items():
        out["conditioner.embedders.0.transformer." + key.split(".", 2)[2]] = t
    big_g = open_clip_to_ldm(
        z["text_encoder_2"],
        configs["text_encoder_2"],
        np.random.default_rng(0),
        "conditioner.embedders.1.model.",
        sdxl=True,
    )
    out.update(big_g)
    return out


# Keys and shapes of the released sd_xl_base_1.0.safetensors.
REAL_KEYS = {
    "model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
    "model.diffusion_model.label_emb.0.2.weight": (1280, 1280),
    "model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight": (640, 2048),
    "model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn1.to_q.weight": (1280, 1280),
    "model.diffusion_model.input_blocks.3.0.op.weight": (320, 320, 3, 3),
    "model.diffusion_model.output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
    "model.diffusion_model.output_blocks.5.2.conv.weight": (640, 640, 3, 3),
    "model.diffusion_model.output_blocks.8.0.skip_connection.weight": (320, 640, 1, 1),
    "conditioner.embedders.0.transformer.text_model.encoder.layers.11.mlp.fc2.weight": (
        768,
        3072,
    ),
    "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight": (3840, 1280),
    "conditioner.embedders.1.model.text_projection": (1280, 1280),
    "conditioner.embedders.1.model.positional_embedding": (77, 1280),
    "first_stage_model.decoder.up.3.block.0.conv1.weight": (512, 512, 3, 3),
}


def test_full_size_sdxl_preset_converts_key_by_key():
    root = presets_dir() / "sdxl"
    index = json.loads((root / "model_index.json").read_text())
    files = {c: "config.json" for c in COMPONENTS} | {"scheduler": "scheduler_config.json"}
    configs = {c: json.loads((root / c / f).read_text()) for c, f in files.items()}
    shapes = _expected_shapes(index, configs)
    sgm = synthetic_sgm(configs, shapes)
    for key, shape in REAL_KEYS.items():
        assert sgm[key].shape == shape, key
    det = detect(sgm, where="sdxl")
    assert (det.family, det.preset, det.context_dim) == ("sdxl", "sdxl", 2048)
    conv = convert(sgm, text_layers=12, text_layers_2=32)
    assert not conv.unknown and not conv.other
    assert set(conv.components) == set(COMPONENTS)
    te2 = {
        ("text_model." + k if "text_model." + k in shapes["text_encoder_2"] else k): v
        for k, v in conv.components["text_encoder_2"].items()
    }
    check_shapes(shapes["text_encoder_2"], te2, "sdxl", "text encoder 2", "sdxl")
    for comp in ("unet", "vae"):
        check_shapes(shapes[comp], conv.components[comp], "sdxl", comp, "sdxl")
    # diffusers' own converters, on meta tensors, name and shape them the same way
    from diffusers.loaders import single_file_utils as sfu

    meta = {k: torch.empty(v.shape, dtype=torch.float16, device="meta") for k, v in sgm.items()}
    theirs = {
        "unet": sfu.convert_ldm_unet_checkpoint(meta, configs["unet"]),
        "vae": sfu.convert_ldm_vae_checkpoint(meta, configs["vae"]),
        "text_encoder": sfu.convert_ldm_clip_checkpoint(meta),
    }
    import transformers

    with torch.device("meta"):
        big_g = transformers.CLIPTextModelWithProjection(
            transformers.CLIPTextConfig.from_dict(configs["text_encoder_2"])
        )
    theirs["text_encoder_2"] = sfu.convert_open_clip_checkpoint(
        big_g, meta, prefix="conditioner.embedders.1.model."
    )
    for comp, sd in theirs.items():
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
        sd.pop("embeddings.position_ids", None)
        ours = conv.components[comp]
        assert set(sd) == set(ours), (comp, sorted(set(sd) ^ set(ours))[:4])
        for k, v in sd.items():
            assert tuple(v.shape) == ours[k].shape, (comp, k)
    assert conv.components["text_encoder_2"]["text_projection.weight"].base is not None  # a view


def test_preset_tokenizers_without_config(tmp_path):
    """Without --config, both SDXL tokenizers are CLIP's real BPE with the preset's configs:
    the first pads with the end token, the second with "!" (id 0), as the released ones."""
    transformers = pytest.importorskip("transformers")
    for name, pad in (("tokenizer", 49407), ("tokenizer_2", 0)):
        write_clip_tokenizer(tmp_path / name, presets_dir() / "sdxl" / name)
        hf = transformers.CLIPTokenizer.from_pretrained(str(tmp_path / name))
        ids = hf("a photo of a cat", padding="max_length", max_length=77).input_ids
        assert len(hf) == 49408 and ids[:7] == [49406, 320, 1125, 539, 320, 2368, 49407]
        assert ids[7] == pad, name


def bad_files(root: Path, good: Path, tiny_sdxl: Path) -> dict[str, tuple[Path, str]]:
    truncated = root / "truncated-sdxl.safetensors"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    refiner = write_single_file(tiny_sdxl, root / "refiner.safetensors", variant="refiner-only")
    embedding = root / "sdxl-embedding.safetensors"
    safetensors_numpy.save_file(
        {"clip_l": np.zeros((2, 32), np.float32), "clip_g": np.zeros((2, 32), np.float32)},
        str(embedding),
    )
    return {
        "truncated": (truncated, "is truncated (header says"),
        "refiner": (refiner, "is an SDXL refiner (one OpenCLIP ViT-bigG text encoder"),
        "embedding": (embedding, "is a textual-inversion embedding, not a model"),
    }


def test_bad_sdxl_files_one_line_nothing_written(
    sdxl_files, tiny_sdxl_model, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("SDIREE_CACHE", str(cache))
    for case, (path, says) in bad_files(tmp_path, sdxl_files["sdxl"], tiny_sdxl_model).items():
        out = tmp_path / f"out-{case}"
        args = ("--target", "cpu", "--config", tiny_sdxl_model, "--out", out)
        assert_clean_failure(run_compile(path, *args), says)
        assert not out.exists(), case
        assert not cache.exists(), case


def test_sdxl_single_file_compiles_to_the_folders_image(
    compiled_sdxl, sdxl_files, tiny_sdxl_model, tmp_path
):
    """End to end: the SDXL single file (--config: the tiny model's own configs and both
    tokenizers) compiled for cpu gives the folder's artifact's archives, byte for byte, and
    its image."""
    from parity import psnr, sdiree_images

    from sdiree.compile.driver import CompileOptions, compile_model
    from sdiree.compile.report import Reporter
    from sdiree.runtime.weights.archive import Archive

    folder_art = compiled_sdxl.get("cpu", "host", "fp32")
    root = tmp_path / "artifacts"
    log = io.StringIO()
    manifest = compile_model(
        CompileOptions(
            model_dir=sdxl_files["sdxl"],
            target="cpu",
            arch="host",
            dtype="fp32",
            artifacts_root=root,
            config_dir=tiny_sdxl_model,
        ),
        Reporter(stream=log),
    )
    art = manifest.parent
    assert art == root.absolute() / "tiny-sdxl" / "cpu-host-fp32-64x64-b1"
    assert "SDXL checkpoint" in log.getvalue()
    assert len(list((root / "tiny-sdxl" / "single-file").glob(f"*/tiny-sdxl/{SOURCE_FILE}"))) == 1
    data = json.loads(manifest.read_text())
    assert data["model"]["family"] == "sdxl"
    names = sorted(p.name for p in art.glob("*.irpa"))
    assert names == sorted(p.name for p in folder_art.glob("*.irpa"))
    assert any(n.startswith("text_encoder_2") for n in names)
    for name in names:
        a, b = Archive(art / name), Archive(folder_art / name)
        assert set(a.entries) == set(b.entries), name
        for key in b.entries:
            assert single_file_tests.entry_bytes(a, key) == single_file_tests.entry_bytes(b, key), (
                name,
                key,
            )
    args = ("euler", 6, 7.5, 42, "a lighthouse at dusk", "blurry", 1)
    ours, m = sdiree_images(art, *args)
    ref, _ = sdiree_images(folder_art, *args)
    assert m.family == "sdxl"
    print(f"SDXL single file vs folder artifact: {psnr(ours, ref):.1f} dB")
    assert psnr(ours, ref) >= 60.0
