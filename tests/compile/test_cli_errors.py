"""Bad input to `sdiree compile`: one clear line, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def run_compile(*args):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_failure(proc, must_say: str):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and must_say in lines[0], lines[0]


@pytest.fixture
def broken_model(tiny_model, tmp_path):
    def make(remove: str):
        copy = tmp_path / "model"
        shutil.copytree(tiny_model, copy)
        target = copy / remove
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        return copy

    return make


def test_not_a_diffusers_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(tmp_path / "empty", "--target", "cpu", "--out", out), "model_index.json"
    )
    assert not out.exists()


def test_missing_model_folder(tmp_path):
    assert_clean_failure(run_compile(tmp_path / "nope", "--target", "cpu"), "does not exist")


def test_missing_submodule(broken_model, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(broken_model("vae"), "--target", "cpu", "--out", out), "'vae/'"
    )
    assert not out.exists()


# Each: the arguments, what the error line says, and what else stderr names (the choices or
# the way out). vulkan-spirv's baseline profile cannot compile fp16.
@pytest.mark.parametrize(
    "args,says,also",
    [
        (("--target", "metal"), "unknown target 'metal'", "vulkan-spirv"),
        (("--target", "rocm", "--arch", "gfx000"), "unknown arch 'gfx000'", "gfx942"),
        (
            ("--target", "vulkan-spirv", "--arch", "baseline", "--dtype", "fp16"),
            "--dtype fp16 is refused for vulkan-spirv/baseline",
            "use --dtype fp32",
        ),
    ],
    ids=["unknown-target", "unknown-arch", "refused-dtype"],
)
def test_bad_choice_names_the_way_out(tiny_model, tmp_path, args, says, also):
    out = tmp_path / "out"
    proc = run_compile(tiny_model, *args, "--out", out)
    assert_clean_failure(proc, says)
    assert also in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--height", 100), ("--width", 36), ("--height", -8)])
def test_size_not_multiple_of_8(tiny_model, tmp_path, flag, value):
    out = tmp_path / "out"
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", flag, value, "--out", out), "multiple of 8"
    )
    assert not out.exists()


def test_unwritable_out(tiny_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", "--out", blocker / "sub" / "out"), "cannot write"
    )
    assert blocker.read_text() == "not a directory"


# What `sdiree compile` runs, reporting afterwards which heavy libraries it imported.
IMPORTS_AFTER = """
import sys
from sdiree.runtime.cli import main
try:
    main(sys.argv[1:])
finally:
    heavy = [m for m in ("torch", "diffusers", "transformers", "iree.compiler") if m in sys.modules]
    print("imported:", *heavy, file=sys.stdout)
"""


@pytest.mark.parametrize(
    "args,says",
    [
        (("--arch", "bogus"), "unknown arch 'bogus'"),
        (("--height", "100"), "multiple of 8"),
        (("--dtype", "int4"), "dtype int4"),
    ],
    ids=["arch", "size", "dtype"],
)
def test_bad_options_are_said_before_the_heavy_imports(tiny_model, tmp_path, args, says):
    """A wrong option is one line in well under a second: found before torch, diffusers or
    transformers are imported (seconds), not after."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER, "compile", str(tiny_model), "--target", "cpu",
         *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_clean_failure(proc, says)
    assert proc.stdout.strip() == "imported:", proc.stdout
    assert not out.exists()


def test_unknown_dtype(tiny_model, tmp_path):
    assert_clean_failure(
        run_compile(tiny_model, "--target", "cpu", "--dtype", "int4", "--out", tmp_path / "o"),
        "dtype",
    )


def _edit_json(rel: str, change):
    """A mutation that loads model file rel, applies change(data) (its result, if not None,
    replaces data) and writes it back."""

    def mutate(model):
        path = model / rel
        data = json.loads(path.read_text())
        data = change(data) or data
        path.write_text(json.dumps(data))

    return mutate


