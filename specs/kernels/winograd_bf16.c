/* sdiree's Winograd F(2x2,3x3) convolution in two kernels: the input transform, and the 16
   products with the output transform and the conv's epilogue (compile/exporters/winograd_fused.py).

   As iree's graph, a Winograd conv on the matmul kernel is ~25 passes over the activations around
   its 16 products: an f32 transform of the tile rows, 16 casts of the transformed tiles to bf16,
   the products' 16 f32 results written and read back by the inverse transform, the bias and the
   skip added after it. On a CPU without AMX (vdpbf16ps), those passes cost half as much as the
   products (SD 1.5's 320-channel 64x64 conv, batch 2: ~8 ms input side, ~19 ms products, ~7 ms
   output side). Here:

   sdiree_wino2_input_workgroup reads the conv's input as the GroupNorm kernel or a pad writes it
   for the direct conv kernel (zero-padded channels-last rows, [images][H + 2][W + 2][C] bf16,
   conv_amx.py) and writes the transformed tiles V = B^T d B once, [16][M][C] bf16: element
   (r, s) of tile t (tiles image-major, then tile rows, then columns; M the tiles rounded up to
   32, the rows past them zero). Grid: M / 32 workgroups of 32 tiles.

   sdiree_wino2_conv_workgroup computes, for a block of TB tiles and NB output channels, the 16
   products V_rs U_rs (U packed as the matmul kernel's B operand, [16][N / 16][K / 2][16][2]),
   each 32 x 32 block added straight into the tiles' 2x2 outputs y = A^T M A in L1 (never
   written as products), and writes y once to out [images][H][W][N] f32 with add[i][n] (the
   bias, and a resnet's time embedding; i the image, or 0 where add has one row) and, with
   has_res, res [images][H][W][N] (a resnet's skip) added. Grid (N / NB, M / TB).

   Both built freestanding like amx_bf16_matmul.c (compile/kernel_objects.py), on AMX's tiles or
   avx512_bf16's vdpbf16ps (amx_support.h). */
#include "amx_support.h"

#define TB_MAX 64 /* tiles a workgroup of the products: their outputs stay on the stack */

