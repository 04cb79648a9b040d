/* sdiree's AMX matmul: C[M, N] (f32) = A[M, K] (bf16) x B (bf16), one workgroup's block of C.

   iree 3.13 has no AMX ukernel: on a CPU with AMX it runs bf16 matmuls on the avx512_bf16 dot
   products, no faster there than fp32 (compile/NOTES.md, "AMX"). The UNet export
   (compile/exporters/amx_matmul.py) dispatches its large bf16 matmuls here instead.

   Layouts: A and C row-major and contiguous; B packed for AMX's B operand, [N / 16][K / 2][16][2]
   (element (k, n) at ((n / 16) * (K / 2) + k / 2) * 32 + (n % 16) * 2 + k % 2): one 16-column
   strip is K / 2 rows of 64 bytes, and 16 of those rows are one B tile. M, N and K are
   multiples of 32 (the exporter only sends such matmuls).

   Built freestanding (no libc, no TLS) for iree's embedded ELF executables by
   compile/kernel_objects.py and linked into the module as a `hal.executable.object`. The
   workgroup grid is (N / NB, M / MB): each call computes one MB x NB block of C, 32 x 32 at a
   time in four accumulator tiles (0-3), two A tiles (4, 5) and two B tiles (6, 7). The matmul's
   MB and NB come with the call (compile/exporters/amx_matmul.py picks them by shape), the
   others' are SDIREE_AMX_MB x SDIREE_AMX_NB. With a bias (has_bias), every row of C starts from
   it: the accumulators are loaded with the bias before the products (amx_support.h,
   sdiree_init_32x32), where iree added it in a pass of its own over C.

   With `split` 1 (the exports' `amx_operands: bf16x3`), A's rows are [hi | lo] (K / 2 each) and
   B packs [hi | lo] along K: each operand an f32 value as the sum of two bf16 parts, three
   products each (amx_support.h, sdiree_dp3_32x32), fp32-class results for AMX's rate / 3.

   Also here: the GEGLU form (sdiree_amx_bf16_geglu_workgroup, below), a matmul whose epilogue
   adds the bias and applies GEGLU's gate before anything leaves the workgroup. */
#include "amx_support.h"

#ifndef SDIREE_AMX_MB
#define SDIREE_AMX_MB 128
#endif
#ifndef SDIREE_AMX_NB
#define SDIREE_AMX_NB 64
#endif

/* Where a 3x3 conv's epilogue writes (sdiree_amx_bf16_conv3x3_out_workgroup, below). */
typedef struct {
  const float *add, *res;
  float *out;
  size_t row, H, images, add_rows;
} sdiree_conv_epilogue;

/* A 32 x 32 block of conv output rows [m, m + 32) x columns [n, n + 32) in blk: the rows of
   real pixels, plus the add row and the residual, to e->out ([images][H][W][N]). */
static inline void sdiree_conv_store(const sdiree_conv_epilogue *e, float blk[32][32], size_t m,
                                     size_t n, size_t N) {
  const size_t W = e->row - 2, img_rows = (e->H + 2) * e->row;
  /* the block's first row's image, padded row and column, then stepped along */
  size_t img = m / img_rows, rem = m - img * img_rows, hp = rem / e->row, wp = rem - hp * e->row;
  for (int r = 0; r < 32; ++r) {
    if (img < e->images && hp < e->H && wp < W) {
      const size_t o = ((img * e->H + hp) * W + wp) * N + n;
      const float *av = e->add + (e->add_rows > 1 ? img : 0) * N + n;
      for (int c = 0; c < 32; c += 16) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(&blk[r][c]), _mm512_loadu_ps(av + c));
        if (e->res) v = _mm512_add_ps(v, _mm512_loadu_ps(e->res + o + c));
        _mm512_storeu_ps(e->out + o + c, v);
      }
    }
    if (++wp == e->row) {
      wp = 0;
      if (++hp == e->H + 2) {
        hp = 0;
        ++img;
      }
    }
  }
}

/* One workgroup's block of C = sum over taps t of A shifted by shifts[t] rows, times B_t (the
   taps' packed B operands one after another), plus bias[N] in every row where not NULL: the
   matmul is one tap, the 3x3 conv below nine. Without an epilogue C is [M][N]; with one, it
   says where the blocks go. */
