"""Shared fixtures: the tiny SD 1.x, SD 2.x and SDXL models and their compiled artifacts, built
once per session (`compiled`, `compiled_sd2`, `compiled_sdxl`).

Artifacts are compiled through the same code path as `sdiree compile` and cached for the whole
test session, so compile tests and runtime tests share them. The artifacts the collected tests
will ask for are queued at the first test for a background compile process that works through
them, while the test files that need no artifact run first, beside it. A test that needs one
not started yet compiles it itself; one that would wait for the background compiles the next
queued one meanwhile: one compile keeps this 2-core machine ~1.1 cores busy (export is
single-threaded), and these compiles are most of the suite's time. Their shared compile cache
(exported MLIR, parameter archives) is a session folder named by $SDIREE_CACHE, never the
user's own cache. $SDIREE_TEST_QUEUE_LOG names a file where each compile's start and end and
each test's wait are written (seconds since the epoch), to see the suite's critical path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from subprocess import PIPE, Popen

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from llvm_cpu import avx2_cpu_fp32, laid_out_cpu_fp32  # noqa: E402
from suite_progress import (  # noqa: E402, F401  (hooks: a crashed run's test, a resumed run)
    deselect_ended,
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
    record_failure,
)

# The tests share the 2 cores with the background compile: torch's OpenMP workers then spin at
# their barriers waiting for a core the compile holds (a tiny img2img parity test took 4.7 s
# with 2 threads, 0.4 s with 1; in a whole run up to 38 s). One thread for the tests' torch and
# OpenBLAS, and for the processes they start (set before any of them imports torch).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


@pytest.fixture(params=["amx", "avx512_bf16"])
def kernel_isa(request):
    """Each of sdiree's kernel instruction sets in turn (export choice `kernel_isa`) for the
    traces of a test: AMX's tiles, and AVX-512 bf16 dot products (kernels/amx_support.h)."""
    pytest.importorskip("torch")
    from sdiree.compile.exporters.amx_matmul import set_kernel_isa

    set_kernel_isa(request.param)
    yield request.param
    set_kernel_isa("amx")


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


@pytest.fixture(scope="session")
def tiny_sdxl_model(tmp_path_factory) -> Path:
    """A tiny SDXL base (two text encoders, text_time UNet, SDXL's Euler scheduler config, VAE
    scaling 0.13025 with force_upcast), 64x64."""
    pytest.importorskip("torch")
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("models") / "tiny-sdxl", seed=0, family="sdxl")


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
# needs besides cpu fp32 (the first one every run needs, queued before these). cpu bf16 comes
# last: it shares cpu fp32's export, which is done by then.
AHEAD = (
    ("vulkan-spirv", "lavapipe", "fp32"),
    ("cpu", "host", "fp16"),
    ("vulkan-spirv", "lavapipe", "fp16"),
    ("rocm", "gfx942", "fp16"),
    ("cuda", "sm_80", "fp16"),
    ("cpu", "host", "bf16"),
    # on an AMX CPU, the cpu fp32 artifact the prune, layout and re-pack tests take instead
    # of host's (llvm_cpu.laid_out_cpu_fp32); on a CPU with AVX-512, the AVX2 panels test's
    # (llvm_cpu.avx2_cpu_fp32: x86-64-v3's, the same artifact on an AMX CPU)
    *dict.fromkeys(
        k for k in (laid_out_cpu_fp32(), avx2_cpu_fp32()) if k != ("cpu", "host", "fp32")
    ),
)
# The tiny SDXL's artifacts, compiled in the background (after the SD 1.x ones) when a test
# that needs them is collected: cpu fp32 first, which the parity tests start with.
SDXL_AHEAD = (
    ("cpu", "host", "fp32"),
    ("vulkan-spirv", "lavapipe", "fp32"),
    ("rocm", "gfx942", "fp16"),
    ("cuda", "sm_80", "fp16"),
)
SDXL_TESTS = (
    "tests/compile/test_sdxl_targets.py",
    "tests/runtime/test_sdxl_parity.py",
    "tests/compile/test_bench_families.py",
)
# The tiny SD 1.x compiled for two image sizes, for tests/compile/test_compile_sizes.py: its main
# size not the model's own nor square (`--height/--width`; its latents take Winograd convs), and
# one more (`--sizes`) at an odd latent side (5x5: im2col, and the race its test looks for).
# Without the VAE encoder, which those tests never call: each size adds UNet and VAE functions,
# and this artifact was the suite's largest compile (cpu: 1,700 s with the model's 64x64 too, 3
# sizes and the encoder, an Intel Xeon under the suite's load; 332 s with 3 sizes, Zen 5).
SIZES_MAIN = (64, 48)  # (height, width) px
SIZES = ((40, 40),)  # besides SIZES_MAIN
SIZES_SUBMODULES = ("text_encoder", "unet", "vae_decoder")
SIZES_AHEAD = (("cpu", "host", "fp32"), ("vulkan-spirv", "lavapipe", "fp32"))
# The tiny SD 2.x's and inpainting model's artifacts, queued last (a test that gets there first
# compiles its own while the background works on the next).
SD2_AHEAD = (
    ("cpu", "host", "fp32"),
    ("vulkan-spirv", "lavapipe", "fp32"),
    ("rocm", "gfx942", "fp16"),
    ("cuda", "sm_80", "fp16"),
)
SD2_TESTS = ("tests/compile/test_sd2_targets.py", "tests/runtime/test_sd2_parity.py")
INPAINT_AHEAD = (("cpu", "host", "fp32"), ("vulkan-spirv", "lavapipe", "fp32"))
INPAINT_TESTS = ("tests/runtime/test_inpaint.py",)
_ahead_wanted = False
_sdxl_ahead_wanted = False
_sizes_ahead_wanted = False
_sd2_ahead_wanted = False
_inpaint_ahead_wanted = False
_artifact_fixtures_wanted: set[str] = set()  # of QUEUE_ORDER, by the tests collected


