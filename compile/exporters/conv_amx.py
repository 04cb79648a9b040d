"""3x3, stride-1 convolutions traced as one dispatch to sdiree's AMX implicit-matmul conv kernel
(`sdiree_amx_bf16_conv3x3_out_workgroup` in specs/kernels/amx_bf16_matmul.c), under export
choice `matmul_kernel: amx` in place of Winograd.

On the AMX kernel, Winograd's products were the cheap part of a conv: its input and output
transforms are passes over the activations that cost several times the products (one 320-channel
64x64 conv, batch 2: 19 ms, of which the products ~4). Here the graph only pads the channels-last
input (one zero row and column around each image, and the kernel's read-ahead rows at the end)
and casts it to bf16; the kernel sums the nine taps' products, each a view of that padded input
shifted by whole rows of pixels, so nothing is copied nine times. It computes a row for every
padded position and its epilogue writes only the real pixels' ([N, H, W, O] f32), the bias added,
and a resnet's time embedding and skip where given (conv3x3_amx_padded): no pass of the graph
slices, adds a bias or a skip. The GroupNorm kernels write the padded input themselves
(group_norm_kernel.py). The weight, packed per tap for the kernel
([9, O / 16, C / 2, 16, 2]), is a constant expression of the conv's own weight, which the
parameter encoder computes at compile: no derived weights, no Winograd archive.

`fits_conv`: 3x3, stride 1, padding 1, no groups or dilation (channels that are not multiples
of 32, as conv_in's 4 latent channels, are zero-padded to one); and at the call an input width
of at least MIN_WIDTH, else the conv takes its im2col matmul. conv_matmul.py gives a conv this lowering where its input's side is at least
MIN_WIDTH, Winograd below: on one Intel AMX core pair, batch 2, Winograd F(2x2) (split,
interleaved) against this, 320 channels at 64x64 16.0 -> 7.9 ms, 640 at 32x32 9.7 -> 7.9, but
1280 at 16x16 5.9 -> 8.2 (the kernel runs near AMX's peak there; Winograd's 2.25x fewer
products win once its transforms are small beside the weights).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .amx_matmul import (
    BLOCK_M,
    BLOCK_N,
    GRID_MN,
    KERNEL,
    MULTIPLE,
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    is_split,
    operand,
    pack_b,
    product,
    residual_values,
    select_static,
    template_loader,
    unpack_b,
    weight_operand,
)
from .im2col import conv2d_as_matmul_nhwc, supported

MIN_WIDTH = 32


def fits_conv(conv: torch.nn.Conv2d) -> bool:
    """Whether conv's shape suits the kernel (its input's width is checked at the call)."""
    return (
        isinstance(conv, torch.nn.Conv2d)
        and supported(conv)
        and tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and tuple(conv.padding) == (1, 1)
    )


def conv3x3_amx(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """conv3x3_amx_nhwc on an NCHW input, NCHW out."""
    return conv3x3_amx_nhwc(conv, x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def conv3x3_amx_nhwc(conv: torch.nn.Conv2d, xh: torch.Tensor) -> torch.Tensor:
    """conv on a channels-last input [N, H, W, C], its output channels-last; on the kernel where
    it fits, else as an im2col matmul on the AMX matmul kernel."""
    n, h, w, c = xh.shape
    if not takes_input(conv, w):
        return conv2d_as_matmul_nhwc(conv, xh, "amx")
    # channels zero-padded to the kernel's multiple (conv_in's 4 latent channels, conv_out's 4
    # or 3 outputs): zeros add nothing, the padded outputs are dropped
    c_pad = -c % MULTIPLE
    positions, m, tail = padded_rows(n, h, w)
    xp = F.pad(xh, (0, c_pad, 1, 1, 1, 1)).reshape(positions, c + c_pad)
    xp = operand(F.pad(xp, (0, 0, 0, tail)), is_split(conv))
    return conv3x3_amx_padded(conv, xp, n, h, w)


def takes_input(conv, w) -> bool:
    """Whether conv on an input w wide takes the kernel (else conv3x3_amx_nhwc's im2col)."""
    return fits_conv(conv) and isinstance(w, int) and w >= MIN_WIDTH


def padded_rows(n: int, h: int, w: int) -> tuple[int, int, int]:
    """(padded positions, output rows: those rounded up to the kernel's multiple, zero rows the
    input has past the positions: the last taps read that far)."""
    row = w + 2
    positions = n * (h + 2) * row
    m = -(-positions // MULTIPLE) * MULTIPLE
    return positions, m, m - positions + 2 * row + 2


def conv_on_padded_rows(conv_mod, shape, padded, add=None, residual=None):
    """conv_mod on a channels-last input of shape [N, H, W, C] that a kernel writes as zero-padded
    bf16 rows (padded(tail) -> [N·(H+2)·(W+2) + tail, C']): on this conv kernel where conv_mod
    takes it, else on the fused Winograd kernels where it takes those (no tail), plus add and
    residual; None where it takes neither (the caller's other lowering)."""
    from . import winograd_fused
    from .conv_matmul import CHANNELS_LAST_FORWARD

    n, h, w, _ = shape
    forward = getattr(getattr(conv_mod, CHANNELS_LAST_FORWARD, None), "__func__", None)
    if forward is conv3x3_amx_nhwc and takes_input(conv_mod, w):
        xp = padded(padded_rows(n, h, w)[2])
        return conv3x3_amx_padded(conv_mod, xp, n, h, w, add, residual)
    if winograd_fused.takes(conv_mod, tuple(shape)):
        return winograd_fused.conv3x3_wino_padded(conv_mod, padded(0), n, h, w, add, residual)
    return None


def conv3x3_amx_padded(
    conv: torch.nn.Conv2d,
    xp: torch.Tensor,
    n: int,
    h: int,
    w: int,
    add: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """conv on its input already padded for the kernel (xp [N·(H+2)·(W+2) + tail, C'] bf16, C'
    the channels padded to the kernel's multiple, twice that under `amx_operands: bf16x3`, the
    hi parts then the lo ones: conv3x3_amx_nhwc's, or the GroupNorm kernel's output,
    group_norm_kernel.py), plus add ([N or 1, O]: a resnet's time embedding) and
    residual ([N, H, W, O]) where given; channels-last output [N, H, W, O]. The kernel's
    epilogue writes only the real pixels, with the bias, add and residual added."""
    o, row, split = conv.out_channels, w + 2, is_split(conv)
    c_pad, o_pad = xp.shape[1] // (2 if split else 1) - conv.in_channels, -o % MULTIPLE
    weight = weight_operand(F.pad(conv.weight, (0, 0, 0, 0, 0, c_pad, 0, o_pad)), split, dim=1)
    vec = conv.bias if conv.bias is not None else torch.zeros(o, dtype=conv.weight.dtype)
    vec = vec.float()[None] if add is None else vec.float() + add.float()
    vec = F.pad(vec, (0, o_pad))
    if residual is not None and not o_pad:
        return _OUT_RES(xp, pack_taps(weight), vec, residual.float(), row, h, n, int(split))
    y = _OUT(xp, pack_taps(weight), vec, row, h, n, int(split))
    y = y if not o_pad else y[..., :o]
    return y if residual is None else residual + y


def pack_taps(weight: torch.Tensor) -> torch.Tensor:
    """A 3x3 weight [O, C, 3, 3] as the kernel's B operands, tap by tap (row-major over the
    window): [9, O / 16, C / 2, 16, 2] bf16."""
    o, c = weight.shape[:2]
    return pack_b(weight.permute(2, 3, 0, 1).reshape(9, o, c))


_OUT = KernelOp("amx_conv3x3_out", lambda: _make_ops()[0])
_OUT_RES = KernelOp("amx_conv3x3_out_res", lambda: _make_ops()[1])


def register() -> None:
    _OUT.register()
    _OUT_RES.register()


def _eager_out(a, packed, vec, res, row: int, h: int, images: int, split: int) -> torch.Tensor:
    w = row - 2
    y = _eager(a, packed, row, bool(split))[: images * (h + 2) * row]
    y = y.reshape(images, h + 2, row, -1)[:, :h, :w] + vec[:, None, None, :]
    return y if res is None else y + res


def _eager(a: torch.Tensor, packed: torch.Tensor, row: int, split: bool) -> torch.Tensor:
    m = a.shape[0] - 2 * row - 2
    taps = unpack_b(packed)  # [9, C, O]
    out = 0
    for t in range(9):
        shift = (t // 3) * row + t % 3
        out = out + product(a[shift : shift + m], taps[t], split)
    return out


_OUT_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_MN
    + """    builtin.module {{
      func.func private @sdiree_amx_bf16_conv3x3_out_workgroup(memref<bf16>, index,
          memref<bf16>, index, memref<f32>, index, memref<f32>, index, memref<f32>, index, index,
          index, index, index, index, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%a: !stream.binding, %b: !stream.binding, %add: !stream.binding,
          {res_arg}%c: !stream.binding, %M: index, %N: index, %K: index, %R: index, %A: index,
          %H: index, %I: index, %AR: index, %SO: index) {{
        %c0 = arith.constant 0 : index
        %c9 = arith.constant 9 : index
        %has_res = arith.constant {has_res} : index
        %split = arith.constant {split} : index
        %wn = stream.dispatch.workgroup.id[0] : index
        %wm = stream.dispatch.workgroup.id[1] : index
        %sa = arith.muli %A, %K : index
        %nk = arith.muli %N, %K : index
        %sb = arith.muli %nk, %c9 : index
        %sadd = arith.muli %AR, %N : index
"""
    + buffer_views(("a", "bf16", "sa"), ("b", "bf16", "sb"), ("add", "f32", "sadd"))
    + "{res_view}"
    + buffer_views(("c", "f32", "SO"))
    + """        %r = func.call @sdiree_amx_bf16_conv3x3_out_workgroup(%a_base, %a_off, %b_base,
            %b_off, %add_base, %add_off, {res_base}, {res_off}, %c_base, %c_off, %M, %N, %K,
            %R, %H, %I, %AR, %has_res, %split, %wn, %wm) : (memref<bf16>, index, memref<bf16>,
            index, memref<f32>, index, memref<f32>, index, memref<f32>, index, index, index,
            index, index, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%a: tensor<{rows}x{k}xbf16>, %b: tensor<9x{j}x{k2}x16x2xbf16>,
      %add: tensor<{add_rows}x{n}xf32>{res_param}) -> tensor<{images}x{h}x{w}x{n}xf32> {{
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %k = arith.constant {k} : index
    %row = arith.constant {row} : index
    %rows = arith.constant {rows} : index
    %h = arith.constant {h} : index
    %images = arith.constant {images} : index
    %add_rows = arith.constant {add_rows} : index
    %so = arith.constant {so} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n](%a, %b, %add, {res_operand}%m, %n, %k, %row,
        %rows, %h, %images, %add_rows, %so)
        : (tensor<{rows}x{k}xbf16>, tensor<9x{j}x{k2}x16x2xbf16>, tensor<{add_rows}x{n}xf32>,
           {res_type}index, index, index, index, index, index, index, index, index)
        -> tensor<{images}x{h}x{w}x{n}xf32>
    util.return %0 : tensor<{images}x{h}x{w}x{n}xf32>
  }}
}}
"""
)


def _out_values(kb, ksel, has_res: bool) -> dict:
    """The template's values for a conv3x3_out call (with a residual operand or not)."""
    from iree.turbine.support.ir_imports import RankedTensorType

    rows, k = RankedTensorType(kb.arg_bindings[0].type).shape
    _, j, k2 = RankedTensorType(kb.arg_bindings[1].type).shape[:3]
    add_rows = RankedTensorType(kb.arg_bindings[2].type).shape[0]
    first = 4 if has_res else 3
    row, h, images, split = (ksel.arg_descs[i].v for i in range(first, first + 4))
    n, m = j * 16, rows - 2 * row - 2
    res_type = f"tensor<{images}x{h}x{row - 2}x{n}xf32>"
    return dict(
        block_m=BLOCK_M, block_n=BLOCK_N, m=m, k=k, n=n, j=j, k2=k2, row=row, rows=rows, h=h,
        w=row - 2, images=images, add_rows=add_rows, so=images * h * (row - 2) * n,
        has_res=int(has_res), split=split,
        **residual_values(has_res, res_type),
    )  # fmt: skip


def _shape_tag(v: dict) -> str:
    """What tells one conv call's function from another's (a function is made once a name, and
    typed by all of these: the add's rows too, 1 or one per image)."""
    return f"{v['images']}x{v['m']}x{v['k']}x{v['n']}r{v['row']}a{v['add_rows']}s{v['split']}"


@functools.cache
def _make_ops():
    from iree.turbine.runtime.op_reg import CustomOp, def_library

    loader = template_loader(_OUT_TEMPLATE)
    library = def_library("sdiree_amx_conv_out")

    def shape(s, row, h, images, split):
        return [images, h, row - 2, s[1][1] * 16]

    @CustomOp.register(library=library)
    class amx_bf16_conv3x3_out(CustomOp):
        signature = (
            "amx_bf16_conv3x3_out(Tensor a, Tensor b, Tensor add, int row, int h, int images,"
            " int split) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 3, 4, lambda s, *v: (shape(s, *v), torch.float32))

        def eager_execute(self, a, b, add, row, h, images, split):
            return _eager_out(a, b, add, None, row, h, images, split)

        def generate(self, ksel, kb):
            v = _out_values(kb, ksel, False)
            name = f"sdiree_amx_conv3x3o_{_shape_tag(v)}"
            emit_call(loader, kb, KERNEL, name, 3, **v)

    @CustomOp.register(library=library)
    class amx_bf16_conv3x3_out_res(CustomOp):
        signature = (
            "amx_bf16_conv3x3_out_res(Tensor a, Tensor b, Tensor add, Tensor res, int row,"
            " int h, int images, int split) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 4, 4, lambda s, *v: (shape(s, *v), torch.float32))

        def eager_execute(self, a, b, add, res, row, h, images, split):
            return _eager_out(a, b, add, res, row, h, images, split)

        def generate(self, ksel, kb):
            v = _out_values(kb, ksel, True)
            name = f"sdiree_amx_conv3x3or_{_shape_tag(v)}"
            emit_call(loader, kb, KERNEL, name, 4, **v)

    return amx_bf16_conv3x3_out, amx_bf16_conv3x3_out_res