static inline void sdiree_taps_workgroup(const uint16_t *a, const uint16_t *b, const float *bias,
                                         float *c, size_t M, size_t N, size_t K,
                                         const size_t *shifts, size_t taps,
                                         const sdiree_conv_epilogue *ep, size_t MB, size_t NB,
                                         int split, size_t wg_n, size_t wg_m) {
  sdiree_configure_tiles();
  sdiree_acc tiles;
  float blk[32][32] __attribute__((aligned(64)));
  const size_t m_begin = wg_m * MB, n_begin = wg_n * NB;
  const size_t m_end = m_begin + MB < M ? m_begin + MB : M;
  const size_t n_end = n_begin + NB < N ? n_begin + NB : N;
  const size_t lda = K * 2, ldc = N * 4, strip = K * 32, tap_bytes = N * K * 2; /* bytes */
  /* a narrow block walks its B strips outermost (each strip stays in L1 over the block's rows);
     a wide one its rows (each 32-row A block stays in L1 over the strips, B streams from L2) */
  const int rows_outer = NB >= 128;
  const size_t steps_m = (m_end - m_begin + 31) / 32, steps_n = (n_end - n_begin + 31) / 32;
  for (size_t i = 0; i < steps_m * steps_n; ++i) {
    const size_t n = n_begin + 32 * (rows_outer ? i % steps_n : i / steps_m);
    const size_t m = m_begin + 32 * (rows_outer ? i / steps_n : i % steps_m);
    if (taps == 1 && !ep && !split) { /* a plain matmul's block goes straight to C */
      const uint8_t *b0 = (const uint8_t *)b + (n / 16) * strip;
      sdiree_dp_32x32_store(&tiles, a + m * K, lda, b0, b0 + strip, K, c + m * N + n, ldc,
                            bias ? bias + n : 0);
      continue;
    }
    if (bias)
      sdiree_init_32x32(&tiles, bias + n);
    else
      sdiree_zero_32x32(&tiles);
    for (size_t t = 0; t < taps; ++t) {
      const uint8_t *b0 = (const uint8_t *)b + t * tap_bytes + (n / 16) * strip;
      sdiree_dp_any_32x32(&tiles, a + (m + shifts[t]) * K, lda, b0, b0 + strip, K, split);
    }
    if (ep) {
      sdiree_store_32x32(&tiles, &blk[0][0], 128);
      sdiree_conv_store(ep, blk, m, n, N);
    } else {
      sdiree_store_32x32(&tiles, c + m * N + n, ldc);
    }
  }
  sdiree_release_tiles();
}

int sdiree_amx_bf16_matmul_workgroup(const uint16_t *a, size_t a_offset, const uint16_t *b,
                                     size_t b_offset, const float *bias, size_t bias_offset,
                                     size_t has_bias, float *c, size_t c_offset, size_t M,
                                     size_t N, size_t K, size_t MB, size_t NB, size_t split,
                                     size_t wg_n, size_t wg_m) {
  sdiree_request_amx();
  const size_t none = 0;
  sdiree_taps_workgroup(a + a_offset, b + b_offset, has_bias ? bias + bias_offset : 0,
                        c + c_offset, M, N, K, &none, 1, 0, MB, NB, (int)split, wg_n, wg_m);
  return 0;
}

