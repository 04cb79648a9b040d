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
   time in four accumulator tiles (0-3), two A tiles (4, 5) and two B tiles (6, 7). */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifndef SDIREE_AMX_MB
#define SDIREE_AMX_MB 128
#endif
#ifndef SDIREE_AMX_NB
#define SDIREE_AMX_NB 64
#endif

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static volatile int amx_permitted;

/* Linux grants a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); it holds for every thread of the process, and asking again is harmless. */
static void request_amx(void) {
  if (amx_permitted) return;
  long ret;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(158L), "D"(0x1023L), "S"(18L)
                   : "rcx", "r11", "memory");
  amx_permitted = ret == 0;
}

int sdiree_amx_bf16_matmul_workgroup(const uint16_t *a, size_t a_offset, const uint16_t *b,
                                     size_t b_offset, float *c, size_t c_offset, size_t M,
                                     size_t N, size_t K, size_t wg_n, size_t wg_m) {
  request_amx();
  a += a_offset;
  b += b_offset;
  c += c_offset;
  tile_config cfg;
  uint8_t *raw = (uint8_t *)&cfg;
  for (size_t i = 0; i < sizeof cfg; ++i) raw[i] = 0;
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const size_t m_begin = wg_m * SDIREE_AMX_MB, n_begin = wg_n * SDIREE_AMX_NB;
  const size_t m_end = m_begin + SDIREE_AMX_MB < M ? m_begin + SDIREE_AMX_MB : M;
  const size_t n_end = n_begin + SDIREE_AMX_NB < N ? n_begin + SDIREE_AMX_NB : N;
  const size_t lda = K * 2, ldc = N * 4, strip = K * 32; /* bytes */
  for (size_t n = n_begin; n < n_end; n += 32) {
    const uint8_t *b0 = (const uint8_t *)b + (n / 16) * strip;
    const uint8_t *b1 = b0 + strip;
    for (size_t m = m_begin; m < m_end; m += 32) {
      const uint8_t *a0 = (const uint8_t *)(a + m * K);
      const uint8_t *a1 = a0 + 16 * lda;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (size_t k = 0; k < K; k += 32) {
        _tile_loadd(4, a0 + k * 2, lda);
        _tile_loadd(6, b0 + k * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + k * 32, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + k * 2, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      uint8_t *c0 = (uint8_t *)(c + m * N + n);
      _tile_stored(0, c0, ldc);
      _tile_stored(1, c0 + 64, ldc);
      _tile_stored(2, c0 + 16 * ldc, ldc);
      _tile_stored(3, c0 + 16 * ldc + 64, ldc);
    }
  }
  _tile_release();
  return 0;
}
