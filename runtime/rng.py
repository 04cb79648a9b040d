"""Torch-free reproduction of ``torch.randn(..., generator=torch.Generator("cpu").manual_seed(s))``.

diffusers draws the initial latents with a CPU ``torch.Generator``; to give the same image for
the same seed without torch, this module replays torch's CPU random stream in numpy:

* the engine is the 32-bit Mersenne Twister that ``at::mt19937`` implements (seeded with the low
  32 bits of the seed, Knuth's initialisation). numpy's own ``MT19937`` bit generator runs the
  twist; we only inject the state torch would have, so the words are identical.
* float32 uniforms are ``(word & 0xFFFFFF) * 2**-24``; float64 uniforms take 53 bits of
  ``random64 = (word1 << 32) | word2``.
* ``normal_`` on a contiguous tensor of >= 16 elements fills all uniforms first, then applies
  Box-Muller to blocks of 16 (lanes 0-7 feed the log with ``1 - u``, lanes 8-15 the angle); when
  the size is not a multiple of 16 it draws 16 fresh uniforms and recomputes the last 16 values.
* fewer than 16 elements (or any non-contiguous tensor) go through ``at::normal_distribution``
  in double: two random64 uniforms per pair, ``sqrt(-2 log1p(-u2))`` with angle ``2 pi u1``; the
  sine half is cached in the generator and returned by the next scalar draw, even in a later call.

For float32 with >= 16 elements torch's kernel is chosen when torch is built, per CPU capability:
its AVX2 and AVX-512 builds (both compiled with ``__AVX2__``) run the ``avx_mathfun`` (Cephes)
``log256_ps``/``sincos256_ps`` polynomials, which GCC contracts into FMAs; its DEFAULT build (x86
without AVX2+FMA, or ``ATEN_CPU_CAPABILITY=default``) and every non-x86 build call libm's
``logf``/``sinf``/``cosf`` per element. Both are ported op for op in float32/float64 numpy
arithmetic (runtime/rng_kernels.py): ``kernel="avx2"`` and ``kernel="scalar"`` (glibc >= 2.28 algorithms);
``kernel="auto"`` picks the one torch picks on this machine. The other paths only use
double-precision libm functions, taken from ``math``.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence

import numpy as np

from .rng_kernels import fill16_avx2, fill16_f64, fill16_scalar_f32

__all__ = [
    "KERNELS",
    "PerImageGenerators",
    "TorchCPUGenerator",
    "detect_kernel",
    "kernel_for_flags",
]

KERNELS = ("avx2", "scalar")

_F32 = np.float32
_F64 = np.float64
_U32_MASK = 0xFFFFFFFF
_MT_N = 624


def detect_kernel() -> str:
    """The float32 normal kernel torch's CPU dispatch uses here: "avx2" or "scalar".

    Mirrors ATen: ``ATEN_CPU_CAPABILITY=default`` forces the DEFAULT build; otherwise an x86 CPU
    with AVX2 and FMA runs torch's AVX2 or AVX-512 build, and both of those hold the vectorised
    kernel (``normal_fill_AVX2`` is compiled wherever ``__AVX2__`` is defined). Checked against
    torch on AVX2-only and AVX-512 CPUs with every capability forced (tests/runtime/test_rng.py).
    """
    env = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if env == "default":
        return "scalar"
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i386", "i686"):
        return "scalar"
    flags = _cpu_flags()
    if flags is None:
        # No /proc/cpuinfo (Windows, macOS): every x86-64 CPU of the last decade has AVX2+FMA.
        return "avx2"
    return kernel_for_flags(flags)


def kernel_for_flags(flags: set[str] | frozenset[str]) -> str:
    """The kernel torch (not forced by ATEN_CPU_CAPABILITY) uses on an x86 CPU with these
    /proc/cpuinfo flags: AVX2+FMA (with or without AVX-512) → "avx2", older → "scalar"."""
    return "avx2" if {"avx2", "fma"} <= set(flags) else "scalar"


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _mt19937_key(seed32: int) -> np.ndarray:
    key = np.empty(_MT_N, dtype=np.uint32)
    x = seed32
    key[0] = x
    for j in range(1, _MT_N):
        x = (1812433253 * (x ^ (x >> 30)) + j) & _U32_MASK
        key[j] = x
    return key


class TorchCPUGenerator:
    """A numpy stand-in for a seeded ``torch.Generator("cpu")`` that only draws ``randn``.

    Successive ``randn`` calls return what successive ``torch.randn(shape, generator=g,
    dtype=...)`` calls return on a generator seeded with ``torch.Generator("cpu").manual_seed``.
    """

    def __init__(self, seed: int, kernel: str = "auto") -> None:
        if kernel == "auto":
            kernel = detect_kernel()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; expected 'auto' or one of {KERNELS}")
        self.kernel = kernel
        self._bits = np.random.MT19937(0)
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> TorchCPUGenerator:
        """Reseed in place, as ``torch.Generator.manual_seed`` does; returns self."""
        seed = int(seed)
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed {seed} does not fit in 64 bits")
        self.seed = seed & 0xFFFFFFFFFFFFFFFF
        self._bits.state = {
            "bit_generator": "MT19937",
            # pos == 624 makes the first draw twist, like torch's left_ = 1 after seeding.
            "state": {"key": _mt19937_key(self.seed & _U32_MASK), "pos": _MT_N},
        }
        self._next_normal: float | None = None
        return self

    def randn(self, shape: int | Sequence[int], dtype=np.float32) -> np.ndarray:
        """Standard normal samples of ``shape``, advancing the stream exactly as torch does."""
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(_F32), np.dtype(_F64)):
            raise NotImplementedError(f"randn supports float32 and float64, not {dt}")
        n = math.prod(shape)
        if n >= 16:
            if dt == _F32:
                fill = fill16_avx2 if self.kernel == "avx2" else fill16_scalar_f32
                flat = self._normal_fill(n, self._uniform_f32, fill)
            else:
                flat = self._normal_fill(n, self._uniform_f64, fill16_f64)
        else:
            flat = np.array([self._normal_scalar() for _ in range(n)], dtype=_F64).astype(dt)
        return flat.reshape(shape)

    def _words(self, n: int) -> np.ndarray:
        return self._bits.random_raw(n).astype(np.uint32)

    def _uniform_f32(self, n: int) -> np.ndarray:
        return (self._words(n) & 0xFFFFFF).astype(_F32) * _F32(2.0**-24)

    def _uniform_f64(self, n: int) -> np.ndarray:
        w = self._words(2 * n).astype(np.uint64)
        r64 = (w[0::2] << np.uint64(32)) | w[1::2]
        return (r64 & np.uint64((1 << 53) - 1)).astype(_F64) * 2.0**-53

    def _normal_fill(self, n: int, uniform, fill16) -> np.ndarray:
        out = uniform(n)
        full = n - n % 16
        out[:full] = fill16(out[:full].reshape(-1, 16)).reshape(-1)
        if full != n:
            out[n - 16 :] = fill16(uniform(16).reshape(1, 16)).reshape(-1)
        return out

    def _normal_scalar(self) -> float:
        if self._next_normal is not None:
            value, self._next_normal = self._next_normal, None
            return value
        u1, u2 = self._uniform_f64(2).tolist()
        radius = math.sqrt(-2.0 * math.log1p(-u2))
        theta = 2.0 * math.pi * u1
        self._next_normal = radius * math.sin(theta)
        return radius * math.cos(theta)


class PerImageGenerators:
    """One ``TorchCPUGenerator`` per image, drawn as one: ``randn((N, ...))`` stacks image i's
    draw of ``(1, ...)`` from generator i.

    This is diffusers' ``generator=[torch.Generator("cpu").manual_seed(s) for s in seeds]`` (its
    ``randn_tensor`` draws per generator), and AUTOMATIC1111's seed + i per image: every image
    of a batch is remade alone from its own seed, whatever the batch it was made in.
    """

    def __init__(self, seeds: Sequence[int], kernel: str = "auto") -> None:
        self.generators = [TorchCPUGenerator(s, kernel=kernel) for s in seeds]

    def randn(self, shape: int | Sequence[int], dtype=np.float32) -> np.ndarray:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        if not shape or shape[0] != len(self.generators):
            raise ValueError(f"shape {shape} does not start with the {len(self.generators)} images")
        return np.concatenate([g.randn((1, *shape[1:]), dtype=dtype) for g in self.generators])
