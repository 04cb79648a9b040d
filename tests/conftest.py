"""Shared fixtures: the tiny SD 1.x model and its compiled artifacts, built once per session.

Artifacts are compiled through the same code path as `sdiree compile` and cached for the whole
test session, so compile tests and runtime tests share them.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("models") / "tiny-sd", seed=0)


@pytest.fixture(scope="session")
def artifacts_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


class CompiledArtifacts:
    """Compile-once cache keyed by (target, arch, dtype)."""

    def __init__(self, model: Path, root: Path):
        self.model = model
        self.root = root
        self._done: dict = {}

    def out_dir(self, target: str, arch: str, dtype: str) -> Path:
        return self.root / "tiny-sd" / f"{target}-{arch}-{dtype}"

    def get(self, target: str, arch: str, dtype: str) -> Path:
        key = (target, arch, dtype)
        if key not in self._done:
            from sdiree.compile.driver import CompileOptions, compile_model
            from sdiree.compile.report import Reporter

            log = io.StringIO()
            compile_model(
                CompileOptions(
                    model_dir=self.model,
                    target=target,
                    arch=arch,
                    dtype=dtype,
                    out=self.out_dir(*key),
                ),
                Reporter(stream=log),
            )
            self._done[key] = self.out_dir(*key)
        return self._done[key]


@pytest.fixture(scope="session")
def compiled(tiny_model, artifacts_root) -> CompiledArtifacts:
    return CompiledArtifacts(tiny_model, artifacts_root)