def pytest_collection_modifyitems(config, items):
    global _ahead_wanted, _sdxl_ahead_wanted, _sizes_ahead_wanted
    global _sd2_ahead_wanted, _inpaint_ahead_wanted, _artifact_fixtures_wanted
    deselect_ended(config, items)  # a resumed run (tests/suite_progress.py)
    _ahead_wanted = any(i.nodeid.startswith("tests/compile/test_compile_targets.py") for i in items)
    _sdxl_ahead_wanted = any(i.nodeid.startswith(SDXL_TESTS) for i in items)
    _sizes_ahead_wanted = any(
        i.nodeid.startswith("tests/compile/test_compile_sizes.py") for i in items
    )
    _sd2_ahead_wanted = any(i.nodeid.startswith(SD2_TESTS) for i in items)
    _inpaint_ahead_wanted = any(i.nodeid.startswith(INPAINT_TESTS) for i in items)
    _artifact_fixtures_wanted = _needing_artifacts_last(items)


# The order the background compiles the fixtures' artifacts in (`compiled` queues the others
# behind SD 1.x's). Longest first: the extra sizes' cpu compile is the suite's longest, and as
# the last job it ran alone on one core for ~90 s at the end, in a test that had taken it from
# the queue while it waited for a 10 s one (the queue ends on short jobs now).
QUEUE_ORDER = (
    "compiled", "compiled_sizes", "compiled_sdxl", "compiled_sd2", "compiled_inpaint",
)  # fmt: skip


def _needing_artifacts_last(items) -> set[str]:
    """Reorder items, whole files at a time (their module fixtures stay set up once): first
    the files none of whose tests needs a compiled artifact, which run while the background
    compiles them, then the others by the last of their fixtures in the queue's order, so a
    test seldom waits for an artifact the queue reaches late while others could run. Returns
    the artifact fixtures needed."""
    rank: dict[str, int] = {}
    wanted: set[str] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        mine = set(item.fixturenames) & set(QUEUE_ORDER)
        last = max((QUEUE_ORDER.index(f) + 1 for f in mine), default=0)
        rank[path] = max(rank.get(path, 0), last)
        wanted |= mine
    items.sort(key=lambda i: rank[i.nodeid.split("::")[0]])  # stable: file order kept
    return wanted


