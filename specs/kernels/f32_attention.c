/* sdiree's fused fp32 attention on AVX-512 FMA: O = softmax(Q K^T) V for one head's block of 32
   queries, read from and written to the projections' own layout.

   iree 3.13 runs the `chunked` export's attention as three dispatches a block of 256 queries (Q
   K^T, the row max and exponentials, P V), its scores (4 MiB a block) written and read back in
   between: at SD 1.5's 64x64 level ~0.75 s and ~9,000 dispatches of a fp32 UNet call on 2 Zen 5
   cores (compile/NOTES.md). Here a workgroup keeps everything in L1 and runs on the FMA units.

   The workgroup works transposed: queries are the vector lanes (two zmm of 16), keys the rows.
     S^T[j][r] = sum_d K[j][d] Q^T[d][r]   8 keys x 32 queries of accumulators, K broadcast
     O^T[c][r] += sum_j V[j][c] P^T[j][r]  8 columns x 32 queries, V broadcast
   so K and V are read in their natural rows (no packing pass in the graph), and the softmax's
   per-query max and sum are lane-wise (no horizontal reductions). Keys come KB at a time with
   the online softmax: a block's max moves each query's reference m, what was summed is rescaled
   by 2^(m_old - m_new). qscale includes log2(e): the exponentials are powers of 2.

   Layouts (B batches, H heads, D the head dim, a multiple of 8, at most DMAX):
     q [B][NQ][H][D], k and v [B][NK][H][D], o [B][NQ][H][D], f32: the projections' [B, N, H*D].
   The grid is (ceil(NQ / 32), B x H); a last block of fewer than 32 queries computes zeros in
   its empty lanes and writes only its real rows. Any NK >= 1.

   Built freestanding (compile/kernel_objects.py); its stack frame is ~57 KB (iree's task
   workers have 128 KB). */
#include <stdint.h>

#include "f32_support.h"

#define NV 2    /* vectors of 16 queries a workgroup */
#define QB (16 * NV)
#define KB 128  /* keys a step of the online softmax */
#define DMAX 160
#define JT 8    /* keys (Q K^T) or output columns (P V) a register tile */
#define FLOOR -1.0e30f /* m before any key: 2^(FLOOR - m) is 0, no inf - inf */

/* s[0..JT) = JT keys' scores for the QB queries: rows key[i] (each D long), qt [D][QB]. */
static inline void scores_tile(float (*s)[QB], const float *const key[JT], const float (*qt)[QB],
                               size_t D) {
  __m512 c[JT][NV];
#pragma GCC unroll 8
  for (int i = 0; i < JT; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) c[i][u] = _mm512_setzero_ps();
  for (size_t d = 0; d < D; ++d) {
    __m512 a[NV];
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) a[u] = _mm512_load_ps(&qt[d][16 * u]);
#pragma GCC unroll 8
    for (int i = 0; i < JT; ++i) {
      const __m512 b = _mm512_set1_ps(key[i][d]);
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) c[i][u] = _mm512_fmadd_ps(b, a[u], c[i][u]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < JT; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) _mm512_store_ps(&s[i][16 * u], c[i][u]);
}

/* acc[c0 .. c0 + JT) += len keys' values (rows value + j * ld, columns c0..) times p. */
static inline void values_tile(float (*acc)[QB], const float (*p)[QB], const float *value,
                               size_t ld, size_t len) {
  __m512 c[JT][NV];
#pragma GCC unroll 8
  for (int i = 0; i < JT; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) c[i][u] = _mm512_load_ps(&acc[i][16 * u]);
  for (size_t j = 0; j < len; ++j) {
    __m512 a[NV];
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) a[u] = _mm512_load_ps(&p[j][16 * u]);
    const float *row = value + j * ld;
#pragma GCC unroll 8
    for (int i = 0; i < JT; ++i) {
      const __m512 b = _mm512_set1_ps(row[i]);
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) c[i][u] = _mm512_fmadd_ps(b, a[u], c[i][u]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < JT; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) _mm512_store_ps(&acc[i][16 * u], c[i][u]);
}

