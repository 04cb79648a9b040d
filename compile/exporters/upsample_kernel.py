"""An Upsample2D (nearest 2x, then its 3x3 conv) on channels-last activations with the
upsampling on sdiree's kernel (specs/kernels/upsample.c): one dispatch reads the input once and
writes the conv kernel's zero-padded bf16 input rows (conv_amx.py, or the fused Winograd
kernels' for a conv that takes those, winograd_fused.py).

iree 3.13 compiles channels_last.upsample's broadcast and the conv kernel's input preparation as
three passes over the upsampled tensor: the broadcast written in f32, a copy that pads it, a
cast to bf16. In SD 1.5's bf16 VAE decode at 512² those were ~195 ms of 1.96 s (the three
upsamplers, two Intel AMX cores; tools/PERFORMANCE.md, sixty-fourth session).

Under export choice `matmul_kernel: amx` with the channels-last layouts, beside the GroupNorm
kernels: `set_upsample_kernel` marks a model's upsamplers, and `upsample_conv` takes the marked
ones whose activations fit (static shapes, channels a multiple of 32).
"""

from __future__ import annotations

import functools

import torch

from .amx_matmul import (
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    is_split,
    operand,
    select_static,
    template_loader,
)
from .group_norm_kernel import GRID_BLOCKS_IMAGES, rows_per_block

KERNEL = "upsample"
MARK = "sdiree_upsample_kernel"


def set_upsample_kernel(model: torch.nn.Module) -> int:
    """Mark model's nearest-2x upsamplers with a conv for the kernel (the op registered); how
    many."""
    from .channels_last import upsample_unsupported

    register()
    marked = 0
    for m in model.modules():
        if type(m).__name__ == "Upsample2D" and upsample_unsupported(m) is None:
            setattr(m, MARK, True)
            marked += 1
    return marked


def fits(u, xh: torch.Tensor) -> bool:
    """Whether the upsampler u (marked) on xh [N, H, W, C] can take the kernel."""
    return (
        getattr(u, MARK, False)
        and all(isinstance(d, int) for d in xh.shape)
        and xh.shape[-1] % 32 == 0
    )


def upsampled_bf16(xh: torch.Tensor, tail: int, split: bool) -> torch.Tensor:
    """xh [N, H, W, C] upsampled 2x (nearest) as a 3x3 conv kernel's input: [N·(2H+2)·(2W+2) +
    tail, C] bf16 zero-padded (2C channels with split: the hi parts then the lo ones)."""
    n, h, w, _ = xh.shape
    return _UP(xh.float(), rows_per_block(h, w), tail, int(split))


def upsample_conv(u, conv_mod, xh: torch.Tensor) -> torch.Tensor | None:
    """conv_mod(upsample 2x of xh) [N, 2H, 2W, O] with the upsampling on the kernel, the conv on
    the AMX conv kernel or the fused Winograd ones reading the rows it writes; None where u does
    not fit or the conv takes another lowering."""
    from .conv_amx import conv_on_padded_rows

    if not fits(u, xh):
        return None
    n, h, w, c = xh.shape
    return conv_on_padded_rows(
        conv_mod,
        (n, 2 * h, 2 * w, c),
        lambda tail: upsampled_bf16(xh, tail, is_split(conv_mod)),
    )


_UP = KernelOp("upsample2x_pad", lambda: _make_op())


def register() -> None:
    _UP.register()


def _eager_up(x: torch.Tensor, rb: int, tail: int, split: int) -> torch.Tensor:
    n, h, w, c = x.shape
    y = x[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
    y = operand(y, bool(split))
    y = torch.nn.functional.pad(y, (0, 0, 1, 1, 1, 1)).reshape(-1, y.shape[-1])
    return torch.nn.functional.pad(y, (0, 0, 0, tail))


_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_BLOCKS_IMAGES
    + """    builtin.module {{
      func.func private @sdiree_upsample2x_pad_workgroup(memref<f32>, index, memref<bf16>,
          index, index, index, index, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %o: !stream.binding, %N: index, %H: index,
          %W: index, %C: index, %RB: index, %TAIL: index, %SX: index, %SO: index) {{
        %c0 = arith.constant 0 : index
        %wb = stream.dispatch.workgroup.id[0] : index
        %wn = stream.dispatch.workgroup.id[1] : index
        %split = arith.constant {split} : index
"""
    + buffer_views(("x", "f32", "SX"), ("o", "bf16", "SO"))
    + """        %r = func.call @sdiree_upsample2x_pad_workgroup(%x_base, %x_off, %o_base, %o_off,
            %N, %H, %W, %C, %RB, %TAIL, %split, %wb, %wn)
            : (memref<f32>, index, memref<bf16>, index, index, index, index, index, index,
            index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{n}x{h}x{w}x{c}xf32>) -> {out_type} {{
    %n = arith.constant {n} : index
    %h = arith.constant {h} : index
    %w = arith.constant {w} : index
    %c = arith.constant {c} : index
    %rb = arith.constant {rb} : index
    %tail = arith.constant {tail} : index
    %sx = arith.constant {sx} : index
    %so = arith.constant {so} : index
    %nb = arith.constant {nb} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nb, %n](%x, %n, %h, %w, %c, %rb, %tail, %sx,
        %so) : (tensor<{n}x{h}x{w}x{c}xf32>, index, index, index, index, index, index, index,
        index) -> {out_type}
    util.return %0 : {out_type}
  }}
}}
"""
)


def _out_shape(s, rb: int, tail: int, split: int) -> list[int]:
    n, h, w, c = s
    return [n * (2 * h + 2) * (2 * w + 2) + tail, 2 * c if split else c]


@functools.cache
def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)
    library = def_library("sdiree_upsample")

    @CustomOp.register(library=library)
    class upsample2x_pad(CustomOp):
        signature = "upsample2x_pad(Tensor x, int rb, int tail, int split) -> (Tensor)"

        def select(self, ksel):
            select_static(ksel, 1, 3, lambda s, *v: (_out_shape(s[0], *v), torch.bfloat16))

        def eager_execute(self, x, rb, tail, split):
            return _eager_up(x, rb, tail, split)

        def generate(self, ksel, kb):
            n, h, w, c = RankedTensorType(kb.arg_bindings[0].type).shape
            rb, tail, split = (ksel.arg_descs[i].v for i in range(1, 4))
            out = _out_shape((n, h, w, c), rb, tail, split)
            emit_call(
                loader,
                kb,
                KERNEL,
                f"sdiree_upsample2x_pad_{n}x{h}x{w}x{c}t{tail}x{split}",
                1,
                n=n,
                h=h,
                w=w,
                c=c,
                rb=rb,
                tail=tail,
                split=split,
                sx=n * h * w * c,
                so=out[0] * out[1],
                nb=-(-h // rb),
                out_type=f"tensor<{out[0]}x{out[1]}xbf16>",
            )

    return upsample2x_pad
