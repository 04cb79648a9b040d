"""`sdiree run --weights/--vae/--lora`: other weights on a compiled artifact, no recompile.

A tiny "fine-tune" (the tiny model's weights moved a little) written as a single LDM-layout file
and loaded with --weights makes the image that compiling the fine-tune makes; LoRA files (kohya
and PEFT layouts) at 0.8 and a VAE file make diffusers' images with the same LoRA / VAE; the PNG
records them as A1111 does; bad files are one line each, exit non-zero, nothing written.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sdiree.runtime.generate import generate_to_files

pytest.importorskip("torch")
from make_tiny_lora import make_tiny_lora  # noqa: E402  (tools/, on sys.path via conftest)
from parity import psnr  # noqa: E402
from to_single_file import vae_to_ldm, write_single_file  # noqa: E402

PROMPT = "a lighthouse on a cliff"
SEED, STEPS, GUIDANCE = 7, 4, 7.5
TARGETS = [("cpu", "host"), ("vulkan-spirv", "lavapipe")]
TARGET_IDS = ["cpu", "lavapipe"]


def _moved(src, dst, seed: int, components=("unet", "vae", "text_encoder"), amount=0.05):
    """A copy of diffusers folder src with the weights of `components` moved by a little noise."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    for comp in components:
        for f in sorted((dst / comp).glob("*.safetensors")):
            with safe_open(str(f), "np") as fh:
                meta = fh.metadata()
                sd = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            for k, v in sd.items():
                if v.dtype.kind == "f":
                    noise = rng.standard_normal(v.shape).astype(v.dtype)
                    sd[k] = v + noise * np.float32(amount * (float(v.std()) + 1e-3))
            save_file(sd, str(f), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def fine_tune(tiny_model, tmp_path_factory):
    return _moved(tiny_model, tmp_path_factory.mktemp("ft") / "tiny-ft", seed=1)


@pytest.fixture(scope="module")
def fine_tune_file(fine_tune, tmp_path_factory):
    return write_single_file(fine_tune, tmp_path_factory.mktemp("ftfile") / "tiny-ft.safetensors")


@pytest.fixture(scope="module")
def compiled_fine_tune(fine_tune, tmp_path_factory):
    """The fine-tune compiled for each target, on first use."""
    from sdiree.compile.driver import CompileOptions, compile_model
    from sdiree.compile.report import Reporter

    root = tmp_path_factory.mktemp("ft-art")
    done = {}

    def get(target, arch):
        if (target, arch) not in done:
            out = root / f"{target}-{arch}"
            compile_model(
                CompileOptions(
                    model_dir=fine_tune, target=target, arch=arch, dtype="fp32", out=out
                ),
                Reporter(stream=io.StringIO()),
            )
            done[(target, arch)] = out
        return done[(target, arch)]

    return get


def _run(art, out, **kw):
    """`sdiree run`'s image (RGB) and PNG parameters, euler with this file's prompt, steps,
    guidance and seed unless kw names others (tests/runtime/weights/test_sdxl_weights.py)."""
    from PIL import Image

    args = {"prompt": PROMPT, "steps": STEPS, "guidance_scale": GUIDANCE, "seed": SEED}
    (path,) = generate_to_files(artifact_dir=art, scheduler="euler", output=out, **{**args, **kw})
    img = Image.open(path)
    return np.asarray(img.convert("RGB")), img.text["parameters"]


def _diffusers(model_dir, prompt=PROMPT, setup=None):
    import diffusers
    import torch

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        model_dir, safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    if setup:
        setup(pipe)
    image = pipe(
        prompt,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
    ).images[0]
    return (image * 255).round().astype(np.uint8)


@pytest.mark.parametrize("target,arch", TARGETS, ids=TARGET_IDS)
def test_weights_file_makes_the_image_of_compiling_it(
    compiled, compiled_fine_tune, fine_tune_file, target, arch, tmp_path
):
    art = compiled.get(target, arch, "fp32")
    ours, params = _run(art, tmp_path / "w.png", weights=fine_tune_file)
    theirs, _ = _run(compiled_fine_tune(target, arch), tmp_path / "c.png")
    base, _ = _run(art, tmp_path / "b.png")
    assert psnr(ours, theirs) >= 60.0
    assert psnr(base, theirs) < 40.0  # the fine-tune is not the model itself
    sha = hashlib.sha256(fine_tune_file.read_bytes()).hexdigest()
    assert f"Model hash: {sha[:10]}, Model: tiny-ft," in params


def test_weights_from_a_diffusers_folder_and_a_ckpt(compiled, fine_tune, fine_tune_file, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    from_file, _ = _run(art, tmp_path / "f.png", weights=fine_tune_file)
    from_folder, _ = _run(art, tmp_path / "d.png", weights=fine_tune)
    ckpt = write_single_file(fine_tune, tmp_path / "tiny-ft.ckpt")
    from_ckpt, _ = _run(art, tmp_path / "k.png", weights=ckpt)
    assert psnr(from_folder, from_file) >= 60.0
    assert psnr(from_ckpt, from_file) >= 60.0


@pytest.mark.parametrize(
    "target,arch,fmt",
    [("cpu", "host", "kohya"), ("cpu", "host", "peft"), ("vulkan-spirv", "lavapipe", "kohya")],
    ids=["cpu-kohya", "cpu-peft", "lavapipe-kohya"],
)
def test_lora_at_0_8_matches_diffusers(compiled, tiny_model, target, arch, fmt, tmp_path):
    # one alpha per kind, as kohya writes: diffusers misreads per-layer alphas of kohya files
    lora = make_tiny_lora(
        tiny_model, tmp_path / f"style-{fmt}.safetensors", fmt=fmt, seed=3, alphas="kohya"
    )
    art = compiled.get(target, arch, "fp32")
    ours, params = _run(art, tmp_path / "l.png", loras=[f"{lora}:0.8"])

    def with_lora(pipe):
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="style")
        pipe.fuse_lora(lora_scale=0.8, components=["unet", "text_encoder"])

    ref = _diffusers(tiny_model, setup=with_lora)
    plain = _diffusers(tiny_model)
    assert psnr(ours, ref) >= 40.0
    assert psnr(plain, ref) < 40.0  # the LoRA changes the image
    assert f'Lora hashes: "style-{fmt}: ' in params


def test_lora_from_a_prompt_tag(compiled, tiny_model, tmp_path):
    loras = tmp_path / "loras"
    lora = make_tiny_lora(tiny_model, loras / "detail.safetensors", fmt="kohya", seed=5)
    art = compiled.get("cpu", "host", "fp32")
    tagged, params = _run(
        art, tmp_path / "t.png", prompt=PROMPT + " <lora:detail:0.6>", lora_dir=loras
    )
    option, _ = _run(art, tmp_path / "o.png", loras=[f"{lora}:0.6"])
    assert psnr(tagged, option) >= 60.0  # the tag is taken out of the prompt text
    assert params.startswith(PROMPT + " <lora:detail:0.6>")


def test_vae_file_matches_diffusers(compiled, tiny_model, tmp_path):
    import diffusers
    from safetensors.numpy import load_file, save_file

    moved = _moved(tiny_model, tmp_path / "vae-moved", seed=4, components=("vae",), amount=0.2)
    (vae_file,) = (moved / "vae").glob("*.safetensors")
    config = json.loads((moved / "vae" / "config.json").read_text())
    ldm = tmp_path / "my-vae.safetensors"
    save_file(
        {k: np.ascontiguousarray(v) for k, v in vae_to_ldm(load_file(vae_file), config).items()},
        str(ldm),
    )
    art = compiled.get("cpu", "host", "fp32")
    ours, params = _run(art, tmp_path / "v.png", vae=ldm)

    def with_vae(pipe):
        pipe.vae = diffusers.AutoencoderKL.from_pretrained(moved / "vae", local_files_only=True)

    assert psnr(ours, _diffusers(tiny_model, setup=with_vae)) >= 40.0
    assert psnr(ours, _diffusers(tiny_model)) < 40.0
    sha = hashlib.sha256(ldm.read_bytes()).hexdigest()
    assert f"VAE hash: {sha[:10]}, VAE: my-vae.safetensors" in params


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def bad_files(tiny_model, tiny_sd2_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    from safetensors.numpy import save_file

    truncated = d / "truncated.safetensors"
    whole = write_single_file(tiny_model, d / "whole.safetensors")
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    nomatch = d / "nomatch.safetensors"
    save_file(
        {
            "lora_unet_nothing_here.lora_down.weight": np.zeros((2, 8), np.float32),
            "lora_unet_nothing_here.lora_up.weight": np.zeros((8, 2), np.float32),
        },
        str(nomatch),
    )
    return {
        "truncated": truncated,
        "text": (d / "notes.safetensors", d.joinpath("notes.safetensors").write_text("hello")),
        "sd2-weights": write_single_file(tiny_sd2_model, d / "sd2.safetensors"),
        "sd2-lora": make_tiny_lora(tiny_sd2_model, d / "sd2-lora.safetensors", fmt="kohya"),
        "nomatch": nomatch,
        "lora": make_tiny_lora(tiny_model, d / "ok-lora.safetensors", fmt="kohya"),
    }


@pytest.mark.parametrize(
    "case,needle",
    [
        (("--weights", "truncated"), "truncated"),
        (("--weights", "text"), "notes.safetensors"),
        (("--weights", "sd2-weights"), "SD 2.x checkpoint"),
        (("--lora", "sd2-lora"), "sd2-lora"),
        (("--lora", "nomatch"), "matches none"),
        (("--lora", "lora:nan"), "not a finite number"),
        (("--vae", "sd2-lora"), "no VAE weights"),
    ],
    ids=[
        "truncated",
        "not-a-checkpoint",
        "other-family",
        "lora-other-family",
        "lora-no-match",
        "strength-nan",
        "vae-not-a-vae",
    ],  # fmt: skip
)
def test_bad_files_are_one_line(compiled, bad_files, case, needle, tmp_path):
    option, name = case
    key, _, suffix = name.partition(":")
    value = bad_files[key]
    value = value[0] if isinstance(value, tuple) else value
    value = f"{value}:{suffix}" if suffix else value
    art = compiled.get("cpu", "host", "fp32")
    out = tmp_path / "never.png"
    r = _cli(art, "--prompt", "x", "--steps", "1", option, value, "-o", out)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1], r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())
