/* What sdiree's kernels share (specs/kernels/amx_*.c): the 32 x 32 block of f32 products they
   all compute, += A x B with B packed for AMX, and 2^x on AVX-512. Included by the kernels; its
   text is part of their sources' hash (compile/kernel_objects.py).

   Two builds (export choice `kernel_isa`, compile/exporters/amx_matmul.py KERNEL_ISAS): on AMX's
   tiles (Linux asked for AMX's tile state, one tile configuration for all), or with
   SDIREE_KERNEL_AVX512 defined, on avx512_bf16's vdpbf16ps for a CPU without AMX, the block in
   L1 (`sdiree_acc`). The kernels call the same functions either way. */
#ifndef SDIREE_AMX_SUPPORT_H
#define SDIREE_AMX_SUPPORT_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} sdiree_tile_config;

#ifndef SDIREE_KERNEL_AVX512
static volatile int sdiree_amx_permitted;

/* Linux grants a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); it holds for every thread of the process, and asking again is harmless. */
static inline void sdiree_request_amx(void) {
  if (sdiree_amx_permitted) return;
  long ret;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(158L), "D"(0x1023L), "S"(18L)
                   : "rcx", "r11", "memory");
  sdiree_amx_permitted = ret == 0;
}

/* The multiple of a product's depth the kernels' blocks take: a tile row's 32 bf16. */
#define SDIREE_DEPTH_STEP 32

/* What the kernels' 32 x 32 blocks live in: AMX's accumulator tiles 0-3, no memory. */
typedef struct {
  char unused;
} sdiree_acc;


