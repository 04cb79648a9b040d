"""sdiree.runtime.rng against torch's CPU generator: same seeds, same draws, same values."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from sdiree.runtime import rng
from sdiree.runtime.rng import KERNELS, TorchCPUGenerator, detect_kernel

torch = pytest.importorskip("torch")

SEEDS = [0, 1, 42, 2**32 + 5, 2**63 - 25]
SHAPES = [(1,), (7,), (15,), (16,), (17,), (33,), (2, 4, 8, 8), (1, 4, 64, 64), (3, 5, 7)]

# Where torch is a GCC build linked against glibc (Linux x86-64 wheels) the port is exact.
EXACT_PLATFORM = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def torch_kernel() -> str:
    """The kernel this torch process really dispatches float32 normal_ to, found by drawing with
    torch and with each port (not from the CPU capability name: torch's AVX-512 build runs the
    AVX2 kernel, which an earlier capability-based guess got wrong)."""
    ref = torch.randn((4096,), generator=torch.Generator("cpu").manual_seed(0)).numpy()
    errors = {k: np.abs(TorchCPUGenerator(0, kernel=k).randn((4096,)) - ref).max() for k in KERNELS}
    return min(errors, key=errors.get)


def assert_same(ours: np.ndarray, ref: np.ndarray, exact: bool = EXACT_PLATFORM) -> None:
    assert ours.shape == ref.shape
    assert ours.dtype == ref.dtype
    if exact:
        np.testing.assert_array_equal(ours, ref)
        return
    # Elsewhere libm or the compiler may round a few values the other way (<= 1 ulp).
    tol = 2e-6 * np.maximum(1.0, np.abs(ref))
    assert np.all(np.abs(ours.astype(np.float64) - ref) <= tol)
    assert np.mean(ours == ref) >= 0.99


def torch_randn(gen, shape, dtype=torch.float32) -> np.ndarray:
    return torch.randn(shape, generator=gen, dtype=dtype).numpy()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_first_draw_matches_torch(seed, shape):
    ours = TorchCPUGenerator(seed, kernel=torch_kernel()).randn(shape)
    assert_same(ours, torch_randn(torch.Generator("cpu").manual_seed(seed), shape))


@pytest.mark.parametrize("seed", [0, 42, 2**40 + 3])
def test_successive_calls_mixing_sizes_match_torch(seed):
    # Small draws go through the scalar path, whose second Box-Muller value stays cached in the
    # generator across calls; large ones through the 16-wide path, which leaves the cache alone.
    shapes = [(1,), (3,), (1, 4, 8, 8), (1,), (17,), (5,), (2, 4, 16, 16), (2,), (16,), (1,)]
    ours = TorchCPUGenerator(seed, kernel=torch_kernel())
    ref = torch.Generator("cpu").manual_seed(seed)
    for shape in shapes:
        assert_same(ours.randn(shape), torch_randn(ref, shape))


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize(
    "shape", [(1,), (7,), (15,), (16,), (17,), (2, 4, 8, 8), (3, 5, 7)], ids=str
)
def test_float64_matches_torch(seed, shape):
    ours = TorchCPUGenerator(seed).randn(shape, dtype=np.float64)
    ref = torch_randn(torch.Generator("cpu").manual_seed(seed), shape, dtype=torch.float64)
    assert ours.dtype == np.float64
    np.testing.assert_allclose(ours, ref, rtol=1e-14, atol=1e-14)
    assert np.mean(ours == ref) >= 0.99


def test_mixed_dtypes_share_one_stream():
    ours = TorchCPUGenerator(3, kernel=torch_kernel())
    ref = torch.Generator("cpu").manual_seed(3)
    for shape, dt, tdt in [
        ((1,), np.float64, torch.float64),
        ((1,), np.float32, torch.float32),
        ((20,), np.float64, torch.float64),
        ((40,), np.float32, torch.float32),
    ]:
        got, want = ours.randn(shape, dtype=dt), torch_randn(ref, shape, dtype=tdt)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_sd_latent_shapes_and_int_shape():
    for shape in [(4, 4, 128, 128), 1000]:
        ours = TorchCPUGenerator(1234, kernel=torch_kernel()).randn(shape)
        assert_same(ours, torch_randn(torch.Generator("cpu").manual_seed(1234), shape))


def test_empty_and_scalar_shapes():
    ours = TorchCPUGenerator(5, kernel=torch_kernel())
    ref = torch.Generator("cpu").manual_seed(5)
    for shape in [(0,), (), (2, 0, 3), (4,)]:
        assert_same(ours.randn(shape), torch_randn(ref, shape))


def test_seed_attribute_and_range():
    assert TorchCPUGenerator(2**32 + 5).seed == 2**32 + 5
    assert TorchCPUGenerator(-1).seed == 2**64 - 1
    np.testing.assert_array_equal(
        TorchCPUGenerator(-1).randn((20,)), TorchCPUGenerator(2**64 - 1).randn((20,))
    )
    # Only the low 32 bits reach the Mersenne Twister, as in torch.
    np.testing.assert_array_equal(
        TorchCPUGenerator(2**32 + 5).randn((20,)), TorchCPUGenerator(5).randn((20,))
    )
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError):
            TorchCPUGenerator(bad)


def test_manual_seed_restarts_the_stream():
    gen = TorchCPUGenerator(9)
    first = gen.randn((3,))
    gen.randn((40,))
    assert gen.manual_seed(9) is gen
    np.testing.assert_array_equal(gen.randn((3,)), first)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.complex64])
def test_other_dtypes_are_not_implemented(dtype):
    with pytest.raises(NotImplementedError):
        TorchCPUGenerator(0).randn((4,), dtype=dtype)


def test_unknown_kernel_rejected():
    with pytest.raises(ValueError):
        TorchCPUGenerator(0, kernel="avx9")


def test_torch_kernel_is_told_apart():
    # The two kernels differ on ~38 % of values, so the detection above cannot be ambiguous.
    a, b = (TorchCPUGenerator(0, kernel=k).randn((4096,)) for k in KERNELS)
    assert np.mean(a != b) > 0.2


@pytest.mark.skipif(not EXACT_PLATFORM, reason="capability detection is checked on Linux x86-64")
def test_detect_kernel_agrees_with_torch():
    assert detect_kernel() == torch_kernel()


AVX2_FLAGS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"}


@pytest.mark.parametrize(
    "flags,kernel",
    [(AVX2_FLAGS, "avx2"), (AVX512_FLAGS, "avx2"), ({"sse4_2", "avx"}, "scalar")],
    ids=["avx2-zen1", "avx512-zen5", "no-avx2"],
)
def test_kernel_for_each_cpu_kind(monkeypatch, flags, kernel):
    """Whatever CPU this runs on, the choice for the other kinds is checked too: torch's AVX2 and
    AVX-512 builds share the vectorised kernel; only CPUs without AVX2+FMA use libm's."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(rng.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(rng, "_cpu_flags", lambda: set(flags))
    assert detect_kernel() == kernel
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert detect_kernel() == "scalar"