int sdiree_f32_attention_workgroup(const float *q, size_t q_offset, const float *k,
                                   size_t k_offset, const float *v, size_t v_offset, float *o,
                                   size_t o_offset, size_t NQ, size_t NK, size_t H, size_t D,
                                   float qscale, size_t wg_q, size_t wg_h) {
  const size_t b = wg_h / H, h = wg_h % H, ld = H * D; /* a token's row: every head's D */
  const size_t q0 = wg_q * QB, rows = NQ - q0 < QB ? NQ - q0 : QB;
  const float *qh = q + q_offset + (b * NQ + q0) * ld + h * D;
  const float *kh = k + k_offset + b * NK * ld + h * D;
  const float *vh = v + v_offset + b * NK * ld + h * D;
  float *oh = o + o_offset + (b * NQ + q0) * ld + h * D;

  float qt[DMAX][QB] __attribute__((aligned(64)));
  float acc[DMAX][QB] __attribute__((aligned(64)));
  float s[KB][QB] __attribute__((aligned(64)));
  for (size_t d = 0; d < D; ++d) {
    for (size_t r = 0; r < QB; ++r) qt[d][r] = r < rows ? qh[r * ld + d] * qscale : 0.0f;
    for (int u = 0; u < NV; ++u) _mm512_store_ps(&acc[d][16 * u], _mm512_setzero_ps());
  }
  __m512 m[NV], l[NV];
  for (int u = 0; u < NV; ++u) {
    m[u] = _mm512_set1_ps(FLOOR);
    l[u] = _mm512_setzero_ps();
  }

  for (size_t kb = 0; kb < NK; kb += KB) {
    const size_t len = NK - kb < KB ? NK - kb : KB;
    for (size_t j = 0; j < len; j += JT) {
      const float *key[JT];
      for (int i = 0; i < JT; ++i) /* a short last tile repeats its last key (not stored) */
        key[i] = kh + (kb + (j + i < len ? j + i : len - 1)) * ld;
      if (j + JT <= len) {
        scores_tile(&s[j], key, qt, D);
      } else {
        float tail[JT][QB] __attribute__((aligned(64)));
        scores_tile(tail, key, qt, D);
        for (size_t i = 0; i < len - j; ++i)
          for (int u = 0; u < NV; ++u)
            _mm512_store_ps(&s[j + i][16 * u], _mm512_load_ps(&tail[i][16 * u]));
      }
    }
    /* the block's max per query moves the references; what was summed scales to them */
    __m512 x[NV], alpha[NV];
    __mmask16 moved = 0;
    for (int u = 0; u < NV; ++u) {
      x[u] = m[u];
      for (size_t j = 0; j < len; ++j) x[u] = _mm512_max_ps(x[u], _mm512_load_ps(&s[j][16 * u]));
      moved |= _mm512_cmp_ps_mask(x[u], m[u], _CMP_NEQ_UQ);
    }
    if (moved) {
      for (int u = 0; u < NV; ++u) {
        alpha[u] = sdiree_f32_exp2(_mm512_sub_ps(m[u], x[u]));
        l[u] = _mm512_mul_ps(l[u], alpha[u]);
        m[u] = x[u];
      }
      if (kb)
        for (size_t d = 0; d < D; ++d)
          for (int u = 0; u < NV; ++u) {
            const __m512 y = _mm512_mul_ps(_mm512_load_ps(&acc[d][16 * u]), alpha[u]);
            _mm512_store_ps(&acc[d][16 * u], y);
          }
    }
    for (size_t j = 0; j < len; ++j)
      for (int u = 0; u < NV; ++u) {
        const __m512 e = sdiree_f32_exp2(_mm512_sub_ps(_mm512_load_ps(&s[j][16 * u]), m[u]));
        _mm512_store_ps(&s[j][16 * u], e);
        l[u] = _mm512_add_ps(l[u], e);
      }
    for (size_t c = 0; c < D; c += JT)
      values_tile(&acc[c], (const float (*)[QB])s, vh + kb * ld + c, ld, len);
  }

  float inv[QB] __attribute__((aligned(64)));
  for (int u = 0; u < NV; ++u)
    _mm512_store_ps(&inv[16 * u], _mm512_div_ps(_mm512_set1_ps(1.0f), l[u]));
  for (size_t r = 0; r < rows; ++r)
    for (size_t d = 0; d < D; ++d) oh[r * ld + d] = acc[d][r] * inv[r];
  return 0;
}
