/* sdiree's fp32 Winograd F(2x2,3x3) convolution on AVX-512 FMA in two kernels: the input
   transform, and the 16 products with the output transform and the conv's epilogue
   (compile/exporters/winograd_f32.py; the bf16 pair is winograd_bf16.c).

   On the fp32 kernels a split Winograd conv is ~40 dispatches: a row transform, 16 transformed
   tiles written one by one, 16 products on the matmul kernel whose results the inverse transform
   reads back, the bias and a resnet's time embedding and skip added after. Here:

   sdiree_wino2f_input_workgroup reads the conv's input as the previous op wrote it ([images][H]
   [W][C] f32, the zero padding implied) and writes the transformed tiles V = B^T d B once,
   [16][M][C]: element (r, s) of tile t (tiles image-major, then tile rows, then columns; M the
   tile count). Grid: ceil(M / 32) workgroups of 32 tiles.

   sdiree_wino2f_conv_workgroup computes, for a block of TB tiles and NB output channels, the 16
   products V_rs U_rs (U packed as the fp32 matmul kernel's B operand per element, [16][N / 64]
   [K][64]) in 6-tile x 64-channel register tiles, depth in equal steps of at most KC, and adds
   each register tile straight into its tiles' 2x2 outputs y = A^T M A where they lie in out
   [images][H][W][N]
   (products are linear in the depth too, so no partial sum is kept anywhere else). out is first
   set to add[i][n] (the bias, and a resnet's time embedding; i the image, or 0 where add has one
   row), plus res [images][H][W][N] (a resnet's skip) with has_res. The block's outputs, its A
   rows and one B strip stay in L2. Grid (N / NB, M / TB).

   Built freestanding (compile/kernel_objects.py). */
#include "f32_support.h"

#define KC 768 /* depth a step at most */
#define TB_MAX 512 /* tiles a workgroup at most */

int sdiree_wino2f_input_workgroup(const float *x, size_t x_offset, float *v, size_t v_offset,
                                  size_t M, size_t C, size_t H, size_t W, size_t images,
                                  size_t wg) {
  x += x_offset;
  v += v_offset;
  const size_t tw = W / 2, th = H / 2;
  (void)images;
  for (size_t t = wg * 32; t < wg * 32 + 32 && t < M; ++t) {
    const size_t img = t / (th * tw), rem = t % (th * tw), ty = rem / tw, tx = rem % tw;
    /* the tile's 4x4 window starts one pixel up and left: rows and columns outside are zero */
    const float *rows[4];
    int cols[4];
    for (int i = 0; i < 4; ++i) {
      const long y = (long)(2 * ty) - 1 + i, xx = (long)(2 * tx) - 1 + i;
      rows[i] = (y >= 0 && y < (long)H) ? x + ((img * H + (size_t)y) * W) * C : 0;
      cols[i] = xx >= 0 && xx < (long)W;
    }
    const long x0 = (long)(2 * tx) - 1;
    float *vt = v + t * C;
    for (size_t c = 0; c < C; c += 16) {
      __m512 e[4][4]; /* B^T d: rows combined, column j kept */
      for (int j = 0; j < 4; ++j) {
        __m512 d[4];
        for (int i = 0; i < 4; ++i)
          d[i] = rows[i] && cols[j] ? _mm512_loadu_ps(rows[i] + (size_t)(x0 + j) * C + c)
                                    : _mm512_setzero_ps();
        e[0][j] = _mm512_sub_ps(d[0], d[2]);
        e[1][j] = _mm512_add_ps(d[1], d[2]);
        e[2][j] = _mm512_sub_ps(d[2], d[1]);
        e[3][j] = _mm512_sub_ps(d[1], d[3]);
      }
      for (int r = 0; r < 4; ++r) { /* (B^T d) B: the same combination of the columns */
        const __m512 s[4] = {_mm512_sub_ps(e[r][0], e[r][2]), _mm512_add_ps(e[r][1], e[r][2]),
                             _mm512_sub_ps(e[r][2], e[r][1]), _mm512_sub_ps(e[r][1], e[r][3])};
        for (int k = 0; k < 4; ++k) _mm512_storeu_ps(vt + (r * 4 + k) * M * C + c, s[k]);
      }
    }
  }
  return 0;
}

