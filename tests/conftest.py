"""Shared fixtures: the tiny SD 1.x model and its compiled artifacts, built once per session.

Artifacts are compiled through the same code path as `sdiree compile` and cached for the whole
test session, so compile tests and runtime tests share them. When the compile tests are
collected, the artifacts they will ask for are compiled ahead, one at a time, by a background
`sdiree compile` process beside the test that is running: each compile leaves much of this
machine's second core idle (export is single-threaded), and these compiles are most of the
suite's time.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from concurrent.futures import Future
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


# Compiled ahead when tests/compile/test_compile_targets.py is collected: the artifacts it
# needs besides cpu fp32 (the first one every run needs, compiled in the foreground). cpu bf16
# comes last: it shares cpu fp32's export, which is done by then.
AHEAD = (
    ("vulkan-spirv", "lavapipe", "fp32"),
    ("cpu", "host", "fp16"),
    ("vulkan-spirv", "lavapipe", "fp16"),
    ("rocm", "gfx942", "fp16"),
    ("cuda", "sm_80", "fp16"),
    ("cpu", "host", "bf16"),
)
_ahead_wanted = False


def pytest_collection_modifyitems(items):
    global _ahead_wanted
    _ahead_wanted = any(i.nodeid.startswith("tests/compile/test_compile_targets.py") for i in items)


class CompiledArtifacts:
    """Compile-once cache keyed by (target, arch, dtype)."""

    def __init__(self, model: Path, root: Path):
        self.model = model
        self.root = root
        self._done: dict = {}
        self._ahead: dict[tuple, Future] = {}

    def out_dir(self, target: str, arch: str, dtype: str) -> Path:
        return self.root / "tiny-sd" / f"{target}-{arch}-{dtype}"

    def compile_ahead(self, keys) -> None:
        """Compile keys one after another in a background process; get() waits for them."""
        for key in keys:
            self._ahead[key] = Future()
        threading.Thread(target=self._run_ahead, args=(keys,), daemon=True).start()

    def _run_ahead(self, keys) -> None:
        for key in keys:
            target, arch, dtype = key
            cmd = [
                sys.executable, "-c", "from sdiree.runtime.cli import main; main()",
                "compile", str(self.model), "--target", target, "--arch", arch,
                "--dtype", dtype, "--out", str(self.out_dir(*key)),
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            self._ahead[key].set_result(done)

    def get(self, target: str, arch: str, dtype: str) -> Path:
        key = (target, arch, dtype)
        if key in self._ahead and key not in self._done:
            done = self._ahead[key].result()
            if done.returncode != 0:
                raise RuntimeError(f"compile {key} failed:\n{done.stdout}\n{done.stderr}")
            self._done[key] = self.out_dir(*key)
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
    artifacts = CompiledArtifacts(tiny_model, artifacts_root)
    if _ahead_wanted:
        artifacts.compile_ahead(AHEAD)
    return artifacts
