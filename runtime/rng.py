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
``logf``/``sinf``/``cosf`` per element. Both are ported here op for op in float32/float64 numpy
arithmetic: ``kernel="avx2"`` and ``kernel="scalar"`` (glibc >= 2.28 algorithms);
``kernel="auto"`` picks the one torch picks on this machine. The other paths only use
double-precision libm functions, taken from ``math``.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence

import numpy as np

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
                fill = _fill16_avx2 if self.kernel == "avx2" else _fill16_scalar_f32
                flat = self._normal_fill(n, self._uniform_f32, fill)
            else:
                flat = self._normal_fill(n, self._uniform_f64, _fill16_f64)
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


# ---------------------------------------------------------------------------------------------
# float64 kernel (normal_fill<double>): libm's double log/sin/cos. numpy's own SIMD versions may
# differ in the last bit on some CPUs, so the (rarely used) float64 path calls libm via ``math``.


def _libm(fn, a: np.ndarray) -> np.ndarray:
    return np.fromiter(map(fn, a.ravel().tolist()), dtype=_F64, count=a.size).reshape(a.shape)


def _fill16_f64(u: np.ndarray) -> np.ndarray:
    radius = np.sqrt(-2.0 * _libm(math.log, 1.0 - u[:, :8]))
    theta = 2.0 * math.pi * u[:, 8:]
    return np.concatenate(
        [radius * _libm(math.cos, theta), radius * _libm(math.sin, theta)], axis=1
    )


# ---------------------------------------------------------------------------------------------
# float32 AVX2 kernel: avx_mathfun's Cephes polynomials, with the multiply-adds that GCC fuses
# when it builds torch's AVX2 kernels with -mfma (found by matching torch bit for bit).


def _c32(v: float) -> np.float32:
    return _F32(v)


_ONE = _c32(1.0)
_HALF = _c32(0.5)
_MIN_NORM = np.array(0x00800000, dtype=np.int32).view(_F32)
_HALF_BITS = np.int32(0x3F000000)
_SQRTHF = _c32(0.707106781186547524)
_LOG_P = [
    _c32(v)
    for v in (
        7.0376836292e-2,
        -1.1514610310e-1,
        1.1676998740e-1,
        -1.2420140846e-1,
        1.4249322787e-1,
        -1.6668057665e-1,
        2.0000714765e-1,
        -2.4999993993e-1,
        3.3333331174e-1,
    )
]
_LOG_Q1 = _c32(-2.12194440e-4)
_LOG_Q2 = _c32(0.693359375)
_DP1 = _c32(-0.78515625)
_DP2 = _c32(-2.4187564849853515625e-4)
_DP3 = _c32(-3.77489497744594108e-8)
_SIN_P = (_c32(-1.9515295891e-4), _c32(8.3321608736e-3), _c32(-1.6666654611e-1))
_COS_P = (_c32(2.443315711809948e-005), _c32(-1.388731625493765e-003), _c32(4.166664568298827e-002))
_FOPI = _c32(1.27323954473516)
_SIGN_BIT = np.int32(-(2**31))
_TWO_PI_F32 = _c32(2.0 * math.pi)


