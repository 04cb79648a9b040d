/* Peak multiply rate of one CPU core: avx512 fp32 FMA and avx512_bf16 dot products, or on an
   AVX2-only CPU 256-bit fp32 FMA and three fp32 matmul register tiles.

   Independent accumulator chains, so the figure is the issue rate, not the latency: the
   ceiling for a matmul kernel on this core (multiply by the core count for a machine). Used
   to tell how far iree's matmul ukernels are from the hardware (compile/NOTES.md).

   On AVX2 it also times register tiles over packed panels (K = 320, four RHS panels, L2
   resident): 8x8, the tile iree 3.13 data-tiles every AVX2 f32 matmul into (its ukernel's
   loop: 8 broadcast loads and 1 vector load for 8 FMAs), against 4x16 (8 accumulators, 6
   loads) and 6x16 (12 accumulators, 8 loads), the shapes BLAS kernels use on AVX2.

       gcc -O2 -mavx512f -mavx512bf16 tools/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak
       gcc -O3 -mavx2 -mfma tools/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak   (AVX2 only)
*/
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifndef __AVX512F__
#define B(p) _mm256_broadcast_ss(p)
#define FMA(a, b, c) c = _mm256_fmadd_ps(a, b, c)
#define ST(p, v) _mm256_storeu_ps(p, v)

static void tile_8x8(float *out, const float *lhs, const float *rhs, int k) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (; k > 0; k--, lhs += 8, rhs += 8) {
    __m256 r = _mm256_loadu_ps(rhs);
    FMA(B(lhs), r, c0); FMA(B(lhs + 1), r, c1); FMA(B(lhs + 2), r, c2); FMA(B(lhs + 3), r, c3);
    FMA(B(lhs + 4), r, c4); FMA(B(lhs + 5), r, c5); FMA(B(lhs + 6), r, c6); FMA(B(lhs + 7), r, c7);
  }
  ST(out, c0); ST(out + 8, c1); ST(out + 16, c2); ST(out + 24, c3);
  ST(out + 32, c4); ST(out + 40, c5); ST(out + 48, c6); ST(out + 56, c7);
}

#define ROW(i)        \
  b = B(lhs + i);     \
  FMA(b, r0, c##i##0); \
  FMA(b, r1, c##i##1);
#define STROW(i) ST(out + 16 * i, c##i##0); ST(out + 16 * i + 8, c##i##1);

static void tile_4x16(float *out, const float *lhs, const float *rhs, int k) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, b;
  for (; k > 0; k--, lhs += 4, rhs += 16) {
    __m256 r0 = _mm256_loadu_ps(rhs), r1 = _mm256_loadu_ps(rhs + 8);
    ROW(0) ROW(1) ROW(2) ROW(3)
  }
  STROW(0) STROW(1) STROW(2) STROW(3)
}

static void tile_6x16(float *out, const float *lhs, const float *rhs, int k) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, b;
  for (; k > 0; k--, lhs += 6, rhs += 16) {
    __m256 r0 = _mm256_loadu_ps(rhs), r1 = _mm256_loadu_ps(rhs + 8);
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
  }
  STROW(0) STROW(1) STROW(2) STROW(3) STROW(4) STROW(5)
}

typedef void (*tile_fn)(float *, const float *, const float *, int);

/* GFLOP/s of one register tile (rows x cols) over K = 320 and four RHS panels */
static double tile_rate(tile_fn f, int rows, int cols) {
  enum { K = 320, PANELS = 4 };
  static float lhs[K * 8], rhs[PANELS * K * 16], out[128];
  for (int i = 0; i < K * 8; i++) lhs[i] = 1e-3f;
  for (int i = 0; i < PANELS * K * 16; i++) rhs[i] = 1e-3f;
  long reps = 1000000000L / ((long)K * rows * cols * PANELS);
  double t = now();
  for (long r = 0; r < reps; r++)
    for (int p = 0; p < PANELS; p++) f(out, lhs, rhs + p * K * cols, K);
  double dt = now() - t;
  for (int i = 0; i < rows * cols; i++) /* every sum is K products of 1e-3 * 1e-3 */
    if (out[i] < 0.99f * K * 1e-6f || out[i] > 1.01f * K * 1e-6f) return -1.0;
  return reps * PANELS * 2.0 * rows * cols * K / dt / 1e9;
}

int main(void) {
  const long n = 200000000 / 12;
  __m256 acc[12];  /* 12 chains and the two operands fit AVX2's 16 registers */
  float sink = 0;
  __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
  for (int i = 0; i < 12; i++) acc[i] = _mm256_setzero_ps();
  double t = now();
  for (long r = 0; r < n; r++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(x, y, acc[i]);
    __asm__ volatile("" : "+v"(x));
  }
  double dt = now() - t;
  float out[8];
  for (int i = 0; i < 12; i++) {
    _mm256_storeu_ps(out, acc[i]);
    for (int j = 0; j < 8; j++) sink += out[j];
  }
  printf("fp32 vfmadd (256-bit): %.1f GFLOP/s per core\n", n * 12.0 * 16 / dt / 1e9);
  for (int round = 0; round < 3; round++)
    printf("register tiles, GFLOP/s per core: 8x8 (iree's) %.1f, 4x16 %.1f, 6x16 %.1f\n",
           tile_rate(tile_8x8, 8, 8), tile_rate(tile_4x16, 4, 16), tile_rate(tile_6x16, 6, 16));
  return sink == 12345.0f; /* keeps the sums live */
}
#else
int main(void) {
  const long n = 200000000 / 16;
  __m512 acc[16];
  float sink = 0;

  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  double t = now();
  for (long r = 0; r < n; r++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
    __asm__ volatile("" : "+v"(a));
  }
  double dt = now() - t;
  for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
  printf("bf16 vdpbf16ps: %.1f GFLOP/s per core\n", n * 16.0 * 64 / dt / 1e9);

  __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  t = now();
  for (long r = 0; r < n; r++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
    __asm__ volatile("" : "+v"(x));
  }
  dt = now() - t;
  for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
  printf("fp32 vfmadd:    %.1f GFLOP/s per core\n", n * 16.0 * 32 / dt / 1e9);
  return sink == 12345.0f;  /* keeps the sums live */
}
#endif