def _cpu_has(*flags: str) -> bool:
    return set(flags) <= (rng._cpu_flags() or set())


@pytest.mark.skipif(not EXACT_PLATFORM, reason="needs a torch that honours ATEN_CPU_CAPABILITY")
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_each_kernel_against_torch_forced_to_it(capability):
    """torch pinned to each CPU capability this machine has, against our choice under the same
    environment: the latents must be bit-identical for every one."""
    needs = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512vl", "avx512bw", "avx512dq")}
    if not _cpu_has(*needs.get(capability, ())):
        pytest.skip(f"this CPU cannot run torch's {capability} build")
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from sdiree.runtime.rng import TorchCPUGenerator, detect_kernel
        kernel = detect_kernel()
        worst = 0
        for seed in (0, 11, 2**33 + 1):
            ours = TorchCPUGenerator(seed, kernel=kernel)
            ref = torch.Generator("cpu").manual_seed(seed)
            for shape in ((16,), (33,), (1, 4, 64, 64), (3, 5, 7), (300001,)):
                a = ours.randn(shape)
                b = torch.randn(shape, generator=ref).numpy()
                worst = max(worst, int((a != b).sum()))
        print(torch.backends.cpu.get_cpu_capability().lower(), kernel, worst)
        """
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [capability, {"default": "scalar"}.get(capability, "avx2"), "0"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_latent_draw_is_fast(kernel):
    gen = TorchCPUGenerator(0, kernel=kernel)
    gen.randn((16,))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        gen.randn((1, 4, 128, 128))  # 65536 values
        best = min(best, time.perf_counter() - start)
    assert best < 0.05


def test_module_does_not_import_torch():
    code = "import sys, sdiree.runtime.rng; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_per_image_generators_are_diffusers_generator_lists():
    """diffusers' randn_tensor with a list of generators draws each image from its own."""
    from diffusers.utils.torch_utils import randn_tensor

    seeds = [7, 8, 2**40]
    gens = rng.PerImageGenerators(seeds, kernel=torch_kernel())
    refs = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    for shape in [(3, 4, 8, 8), (3, 4, 8, 8), (3, 5)]:
        assert_same(gens.randn(shape), randn_tensor(shape, generator=refs).numpy())
    # Image i alone, from its own seed, is the same as in the batch.
    alone = TorchCPUGenerator(8, kernel=torch_kernel()).randn((1, 4, 8, 8))
    np.testing.assert_array_equal(rng.PerImageGenerators(seeds).randn((3, 4, 8, 8))[1:2], alone)
    with pytest.raises(ValueError):
        gens.randn((2, 4))