@pytest.fixture(scope="session", autouse=True)
def _compile_from_the_start(compile_cache, request):
    """The background starts on the artifacts at the first test, not at the first test that
    needs one: the tests that need none run beside it. SD 1.x's first (the `compiled` fixture
    queues the extra sizes' and the other models' behind its own)."""
    for fixture in QUEUE_ORDER:
        if fixture in _artifact_fixtures_wanted:
            request.getfixturevalue(fixture)


class AheadQueue:
    """One background thread for every model's queued compiles, run one at a time (a second
    beside the tests would oversubscribe the 2 cores) in one worker process (WORKER) that lives
    while the queue has jobs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: list[tuple] = []  # (CompiledArtifacts, key), not started yet
        self.proc: Popen | None = None  # the worker (WORKER)
        self.worker_log = None  # its stderr
        self.stopped = False
        self._thread: threading.Thread | None = None
        # The environment at the first queued job (the session's $SDIREE_CACHE): a compile
        # started while a test has monkeypatched it (its own cache) would otherwise write the
        # shared artifacts' archives into that test's cache.
        self.env: dict[str, str] | None = None

    def add(self, owner, keys) -> None:
        with self.lock:
            if self.env is None:
                self.env = dict(os.environ)
            self.items += [(owner, k) for k in keys]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()

    def take_back(self, owner, key) -> bool:
        """Remove a job not started yet (its test compiles it itself); True if it was queued."""
        with self.lock:
            if (owner, key) in self.items:
                self.items.remove((owner, key))
                return True
            return False

    def steal(self):
        """The next job not started yet, for a process that would otherwise wait: (owner, key,
        the Future its own get() waits on), or None."""
        with self.lock:
            return self._pop()

    def _next(self):
        with self.lock:
            job = self._pop()
            if job is None:
                self._thread = None
                if self.proc is not None:  # the worker ends once its stdin does
                    self.proc.stdin.close()
                    self.proc = None
            return job

    def _pop(self):
        """(owner, key, its Future) of the first job not started, marked started; the lock held."""
        if self.stopped or not self.items:
            return None
        owner, key = self.items.pop(0)
        owner._ahead[key] = Future()
        return owner, key, owner._ahead[key]

    def _run(self) -> None:
        while (job := self._next()) is not None:
            owner, key, future = job
            _queue_log("start", owner, key)
            try:
                future.set_result(self._compile(owner.options(key)))
            except BaseException as error:  # handed to the test that waits for it
                future.set_exception(error)
            _queue_log("end", owner, key)

    def _compile(self, options: dict) -> tuple[int, str]:
        """(exit status, output) of one compile in the worker process, started when needed."""
        if self.proc is None or self.proc.poll() is not None:
            self.worker_log = tempfile.TemporaryFile()  # noqa: SIM115 - the worker's stderr, for its life
            # its own process group: stop() kills it with its iree-compile child
            self.proc = Popen(
                [sys.executable, "-c", WORKER], stdin=PIPE, stdout=PIPE,
                stderr=self.worker_log, text=True, start_new_session=True, env=self.env,
            )  # fmt: skip
        self.proc.stdin.write(json.dumps(options) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if answer:
            answer = json.loads(answer)
            return answer["code"], answer["output"]
        code = self.proc.wait()
        self.worker_log.seek(0)
        tail = self.worker_log.read()[-4000:].decode(errors="replace")
        return code or 1, f"the background compile process died (exit status {code}):\n{tail}"

    def stop(self) -> None:
        """At the session's end: no compile goes on writing into its temporary folders."""
        with self.lock:
            self.stopped = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


_AHEAD = AheadQueue()


@contextlib.contextmanager
def _session_cache(queued: bool):
    """A queued job compiled by a waiting test uses the session's $SDIREE_CACHE, whatever that
    test set it to."""
    if not queued or _AHEAD.env is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDIREE_CACHE", _AHEAD.env["SDIREE_CACHE"])
        yield


