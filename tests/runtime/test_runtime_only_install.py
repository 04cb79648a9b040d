"""A runtime-only install (`pip install .`, no extras) makes images without torch.

Builds a fresh venv, so it is marked slow; CI runs it (`pytest -m "not gpu"`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.slow
def test_runtime_only_venv_runs_prebuilt_artifacts(compiled, tmp_path):
    art = compiled.get("cpu", "host", "fp32")
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(
        art.parent,
        prebuilt,
        ignore=shutil.ignore_patterns("mlir", "cpu-*", "vulkan-*", "rocm-*", "cuda-*"),
    )
    shutil.copytree(art, prebuilt / art.name)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", str(ROOT)], capture_output=True, text=True, env=env
    )
    assert pip.returncode == 0, pip.stderr[-3000:]

    check = subprocess.run(
        [str(py), "-c", "import importlib.util as u; print([m for m in "
         "('torch','diffusers','transformers','iree.compiler') if u.find_spec(m.split('.')[0]) "
         "and (m != 'iree.compiler' or u.find_spec(m))])"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert check.stdout.strip() == "[]", check.stdout

    out = tmp_path / "img.png"
    run = subprocess.run(
        [str(venv / "bin" / "sdiree"), "run", str(prebuilt / art.name), "--prompt", "a lighthouse",
         "--steps", "3", "--seed", "1", "-o", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert out.is_file()
    size_mb = dir_size(venv) / 1e6
    print(f"\nruntime-only venv: {size_mb:.0f} MB installed")
    assert size_mb < 400  # goal < 150 MB; this bound only catches torch & co. sneaking in