/* 16 bf16 at p as f32. */
static inline __m512 sdiree_bf16_load16(const uint16_t *p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

int sdiree_wino2_input_workgroup(const uint16_t *x, size_t x_offset, uint16_t *v,
                                 size_t v_offset, size_t M, size_t C, size_t H, size_t W,
                                 size_t images, size_t wg) {
  x += x_offset;
  v += v_offset;
  const size_t row = W + 2, tw = W / 2, th = H / 2, tiles = images * th * tw;
  for (size_t t = wg * 32; t < wg * 32 + 32 && t < M; ++t) {
    uint16_t *vt = v + t * C;
    if (t >= tiles) {
      for (int rs = 0; rs < 16; ++rs)
        for (size_t c = 0; c < C; c += 16)
          _mm256_storeu_si256((__m256i *)(vt + rs * M * C + c), _mm256_setzero_si256());
      continue;
    }
    const size_t img = t / (th * tw), rem = t % (th * tw), ty = rem / tw, tx = rem % tw;
    const uint16_t *d = x + ((img * (H + 2) + 2 * ty) * row + 2 * tx) * C;
    for (size_t c = 0; c < C; c += 16) {
      __m512 e[4][4]; /* B^T d: rows combined, column j kept */
      for (int j = 0; j < 4; ++j) {
        const __m512 d0 = sdiree_bf16_load16(d + (0 * row + j) * C + c);
        const __m512 d1 = sdiree_bf16_load16(d + (1 * row + j) * C + c);
        const __m512 d2 = sdiree_bf16_load16(d + (2 * row + j) * C + c);
        const __m512 d3 = sdiree_bf16_load16(d + (3 * row + j) * C + c);
        e[0][j] = _mm512_sub_ps(d0, d2);
        e[1][j] = _mm512_add_ps(d1, d2);
        e[2][j] = _mm512_sub_ps(d2, d1);
        e[3][j] = _mm512_sub_ps(d1, d3);
      }
      for (int r = 0; r < 4; ++r) { /* (B^T d) B: the same combination of the columns */
        const __m512 s[4] = {_mm512_sub_ps(e[r][0], e[r][2]), _mm512_add_ps(e[r][1], e[r][2]),
                             _mm512_sub_ps(e[r][2], e[r][1]), _mm512_sub_ps(e[r][1], e[r][3])};
        for (int k = 0; k < 4; ++k)
          _mm256_storeu_si256((__m256i *)(vt + (r * 4 + k) * M * C + c),
                              (__m256i)_mm512_cvtneps_pbh(s[k]));
      }
    }
  }
  return 0;
}

/* y[a][b] += A^T[a][r] A^T[b][s] blk for F(2x2)'s A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]. */
static inline void sdiree_wino2_gather(float (*y)[32][32], const float (*blk)[32], int r, int s) {
  static const int at[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
  for (int ab = 0; ab < 4; ++ab) {
    const int coef = at[ab / 2][r] * at[ab % 2][s];
    if (!coef) continue;
    float(*ya)[32] = y[ab];
    for (int i = 0; i < 32; ++i)
      for (int c = 0; c < 32; c += 16) {
        const __m512 b = _mm512_load_ps(&blk[i][c]);
        const __m512 a = _mm512_load_ps(&ya[i][c]);
        _mm512_store_ps(&ya[i][c], coef > 0 ? _mm512_add_ps(a, b) : _mm512_sub_ps(a, b));
      }
  }
}

int sdiree_wino2_conv_workgroup(const uint16_t *v, size_t v_offset, const uint16_t *u,
                                size_t u_offset, const float *add, size_t add_offset,
                                const float *res, size_t res_offset, float *out,
                                size_t out_offset, size_t M, size_t N, size_t K, size_t H,
                                size_t W, size_t images, size_t add_rows, size_t has_res,
                                size_t TB, size_t NB, size_t wg_n, size_t wg_m) {
  sdiree_request_amx();
  v += v_offset;
  u += u_offset;
  add += add_offset;
  res = has_res ? res + res_offset : 0;
  out += out_offset;
  const size_t tw = W / 2, th = H / 2, tiles = images * th * tw;
  const size_t m_begin = wg_m * TB, m_end = m_begin + TB < M ? m_begin + TB : M;
  const size_t n_begin = wg_n * NB, n_end = n_begin + NB < N ? n_begin + NB : N;
  const size_t subs = (m_end - m_begin) / 32, lda = K * 2, strip = K * 32; /* bytes */
  /* the 2x2 outputs y[a * 2 + b] of each 32-tile sub-block, for one 32-column block */
  float y[TB_MAX / 32][4][32][32] __attribute__((aligned(64)));
#ifndef SDIREE_KERNEL_AVX512
  float stage[32][32] __attribute__((aligned(64)));
#endif
  sdiree_configure_tiles();
  sdiree_acc tiles_acc;
  for (size_t n = n_begin; n < n_end; n += 32) {
    for (size_t sb = 0; sb < subs; ++sb)
      for (int ab = 0; ab < 4; ++ab)
        for (int i = 0; i < 32; ++i) {
          _mm512_store_ps(&y[sb][ab][i][0], _mm512_setzero_ps());
          _mm512_store_ps(&y[sb][ab][i][16], _mm512_setzero_ps());
        }
    for (int rs = 0; rs < 16; ++rs) {
      /* this element's B strips stay in cache over the sub-blocks */
      const uint8_t *b0 = (const uint8_t *)(u + rs * N * K) + (n / 16) * strip;
      for (size_t sb = 0; sb < subs; ++sb) {
        const uint16_t *a = v + (rs * M + m_begin + sb * 32) * K;
        sdiree_zero_32x32(&tiles_acc);
        sdiree_dp_32x32(&tiles_acc, a, lda, b0, b0 + strip, K);
#ifdef SDIREE_KERNEL_AVX512
        sdiree_wino2_gather(y[sb], (const float(*)[32])tiles_acc.c, rs / 4, rs % 4);
#else
        sdiree_store_32x32(&tiles_acc, &stage[0][0], 128);
        sdiree_wino2_gather(y[sb], (const float(*)[32])stage, rs / 4, rs % 4);
#endif
      }
    }
    /* the epilogue: each real tile's 2x2 pixels, plus add and the skip */
    for (size_t sb = 0; sb < subs; ++sb)
      for (int i = 0; i < 32; ++i) {
        const size_t t = m_begin + sb * 32 + i;
        if (t >= tiles) break;
        const size_t img = t / (th * tw), rem = t % (th * tw), ty = rem / tw, tx = rem % tw;
        const float *av = add + (add_rows > 1 ? img : 0) * N + n;
        for (int ab = 0; ab < 4; ++ab) {
          const size_t o = ((img * H + 2 * ty + ab / 2) * W + 2 * tx + ab % 2) * N + n;
          for (int c = 0; c < 32; c += 16) {
            __m512 x = _mm512_add_ps(_mm512_load_ps(&y[sb][ab][i][c]), _mm512_loadu_ps(av + c));
            if (res) x = _mm512_add_ps(x, _mm512_loadu_ps(res + o + c));
            _mm512_storeu_ps(out + o + c, x);
          }
        }
      }
  }
  sdiree_release_tiles();
  return 0;
}