_QUEUE_LOG = os.environ.get("SDIREE_TEST_QUEUE_LOG")  # a file: when each compile starts and ends


def _queue_log(event: str, owner, key, where: str = "background") -> None:
    if _QUEUE_LOG:
        import time

        name = f"{owner.model.name}/{owner.out_dir(*key).name}"
        with open(_QUEUE_LOG, "a") as f:
            f.write(f"{time.time():.1f} {event} {where} {name}\n")


def _compile_options(fields: dict):
    from sdiree.compile.driver import CompileOptions

    paths = {k: Path(fields[k]) for k in ("model_dir", "out")}
    sizes = tuple(tuple(s) for s in fields["sizes"])
    subs = tuple(fields["submodules"]) if fields["submodules"] else None
    return CompileOptions(**{**fields, **paths, "sizes": sizes, "submodules": subs})


# The background compiles' process, one for the whole queue: torch, diffusers and iree import
# once, not at each job's start (~7 s each). One job per line on stdin, CompiledArtifacts.options'
# fields (JSON); each answered by one line on stdout, {"code": exit status, "output": what
# `sdiree compile` prints, or the traceback}. Anything else written to fd 1 goes to stderr.
WORKER = f"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, {str(ROOT / "tests")!r})
from conftest import _compile_options
from sdiree.compile.driver import compile_model
from sdiree.compile.report import Reporter
for line in sys.stdin:
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            compile_model(_compile_options(json.loads(line)), Reporter(stream=out))
        except BaseException:
            traceback.print_exc()
            code = 1
    answers.write(json.dumps({{"code": code, "output": out.getvalue()}}) + "\\n")
    answers.flush()
"""


class CompiledArtifacts:
    """Compile-once cache keyed by (target, arch, dtype), with an optional queue of keys that a
    background process compiles one after another while the tests run. get() takes a queued key
    that the background has not started yet and compiles it itself, so both cores stay busy."""

    def __init__(
        self, model: Path, root: Path, size=None, sizes: tuple = (), submodules: tuple = ()
    ):
        self.model = model
        self.root = root
        self.size = size  # `--height/--width`, (height, width) px; None: the model's own
        self.sizes = sizes  # `--sizes` besides the main one, (height, width) px
        self.submodules = submodules  # () is every submodule of the model's family
        self._done: dict = {}
        self._ahead: dict[tuple, Future] = {}  # started in the background

    def out_dir(self, target: str, arch: str, dtype: str) -> Path:
        main = "" if self.size is None else "@{}x{}".format(*self.size)
        more = "".join(f"+{h}x{w}" for h, w in self.sizes)
        return self.root / self.model.name / f"{target}-{arch}-{dtype}{main}{more}"

    def options(self, key: tuple) -> dict:
        """CompileOptions' fields (JSON-able) for the artifact of key."""
        target, arch, dtype = key
        return {
            "model_dir": str(self.model), "target": target, "arch": arch, "dtype": dtype,
            "out": str(self.out_dir(*key)), "sizes": [list(s) for s in self.sizes],
            "height": self.size and self.size[0], "width": self.size and self.size[1],
            "submodules": list(self.submodules) or None,
        }  # fmt: skip

    def compile_ahead(self, keys) -> None:
        _AHEAD.add(self, keys)

    def stop_ahead(self) -> None:
        _AHEAD.stop()

    def get(self, target: str, arch: str, dtype: str) -> Path:
        key = (target, arch, dtype)
        if key in self._done:
            return self._done[key]
        _AHEAD.take_back(self, key)  # not started: compiled here instead
        with _AHEAD.lock:
            started = self._ahead.get(key)
        if started is None:
            self._compile_here(key)
        else:
            # while another process compiles it, this one compiles what is queued after it
            _queue_log("wait", self, key, "foreground")
            while not started.done() and (job := _AHEAD.steal()) is not None:
                owner, other, future = job
                owner._compile_here(other, future)
            code, output = started.result()
            _queue_log("got", self, key, "foreground")
            if code != 0:
                raise RuntimeError(f"compile {key} failed (exit {code}):\n{output}")
        self._done[key] = self.out_dir(*key)
        return self._done[key]

    def _compile_here(self, key: tuple, future: Future | None = None) -> None:
        """Compile key's artifact in this process. A job taken from the queue (its future
        given) hands its outcome to the test that waits for it, not to the one compiling it."""
        from sdiree.compile.driver import compile_model
        from sdiree.compile.report import Reporter

        _queue_log("start", self, key, "foreground")
        try:
            with _session_cache(future is not None):
                compile_model(_compile_options(self.options(key)), Reporter(stream=io.StringIO()))
        except Exception as error:
            if future is None:
                raise
            future.set_exception(error)
        else:
            if future is not None:
                future.set_result((0, ""))
        _queue_log("end", self, key, "foreground")


