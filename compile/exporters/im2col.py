"""Export choice `conv: "matmul"`: a Conv2d as channels-last im2col and one matmul,
[N·OH·OW, KH·KW·C] @ [KH·KW·C, O]; also what every other choice falls back to for the convs it
does not take. Under `matmul_kernel: amx` the matmul goes to sdiree's AMX kernel where it fits
(bf16 columns, the weight packed for the kernel in the graph: a constant expression the
parameter encoder computes); under `matmul_kernel: f32` to sdiree's fp32 kernel likewise
(linear_f32.py), the conv's bias added by the kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import linear_f32
from .amx_matmul import (
    fits_padded,
    from_operand,
    is_split,
    operand,
    pack_b,
    padded_matmul,
    weight_operand,
)


def conv2d_as_matmul(conv: torch.nn.Conv2d, x: torch.Tensor, matmul: str = "iree") -> torch.Tensor:
    return conv2d_as_matmul_nhwc(conv, x.permute(0, 2, 3, 1), matmul).permute(0, 3, 1, 2)


def conv2d_as_matmul_nhwc(
    conv: torch.nn.Conv2d, xh: torch.Tensor, matmul: str = "iree"
) -> torch.Tensor:
    """The same on a channels-last input [N, H, W, C]; channels-last output [N, OH, OW, O].
    Under `amx_operands: bf16x3` a bf16 input is an operand's hi and lo parts (a norm kernel's
    result): a 1x1 conv on the AMX kernel takes it as it is, any other conv their sum."""
    o, _, kh, kw = conv.weight.shape
    split = is_split(conv)
    if split and xh.dtype == torch.bfloat16:
        n, h, w, c2 = xh.shape
        pointwise = (
            (kh, kw) == (1, 1) and tuple(conv.stride) == (1, 1) and conv.padding in ((0, 0), 0)
        )
        if not (pointwise and matmul == "amx" and fits_padded(n * h * w, o, c2 // 2)):
            xh = from_operand(xh, True)
    n, h, w, c = xh.shape
    sh, sw = conv.stride
    ph, pw = conv.padding
    oh = (h + 2 * ph - kh) // sh + 1
    ow = (w + 2 * pw - kw) // sw + 1
    if ph or pw:
        xh = F.pad(xh, (0, 0, pw, pw, ph, ph))
    windows = [
        xh[:, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    cols = torch.cat(windows, dim=-1) if len(windows) > 1 else windows[0]
    cols = cols.reshape(n * oh * ow, kh * kw * c)
    c = c // 2 if cols.dtype == torch.bfloat16 and split else c  # the parts' real channels
    if matmul == "amx" and fits_padded(n * oh * ow, o, kh * kw * c):
        weight = conv.weight.permute(0, 2, 3, 1).reshape(o, kh * kw * c)
        packed = pack_b(weight_operand(weight, split))
        out = padded_matmul(operand(cols, split), packed, split, conv.bias)  # bias in the kernel
        return out.reshape(n, oh, ow, o)
    weight = conv.weight.permute(2, 3, 1, 0).reshape(kh * kw * c, o)
    cols = cols.to(conv.weight.dtype)
    if matmul == "f32" and linear_f32.fits_matmul(cols, weight):
        return linear_f32.f32_matmul(cols, weight, conv.bias).reshape(n, oh, ow, o)
    out = torch.mm(cols, weight)
    if conv.bias is not None:
        out = out + conv.bias
    return out.reshape(n, oh, ow, o)


def supported(conv: torch.nn.Conv2d) -> bool:
    return (
        conv.groups == 1
        and tuple(conv.dilation) == (1, 1)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )
