/* Nearest 2x upsampling written as the zero-padded bf16 input of the 3x3 conv after it
   (compile/exporters/upsample_kernel.py): an Upsample2D's interpolation and its conv's input
   preparation in one pass.

   iree 3.13 compiles the channels-last upsampling (a broadcast), the conv kernel's padding and
   its cast to bf16 as three passes over the upsampled tensor: the broadcast writes it in f32,
   a copy pads it, a cast writes it again in bf16. Here each input pixel is read once and its
   bf16 written to the two output pixels it becomes, and each written output row is copied to
   the row below it.

   sdiree_upsample2x_pad_workgroup: x is [N][H][W][C] f32; out is [N][2H + 2][2W + 2][OC] and
   `tail` more zero rows of OC after it (the conv kernel's read-ahead; amx_bf16_matmul.c), where
   pixel (1 + i, 1 + j) of an image is x's (i / 2, j / 2) and the border is zero. OC is C, or 2C
   with `split` 1 (`amx_operands: bf16x3`): a pixel's C hi parts then its C lo parts
   (amx_support.h). Workgroup (b, n) does x's rows [b RB, b RB + RB) of image n, output rows
   2 b RB + 1 to 2 (b RB + RB); the first and last blocks the border rows, the last image's last
   block the tail. C is a multiple of 16.

   Built freestanding like the other kernels (compile/kernel_objects.py). */
#include "amx_support.h"

static inline void copy_u16(uint16_t *dst, const uint16_t *src, size_t count) {
  size_t i = 0;
  for (; i + 32 <= count; i += 32)
    _mm512_storeu_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
  for (; i < count; ++i) dst[i] = src[i];
}

int sdiree_upsample2x_pad_workgroup(const float *x, size_t x_offset, uint16_t *out,
                                    size_t out_offset, size_t N, size_t H, size_t W, size_t C,
                                    size_t RB, size_t tail, size_t split, size_t wg_b,
                                    size_t wg_n) {
  const float *img = x + x_offset + wg_n * H * W * C;
  const size_t OC = split ? 2 * C : C, lo = split ? C : 0;
  const size_t orow = (2 * W + 2) * OC, oimg = (2 * H + 2) * orow;
  uint16_t *o = out + out_offset + wg_n * oimg;
  const size_t h0 = wg_b * RB, h1 = h0 + RB < H ? h0 + RB : H;
  for (size_t h = h0; h < h1; ++h) {
    uint16_t *dst = o + (2 * h + 1) * orow;
    const float *src = img + h * W * C;
    sdiree_zero_bf16(dst, OC); /* the left border */
    for (size_t w = 0; w < W; ++w) {
      uint16_t *left = dst + (2 * w + 1) * OC;
      for (size_t c = 0; c < C; c += 16) {
        const __m512 y = _mm512_loadu_ps(src + w * C + c);
        sdiree_store_bf16x16(left + c, y, lo);
        sdiree_store_bf16x16(left + OC + c, y, lo);
      }
    }
    sdiree_zero_bf16(dst + (2 * W + 1) * OC, OC); /* the right border */
    copy_u16(dst + orow, dst, orow);
  }
  if (h0 == 0) sdiree_zero_bf16(o, orow);
  if (h1 == H) sdiree_zero_bf16(o + (2 * H + 1) * orow, orow);
  if (h1 == H && wg_n == N - 1) sdiree_zero_bf16(out + out_offset + N * oimg, tail * OC);
  return 0;
}
