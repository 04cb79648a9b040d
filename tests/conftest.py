"""Shared fixtures: the tiny SD 1.x and SD 2.x models and their compiled artifacts, built once
per session (`compiled`, `compiled_sd2`).

Artifacts are compiled through the same code path as `sdiree compile` and cached for the whole
test session, so compile tests and runtime tests share them. When the compile tests are
collected, the artifacts they will ask for are queued for a background `sdiree compile`
process that works through them beside the tests, while a test that needs one not started yet
compiles it itself: one compile keeps this 2-core machine ~1.1 cores busy (export is
single-threaded), and these compiles are most of the suite's time. Their shared compile cache
(exported MLIR, parameter archives) is a session folder named by $SDIREE_CACHE, never the
user's own cache.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from subprocess import PIPE, STDOUT, Popen

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("models") / "tiny-sd", seed=0)


@pytest.fixture(scope="session")
def tiny_sd2_model(tmp_path_factory) -> Path:
    """A tiny SD 2.1-architecture model (v-prediction, gelu text encoder, linear projections,
    per-block head counts, attention upcast), 64x64."""
    pytest.importorskip("torch")
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("models") / "tiny-sd2", seed=0, family="sd2")


@pytest.fixture(scope="session")
def tiny_inpaint_model(tmp_path_factory) -> Path:
    """A tiny SD 1.x inpainting model (StableDiffusionInpaintPipeline, 9-channel UNet), 64x64."""
    pytest.importorskip("torch")
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("models") / "tiny-sd-inpaint", seed=0, inpaint=True)


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory) -> Path:
    """$SDIREE_CACHE for the session: where compiles with --out keep what artifacts share."""
    cache = tmp_path_factory.mktemp("sdiree-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDIREE_CACHE", str(cache))
        yield cache


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
    """Compile-once cache keyed by (target, arch, dtype), with an optional queue of keys that a
    background process compiles one after another while the tests run. get() takes a queued key
    that the background has not started yet and compiles it itself, so both cores stay busy."""

    def __init__(self, model: Path, root: Path):
        self.model = model
        self.root = root
        self._done: dict = {}
        self._lock = threading.Lock()
        self._queue: list[tuple] = []  # not started yet
        self._ahead: dict[tuple, Future] = {}  # started in the background
        self._proc: Popen | None = None
        self._stopped = False

    def out_dir(self, target: str, arch: str, dtype: str) -> Path:
        return self.root / self.model.name / f"{target}-{arch}-{dtype}"

    def compile_ahead(self, keys) -> None:
        self._queue = list(keys)
        threading.Thread(target=self._run_ahead, daemon=True).start()

    def _take(self) -> tuple | None:
        with self._lock:
            if self._stopped or not self._queue:
                return None
            key = self._queue.pop(0)
            self._ahead[key] = Future()
            return key

    def _run_ahead(self) -> None:
        while (key := self._take()) is not None:
            target, arch, dtype = key
            cmd = [
                sys.executable, "-m", "sdiree.runtime.cli", "compile", str(self.model),
                "--target", target, "--arch", arch, "--dtype", dtype,
                "--out", str(self.out_dir(*key)),
            ]  # fmt: skip
            try:
                # its own process group: stop_ahead() kills it with its iree-compile child
                self._proc = Popen(
                    cmd, stdout=PIPE, stderr=STDOUT, text=True, start_new_session=True
                )
                output, _ = self._proc.communicate()
                self._ahead[key].set_result((self._proc.returncode, output))
            except BaseException as error:  # handed to the test that waits for it
                self._ahead[key].set_exception(error)

    def stop_ahead(self) -> None:
        """At the session's end: no compile goes on writing into its temporary folders."""
        with self._lock:
            self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def get(self, target: str, arch: str, dtype: str) -> Path:
        key = (target, arch, dtype)
        if key in self._done:
            return self._done[key]
        with self._lock:
            if key in self._queue:
                self._queue.remove(key)  # not started: compiled here instead
            started = self._ahead.get(key)
        if started is not None:
            code, output = started.result()
            if code != 0:
                raise RuntimeError(f"compile {key} failed (exit {code}):\n{output}")
        else:
            from sdiree.compile.driver import CompileOptions, compile_model
            from sdiree.compile.report import Reporter

            compile_model(
                CompileOptions(
                    model_dir=self.model,
                    target=target,
                    arch=arch,
                    dtype=dtype,
                    out=self.out_dir(*key),
                ),
                Reporter(stream=io.StringIO()),
            )
        self._done[key] = self.out_dir(*key)
        return self._done[key]


@pytest.fixture(scope="session")
def compiled(tiny_model, artifacts_root):
    artifacts = CompiledArtifacts(tiny_model, artifacts_root)
    if _ahead_wanted:
        artifacts.compile_ahead(AHEAD)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_sd2(tiny_sd2_model, artifacts_root):
    """The tiny SD 2.x model's artifacts, compiled on first use (no background queue: its
    tests need few of them)."""
    artifacts = CompiledArtifacts(tiny_sd2_model, artifacts_root)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_inpaint(tiny_inpaint_model, artifacts_root):
    """The tiny inpainting model's artifacts, compiled on first use."""
    artifacts = CompiledArtifacts(tiny_inpaint_model, artifacts_root)
    yield artifacts
    artifacts.stop_ahead()