def _fma32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c``, like one vfmadd instruction.

    The float32 product is exact in float64; the float64 sum is then nudged off any float32
    rounding midpoint it only reached by rounding, so the final float32 rounding is single.
    """
    p = np.asarray(a, dtype=_F64) * np.asarray(b, dtype=_F64)
    c = np.asarray(c, dtype=_F64)
    t = p + c
    bits = t.view(np.uint64)
    midpoint = (bits & np.uint64(0x1FFFFFFF)) == np.uint64(0x10000000)
    if midpoint.any():
        bb = t - p
        err = (p - (t - bb)) + (c - bb)
        fix = midpoint & (err != 0)
        if fix.any():
            t = t.copy()
            t[fix] = np.nextafter(t[fix], np.where(err[fix] > 0, np.inf, -np.inf))
    return t.astype(_F32)


def _log256(x: np.ndarray) -> np.ndarray:
    x = np.maximum(x, _MIN_NORM)
    bits = x.view(np.int32)
    e = ((bits >> 23) - 0x7F).astype(_F32) + _ONE
    x = ((bits & np.int32(~0x7F800000)) | _HALF_BITS).view(_F32)
    mask = x < _SQRTHF
    tmp = np.where(mask, x, _F32(0))
    x = x - _ONE
    e = e - np.where(mask, _ONE, _F32(0))
    x = x + tmp
    z = x * x
    y = np.full_like(x, _LOG_P[0])
    for p in _LOG_P[1:]:
        y = _fma32(y, x, p)
    y = y * x
    y = _fma32(y, z, e * _LOG_Q1)
    y = _fma32(-z, _HALF, y)
    x = x + y
    return _fma32(e, _LOG_Q2, x)


def _sincos256(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xi = x.view(np.int32)
    sign_sin = xi & _SIGN_BIT
    x = (xi & np.int32(0x7FFFFFFF)).view(_F32)
    j = (x * _FOPI).astype(np.int32)
    j = (j + 1) & np.int32(~1)
    y = j.astype(_F32)
    swap_sin = (j & 4) << 29
    poly_mask = (j & 2) == 0
    x = _fma32(y, _DP1, x)
    x = _fma32(y, _DP2, x)
    x = _fma32(y, _DP3, x)
    sign_cos = (~(j - 2) & 4) << 29
    sign_sin = sign_sin ^ swap_sin

    z = x * x
    yc = _fma32(_COS_P[0], z, _COS_P[1])
    yc = _fma32(yc, z, _COS_P[2])
    yc = yc * z
    yc = _fma32(yc, z, -(z * _HALF))
    yc = yc + _ONE
    ys = _fma32(_SIN_P[0], z, _SIN_P[1])
    ys = _fma32(ys, z, _SIN_P[2])
    ys = ys * z
    ys = _fma32(ys, x, x)

    zero = _F32(0)
    ysin2 = np.where(poly_mask, ys, zero)
    ysin1 = np.where(poly_mask, zero, yc)
    ys = ys - ysin2
    yc = yc - ysin1
    sin = ((ysin1 + ysin2).view(np.int32) ^ sign_sin).view(_F32)
    cos = ((yc + ys).view(np.int32) ^ sign_cos).view(_F32)
    return sin, cos


def _fill16_avx2(u: np.ndarray) -> np.ndarray:
    radius = np.sqrt(_F32(-2.0) * _log256(_ONE - u[:, :8]))
    sin, cos = _sincos256(_TWO_PI_F32 * u[:, 8:])
    # torch ends with fmadd(n, std, mean); with std=1, mean=0 that is exactly n.
    return np.concatenate([radius * cos, radius * sin], axis=1)


# ---------------------------------------------------------------------------------------------
# float32 scalar kernel (normal_fill<float>): glibc's logf/sinf/cosf (2.28+), which evaluate in
# double and round once. Their FMA builds round some double intermediates differently; that
# changes the float32 result only when it lands within ~2^-50 of a rounding midpoint.


def _hex(s: str) -> float:
    return float.fromhex(s)


_LOGF_INVC = np.array(
    [
        _hex(v)
        for v in (
            "0x1.661ec79f8f3bep+0",
            "0x1.571ed4aaf883dp+0",
            "0x1.49539f0f010bp+0",
            "0x1.3c995b0b80385p+0",
            "0x1.30d190c8864a5p+0",
            "0x1.25e227b0b8eap+0",
            "0x1.1bb4a4a1a343fp+0",
            "0x1.12358f08ae5bap+0",
            "0x1.0953f419900a7p+0",
            "0x1p+0",
            "0x1.e608cfd9a47acp-1",
            "0x1.ca4b31f026aap-1",
            "0x1.b2036576afce6p-1",
            "0x1.9c2d163a1aa2dp-1",
            "0x1.886e6037841edp-1",
            "0x1.767dcf5534862p-1",
        )
    ]
)
_LOGF_LOGC = np.array(
    [
        _hex(v)
        for v in (
            "-0x1.57bf7808caadep-2",
            "-0x1.2bef0a7c06ddbp-2",
            "-0x1.01eae7f513a67p-2",
            "-0x1.b31d8a68224e9p-3",
            "-0x1.6574f0ac07758p-3",
            "-0x1.1aa2bc79c81p-3",
            "-0x1.a4e76ce8c0e5ep-4",
            "-0x1.1973c5a611cccp-4",
            "-0x1.252f438e10c1ep-5",
            "0x0p+0",
            "0x1.aa5aa5df25984p-5",
            "0x1.c5e53aa362eb4p-4",
            "0x1.526e57720db08p-3",
            "0x1.bc2860d22477p-3",
            "0x1.1058bc8a07ee1p-2",
            "0x1.4043057b6ee09p-2",
        )
    ]
)
_LOGF_LN2 = _hex("0x1.62e42fefa39efp-1")
_LOGF_A = tuple(
    _hex(v) for v in ("-0x1.00ea348b88334p-2", "0x1.5575b0be00b6ap-2", "-0x1.ffffef20a4123p-2")
)

_SINF_HPI_INV = _hex("0x1.45F306DC9C883p+23")  # 2/pi scaled by 2^24 (x86 has no toint intrinsics)
_SINF_HPI = _hex("0x1.921FB54442D18p0")
_COSF_C = tuple(
    _hex(v)
    for v in (
        "0x1p0",
        "-0x1.ffffffd0c621cp-2",
        "0x1.55553e1068f19p-5",
        "-0x1.6c087e89a359dp-10",
        "0x1.99343027bf8c3p-16",
    )
)
_SINF_S = tuple(
    _hex(v) for v in ("-0x1.555545995a603p-3", "0x1.1107605230bc4p-7", "-0x1.994eb3774cf24p-13")
)


def _glibc_logf(x: np.ndarray) -> np.ndarray:
    """logf for positive normal float32 inputs (all that Box-Muller feeds it)."""
    ix = x.view(np.uint32)
    tmp = ix - np.uint32(0x3F330000)
    i = (tmp >> np.uint32(19)) & np.uint32(15)
    k = tmp.view(np.int32) >> 23
    iz = ix - (tmp & np.uint32(0x1FF << 23))
    z = iz.view(_F32).astype(_F64)
    r = z * _LOGF_INVC[i] - 1.0
    y0 = _LOGF_LOGC[i] + k.astype(_F64) * _LOGF_LN2
    r2 = r * r
    y = _LOGF_A[1] * r + _LOGF_A[2]
    y = _LOGF_A[0] * r2 + y
    y = y * r2 + (y0 + r)
    return y.astype(_F32)


def _sin_poly(x: np.ndarray, x2: np.ndarray) -> np.ndarray:
    x3 = x * x2
    s1 = _SINF_S[1] + x2 * _SINF_S[2]
    x7 = x3 * x2
    s = x + x3 * _SINF_S[0]
    return s + x7 * s1


def _cos_poly(x2: np.ndarray) -> np.ndarray:
    x4 = x2 * x2
    c2 = _COSF_C[3] + x2 * _COSF_C[4]
    c1 = _COSF_C[0] + x2 * _COSF_C[1]
    x6 = x4 * x2
    c = c1 + x4 * _COSF_C[2]
    return c + x6 * c2


def _glibc_sincosf(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sinf and cosf for float32 inputs in [0, 2pi] (glibc's |x| < 120 paths)."""
    top12 = (theta.view(np.uint32) >> np.uint32(20)) & np.uint32(0x7FF)
    x = theta.astype(_F64)
    # |x| < pi/4 (as a 12-bit exponent+mantissa-prefix compare): no reduction.
    small = top12 < 0x3F4
    tiny = top12 < 0x398
    n = ((x * _SINF_HPI_INV).astype(np.int32) + 0x800000) >> 24
    n = np.where(small, 0, n)
    xr = np.where(small, x, x - n * _SINF_HPI)
    x2 = xr * xr
    sp = _sin_poly(xr, x2)
    cp = _cos_poly(x2)
    # Odd quadrants swap the polynomials. Signs come from glibc's {1, -1, -1, 1}[n & 3] factor on
    # x (the sine polynomial is odd, so that negates it exactly) and from its second table, the
    # negated cosine coefficients, used when n & 2.
    odd = (n & 1) != 0
    neg = (n & 2) != 0
    sin = np.where(odd, cp, sp)
    sin = np.where(neg, -sin, sin)
    cos = np.where(odd, np.where((n & 3) == 1, -sp, sp), np.where(neg, -cp, cp))
    sin = np.where(tiny, x, sin)
    cos = np.where(tiny, 1.0, cos)
    return sin.astype(_F32), cos.astype(_F32)


def _fill16_scalar_f32(u: np.ndarray) -> np.ndarray:
    radius = np.sqrt(_F32(-2.0) * _glibc_logf(_ONE - u[:, :8]))
    # 2.0f * pi<double> * u2 is evaluated in double, then stored as float.
    theta = (2.0 * math.pi * u[:, 8:].astype(_F64)).astype(_F32)
    sin, cos = _glibc_sincosf(theta)
    return np.concatenate([radius * cos, radius * sin], axis=1)


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
