/* What sdiree's fp32 kernels share (specs/kernels/f32_*.c, winograd_f32.c): the 6 x 64 register
   tile of A B products on AVX-512 FMA, and 2^x, 1/x and erf on 16 lanes. Included by the
   kernels; its text is part of their sources' hash (compile/kernel_objects.py). */
#ifndef SDIREE_F32_SUPPORT_H
#define SDIREE_F32_SUPPORT_H

#include <immintrin.h>
#include <stddef.h>

#define NR 64 /* columns a register tile: four vectors */
#define MR 6  /* rows a register tile */

/* acc[i][.] = A[i][0..kc) B[0..kc)[64] for the first `rows` rows of A (lda apart), B packed
   [kc][64]: 4 loads and `rows` broadcasts a step for 4 `rows` FMAs (24 zmm accumulators). */
static inline __attribute__((always_inline)) void sdiree_f32_accumulate(
    int rows, const float *a, size_t lda, const float *b, size_t kc, __m512 acc[MR][4]) {
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    if (i < rows)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[i][u] = _mm512_setzero_ps();
  for (size_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(b + k * NR), b1 = _mm512_load_ps(b + k * NR + 16);
    const __m512 b2 = _mm512_load_ps(b + k * NR + 32), b3 = _mm512_load_ps(b + k * NR + 48);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
      if (i < rows) {
        const __m512 x = _mm512_set1_ps(a[i * lda + k]);
        acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(x, b3, acc[i][3]);
      }
  }
}

/* 2^x, relative error ~2.3e-7 (degree-5 fit of 2^r on |r| <= 1/2); very negative x give 0. */
static inline __m512 sdiree_f32_exp2(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.326697064e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.675459936e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550742522e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402212173e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931469440e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000000119e+0f));
  return _mm512_scalef_ps(p, n);
}

/* The exact GELU, x (1 + erf(x / sqrt 2)) / 2, with erf by Abramowitz & Stegun 7.1.26
   (|error| <= 1.5e-7); 1 / (1 + p|x|) by vrcp14ps and one Newton step. */
static inline __m512 sdiree_f32_gelu(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  const __m512 az = _mm512_abs_ps(z);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 d = _mm512_fmadd_ps(az, _mm512_set1_ps(0.3275911f), one);
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
  __m512 y = _mm512_set1_ps(1.061405429f);
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.453152027f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.421413741f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-0.284496736f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(0.254829592f));
  y = _mm512_mul_ps(y, t);
  /* e^(-z^2) = 2^(-z^2 log2 e) */
  const __m512 q = _mm512_mul_ps(_mm512_mul_ps(az, az), _mm512_set1_ps(-1.4426950408889634f));
  const __m512 e = sdiree_f32_exp2(_mm512_max_ps(q, _mm512_set1_ps(-126.0f)));
  __m512 erf = _mm512_fnmadd_ps(y, e, one); /* erf(|z|) */
  erf = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(erf),
                      _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u))));
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(one, erf));
}

#endif
