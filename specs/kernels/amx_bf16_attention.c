/* sdiree's fused attention on AMX: O = softmax(Q K^T) V for one head's block of 32 queries.

   The chunked attention of compile/exporters/attention.py writes each chunk's score block
   (256 queries x 4096 keys, f32: 4 MiB) to memory and reads it back three times (max, exp, the
   product with V): at SD 1.5's 64x64 level that is ~18 GB of traffic a UNet call, more than the
   products cost on AMX. Here a workgroup keeps its scores in L1: keys are taken a block of KB at
   a time, the softmax is the online one (running row reference m and sum l, the output rescaled
   when a row's scores pass its reference by more than SLACK), and both products run on AMX
   tiles. The exporter (compile/exporters/attention_amx.py) sends attention without a mask here.

   Layouts, per head h of BH = B x H (the workgroup grid is (NQ / 32, BH)):
     q  [B][NQ][H][DQ] f32, the heads side by side in each query's row, as the projection
        writes them (H 1: [BH][NQ][DQ]): a workgroup takes its 32 rows of its head, scaled by
        qscale, as bf16 zero-padded to D (the products' depth: a multiple of 32) into L1 itself,
        so no pass of the graph scales, casts or pads them;
     k  [BH][NK / 16][D / 2][16][2] bf16: each head's keys [NK, D] packed as AMX's B operand of
        Q K^T (amx_matmul.pack_b of the keys);
     v  [BH][DV / 16][NK / 2][16][2] bf16: each head's values [NK, DV] packed as the B operand of
        P V (pack_b of the values' transpose), DV a multiple of 32, at most 160;
     o  [B][NQ][H][DO]: the first DO <= DV columns of the normalized output, the heads side by
        side again, as the output projection reads them: bf16 (its operand), f32 with split.
   NQ and NK are multiples of 32; only the first NKV <= NK keys are real (cross-attention's 77
   text tokens, zero-padded to 96): the others' scores are set to MASKED before the softmax.
   qscale includes log2(e), so the softmax's exponentials are powers of 2, and as P is
   rounded to bf16 for the product they are taken to bf16's precision (sdiree_exp2_coarse); the
   row sums l are summed in f32 before that rounding (its errors are unbiased and average out
   over a row), 16 lanes a row until the end.

   Row maxima: only the first key block's are reduced (the rows' references m). A later block's
   exponentials are taken against m as it is, and a row is looked at again only when one lane of
   its block sum passes 2^SLACK (which any exponential above 2^SLACK, a score more than SLACK
   past m, makes it do): then its maximum is reduced, and where it passes m by more than SLACK, m
   moves to it, l and the row's output are rescaled by 2^(m_old - m_new) and the row's
   exponentials taken again.

   With `split` 1 (`amx_operands: bf16x3`) every operand is an f32 value as two bf16 parts
   (amx_support.h, sdiree_dp3_32x32): q's rows per head [hi D/2 | lo D/2], k packing [hi | lo]
   along D, v's strips packing the values' hi parts for all NK keys, then their lo parts; P is
   taken to f32's precision (sdiree_exp2) and split likewise.

   sdiree_amx_bf16_pack_kv_workgroup makes k or v above from the projection's f32 output
   [B][NK][H][DQ] in one pass (cast, head split, zero padding and packing): as iree passes
   those were a cast-and-transpose, a pad copy and a packing transpose of 16-bit pairs that iree
   3.13 moved at ~3 GB/s (~30 ms a UNet call at SD 1.5's 64x64 level).

   Built freestanding like amx_bf16_matmul.c (compile/kernel_objects.py). Its stack frame is
   ~74 KB (iree's task workers have 128 KB). */
#include "amx_support.h"

#define QB 32        /* queries a workgroup */
#define KB 128       /* keys a step of the online softmax */
#define DV_MAX 160
#define SLACK 8.0f   /* how far (base 2) scores may pass a row's reference max */
#define MASKED -30000.0f /* a padded key's score: its exponential is 0 */

/* The lanes of a 16-wide vector starting at column c of a row whose first n columns count. */
static inline __mmask16 sdiree_lanes_before(size_t n, size_t c) {
  return (__mmask16)(c >= n ? 0 : n - c >= 16 ? 0xFFFFu : (1u << (n - c)) - 1);
}

/* p[r] = 2^(s[r] - m) for one row's len scores (bf16, with split its lo parts too at lo
   elements past p), their sum returned as 16 lanes. */