/* F(2x2)'s A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: element r of a tile's products goes to output
   row a with sign AT[a][r] (columns likewise). */
static const int AT[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};

/* The product of `rows` tiles' V rows a (lda apart, depth kc) and B strip b ([kc][64]), added
   into those tiles' 2x2 outputs in c with signs AT[.][r] AT[.][s]: tile i's top left output
   at c + pix[i], the pixel right of it dx further, the one below dy. */
static inline __attribute__((always_inline)) void tile(int rows, const float *a, size_t lda,
                                                      const float *b, size_t kc, float *c,
                                                      const size_t *pix, size_t dy, size_t dx,
                                                      int r, int s) {
  __m512 acc[MR][4];
  sdiree_f32_accumulate(rows, a, lda, b, kc, acc);
  for (int ya = 0; ya < 2; ++ya)
    for (int yb = 0; yb < 2; ++yb) {
      const int sign = AT[ya][r] * AT[yb][s];
      if (!sign) continue;
      const size_t off = ya * dy + yb * dx;
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i)
        if (i < rows) {
          float *o = c + pix[i] + off;
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) {
            const __m512 y = _mm512_loadu_ps(o + 16 * u);
            _mm512_storeu_ps(o + 16 * u, sign > 0 ? _mm512_add_ps(y, acc[i][u])
                                                  : _mm512_sub_ps(y, acc[i][u]));
          }
        }
    }
}

int sdiree_wino2f_conv_workgroup(const float *v, size_t v_offset, const float *u,
                                 size_t u_offset, const float *add, size_t add_offset,
                                 const float *res, size_t res_offset, float *out,
                                 size_t out_offset, size_t M, size_t N, size_t K, size_t H,
                                 size_t W, size_t images, size_t add_rows, size_t has_res,
                                 size_t TB, size_t NB, size_t wg_n, size_t wg_m) {
  (void)images;
  v += v_offset;
  u += u_offset;
  add += add_offset;
  res = has_res ? res + res_offset : 0;
  out += out_offset;
  const size_t tw = W / 2, th = H / 2, dy = W * N, dx = N;
  const size_t m0 = wg_m * TB, m1 = m0 + TB < M ? m0 + TB : M;
  const size_t n0 = wg_n * NB, n1 = n0 + NB < N ? n0 + NB : N;
  size_t pix[TB_MAX];
  for (size_t t = m0; t < m1; ++t) {
    const size_t img = t / (th * tw), rem = t % (th * tw), ty = rem / tw, tx = rem % tw;
    pix[t - m0] = ((img * H + 2 * ty) * W + 2 * tx) * N;
    const float *av = add + (add_rows > 1 ? img : 0) * N;
    for (size_t p = 0; p < 4; ++p) { /* out starts as add, plus the skip */
      float *o = out + pix[t - m0] + (p / 2) * dy + (p % 2) * dx;
      const float *rp = res ? res + (o - out) : 0;
      for (size_t n = n0; n < n1; n += 16) {
        __m512 y = _mm512_loadu_ps(av + n);
        if (rp) y = _mm512_add_ps(y, _mm512_loadu_ps(rp + n));
        _mm512_storeu_ps(o + n, y);
      }
    }
  }
  /* depth in equal steps of at most KC: a short last step would add its outputs for little */
  const size_t steps = (K + KC - 1) / KC, step = (K + steps - 1) / steps;
  for (int rs = 0; rs < 16; ++rs) {
    const float *vr = v + rs * M * K, *ur = u + rs * N * K;
    for (size_t k0 = 0; k0 < K; k0 += step) {
      const size_t kc = K - k0 < step ? K - k0 : step;
      for (size_t j = n0; j < n1; j += NR) {
        const float *bj = ur + (j / NR) * K * NR + k0 * NR;
        size_t i = m0;
        for (; i + MR <= m1; i += MR)
          tile(MR, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4);
        switch (m1 - i) { /* the block's last tiles */
          case 5: tile(5, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4); break;
          case 4: tile(4, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4); break;
          case 3: tile(3, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4); break;
          case 2: tile(2, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4); break;
          case 1: tile(1, vr + i * K + k0, K, bj, kc, out + j, pix + (i - m0), dy, dx, rs / 4, rs % 4); break;
          default: break;
        }
      }
    }
  }
  return 0;
}