/* erf(x) (Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7), 16 at a time. */
static inline __m512 erf16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = sdiree_rcp(_mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f), one));
  __m512 y = _mm512_set1_ps(1.061405429f);
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.453152027f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.421413741f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-0.284496736f));
  y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(0.254829592f));
  y = _mm512_mul_ps(y, t);
  /* e^(-x^2) = 2^(-x^2 log2 e) */
  const __m512 z = _mm512_mul_ps(_mm512_mul_ps(ax, ax), _mm512_set1_ps(-1.44269504f));
  const __m512 e = sdiree_exp2(_mm512_max_ps(z, _mm512_set1_ps(-126.0f)));
  const __m512 v = _mm512_fnmadd_ps(y, e, one); /* erf(|x|) */
  return _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(v),
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* GEGLU on AMX: out[M, N / 2] (bf16) = (x W_v^T + b_v) * gelu(x W_g^T + b_g), one workgroup's
   block of rows x 32 outputs. B packs W interleaved by 32 rows (value 32, gate 32, value 32,
   ...), bias likewise, so a workgroup's 64 packed columns are one output block's value and gate;
   the grid is (N / 64, M / MB). gelu is the exact one, x * (1 + erf(x / sqrt 2)) / 2. With
   split, out is [M, N] (each row's hi parts, then its lo parts), the next linear's operand. */
int sdiree_amx_bf16_geglu_workgroup(const uint16_t *a, size_t a_offset, const uint16_t *b,
                                    size_t b_offset, const float *bias, size_t bias_offset,
                                    uint16_t *out, size_t out_offset, size_t M, size_t N,
                                    size_t K, size_t split, size_t wg_n, size_t wg_m) {
  sdiree_request_amx();
  a += a_offset;
  b += b_offset;
  bias += bias_offset + wg_n * 64;
  const size_t lo = split ? N / 2 : 0; /* the output's lo parts, after its hi ones */
  out += out_offset + wg_n * 32;
  sdiree_configure_tiles();
  sdiree_acc tiles;
  float vg[2][32][32] __attribute__((aligned(64))); /* value, gate: one 32 x 32 block each */
  const size_t m_begin = wg_m * SDIREE_AMX_MB;
  const size_t m_end = m_begin + SDIREE_AMX_MB < M ? m_begin + SDIREE_AMX_MB : M;
  const size_t lda = K * 2, strip = K * 32, ldo = split ? N : N / 2;
  const uint8_t *bw = (const uint8_t *)b + wg_n * 4 * strip;
  for (size_t m = m_begin; m < m_end; m += 32) {
    for (int half = 0; half < 2; ++half) {
      const uint8_t *b0 = bw + half * 2 * strip;
      sdiree_zero_32x32(&tiles);
      sdiree_dp_any_32x32(&tiles, a + m * K, lda, b0, b0 + strip, K, (int)split);
      sdiree_store_32x32(&tiles, &vg[half][0][0], 128);
    }
    for (int r = 0; r < 32; ++r) {
      for (int c = 0; c < 32; c += 16) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(&vg[0][r][c]), _mm512_loadu_ps(bias + c));
        const __m512 g =
            _mm512_add_ps(_mm512_load_ps(&vg[1][r][c]), _mm512_loadu_ps(bias + 32 + c));
        const __m512 e = erf16(_mm512_mul_ps(g, _mm512_set1_ps(0.70710678f)));
        const __m512 h = _mm512_mul_ps(_mm512_mul_ps(g, _mm512_set1_ps(0.5f)),
                                       _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
        sdiree_store_bf16x16(out + (m + r) * ldo + c, _mm512_mul_ps(v, h), lo);
      }
    }
  }
  sdiree_release_tiles();
  return 0;
}

/* A 3x3, stride-1 convolution on AMX as an implicit matmul (compile/exporters/conv_amx.py):
   the sum over the 9 taps t of A_t x B_t, where A is the zero-padded channels-last input
   flattened to rows of K channels, [rows, K] bf16, with `row` = W + 2 rows per image row, A_t
   its view shifted by (t / 3) * row + t % 3 rows, and B_t the tap's [K, N] weight packed as the
   matmul's B ([9][N / 16][K / 2][16][2]). Row m of the product is the output at padded position
   m, so no tile crosses an image row's edge and A needs no im2col copy; M is the padded
   positions rounded up to 32, and the caller pads A with at least 2 * row + 2 zero rows past
   them. In the workgroup's epilogue only the rows of real pixels leave it, as out
   [images][H][W][N] f32, each plus add[i][n] (the bias, and a resnet's time embedding; i the
   image, or 0 where add has one row) and, with has_res, plus res[images][H][W][N] (a resnet's
   skip): no pass of the graph slices the padded rows or adds the bias or the skip. Same grid
   and blocking as the matmul. */
int sdiree_amx_bf16_conv3x3_out_workgroup(const uint16_t *a, size_t a_offset, const uint16_t *b,
                                          size_t b_offset, const float *add, size_t add_offset,
                                          const float *res, size_t res_offset, float *out,
                                          size_t out_offset, size_t M, size_t N, size_t K,
                                          size_t row, size_t H, size_t images, size_t add_rows,
                                          size_t has_res, size_t split, size_t wg_n,
                                          size_t wg_m) {
  sdiree_request_amx();
  size_t shifts[9];
  for (size_t t = 0; t < 9; ++t) shifts[t] = (t / 3) * row + t % 3;
  const sdiree_conv_epilogue ep = {add + add_offset, has_res ? res + res_offset : 0,
                                   out + out_offset, row, H, images, add_rows};
  sdiree_taps_workgroup(a + a_offset, b + b_offset, 0, 0, M, N, K, shifts, 9, &ep, SDIREE_AMX_MB,
                        SDIREE_AMX_NB, (int)split, wg_n, wg_m);
  return 0;
}
