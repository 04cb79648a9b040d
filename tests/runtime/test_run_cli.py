"""`sdiree run` and `sdiree devices` from the command line: output files, PNG metadata, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from sdiree.runtime.errors import UserError


def sdiree(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def assert_clean_failure(proc, must_say):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert must_say in lines[0], lines[0]


@pytest.fixture(scope="module")
def cpu_art(compiled):
    return compiled.get("cpu", "host", "fp32")


def test_run_writes_png_with_parameters(cpu_art, tmp_path):
    out = tmp_path / "lighthouse.png"
    proc = sdiree("run", cpu_art, "--prompt", "a lighthouse at dusk", "--seed", 42, "-o", out,
                  "--steps", 6, "--scheduler", "dpmpp-2m-karras")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    img = Image.open(out)
    assert img.size == (64, 64) and img.mode == "RGB"
    params = img.text["parameters"]
    manifest = json.loads((cpu_art / "manifest.json").read_text())
    # A1111's infotext: its key order, the sampler and schedule type apart (A1111 >= 1.9), the
    # model's content hash for "Model hash", and "RNG: CPU" (else A1111 assumes GPU noise).
    assert params == (
        "a lighthouse at dusk\nSteps: 6, Sampler: DPM++ 2M, Schedule type: Karras, "
        "CFG scale: 7.5, Seed: 42, Size: 64x64, "
        f"Model hash: {manifest['model']['content_hash'][:10]}, "
        f"Model: {manifest['model']['name']}, "
        "RNG: CPU, Target: cpu, Arch: host, Dtype: fp32"
    )
    assert "s/step" in proc.stderr and "decode" in proc.stderr  # timing summary
    # never overwrites without --overwrite
    again = sdiree("run", cpu_art, "--prompt", "x", "--seed", 1, "-o", out, "--steps", 2)
    assert_clean_failure(again, "--overwrite")
    assert Image.open(out).text["parameters"] == params
    assert (
        sdiree("run", cpu_art, "--prompt", "x", "-o", out, "--steps", 2, "--overwrite").returncode
        == 0
    )


@pytest.mark.parametrize("seed", [[], ["--seed", -1]], ids=["no-seed", "seed-minus-1"])
def test_random_seed_is_printed_and_stored(cpu_art, tmp_path, seed):
    proc = sdiree("run", cpu_art, "--prompt", "a", "--steps", 2, "-o", tmp_path / "r.png", *seed)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stderr.split("seed ", 1)[1].split(",")[0]
    assert printed.isdigit() and 0 <= int(printed) < 2**32
    assert f"Seed: {printed}," in Image.open(tmp_path / "r.png").text["parameters"]


def test_each_image_is_remade_alone_from_its_own_seed(cpu_art, tmp_path):
    # A1111's batches: image i is made from seed + i with its own generator, and says so.
    proc = sdiree("run", cpu_art, "--prompt", "a", "--steps", 2, "--num-images", 2, "--seed", 5,
                  "--scheduler", "euler-a", "-o", tmp_path / "cat.png")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    a, b = (Image.open(tmp_path / f"cat-{i}.png") for i in (0, 1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert "Seed: 5," in a.text["parameters"] and "Seed: 6," in b.text["parameters"]
    assert a.text["parameters"].replace("Seed: 5,", "Seed: 6,") == b.text["parameters"]
    for seed, image in ((6, b), (5, a)):
        alone = tmp_path / f"alone-{seed}.png"
        proc = sdiree("run", cpu_art, "--prompt", "a", "--steps", 2, "--seed", seed,
                      "--scheduler", "euler-a", "-o", alone)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_array_equal(np.asarray(Image.open(alone)), np.asarray(image))


def test_long_prompt_warns_how_many_tokens_dropped(cpu_art, tmp_path):
    proc = sdiree("run", cpu_art, "--prompt", "a red lighthouse " * 40, "--steps", 1, "--seed", 1,
                  "-o", tmp_path / "l.png")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "token(s)" in proc.stderr and "dropped" in proc.stderr


def test_devices_lists_lavapipe_as_cpu_implementation():
    proc = sdiree("devices")
    assert proc.returncode == 0, proc.stderr
    assert "local-task" in proc.stdout
    assert "llvmpipe" in proc.stdout and "CPU implementation" in proc.stdout
    assert "cooperative matrix no" in proc.stdout and "runs --arch lavapipe" in proc.stdout


def test_vulkan_run_on_lavapipe(compiled, tmp_path):
    art = compiled.get("vulkan-spirv", "lavapipe", "fp32")
    proc = sdiree("run", art, "--prompt", "a", "--steps", 2, "--seed", 1, "-o", tmp_path / "v.png")
    assert proc.returncode == 0, proc.stderr
    assert "device: vulkan:0" in proc.stderr
    assert "Target: vulkan-spirv" in Image.open(tmp_path / "v.png").text["parameters"]


# -- bad input ------------------------------------------------------------------------------


@pytest.fixture
def art_copy(compiled, tmp_path):
    """A private copy of a compiled tree (artifact dir plus the shared params beside it)."""

    def make(target="cpu", arch="host", dtype="fp32"):
        src = compiled.get(target, arch, dtype)
        root = tmp_path / "copy"
        shutil.copytree(
            src.parent, root, ignore=shutil.ignore_patterns("cpu-killed", "cpu-flag-change")
        )
        return root / src.name

    return make


BAD_RUNS = [
    (["--steps", 0], "at least 1"),
    (["--steps", -3], "at least 1"),
    (["--guidance-scale", "nan"], "finite"),
    (["--guidance-scale", "inf"], "finite"),
    (["--scheduler", "heun"], "unknown scheduler 'heun'"),
    (["--width", 128], "compiled for 64x64"),
    (["--height", 32], "compiled for 64x64"),
    (["--device", "vulkan:7"], "vulkan device"),
    (["--device", "no-such-gpu"], "no vulkan device has 'no-such-gpu'"),
]


@pytest.mark.parametrize(
    "extra,must_say", BAD_RUNS, ids=[" ".join(map(str, b[0])) for b in BAD_RUNS]
)
def test_bad_run_arguments(cpu_art, tmp_path, extra, must_say):
    out = tmp_path / "o.png"
    assert_clean_failure(sdiree("run", cpu_art, "--prompt", "a", "-o", out, *extra), must_say)
    assert not out.exists()


def test_missing_artifact_dir(tmp_path):
    assert_clean_failure(sdiree("run", tmp_path / "nope", "--prompt", "a"), "does not exist")


def test_output_in_missing_directory(cpu_art, tmp_path):
    out = tmp_path / "missing" / "o.png"
    assert_clean_failure(sdiree("run", cpu_art, "--prompt", "a", "-o", out), "does not exist")
    assert not out.parent.exists()


def test_unknown_schema(art_copy, tmp_path):
    art = art_copy()
    m = json.loads((art / "manifest.json").read_text())
    m["schema_version"] = 99
    (art / "manifest.json").write_text(json.dumps(m))
    assert_clean_failure(
        sdiree("run", art, "--prompt", "a", "-o", tmp_path / "o.png"), "schema version 99"
    )


def _unet_file(art, which):
    unet = json.loads((art / "manifest.json").read_text())["submodules"]["unet"]
    if which == "encoded":  # the cpu UNet's weights repacked at compile time
        return art / next(e["path"] for e in unet["extra_parameters"] if "encoded" in e["path"])
    return (art / unet[which]).resolve()


@pytest.mark.parametrize("which", ["vmfb", "parameters", "encoded"])
def test_tampered_files_refused(art_copy, tmp_path, which):
    art = art_copy()
    victim = _unet_file(art, which)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "o.png"
    assert_clean_failure(
        sdiree("run", art, "--prompt", "a", "-o", out), "does not match its sha256"
    )
    assert not out.exists()


def test_missing_encoded_archive_refused(art_copy, tmp_path):
    art = art_copy()
    _unet_file(art, "encoded").unlink()
    out = tmp_path / "o.png"
    proc = sdiree("run", art, "--prompt", "a", "-o", out)
    assert_clean_failure(proc, "unet.encoded.irpa")
    assert not out.exists()


def test_arch_device_mismatch_refused(art_copy, tmp_path):
    art = art_copy("vulkan-spirv", "lavapipe", "fp32")
    m = json.loads((art / "manifest.json").read_text())
    m["target"].update(arch="rdna3", arch_cpu_emulated=False)  # as if built for a Radeon GPU
    (art / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "o.png"
    proc = sdiree("run", art, "--prompt", "a", "-o", out)
    assert_clean_failure(proc, "compile with --arch lavapipe")
    assert not out.exists()


def _run_with_target(art, target: dict, tmp_path):
    """`sdiree run` on art with its manifest's target fields updated from target."""
    m = json.loads((art / "manifest.json").read_text())
    m["target"].update(target)
    (art / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "o.png"
    return sdiree("run", art, "--prompt", "a", "-o", out), out


def test_arch_needs_what_the_device_lacks_refused(art_copy, tmp_path):
    """The manifest's device_requires (the rdna3 preset's, with cooperative matrices, which no
    preset asks for today) against what lavapipe reports."""
    from sdiree.runtime.targets import load_registry

    rdna3 = load_registry().target("vulkan-spirv").arch("rdna3")
    # arch_cpu_emulated kept
    target = {"arch": "rdna3", "device_requires": {**rdna3.device, "cooperative_matrix": True}}
    proc, out = _run_with_target(art_copy("vulkan-spirv", "lavapipe", "fp32"), target, tmp_path)
    assert_clean_failure(proc, "cooperative matrices")
    assert "subgroup size 32 and 64" in proc.stderr and "--arch lavapipe" in proc.stderr
    assert not out.exists()


def test_cpu_features_the_kernels_need_are_checked(art_copy, tmp_path):
    """The manifest's cpu_requires (sdiree's AMX kernel's features, when an export links it)
    against this CPU: one clear line where it lacks one, no image."""
    target = {"cpu_requires": ["amx_bf16", "no_such_feature"]}
    proc, out = _run_with_target(art_copy("cpu", "host", "fp32"), target, tmp_path)
    assert_clean_failure(proc, "needs ")
    assert "no_such_feature" in proc.stderr and "compile the model on this machine" in proc.stderr
    assert not out.exists()


def test_an_amx_artifact_says_what_it_needs(compiled):
    """A host bf16 artifact lists the features of sdiree's kernels where its export links them:
    on an AMX CPU AMX's and the AVX-512 of the kernels' epilogues, on one with avx512_bf16 and no
    AMX (`kernel_isa: avx512_bf16`) that AVX-512 alone."""
    from sdiree.runtime.cpu_features import host_cpu_features

    m = json.loads((compiled.get("cpu", "host", "bf16") / "manifest.json").read_text())
    have = host_cpu_features()
    avx512 = ["avx512_bf16", "avx512bw", "avx512dq", "avx512f", "avx512vl"]
    if {"amx_bf16", "amx_tile"} <= have:
        needs = ["amx_bf16", "amx_tile", *avx512]
    elif "avx512_bf16" in have:
        needs = avx512
    else:
        needs = None
    assert m["target"].get("cpu_requires") == needs
    assert not needs or set(needs) <= have  # names as this machine reports them
    assert (m["submodules"]["unet"]["export"].get("linear") == "amx") == bool(needs)


def test_cpu_artifact_refuses_vulkan_device(cpu_art, tmp_path):
    proc = sdiree("run", cpu_art, "--prompt", "a", "--device", "vulkan", "-o", tmp_path / "o.png")
    assert_clean_failure(proc, "compiled for cpu")


def test_nan_result_reported_not_saved(cpu_art, tmp_path, monkeypatch):
    from sdiree.runtime import generate, session

    real_call = session.Session.call

    def nan_decode(self, sub, fn, *args):
        out = real_call(self, sub, fn, *args)
        return [np.full_like(o, np.nan) for o in out] if sub == "vae_decoder" else out

    monkeypatch.setattr(session.Session, "call", nan_decode)
    out = tmp_path / "nan.png"
    with pytest.raises(UserError, match="NaN"):
        generate.generate_to_files(artifact_dir=cpu_art, prompt="a", steps=1, seed=1, output=out)
    assert not out.exists()