@pytest.fixture(scope="session")
def compiled(tiny_model, artifacts_root, request):
    artifacts = CompiledArtifacts(tiny_model, artifacts_root)
    # cpu fp32 first: most tests need it, and the tests that need no artifact run meanwhile
    artifacts.compile_ahead([("cpu", "host", "fp32"), *(AHEAD if _ahead_wanted else ())])
    # queued now, behind SD 1.x's in QUEUE_ORDER's order, rather than at their first test
    wanted = {
        "compiled_sizes": _sizes_ahead_wanted,
        "compiled_sdxl": _sdxl_ahead_wanted,
        "compiled_sd2": _sd2_ahead_wanted,
        "compiled_inpaint": _inpaint_ahead_wanted,
    }
    for fixture in QUEUE_ORDER[1:]:
        if wanted[fixture]:
            request.getfixturevalue(fixture)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_sd2(tiny_sd2_model, artifacts_root):
    """The tiny SD 2.x model's artifacts: queued for the background compile when its tests
    are collected (after SD 1.x's and SDXL's), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_sd2_model, artifacts_root)
    if _sd2_ahead_wanted:
        artifacts.compile_ahead(SD2_AHEAD)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_sdxl(tiny_sdxl_model, artifacts_root):
    """The tiny SDXL's artifacts: queued for the background compile when its tests are
    collected (after the SD 1.x ones), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_sdxl_model, artifacts_root)
    if _sdxl_ahead_wanted:
        artifacts.compile_ahead(SDXL_AHEAD)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_sizes(tiny_model, artifacts_root):
    """The tiny SD 1.x compiled at SIZES_MAIN and SIZES: queued for the background compile
    when tests/compile/test_compile_sizes.py is collected (right behind SD 1.x's), else on first
    use."""
    artifacts = CompiledArtifacts(
        tiny_model, artifacts_root, size=SIZES_MAIN, sizes=SIZES, submodules=SIZES_SUBMODULES
    )
    if _sizes_ahead_wanted:
        artifacts.compile_ahead(SIZES_AHEAD)
    yield artifacts
    artifacts.stop_ahead()


@pytest.fixture(scope="session")
def compiled_inpaint(tiny_inpaint_model, artifacts_root):
    """The tiny inpainting model's artifacts: queued for the background compile when its tests
    are collected (last), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_inpaint_model, artifacts_root)
    if _inpaint_ahead_wanted:
        artifacts.compile_ahead(INPAINT_AHEAD)
    yield artifacts
    artifacts.stop_ahead()


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """A failed test is named on stderr at once (`-q` prints only its F, and a crash later in the
    run would take the summary with it), and what its frames held (sessions, Vulkan devices) is
    freed now, in order, not by a collection inside some later test: pytest keeps the failure's
    traceback in sys.last_* for post-mortem debugging, and iree objects torn down late are the
    likely cause of crashes late in CI runs (compile/NOTES.md, "Vulkan devices kept")."""
    record_failure(report)
    if not report.failed:
        return
    lines = report.longreprtext.splitlines()
    said = [ln[1:].strip() for ln in lines if ln.startswith("E ")][:1] or lines[-1:]
    print(f"\nFAILED {report.nodeid} ({report.when}): {''.join(said)[:300]}", file=sys.__stderr__)
    if report.when == "call":
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        import gc

        gc.collect()
