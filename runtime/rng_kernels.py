"""torch's CPU Box-Muller kernels (``normal_fill`` in float32 and float64), replayed in numpy
for runtime/rng.py: each maps a (rows, 16) block of uniforms to 16 normals per row, lanes 0-7
feeding the log with ``1 - u`` and lanes 8-15 the angle.

``fill16_avx2`` is torch's AVX2/AVX-512 float32 kernel (avx_mathfun's Cephes ``log256_ps`` and
``sincos256_ps``, with the multiply-adds GCC fuses); ``fill16_scalar_f32`` its DEFAULT build's,
glibc's ``logf``/``sinf``/``cosf`` (>= 2.28) op for op; ``fill16_f64`` the float64 kernel on
libm's double functions through ``math``. Each matches torch bit for bit
(tests/runtime/test_rng.py).
"""

from __future__ import annotations

import math

import numpy as np

_F32 = np.float32
_F64 = np.float64

# ---------------------------------------------------------------------------------------------
# float64 kernel (normal_fill<double>): libm's double log/sin/cos. numpy's own SIMD versions may
# differ in the last bit on some CPUs, so the (rarely used) float64 path calls libm via ``math``.


def _libm(fn, a: np.ndarray) -> np.ndarray:
    return np.fromiter(map(fn, a.ravel().tolist()), dtype=_F64, count=a.size).reshape(a.shape)


def fill16_f64(u: np.ndarray) -> np.ndarray:
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


def fill16_avx2(u: np.ndarray) -> np.ndarray:
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


def fill16_scalar_f32(u: np.ndarray) -> np.ndarray:
    radius = np.sqrt(_F32(-2.0) * _glibc_logf(_ONE - u[:, :8]))
    # 2.0f * pi<double> * u2 is evaluated in double, then stored as float.
    theta = (2.0 * math.pi * u[:, 8:].astype(_F64)).astype(_F32)
    sin, cos = _glibc_sincosf(theta)
    return np.concatenate([radius * cos, radius * sin], axis=1)