/* Every tile 16 rows of 64 bytes: 16 x 16 f32 accumulators, 16 x 32 bf16 operands. */
static inline void sdiree_configure_tiles(void) {
  sdiree_tile_config cfg __attribute__((aligned(64)));
  uint8_t *raw = (uint8_t *)&cfg;
  for (size_t i = 0; i < sizeof cfg; ++i) raw[i] = 0;
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

static inline void sdiree_release_tiles(void) { _tile_release(); }

/* The 32 x 32 block every kernel computes, in accumulator tiles 0-3 (rows 0-15 and 16-31, columns
   0-15 and 16-31): zeroed, loaded from or stored to c (row stride ldc bytes), and
   += A x B over `depth` (a multiple of 32): A's 32 rows at a (row stride lda bytes, bf16), B two
   16-column strips b0 and b1 packed for AMX (rows of 64 bytes: pairs of depth). Tiles 4-5 hold
   A, 6-7 B. */
static inline void sdiree_zero_32x32(sdiree_acc *t) {
  (void)t;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

static inline void sdiree_load_32x32(sdiree_acc *t, const void *c, size_t ldc) {
  (void)t;
  const uint8_t *p = (const uint8_t *)c;
  _tile_loadd(0, p, ldc);
  _tile_loadd(1, p + 64, ldc);
  _tile_loadd(2, p + 16 * ldc, ldc);
  _tile_loadd(3, p + 16 * ldc + 64, ldc);
}

static inline void sdiree_store_32x32(sdiree_acc *t, void *c, size_t ldc) {
  (void)t;
  uint8_t *p = (uint8_t *)c;
  _tile_stored(0, p, ldc);
  _tile_stored(1, p + 64, ldc);
  _tile_stored(2, p + 16 * ldc, ldc);
  _tile_stored(3, p + 16 * ldc + 64, ldc);
}

static inline void sdiree_dp_32x32(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                   const void *b1, size_t depth) {
  (void)t;
  const uint8_t *a0 = (const uint8_t *)a, *a1 = a0 + 16 * lda;
  const uint8_t *s0 = (const uint8_t *)b0, *s1 = (const uint8_t *)b1;
  for (size_t k = 0; k < depth; k += 32) {
    _tile_loadd(4, a0 + k * 2, lda);
    _tile_loadd(6, s0 + k * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, s1 + k * 32, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * 2, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

/* sdiree_dp_32x32 where only the block's first `cols` columns are wanted: at most 16, the first
   strip's alone, half the products (tiles 1 and 3 keep what they hold). Attention's P V at a
   head dim of 40 padded to 64: its last block has 8 real columns; the kernel alone, one
   thread, 2x8x4096x4096: 95 -> 87-89 ms. */
static inline void sdiree_dp_32x32_cols(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                        const void *b1, size_t depth, size_t cols) {
  if (cols > 16) {
    sdiree_dp_32x32(t, a, lda, b0, b1, depth);
    return;
  }
  (void)t;
  (void)b1;
  const uint8_t *a0 = (const uint8_t *)a, *a1 = a0 + 16 * lda, *s0 = (const uint8_t *)b0;
  for (size_t k = 0; k < depth; k += 32) {
    _tile_loadd(4, a0 + k * 2, lda);
    _tile_loadd(6, s0 + k * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1 + k * 2, lda);
    _tile_dpbf16ps(2, 5, 6);
  }
}

/* Every row of the block set to init's 32 values (a linear's bias): tile loads of one row
   (stride 0), so the bias costs no pass over C and no vector work. */
static inline void sdiree_init_32x32(sdiree_acc *t, const float *init) {
  (void)t;
  _tile_loadd(0, init, 0);
  _tile_loadd(1, init + 16, 0);
  _tile_loadd(2, init, 0);
  _tile_loadd(3, init + 16, 0);
}

/* A fresh block's A x B, plus init's 32 values in every row where init is not NULL, stored at
   c (row stride ldc bytes): zero (or init), dp and store in one. */
static inline void sdiree_dp_32x32_store(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                         const void *b1, size_t depth, void *c, size_t ldc,
                                         const float *init) {
  if (init)
    sdiree_init_32x32(t, init);
  else
    sdiree_zero_32x32(t);
  sdiree_dp_32x32(t, a, lda, b0, b1, depth);
  sdiree_store_32x32(t, c, ldc);
}

/* sdiree_dp_32x32 on operands that are each the sum of two bf16 parts, hi + lo (an f32 value to
   ~16 significant bits; the exports' `amx_operands: bf16x3`): += A_hi B_lo + A_hi B_hi +
   A_lo B_hi over `depth`, A_lo B_lo (~2^-17 of the product) dropped. A's lo part is a_lo bytes
   past its hi part (the same row), each B strip's lo part b_lo bytes past its hi part. Each
   accumulator takes every fourth product, as in sdiree_dp_32x32; 8 tile loads for 12 products. */
static inline void sdiree_dp3_32x32(sdiree_acc *t, const void *a, size_t a_lo, size_t lda,
                                    const void *b0, const void *b1, size_t b_lo, size_t depth) {
  (void)t;
  const uint8_t *a0 = (const uint8_t *)a, *a1 = a0 + 16 * lda;
  const uint8_t *s0 = (const uint8_t *)b0, *s1 = (const uint8_t *)b1;
  for (size_t k = 0; k < depth; k += 32) {
    _tile_loadd(4, a0 + k * 2, lda);
    _tile_loadd(6, s0 + b_lo + k * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, s1 + b_lo + k * 32, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * 2, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, s0 + k * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, s1 + k * 32, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, a0 + a_lo + k * 2, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + a_lo + k * 2, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

#else /* SDIREE_KERNEL_AVX512: the same kernels on AVX-512 bf16 dot products, no AMX */

/* A CPU with avx512_bf16 and no AMX (Zen 4 and 5, Cooper Lake) multiplies bf16 pairs 16 lanes at
   a time with vdpbf16ps. The kernels' 32 x 32 block then lives in memory (4 KB, in L1): a dot
   product loads one 8-row quarter of it into 16 zmm accumulators, runs the whole depth on them,
   and stores it back. `fresh` marks a zeroed block that was not written yet (no loads). */
typedef struct {
  float c[32][32] __attribute__((aligned(64)));
  int fresh;
} sdiree_acc;

typedef int32_t sdiree_pair __attribute__((may_alias, aligned(4)));

/* vdpbf16ps multiplies pairs: a product's depth need only be even (attention's head dim 40, not
   its AMX padding to 64). */
#define SDIREE_DEPTH_STEP 2

static inline void sdiree_request_amx(void) {}
static inline void sdiree_configure_tiles(void) {}
static inline void sdiree_release_tiles(void) {}

static inline void sdiree_zero_32x32(sdiree_acc *t) { t->fresh = 1; }

static inline void sdiree_init_32x32(sdiree_acc *t, const float *init) {
  const __m512 lo = _mm512_loadu_ps(init), hi = _mm512_loadu_ps(init + 16);
  for (int r = 0; r < 32; ++r) {
    _mm512_store_ps(&t->c[r][0], lo);
    _mm512_store_ps(&t->c[r][16], hi);
  }
  t->fresh = 0;
}

static inline void sdiree_load_32x32(sdiree_acc *t, const void *c, size_t ldc) {
  const uint8_t *p = (const uint8_t *)c;
  for (int r = 0; r < 32; ++r) {
    _mm512_store_ps(&t->c[r][0], _mm512_loadu_ps((const float *)(p + r * ldc)));
    _mm512_store_ps(&t->c[r][16], _mm512_loadu_ps((const float *)(p + r * ldc + 64)));
  }
  t->fresh = 0;
}

static inline void sdiree_store_32x32(sdiree_acc *t, void *c, size_t ldc) {
  uint8_t *p = (uint8_t *)c;
  for (int r = 0; r < 32; ++r) {
    const __m512 lo = t->fresh ? _mm512_setzero_ps() : _mm512_load_ps(&t->c[r][0]);
    const __m512 hi = t->fresh ? _mm512_setzero_ps() : _mm512_load_ps(&t->c[r][16]);
    _mm512_storeu_ps((float *)(p + r * ldc), lo);
    _mm512_storeu_ps((float *)(p + r * ldc + 64), hi);
  }
}

/* 8 rows of 32 f32 at c (row stride ldc floats) += A x B over depth (even), or with fresh
   (c not read) = A x B plus init's 32 values in every row (0 where init is NULL): per pair of
   depth, each row's pair of A broadcast and multiplied into both 16-column strips' row of 64
   bytes. */
static inline void sdiree_dp_8x32(float *c, size_t ldc, const uint8_t *a, size_t lda,
                                  const uint8_t *s0, const uint8_t *s1, size_t depth, int fresh,
                                  const float *init) {
  __m512 c0[8], c1[8];
  const __m512 i0 = init ? _mm512_loadu_ps(init) : _mm512_setzero_ps();
  const __m512 i1 = init ? _mm512_loadu_ps(init + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    c0[i] = fresh ? i0 : _mm512_loadu_ps(c + i * ldc);
    c1[i] = fresh ? i1 : _mm512_loadu_ps(c + i * ldc + 16);
  }
  for (size_t kp = 0; kp < depth / 2; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(s0 + kp * 64));
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(s1 + kp * 64));
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(*(const sdiree_pair *)(a + i * lda + kp * 4));
      c0[i] = _mm512_dpbf16_ps(c0[i], av, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], av, b1);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(c + i * ldc, c0[i]);
    _mm512_storeu_ps(c + i * ldc + 16, c1[i]);
  }
}

/* The block += A x B over `depth` (A's 32 rows at a, row stride lda bytes, bf16; B two 16-column
   strips b0 and b1 packed as for AMX), as sdiree_dp_32x32 on AMX. */
static inline void sdiree_dp_32x32(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                   const void *b1, size_t depth) {
  const int fresh = t->fresh;
  for (int r0 = 0; r0 < 32; r0 += 8)
    sdiree_dp_8x32(&t->c[r0][0], 32, (const uint8_t *)a + r0 * lda, lda, (const uint8_t *)b0,
                   (const uint8_t *)b1, depth, fresh, 0);
  t->fresh = 0;
}

/* A fresh block's A x B (plus init's 32 values in every row where not NULL) stored at c (row
   stride ldc bytes, a multiple of 4), each 8 rows straight from their accumulators (no trip
   through the block in L1). */
static inline void sdiree_dp_32x32_store(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                         const void *b1, size_t depth, void *c, size_t ldc,
                                         const float *init) {
  (void)t;
  for (int r0 = 0; r0 < 32; r0 += 8)
    sdiree_dp_8x32((float *)((uint8_t *)c + r0 * ldc), ldc / 4, (const uint8_t *)a + r0 * lda,
                   lda, (const uint8_t *)b0, (const uint8_t *)b1, depth, 1, init);
}

/* sdiree_dp_32x32 where only the block's first `cols` columns are wanted: at most 16, the first
   strip's alone (16 rows at a time); the others' columns are left as they were. */
static inline void sdiree_dp_32x32_cols(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                        const void *b1, size_t depth, size_t cols) {
  if (cols > 16) {
    sdiree_dp_32x32(t, a, lda, b0, b1, depth);
    return;
  }
  const int fresh = t->fresh;
  const uint8_t *s0 = (const uint8_t *)b0;
  for (int r0 = 0; r0 < 32; r0 += 16) {
    const uint8_t *ar = (const uint8_t *)a + r0 * lda;
    __m512 c[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      c[i] = fresh ? _mm512_setzero_ps() : _mm512_load_ps(&t->c[r0 + i][0]);
    for (size_t kp = 0; kp < depth / 2; ++kp) {
      const __m512bh b = (__m512bh)_mm512_loadu_si512((const void *)(s0 + kp * 64));
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        c[i] = _mm512_dpbf16_ps(
            c[i], (__m512bh)_mm512_set1_epi32(*(const sdiree_pair *)(ar + i * lda + kp * 4)), b);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      _mm512_store_ps(&t->c[r0 + i][0], c[i]);
      if (fresh) _mm512_store_ps(&t->c[r0 + i][16], _mm512_setzero_ps());
    }
  }
  t->fresh = 0;
}

/* sdiree_dp3_32x32 (below, on AMX): A_hi B_lo + A_hi B_hi + A_lo B_hi. */
static inline void sdiree_dp3_32x32(sdiree_acc *t, const void *a, size_t a_lo, size_t lda,
                                    const void *b0, const void *b1, size_t b_lo, size_t depth) {
  const uint8_t *s0 = (const uint8_t *)b0, *s1 = (const uint8_t *)b1;
  sdiree_dp_32x32(t, a, lda, s0 + b_lo, s1 + b_lo, depth);
  sdiree_dp_32x32(t, a, lda, s0, s1, depth);
  sdiree_dp_32x32(t, (const uint8_t *)a + a_lo, lda, s0, s1, depth);
}

#endif

/* The A x B of a kernel whose operands are plain bf16 (split 0: depth is K) or hi and lo parts
   side by side (split 1: rows of A are [hi K/2 | lo K/2], B packs [hi | lo] along K). */
static inline void sdiree_dp_any_32x32(sdiree_acc *t, const void *a, size_t lda, const void *b0,
                                       const void *b1, size_t K, int split) {
  if (split)
    sdiree_dp3_32x32(t, a, K, lda, b0, b1, K / 2 * 32, K / 2);
  else
    sdiree_dp_32x32(t, a, lda, b0, b1, K);
}

/* count bf16 zeros at dst (the zero-padded rows the norm and upsampling kernels write). */
static inline void sdiree_zero_bf16(uint16_t *dst, size_t count) {
  const __m512i z = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 32 <= count; i += 32) _mm512_storeu_si512((void *)(dst + i), z);
  for (; i < count; ++i) dst[i] = 0;
}

/* 16 values rounded to bf16 at dst; with lo (an element offset, not 0) the remainder
   y - bf16(y) rounded to bf16 at dst + lo too: y as the hi and lo parts of an `amx_operands:
   bf16x3` operand. */
static inline void sdiree_store_bf16x16(uint16_t *dst, __m512 y, size_t lo) {
  const __m256i hi = (__m256i)_mm512_cvtneps_pbh(y);
  _mm256_storeu_si256((__m256i *)dst, hi);
  if (lo) {
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    _mm256_storeu_si256((__m256i *)(dst + lo), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(y, back)));
  }
}

/* 2^x for x <= 8 (relative error below 3e-6: Taylor to degree 5 of 2^r, |r| <= 1/2); very
   negative x give 0 (vscalefps underflows). */
static inline __m512 sdiree_exp2(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* 1 / x for finite x > 0: vrcp14ps and one Newton step (relative error ~1e-8). vdivps on zmm
   issues once per 16 cycles, as long as 16 AMX products of a GEGLU block's epilogue. */
static inline __m512 sdiree_rcp(__m512 x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}

/* 2^x to bf16's precision, for softmax probabilities that are rounded to bf16: a degree-3
   polynomial (relative error below 7.5e-5, near-minimax on |r| <= 1/2, against bf16's rounding
   of 2^-9), two multiply-adds fewer than sdiree_exp2. */
static inline __m512 sdiree_exp2_coarse(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.5171653e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4261116e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9326099e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9992807e-1f));
  return _mm512_scalef_ps(p, n);
}

#endif