def _truncate(rel: str):
    def mutate(model):
        text = (model / rel).read_text()
        (model / rel).write_text(text[: len(text) // 2])

    return mutate


def _set(rel: str, key: str, value):
    return _edit_json(rel, lambda d: d.__setitem__(key, value))


def _drop(rel: str, key: str):
    return _edit_json(rel, lambda d: d.pop(key) and None)


def _remove(rel: str):
    return lambda model: (model / rel).unlink()


def _cut(rel: str):
    """A weights file cut short, as an interrupted download leaves it."""

    def mutate(model):
        data = (model / rel).read_bytes()
        (model / rel).write_bytes(data[: len(data) // 3])

    return mutate


def _replace(rel: str, text: str):
    return lambda model: (model / rel).write_text(text)


UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4c2d8f5e3c1a2b9e0d7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d\n"
    "size 3438167536\n"
)


# A damaged or foreign model folder: (mutation, what the one error line must say).
BAD_MODELS = {
    "truncated-unet-config": (_truncate("unet/config.json"), "unet/config.json is not valid JSON"),
    "truncated-vae-config": (_truncate("vae/config.json"), "vae/config.json is not valid JSON"),
    "truncated-text-encoder-config": (
        _truncate("text_encoder/config.json"),
        "text_encoder/config.json is not valid JSON",
    ),
    "truncated-scheduler-config": (
        _truncate("scheduler/scheduler_config.json"),
        "scheduler_config.json is not valid JSON",
    ),
    "truncated-model-index": (_truncate("model_index.json"), "model_index.json is not valid JSON"),
    "binary-unet-config": (
        lambda m: (m / "unet/config.json").write_bytes(b"\xff\xfe\x00garbage"),
        "unet/config.json is not valid JSON",
    ),
    "model-index-is-a-list": (_edit_json("model_index.json", lambda d: [d]), "holds a JSON list"),
    "unet-config-is-a-list": (_edit_json("unet/config.json", lambda d: [d]), "holds a JSON list"),
    "unknown-unet-class": (
        _set("model_index.json", "unet", ["diffusers", "NoSuchModel"]),
        "names class NoSuchModel, which diffusers does not have",
    ),
    "unet-entry-not-a-pair": (
        _set("model_index.json", "unet", "UNet2DConditionModel"),
        "must be a [library, class] pair",
    ),
    "unet-from-another-library": (
        _set("model_index.json", "unet", ["os", "system"]),
        "comes from library 'os'",
    ),
    "vae-block-out-channels-int": (
        _set("vae/config.json", "block_out_channels", 5),
        "'block_out_channels' is 5, but must be a non-empty list of positive integers",
    ),
    "unet-sample-size-string": (
        _set("unet/config.json", "sample_size", "64"),
        "'sample_size' is \"64\", but must be a positive integer",
    ),
    "unet-sample-size-missing": (
        _drop("unet/config.json", "sample_size"),
        "unet/config.json has no 'sample_size'",
    ),
    "unet-cross-attention-dim-missing": (
        _drop("unet/config.json", "cross_attention_dim"),
        "has no 'cross_attention_dim'",
    ),
    "text-encoder-hidden-size-null": (
        _set("text_encoder/config.json", "hidden_size", None),
        "'hidden_size' is null",
    ),
    "vae-scaling-factor-string": (
        _set("vae/config.json", "scaling_factor", "0.18215"),
        "'scaling_factor' is \"0.18215\", but must be a finite number",
    ),
    "scheduler-config-missing": (
        _remove("scheduler/scheduler_config.json"),
        "scheduler/scheduler_config.json is missing",
    ),
    "tokenizer-merges-missing": (_remove("tokenizer/merges.txt"), "has no merges.txt"),
    "truncated-vocab": (_truncate("tokenizer/vocab.json"), "vocab.json is not valid JSON"),
    # what a failed download leaves in a weights file's place (a clone without git-lfs holds
    # pointers; before these checks the UNet's pointer was a MemoryError traceback)
    "unet-weights-lfs-pointer": (
        _replace(UNET_WEIGHTS, LFS_POINTER),
        "unet/diffusion_pytorch_model.safetensors is a Git LFS pointer",
    ),
    "vae-weights-login-page": (
        _replace("vae/diffusion_pytorch_model.safetensors", "<!DOCTYPE html><html>Sign in"),
        "vae/diffusion_pytorch_model.safetensors is a web page (HTML)",
    ),
    "text-encoder-weights-error-message": (
        _replace("text_encoder/model.safetensors", '{"error": "Unauthorized"}'),
        "text_encoder/model.safetensors is a JSON text, not a checkpoint",
    ),
    "unet-weights-cut-short": (
        _cut(UNET_WEIGHTS),
        "unet/diffusion_pytorch_model.safetensors is truncated (header says",
    ),
}


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_folder_is_one_line(model_copy, tmp_path, case):
    mutate, says = BAD_MODELS[case]
    mutate(model_copy)
    out = tmp_path / "artifacts" / "out"
    assert_clean_failure(run_compile(model_copy, "--target", "cpu", "--out", out), says)
    assert not (tmp_path / "artifacts").exists()
    assert not [p for p in model_copy.rglob("*") if p.name.startswith(".")]


def test_weights_of_another_component_are_refused_not_random(tiny_model, model_copy, tmp_path):
    """A weights file that loads but lacks the component's tensors (here the VAE's file in the
    text encoder's and the UNet's place): diffusers and transformers fill what is missing with
    random values and only log it, so the artifact compiled and made noise. Now one line, and
    no manifest; the text encoder, loaded first, leaves not even the folders it would make."""
    vae = (model_copy / "vae/diffusion_pytorch_model.safetensors").read_bytes()
    (model_copy / "text_encoder/model.safetensors").write_bytes(vae)
    out = tmp_path / "artifacts" / "out"
    proc = run_compile(model_copy, "--target", "cpu", "--out", out)
    assert_clean_failure(proc, "text_encoder's weights lack 36 of the 36 tensors its config")
    assert not (tmp_path / "artifacts").exists()
    shutil.copy(tiny_model / "text_encoder/model.safetensors", model_copy / "text_encoder")
    (model_copy / UNET_WEIGHTS).write_bytes(vae)
    proc = run_compile(model_copy, "--target", "cpu", "--out", out)
    assert_clean_failure(proc, "unet's weights lack")
    assert not (out / "manifest.json").exists()


def test_non_component_index_entries_are_tolerated(model_copy, tmp_path):
    """Pipeline options in model_index.json (a boolean, a string, an absent part's [null, null])
    are not components: the folder opens, and the first error is the bad --height."""
    index = json.loads((model_copy / "model_index.json").read_text())
    index.update(force_zeros_for_empty_prompt=True, image_processor="x", watermarker=[None, None])
    (model_copy / "model_index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    proc = run_compile(model_copy, "--target", "cpu", "--height", 100, "--out", out)
    assert_clean_failure(proc, "multiple of 8")
    assert not out.exists()
