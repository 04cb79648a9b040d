/* What sdiree's AMX kernels share (specs/kernels/amx_*.c): asking Linux for AMX's tile state,
   the tile configuration they all use, and 2^x on AVX-512. Included by the kernels; its text is
   part of their sources' hash (compile/kernel_objects.py). */
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

#endif
