/* sdiree's fp32 linear on AVX-512 FMA: C = A B + bias for one workgroup's block of C.

   iree 3.13's f32 matmul ukernel (mmt4d, 16x16 tiles: 16 broadcasts and one load a step for
   16 FMAs) runs SD 1.5's UNet linears at ~65 % of a 2-core Zen 5's FMA peak in situ, its
   activations packed by an encoding dispatch first. Here A is read as the previous op wrote it
   (row-major [M][K], no packing pass) and B is the weight packed once at compile ([N / 64][K]
   [64]: the parameter encoder computes it), the register tile 6 rows x 64 columns (24 zmm
   accumulators, 4 loads and 6 broadcasts a step for 24 FMAs): one core alone 230-235 GFLOP/s
   on 8192x320 @ 320x2560, ~93 % of its peak (compile/NOTES.md).

   A workgroup computes rows [wg_m MB, +MB) and columns [wg_n NB, +NB) (clipped to M and N),
   depth in steps of KC (its B strips, 64 x KC, stay in L2 while the rows pass), the bias added
   as the last step's results are stored. N is a multiple of 64; M and K are any. The grid
   (compile/exporters/linear_f32.py) walks the row blocks fastest, so successive workgroups
   share their B strip and the weight is read from memory once.

   Built freestanding (compile/kernel_objects.py). */
#include "f32_support.h"

#define KC 512 /* depth a step */

/* C[rows][64] (+)= A[rows][kc] B[kc][64], with bias (or nothing) on the last step. */
static inline __attribute__((always_inline)) void tile(int rows, const float *a, size_t lda,
                                                      const float *b, size_t kc, float *c,
                                                      size_t ldc, int first, const float *bias) {
  __m512 acc[MR][4];
  sdiree_f32_accumulate(rows, a, lda, b, kc, acc);
  __m512 add[4];
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) add[u] = bias ? _mm512_loadu_ps(bias + 16 * u) : _mm512_setzero_ps();
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    if (i < rows)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        __m512 y = _mm512_add_ps(acc[i][u], add[u]);
        if (!first) y = _mm512_add_ps(y, _mm512_loadu_ps(c + i * ldc + 16 * u));
        _mm512_storeu_ps(c + i * ldc + 16 * u, y);
      }
}

int sdiree_f32_linear_workgroup(const float *a, size_t a_offset, const float *b,
                                size_t b_offset, const float *bias, size_t bias_offset,
                                float *c, size_t c_offset, size_t M, size_t N, size_t K,
                                size_t MB, size_t NB, size_t wg_n, size_t wg_m) {
  a += a_offset;
  b += b_offset;
  bias += bias_offset;
  c += c_offset;
  const size_t m0 = wg_m * MB, n0 = wg_n * NB;
  const size_t m1 = m0 + MB < M ? m0 + MB : M, n1 = n0 + NB < N ? n0 + NB : N;
  for (size_t k0 = 0; k0 < K; k0 += KC) {
    const size_t kc = K - k0 < KC ? K - k0 : KC;
    const int first = k0 == 0;
    for (size_t j = n0; j < n1; j += NR) {
      const float *bj = b + (j / NR) * K * NR + k0 * NR;
      const float *add = k0 + kc == K ? bias + j : 0;
      size_t i = m0;
      for (; i + MR <= m1; i += MR) tile(MR, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add);
      switch (m1 - i) { /* the block's last rows */
        case 5: tile(5, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add); break;
        case 4: tile(4, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add); break;
        case 3: tile(3, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add); break;
        case 2: tile(2, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add); break;
        case 1: tile(1, a + i * K + k0, K, bj, kc, c + i * N + j, N, first, add); break;
        default: break;
      }
    }
  }
  return 0;
}

/* GEGLU: out[M][N] = (A W_v + b_v) * gelu(A W_g + b_g), the exact GELU, for one workgroup's
   block of out (rows [wg_m MB, +MB), columns [wg_n NB, +NB)). B is the projection's weight
   packed with its value and gate panels interleaved ([2 N / 64][K][64]: value panel p at 2p,
   its gate at 2p + 1), the bias likewise. Each register tile takes the whole depth (a GEGLU
   projection's K is its model width, 320 to 1280: both panels stay in L2 while the rows pass),
   the gate first, kept as gelu(gate) on the stack, then the value, so only the product is
   written: [8192, 1280] instead of the two [8192, 1280] halves and an elementwise pass. */
static inline __attribute__((always_inline)) void geglu_tile(int rows, const float *a, size_t K,
                                                            const float *bv, const float *bg,
                                                            const float *bias, float *c,
                                                            size_t ldc) {
  __m512 acc[MR][4];
  float gate[MR][NR] __attribute__((aligned(64)));
  sdiree_f32_accumulate(rows, a, K, bg, K, acc);
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    if (i < rows)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
        _mm512_store_ps(&gate[i][16 * u],
                        sdiree_f32_gelu(_mm512_add_ps(acc[i][u], _mm512_loadu_ps(bias + NR + 16 * u))));
  sdiree_f32_accumulate(rows, a, K, bv, K, acc);
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    if (i < rows)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512 v = _mm512_add_ps(acc[i][u], _mm512_loadu_ps(bias + 16 * u));
        _mm512_storeu_ps(c + i * ldc + 16 * u, _mm512_mul_ps(v, _mm512_load_ps(&gate[i][16 * u])));
      }
}

int sdiree_f32_geglu_workgroup(const float *a, size_t a_offset, const float *b, size_t b_offset,
                               const float *bias, size_t bias_offset, float *c, size_t c_offset,
                               size_t M, size_t N, size_t K, size_t MB, size_t NB, size_t wg_n,
                               size_t wg_m) {
  a += a_offset;
  b += b_offset;
  bias += bias_offset;
  c += c_offset;
  const size_t m0 = wg_m * MB, n0 = wg_n * NB;
  const size_t m1 = m0 + MB < M ? m0 + MB : M, n1 = n0 + NB < N ? n0 + NB : N;
  for (size_t j = n0; j < n1; j += NR) {
    const float *bv = b + 2 * (j / NR) * K * NR, *bg = bv + K * NR, *bj = bias + 2 * j;
    size_t i = m0;
    for (; i + MR <= m1; i += MR) geglu_tile(MR, a + i * K, K, bv, bg, bj, c + i * N + j, N);
    switch (m1 - i) { /* the block's last rows */
      case 5: geglu_tile(5, a + i * K, K, bv, bg, bj, c + i * N + j, N); break;
      case 4: geglu_tile(4, a + i * K, K, bv, bg, bj, c + i * N + j, N); break;
      case 3: geglu_tile(3, a + i * K, K, bv, bg, bj, c + i * N + j, N); break;
      case 2: geglu_tile(2, a + i * K, K, bv, bg, bj, c + i * N + j, N); break;
      case 1: geglu_tile(1, a + i * K, K, bv, bg, bj, c + i * N + j, N); break;
      default: break;
    }
  }
  return 0;
}
