"""Shared fixtures: the tiny SD 1.x, SD 2.x and SDXL models and their compiled artifacts, built
once per session (`compiled`, `compiled_sd2`, `compiled_sdxl`).

Artifacts are compiled through the same code path as `sdiree compile` and cached for the whole
test session, so compile tests and runtime tests share them. The artifacts the collected tests
will ask for, and the builds their files declare for themselves (compile_queue.Queued), are
queued at the first test for a background compile process that works through them
(tests/compile_queue.py), while the test files that need no artifact run first, beside it: one
compile keeps this 2-core machine ~1.1 cores busy (export is single-threaded), and these
compiles are most of the suite's time. Their shared compile cache (exported MLIR, parameter
archives) is a session folder named by $SDIREE_CACHE, never the user's own cache.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from compile_queue import QUEUE, CompiledArtifacts, declared  # noqa: E402
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
_queued_wanted: list = []  # the Queued builds of the modules collected, in the tests' order


def pytest_collection_modifyitems(config, items):
    global _ahead_wanted, _sdxl_ahead_wanted, _sizes_ahead_wanted
    global _sd2_ahead_wanted, _inpaint_ahead_wanted, _artifact_fixtures_wanted, _queued_wanted
    deselect_ended(config, items)  # a resumed run (tests/suite_progress.py)
    _ahead_wanted = any(i.nodeid.startswith("tests/compile/test_compile_targets.py") for i in items)
    _sdxl_ahead_wanted = any(i.nodeid.startswith(SDXL_TESTS) for i in items)
    _sizes_ahead_wanted = any(
        i.nodeid.startswith("tests/compile/test_compile_sizes.py") for i in items
    )
    _sd2_ahead_wanted = any(i.nodeid.startswith(SD2_TESTS) for i in items)
    _inpaint_ahead_wanted = any(i.nodeid.startswith(INPAINT_TESTS) for i in items)
    _artifact_fixtures_wanted = _needing_artifacts_last(items)
    modules = dict.fromkeys(i.module for i in items if getattr(i, "module", None) is not None)
    _queued_wanted = [job for m in modules for job in declared(m)]


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
def _compile_from_the_start(compile_cache, tmp_path_factory, request):
    """The background starts on the artifacts at the first test, not at the first test that
    needs one: the tests that need none run beside it. SD 1.x's first (the `compiled` fixture
    queues the extra sizes' and the other models' behind its own), the test files' own builds
    right behind its cpu fp32 artifact, in the order their tests run: most of those files need
    no artifact and run early."""
    for fixture in QUEUE_ORDER:
        if fixture in _artifact_fixtures_wanted:
            request.getfixturevalue(fixture)
    if _queued_wanted:
        behind = None
        if "compiled" in _artifact_fixtures_wanted:
            behind = (request.getfixturevalue("compiled"), ("cpu", "host", "fp32"))
        model = request.getfixturevalue("tiny_model")
        for job in reversed(_queued_wanted):  # each right behind cpu fp32: the first ends first
            # a prepare that fails is not queued: it fails again in its own tests, not here
            with contextlib.suppress(Exception):
                job.queue(model, tmp_path_factory, behind=behind)
    yield
    QUEUE.stop()


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
    return artifacts


@pytest.fixture(scope="session")
def compiled_sd2(tiny_sd2_model, artifacts_root):
    """The tiny SD 2.x model's artifacts: queued for the background compile when its tests
    are collected (after SD 1.x's and SDXL's), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_sd2_model, artifacts_root)
    if _sd2_ahead_wanted:
        artifacts.compile_ahead(SD2_AHEAD)
    return artifacts


@pytest.fixture(scope="session")
def compiled_sdxl(tiny_sdxl_model, artifacts_root):
    """The tiny SDXL's artifacts: queued for the background compile when its tests are
    collected (after the SD 1.x ones), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_sdxl_model, artifacts_root)
    if _sdxl_ahead_wanted:
        artifacts.compile_ahead(SDXL_AHEAD)
    return artifacts


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
    return artifacts


@pytest.fixture(scope="session")
def compiled_inpaint(tiny_inpaint_model, artifacts_root):
    """The tiny inpainting model's artifacts: queued for the background compile when its tests
    are collected (last), else compiled on first use."""
    artifacts = CompiledArtifacts(tiny_inpaint_model, artifacts_root)
    if _inpaint_ahead_wanted:
        artifacts.compile_ahead(INPAINT_AHEAD)
    return artifacts


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
