/* sdiree's norm kernels for the AMX exports: GroupNorm and LayerNorm on f32 activations, their
   bf16 results for the matmul and conv kernels that read them next.

   GroupNorm on channels-last activations in two passes over them
   (compile/exporters/group_norm_kernel.py): the statistics, then the normalization with its
   affine, SiLU where the block has one, and the bf16 the next matmul or conv kernel reads,
   written where that kernel reads it.

   iree 3.13 compiles GroupNorm + SiLU + the conv kernel's padded bf16 input as three passes that
   each read the f32 tensor and write one (the centred tensor, the normalized one, the activated
   one padded), then a cast: ~6 f32 passes where two reads and one bf16 write suffice (at 64x64,
   320 channels, batch 2, 4 ms a norm of which ~1.3 needed).

   Statistics (sdiree_group_norm_stats_workgroup): workgroup (b, n) sums, per channel c over the
   pixels of block b of image n, d = x - ref_c and d^2, ref_c being the image's first pixel
   (sums about a value near the mean, so the variance does not cancel). x is [N][P][C],
   partials [N][NB][2][C] (NB = P / PB blocks). The graph combines the blocks and the channels of
   each group into the scale a and shift b of each image's channels.

   Application (sdiree_group_norm_apply_workgroup): y = a x + b per image and channel, silu(y)
   = y / (1 + e^-y) if asked, rounded to bf16. Workgroup (b, n) does image rows [b RB, b RB + RB)
   of image n. The output is [N][H + 2 pad][W + 2 pad][C] and `tail` more zero rows of C after
   it: with pad 1 the zero-padded input of the 3x3 conv kernel (amx_bf16_matmul.c), its border
   and its read-ahead rows zeroed here; with pad 0 the plain [N][H][W][C]. C is a multiple of 16.

   With `split` 1 (`amx_operands: bf16x3`) both write each value as the hi and lo bf16 parts of
   an f32 operand, a pixel's or row's C hi parts then its C lo parts (amx_support.h).

   Built freestanding like the other kernels (compile/kernel_objects.py). */
#include "amx_support.h"

int sdiree_group_norm_stats_workgroup(const float *x, size_t x_offset, float *part,
                                      size_t part_offset, size_t P, size_t C, size_t PB,
                                      size_t wg_b, size_t wg_n) {
  const size_t nb = (P + PB - 1) / PB;
  const float *img = x + x_offset + wg_n * P * C;
  float *out = part + part_offset + (wg_n * nb + wg_b) * 2 * C;
  const size_t p0 = wg_b * PB, p1 = p0 + PB < P ? p0 + PB : P;
  size_t c = 0;
  for (; c + 64 <= C; c += 64) { /* four vectors of channels at a time, the pixels inner */
    __m512 r[4], s1[4], s2[4];
    for (int v = 0; v < 4; ++v) {
      r[v] = _mm512_loadu_ps(img + c + 16 * v);
      s1[v] = s2[v] = _mm512_setzero_ps();
    }
    for (size_t p = p0; p < p1; ++p) {
      const float *px = img + p * C + c;
      for (int v = 0; v < 4; ++v) {
        const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(px + 16 * v), r[v]);
        s1[v] = _mm512_add_ps(s1[v], d);
        s2[v] = _mm512_fmadd_ps(d, d, s2[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_ps(out + c + 16 * v, s1[v]);
      _mm512_storeu_ps(out + C + c + 16 * v, s2[v]);
    }
  }
  for (; c < C; c += 16) {
    const __m512 r = _mm512_loadu_ps(img + c);
    __m512 s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
    for (size_t p = p0; p < p1; ++p) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(img + p * C + c), r);
      s1 = _mm512_add_ps(s1, d);
      s2 = _mm512_fmadd_ps(d, d, s2);
    }
    _mm512_storeu_ps(out + c, s1);
    _mm512_storeu_ps(out + C + c, s2);
  }
  return 0;
}

/* silu(y) = y / (1 + 2^(-y log2 e)), the exponent at most 100 (y > -69: 2^100 stays finite for
   sdiree_rcp, and y / 2^100 is 0 in bf16 as y / inf would be) */