static inline __m512 sdiree_softmax_row(const float *s, float m, uint16_t *p, size_t lo,
                                        size_t len, int split) {
  const __m512 mv = _mm512_set1_ps(m);
  if (split) { /* P to f32's precision, as hi and lo parts */
    __m512 sum = _mm512_setzero_ps();
    for (size_t c = 0; c < len; c += 16) {
      const __m512 e = sdiree_exp2(_mm512_sub_ps(_mm512_load_ps(s + c), mv));
      sdiree_store_bf16x16(p + c, e, lo);
      sum = _mm512_add_ps(sum, e);
    }
    return sum;
  }
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (size_t c = 0; c < len; c += 32) {
    const __m512 e0 = sdiree_exp2_coarse(_mm512_sub_ps(_mm512_load_ps(s + c), mv));
    const __m512 e1 = sdiree_exp2_coarse(_mm512_sub_ps(_mm512_load_ps(s + c + 16), mv));
    _mm512_store_si512((void *)(p + c), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  return _mm512_add_ps(sum0, sum1);
}

#ifdef SDIREE_KERNEL_AVX512
/* acc[32][:40] += p v over len keys (vdpbf16ps, no AMX): a head dim of 40 in one pass a row
   block, the last 8 columns on 256-bit products (on Zen 4 two a cycle, so as dear as a
   512-bit one's half), against two passes of 32 and 16 columns (48 computed). p's rows are KB
   keys apart; v's 16-column strips (rows of 64 bytes: pairs of keys) strip bytes apart. */
static inline void sdiree_pv_40(float (*acc)[DV_MAX], const uint16_t *p, const uint8_t *v,
                                size_t strip, size_t len) {
  for (int r0 = 0; r0 < QB; r0 += 8) {
    __m512 c0[8], c1[8];
    __m256 c2[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      c0[i] = _mm512_load_ps(&acc[r0 + i][0]);
      c1[i] = _mm512_load_ps(&acc[r0 + i][16]);
      c2[i] = _mm256_load_ps(&acc[r0 + i][32]);
    }
    const uint8_t *pr = (const uint8_t *)(p + r0 * KB);
    for (size_t kp = 0; kp < len / 2; ++kp) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(v + kp * 64));
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(v + strip + kp * 64));
      const __m256bh b2 = (__m256bh)_mm256_loadu_si256((const __m256i *)(v + 2 * strip + kp * 64));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m512i av = _mm512_set1_epi32(*(const sdiree_pair *)(pr + i * KB * 2 + kp * 4));
        c0[i] = _mm512_dpbf16_ps(c0[i], (__m512bh)av, b0);
        c1[i] = _mm512_dpbf16_ps(c1[i], (__m512bh)av, b1);
        c2[i] = _mm256_dpbf16_ps(c2[i], (__m256bh)_mm512_castsi512_si256(av), b2);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      _mm512_store_ps(&acc[r0 + i][0], c0[i]);
      _mm512_store_ps(&acc[r0 + i][16], c1[i]);
      _mm256_store_ps(&acc[r0 + i][32], c2[i]);
    }
  }
}
#endif

static inline float sdiree_row_max(const float *s, size_t len) {
  __m512 mx = _mm512_load_ps(s);
  for (size_t c = 16; c < len; c += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s + c));
  return _mm512_reduce_max_ps(mx);
}

