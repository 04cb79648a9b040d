/* Peak multiply rate of one CPU core: avx512 fp32 FMA and avx512_bf16 dot products, or on an
   AVX2-only CPU 256-bit fp32 FMA.

   Independent accumulator chains, so the figure is the issue rate, not the latency: the
   ceiling for a matmul kernel on this core (multiply by the core count for a machine). Used
   to tell how far iree's matmul ukernels are from the hardware (compile/NOTES.md).

       gcc -O2 -mavx512f -mavx512bf16 tools/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak
       gcc -O2 -mavx2 -mfma tools/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak   (AVX2 only)
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
