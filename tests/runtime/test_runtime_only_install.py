"""A runtime-only install (the wheel, no extras) is small, makes images without torch, and says
how to get the compile extra instead of failing with a traceback.

Builds the wheel and a fresh venv (about 30 s with the package registry or a wheel cache at
hand), so it is marked slow; CI runs it (`pytest -m "not gpu"`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from sdiree.runtime import __version__

ROOT = Path(__file__).resolve().parents[2]
# The README's "Set up" states this budget and what fills it; measured 125 MB with numpy 2.4
# and iree-base-runtime 3.13 (numpy 73, iree 45, regex 4, ml_dtypes 2, sdiree 2).
BUDGET_MB = 140
# What a fresh venv holds before anything is installed into it: not part of sdiree's footprint.
VENV_TOOLING = {"pip", "setuptools", "_distutils_hack", "pkg_resources"}

pytestmark = pytest.mark.slow


def _is_tooling(entry: Path) -> bool:
    return entry.name.split("-")[0] in VENV_TOOLING or entry.name == "distutils-precedence.pth"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with only the sdiree wheel (built from a clean copy of this tree)."""
    tmp = tmp_path_factory.mktemp("runtime-only")
    src = tmp / "src"
    # A copy, so a stale build/ of the checkout cannot leak files into the wheel.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "artifacts", "*.egg-info", "__pycache__", ".*cache", ".venv*",
        ".benchmarks",
    ))  # fmt: skip
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    wheels = tmp / "wheels"
    _pip(py, "wheel", "--no-deps", "-w", wheels, src)
    (wheel,) = wheels.glob("sdiree-*.whl")
    _pip(py, "install", wheel)
    return venv


def _pip(py: str, *args) -> None:
    cmd = [py, "-m", "pip", "-q", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _sdiree(venv: Path, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "sdiree"), *map(str, args)],
        capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600,
    )  # fmt: skip


def test_runtime_only_install_is_small_and_torch_free(venv):
    (site,) = venv.glob("lib/python3*/site-packages")
    sizes = {e.name: _size(e) for e in site.iterdir() if not _is_tooling(e)}
    total_mb = sum(sizes.values()) / 1e6
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    listing = ", ".join(f"{name} {size / 1e6:.0f}" for name, size in top)
    print(f"\nruntime-only install: {total_mb:.0f} MB ({listing})")
    assert total_mb <= BUDGET_MB, f"{total_mb:.0f} MB installed, over {BUDGET_MB}: {listing}"
    heavy = ("torch", "diffusers", "transformers", "PIL", "typer", "rich", "pydantic", "scipy")
    assert not [name for name in heavy if (site / name).exists()], sorted(sizes)
    assert not (site / "iree" / "compiler").exists()


def test_runtime_only_version_and_help(venv):
    proc = _sdiree(venv, "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"sdiree {__version__}", proc.stdout
    proc = _sdiree(venv, "run", "--help")
    assert proc.returncode == 0 and "dpmpp-2m-karras" in proc.stdout, proc.stderr


@pytest.mark.parametrize("command", ["compile", "bench"])
def test_runtime_only_compile_says_how_to_install(venv, command, tmp_path):
    proc = _sdiree(venv, command, tmp_path / "model", "--target", "cpu")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "pip install 'sdiree[compile]'" in lines[0]
    assert "pip install -e '.[compile]'" in lines[0]
    assert "torch" in lines[0]


def test_runtime_only_venv_runs_prebuilt_artifacts(venv, compiled, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(
        art.parent,
        prebuilt,
        ignore=shutil.ignore_patterns("mlir", "cpu-*", "vulkan-*", "rocm-*", "cuda-*"),
    )
    shutil.copytree(art, prebuilt / art.name)
    out = tmp_path / "img.png"
    run = _sdiree(venv, "run", prebuilt / art.name, "--prompt", "a lighthouse", "--steps", 3,
                  "--seed", 1, "-o", out, cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    with Image.open(out) as im:
        assert im.format == "PNG" and im.text["parameters"].startswith("a lighthouse\n")