static inline __m512 silu16(__m512 y) {
  const __m512 x = _mm512_min_ps(_mm512_mul_ps(y, _mm512_set1_ps(-1.44269504f)),
                                 _mm512_set1_ps(100.0f));
  return _mm512_mul_ps(y, sdiree_rcp(_mm512_add_ps(sdiree_exp2(x), _mm512_set1_ps(1.0f))));
}

int sdiree_group_norm_apply_workgroup(const float *x, size_t x_offset, const float *ab,
                                      size_t ab_offset, uint16_t *out, size_t out_offset,
                                      size_t N, size_t H, size_t W, size_t C, size_t RB,
                                      size_t pad, size_t tail, size_t silu, size_t split,
                                      size_t wg_b, size_t wg_n) {
  const float *img = x + x_offset + wg_n * H * W * C;
  const float *a = ab + ab_offset + wg_n * 2 * C, *b = a + C;
  const size_t orow = W + 2 * pad, oimg = (H + 2 * pad) * orow;
  const size_t OC = split ? 2 * C : C, lo = split ? C : 0; /* a pixel's [hi | lo] with split */
  uint16_t *o = out + out_offset + wg_n * oimg * OC;
  const size_t h0 = wg_b * RB, h1 = h0 + RB < H ? h0 + RB : H;
  for (size_t h = h0; h < h1; ++h) {
    uint16_t *dst = o + ((h + pad) * orow + pad) * OC;
    const float *src = img + h * W * C;
    for (size_t w = 0; w < W; ++w) {
      for (size_t c = 0; c < C; c += 16) {
        __m512 y = _mm512_fmadd_ps(_mm512_loadu_ps(src + w * C + c), _mm512_loadu_ps(a + c),
                                   _mm512_loadu_ps(b + c));
        if (silu) y = silu16(y);
        sdiree_store_bf16x16(dst + w * OC + c, y, lo);
      }
    }
    if (pad) { /* the row's left and right border */
      sdiree_zero_bf16(dst - OC, OC);
      sdiree_zero_bf16(dst + W * OC, OC);
    }
  }
  if (pad && h0 == 0) sdiree_zero_bf16(o, orow * OC);
  if (pad && h1 == H) sdiree_zero_bf16(o + (H + 1) * orow * OC, orow * OC);
  if (h1 == H && wg_n == N - 1) sdiree_zero_bf16(out + out_offset + N * oimg * OC, tail * OC);
  return 0;
}

/* LayerNorm over the last dimension (layer_norm_kernel.py): x [M][C] f32, rows [wg_m RB,
   wg_m RB + RB) by workgroup; y = (x - mean) rstd gamma + beta rounded to bf16, [M][C]. Each
   row is read from memory once (its second and third reads hit L1); C is a multiple of 16. */
int sdiree_layer_norm_workgroup(const float *x, size_t x_offset, const float *gb,
                                size_t gb_offset, uint16_t *out, size_t out_offset, size_t M,
                                size_t C, size_t RB, size_t eps_bits, size_t split,
                                size_t wg_m) {
  union {
    uint32_t u;
    float f;
  } eps = {(uint32_t)eps_bits};
  const float *gamma = gb + gb_offset, *beta = gamma + C;
  const size_t m0 = wg_m * RB, m1 = m0 + RB < M ? m0 + RB : M;
  const float inv_c = 1.0f / (float)C;
  for (size_t m = m0; m < m1; ++m) {
    const float *row = x + x_offset + m * C;
    __m512 s = _mm512_setzero_ps();
    for (size_t c = 0; c < C; c += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(row + c));
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(s) * inv_c);
    __m512 v = _mm512_setzero_ps();
    for (size_t c = 0; c < C; c += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(row + c), mean);
      v = _mm512_fmadd_ps(d, d, v);
    }
    const float var = _mm512_reduce_add_ps(v) * inv_c + eps.f;
    const __m128 r = _mm_sqrt_ss(_mm_set_ss(var));
    const __m512 rstd = _mm512_set1_ps(1.0f / _mm_cvtss_f32(r));
    uint16_t *dst = out + out_offset + m * (split ? 2 * C : C);
    for (size_t c = 0; c < C; c += 16) {
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + c), mean), rstd);
      const __m512 y = _mm512_fmadd_ps(d, _mm512_loadu_ps(gamma + c), _mm512_loadu_ps(beta + c));
      sdiree_store_bf16x16(dst + c, y, split ? C : 0);
    }
  }
  return 0;
}