int sdiree_amx_bf16_attention_workgroup(const float *q, size_t q_offset, const uint16_t *k,
                                        size_t k_offset, const uint16_t *v, size_t v_offset,
                                        void *o, size_t o_offset, size_t NQ, size_t NK,
                                        size_t NKV, size_t D, size_t DQ, float qscale, size_t DV,
                                        size_t DO, size_t H, size_t split, size_t wg_q,
                                        size_t wg_h) {
  sdiree_request_amx();
  const size_t q0 = wg_q * QB, first = (wg_h / H * NQ + q0) * H + wg_h % H; /* its first row */
  /* the workgroup's queries as the products' A operand: rows of D bf16 (with split, each row
     its hi parts then its lo parts, D / 2 each) */
  uint16_t qa[QB][2 * DV_MAX] __attribute__((aligned(64)));
  const size_t part = split ? D / 2 : D;
  for (int r = 0; r < QB; ++r) {
    const float *src = q + q_offset + (first + (size_t)r * H) * DQ;
    for (size_t c = 0; c < part; c += 16) {
      const __mmask16 in = sdiree_lanes_before(DQ, c);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, src + c), _mm512_set1_ps(qscale));
      sdiree_store_bf16x16(&qa[r][c], x, split ? part : 0);
    }
  }
  const uint8_t *qh = (const uint8_t *)&qa[0][0];
  const uint8_t *kh = (const uint8_t *)(k + k_offset + wg_h * NK * D);
  const size_t vk = split ? 2 * NK : NK; /* a value strip's keys: with split, hi's then lo's */
  const uint8_t *vh = (const uint8_t *)(v + v_offset + wg_h * vk * DV);

  float s[QB][KB] __attribute__((aligned(64)));
  uint16_t p[2][QB][KB] __attribute__((aligned(64))); /* bf16 P, and with split its lo parts */
  float acc[QB][DV_MAX] __attribute__((aligned(64)));
  float m[QB];
  float l[QB][16] __attribute__((aligned(64))); /* each row's sum, 16 lanes: reduced at the end */
  for (int r = 0; r < QB; ++r) {
    _mm512_store_ps(l[r], _mm512_setzero_ps());
    for (size_t c = 0; c < DV; c += 16) _mm512_store_ps(&acc[r][c], _mm512_setzero_ps());
  }

  sdiree_configure_tiles();
  sdiree_acc tiles;

  const size_t ldq = 2 * DV_MAX * 2, k_strip = D * 32, v_strip = vk * 32; /* bytes */
  const __m512 limit = _mm512_set1_ps(1 << (int)SLACK);
  /* the scores' depth: D, or without split the real head dim DQ rounded up to the blocks' depth
     step, the rest of D being q's zero padding */
  const size_t dq_step = (DQ + SDIREE_DEPTH_STEP - 1) / SDIREE_DEPTH_STEP * SDIREE_DEPTH_STEP;
  const size_t qk_depth = split || dq_step > D ? D : dq_step;
  for (size_t kb = 0; kb < NK; kb += KB) {
    const size_t len = NK - kb < KB ? NK - kb : KB;
    /* s = q k^T for keys [kb, kb + len), 32 x 32 at a time */
    for (size_t n = 0; n < len; n += 32) {
      const uint8_t *b0 = kh + ((kb + n) / 16) * k_strip;
      if (!split) {
        sdiree_dp_32x32_store(&tiles, qh, ldq, b0, b0 + k_strip, qk_depth, &s[0][n], KB * 4, 0);
        continue;
      }
      sdiree_zero_32x32(&tiles);
      sdiree_dp_any_32x32(&tiles, qh, ldq, b0, b0 + k_strip, qk_depth, (int)split);
      sdiree_store_32x32(&tiles, &s[0][n], KB * 4);
    }
    if (kb + len > NKV) { /* padded keys out */
      const size_t real = NKV > kb ? NKV - kb : 0;
      for (int r = 0; r < QB; ++r)
        for (size_t c = real & ~(size_t)15; c < len; c += 16) {
          const __mmask16 pad = (__mmask16)~sdiree_lanes_before(real, c);
          _mm512_mask_storeu_ps(&s[r][c], pad, _mm512_set1_ps(MASKED));
        }
    }
    if (kb == 0)
      for (int r = 0; r < QB; ++r) m[r] = sdiree_row_max(s[r], len);
    for (int r = 0; r < QB; ++r) {
      uint16_t *pr = &p[0][r][0];
      __m512 sum = sdiree_softmax_row(s[r], m[r], pr, QB * KB, len, (int)split);
      if (_mm512_cmp_ps_mask(sum, limit, _CMP_GT_OQ)) { /* rarely: a score may pass m + SLACK */
        const float row_max = sdiree_row_max(s[r], len);
        if (row_max > m[r] + SLACK) {
          const __m512 alpha = _mm512_set1_ps(_mm512_cvtss_f32(sdiree_exp2(_mm512_set1_ps(m[r] - row_max))));
          m[r] = row_max;
          _mm512_store_ps(l[r], _mm512_mul_ps(_mm512_load_ps(l[r]), alpha));
          for (size_t c = 0; c < DV; c += 16)
            _mm512_store_ps(&acc[r][c], _mm512_mul_ps(_mm512_load_ps(&acc[r][c]), alpha));
          sum = sdiree_softmax_row(s[r], m[r], pr, QB * KB, len, (int)split);
        }
      }
      _mm512_store_ps(l[r], _mm512_add_ps(_mm512_load_ps(l[r]), sum));
    }
    /* acc += p v for the same keys */
#ifdef SDIREE_KERNEL_AVX512
    if (!split && DO > 32 && DO <= 40) { /* SD 1.5's head dim 40: 2.5 strips in one pass */
      sdiree_pv_40(acc, &p[0][0][0], vh + kb * 32, v_strip, len);
      continue;
    }
#endif
    for (size_t n = 0; n < DV; n += 32) {
      const uint8_t *b0 = vh + (n / 16) * v_strip + kb * 32;
      sdiree_load_32x32(&tiles, &acc[0][n], DV_MAX * 4);
      if (split)
        sdiree_dp3_32x32(&tiles, &p[0][0][0], QB * KB * 2, KB * 2, b0, b0 + v_strip, NK * 32, len);
      else
        sdiree_dp_32x32_cols(&tiles, &p[0][0][0], KB * 2, b0, b0 + v_strip, len, DO - n);
      sdiree_store_32x32(&tiles, &acc[0][n], DV_MAX * 4);
    }
  }
  sdiree_release_tiles();

  for (int r = 0; r < QB; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(l[r])));
    const size_t row = r * H * DO;
    for (size_t c = 0; c < DO; c += 16) {
      const __mmask16 in = sdiree_lanes_before(DO, c);
      const __m512 y = _mm512_mul_ps(_mm512_load_ps(&acc[r][c]), inv);
      if (split)
        _mm512_mask_storeu_ps((float *)o + o_offset + first * DO + row + c, in, y);
      else
        _mm256_mask_storeu_epi16((uint16_t *)o + o_offset + first * DO + row + c, in,
                                 (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
  return 0;
}

/* k or v (values 1) of the attention kernel for 32 keys of head wg_h of BH = B x H, from the
   projection's f32 output x [B][NK][H][DQ]: k [BH][NKP / 16][D / 2][16][2], v [BH][D / 16]
   [NKP / 2][16][2], bf16, zero past the DQ real columns and the NK real keys. Grid (NKP / 32,
   BH); D a multiple of 32 of at most DV_MAX, NKP of 32. */
int sdiree_amx_bf16_pack_kv_workgroup(const float *x, size_t x_offset, uint16_t *o,
                                      size_t o_offset, size_t NK, size_t NKP, size_t H,
                                      size_t DQ, size_t D, size_t values, size_t wg_k,
                                      size_t wg_h) {
  x += x_offset;
  o += o_offset;
  const size_t b = wg_h / H, h = wg_h % H, k0 = wg_k * 32;
  uint16_t t[32][DV_MAX] __attribute__((aligned(64))); /* the 32 keys' rows, bf16, padded */
  for (size_t r = 0; r < 32; ++r) {
    const float *src = x + ((b * NK + k0 + r) * H + h) * DQ;
    for (size_t c = 0; c < D; c += 16) {
      const __mmask16 in = k0 + r < NK ? sdiree_lanes_before(DQ, c) : 0;
      _mm256_store_si256((__m256i *)&t[r][c],
                         (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, src + c)));
    }
  }
  if (!values) { /* pairs of columns (32 bits) of 16 keys, key after key, pair after pair */
    uint32_t *dst = (uint32_t *)(o + (wg_h * NKP + k0) * D);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(DV_MAX / 2));
    for (size_t g = 0; g < 2; ++g)
      for (size_t kp = 0; kp < D / 2; ++kp)
        _mm512_storeu_si512((void *)(dst + (g * D / 2 + kp) * 16),
                            _mm512_i32gather_epi32(rows, (const uint32_t *)&t[16 * g][0] + kp, 4));
    return 0;
  }
  /* per strip of 16 columns: pairs of keys, each column's two values side by side */
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (size_t j = 0; j < D / 16; ++j) {
    uint16_t *dst = o + ((wg_h * (D / 16) + j) * (NKP / 2) + k0 / 2) * 32;
    for (size_t kp = 0; kp < 16; ++kp) {
      const __m512i ab = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)&t[2 * kp][16 * j])),
          _mm256_load_si256((const __m256i *)&t[2 * kp + 1][16 * j]), 1);
      _mm512_storeu_si512((void *)(dst + kp * 32), _mm512_permutexvar_epi16(pairs, ab));
    }
  }
  return 0;
}
