"""GroupNorm (and the SiLU after it) on channels-last activations as two dispatches to sdiree's
kernels (specs/kernels/norms.c), its bf16 result written where the next kernel reads it:
for a 3x3 conv on the AMX conv kernel, its zero-padded input rows (conv_amx.py), else plain
[N, H, W, C] bf16 (a 1x1 projection's or a linear's input).

iree 3.13 compiles the channels-last GroupNorm as a pass that computes the mean and writes the
centred tensor, one that computes the variance and writes the normalized one, one for the
affine and SiLU that writes the padded conv input, and a cast to bf16: ~6 passes of f32 traffic
per norm (SD 1.5's bf16 UNet at 512²: ~4 ms per 64x64 norm, ~13 % of the call; compile/NOTES.md).
Here the statistics kernel reads the input once, and the application reads it again and writes
bf16 once. The statistics are per-block sums about each image's first pixel (so the variance
does not cancel); the graph combines them into each image's per-channel scale and shift, a few
small ops on [N, channels].

Under export choice `matmul_kernel: amx` with the channels-last layouts (channels_last.py):
`set_norm_kernel` marks a model's GroupNorms, and `norm_act_conv` / `norm_bf16` take the marked
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
    from_operand,
    is_split,
    operand,
    select_static,
    template_loader,
)

KERNEL = "norms"
BLOCK_PIXELS = 512  # about how many pixels one workgroup takes
MARK = "sdiree_norm_kernel"


def set_norm_kernel(model: torch.nn.Module) -> int:
    """Mark model's GroupNorms for the kernels (the ops registered); how many."""
    register()
    marked = 0
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            setattr(m, MARK, True)
            marked += 1
    return marked


def rows_per_block(h: int, w: int) -> int:
    return max(1, min(h, BLOCK_PIXELS // w))


def fits(norm, xh: torch.Tensor) -> bool:
    """Whether norm (marked) on xh [N, H, W, C] can take the kernels."""
    c = xh.shape[-1]
    return (
        getattr(norm, MARK, False)
        and all(isinstance(d, int) for d in xh.shape)
        and c % 32 == 0
        and c % norm.num_groups == 0
        and not norm.training
    )


def norm_bf16(norm, xh: torch.Tensor, silu: bool = False, pad: int = 0, tail: int = 0):
    """norm (then SiLU) of xh [N, H, W, C] on the kernels, bf16: [N, H, W, C] (pad 0), or with
    pad 1 the 3x3 conv kernel's input, [N·(H+2)·(W+2) + tail, C] zero-padded; for a norm marked
    for `amx_operands: bf16x3`, 2C channels, the hi parts then the lo ones."""
    n, h, w, c = xh.shape
    x = xh.float()
    rb = rows_per_block(h, w)
    part = _STATS(x.reshape(n, h * w, c), rb * w)  # [N, blocks, 2, C]
    ab = scale_shift(norm, part.sum(dim=1), x[:, 0, 0, :], h * w)
    return _APPLY(x, ab, rb, pad, tail, int(silu), int(is_split(norm)))


def scale_shift(norm, sums: torch.Tensor, ref: torch.Tensor, pixels: int) -> torch.Tensor:
    """[N, 2, C]: per image and channel the a and b of norm(x) = a x + b, from the sums of
    d = x - ref and of d² over each channel's pixels (sums [N, 2, C], ref [N, C])."""
    n, _, c = sums.shape
    g = norm.num_groups
    s1, s2, r = sums[:, 0].reshape(n, g, -1), sums[:, 1].reshape(n, g, -1), ref.reshape(n, g, -1)
    count = pixels * (c // g)
    mean = (s1.sum(-1) + pixels * r.sum(-1)) / count  # [N, G]
    d = r - mean[..., None]  # each channel's reference about its group's mean
    var = (s2 + 2 * d * s1 + pixels * d * d).sum(-1) / count
    rstd = torch.rsqrt(var + norm.eps)[..., None]
    a = rstd.expand(n, g, c // g).reshape(n, c)
    mean_c = mean[..., None].expand(n, g, c // g).reshape(n, c)
    b = -mean_c * a
    if norm.affine:
        a = a * norm.weight.float()
        b = b * norm.weight.float() + norm.bias.float()
    return torch.stack([a, b], dim=1)


def norm_act_conv(norm, act, conv_mod, xh: torch.Tensor, add=None, residual=None):
    """residual + conv_mod(act(norm(xh))) + add with the norm on the kernels, the conv on the AMX
    conv kernel reading the padded rows they write (and adding add and residual in its
    epilogue) where it takes it; None where norm does not fit (act None or SiLU)."""
    from .channels_last import conv, with_added
    from .conv_amx import conv_on_padded_rows

    silu = isinstance(act, torch.nn.SiLU)
    if not fits(norm, xh) or not (act is None or silu):
        return None
    y = conv_on_padded_rows(
        conv_mod, xh.shape, lambda tail: norm_bf16(norm, xh, silu, 1, tail), add, residual
    )
    if y is not None:
        return y
    # another lowering (Winograd below the conv kernel's width) takes the input's dtype
    y = conv(conv_mod, from_operand(norm_bf16(norm, xh, silu), is_split(norm)).to(xh.dtype))
    return with_added(y, add, residual)


_STATS = KernelOp("group_norm_stats", lambda: _make_ops()[0])
_APPLY = KernelOp("group_norm_apply", lambda: _make_ops()[1])


def register() -> None:
    _STATS.register()
    _APPLY.register()


def _eager_stats(x: torch.Tensor, pb: int) -> torch.Tensor:
    n, p, c = x.shape
    d = x.double() - x[:, :1].double()
    d = torch.nn.functional.pad(d, (0, 0, 0, -p % pb)).reshape(n, -1, pb, c)
    return torch.stack([d.sum(2), (d * d).sum(2)], dim=2).float()


def _eager_apply(x, ab, rb: int, pad: int, tail: int, silu: int, split: int) -> torch.Tensor:
    y = x * ab[:, None, None, 0] + ab[:, None, None, 1]
    if silu:
        y = torch.nn.functional.silu(y)
    y = operand(y, bool(split))
    if not pad:
        return y
    y = torch.nn.functional.pad(y, (0, 0, 1, 1, 1, 1)).reshape(-1, y.shape[-1])
    return torch.nn.functional.pad(y, (0, 0, 0, tail))


# Both kernels' grid: (blocks of an image, images).
GRID_BLOCKS_IMAGES = """    stream.executable.export public @{name} workgroups(%nb: index, %n: index)
        -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %nb, %n, %c1 : index, index, index
    }}
"""

_STATS_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_BLOCKS_IMAGES
    + """    builtin.module {{
      func.func private @sdiree_group_norm_stats_workgroup(memref<f32>, index, memref<f32>,
          index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %s: !stream.binding, %N: index, %P: index,
          %C: index, %PB: index, %NB: index) {{
        %c0 = arith.constant 0 : index
        %c2 = arith.constant 2 : index
        %wb = stream.dispatch.workgroup.id[0] : index
        %wn = stream.dispatch.workgroup.id[1] : index
        %np = arith.muli %N, %P : index
        %sx = arith.muli %np, %C : index
        %nb = arith.muli %N, %NB : index
        %nb2 = arith.muli %nb, %c2 : index
        %ss = arith.muli %nb2, %C : index
"""
    + buffer_views(("x", "f32", "sx"), ("s", "f32", "ss"))
    + """        %r = func.call @sdiree_group_norm_stats_workgroup(%x_base, %x_off, %s_base, %s_off,
            %P, %C, %PB, %wb, %wn)
            : (memref<f32>, index, memref<f32>, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{n}x{p}x{c}xf32>) -> tensor<{n}x{nb}x2x{c}xf32> {{
    %n = arith.constant {n} : index
    %p = arith.constant {p} : index
    %c = arith.constant {c} : index
    %pb = arith.constant {pb} : index
    %nb = arith.constant {nb} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nb, %n](%x, %n, %p, %c, %pb, %nb)
        : (tensor<{n}x{p}x{c}xf32>, index, index, index, index, index)
        -> tensor<{n}x{nb}x2x{c}xf32>
    util.return %0 : tensor<{n}x{nb}x2x{c}xf32>
  }}
}}
"""
)

_APPLY_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_BLOCKS_IMAGES
    + """    builtin.module {{
      func.func private @sdiree_group_norm_apply_workgroup(memref<f32>, index, memref<f32>,
          index, memref<bf16>, index, index, index, index, index, index, index, index, index,
          index, index, index) -> i32 attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %ab: !stream.binding, %o: !stream.binding,
          %N: index, %H: index, %W: index, %C: index, %RB: index, %PAD: index, %TAIL: index,
          %SILU: index, %SX: index, %SO: index) {{
        %c0 = arith.constant 0 : index
        %c2 = arith.constant 2 : index
        %wb = stream.dispatch.workgroup.id[0] : index
        %wn = stream.dispatch.workgroup.id[1] : index
        %n2 = arith.muli %N, %c2 : index
        %sab = arith.muli %n2, %C : index
        %split = arith.constant {split} : index
"""
    + buffer_views(("x", "f32", "SX"), ("ab", "f32", "sab"), ("o", "bf16", "SO"))
    + """        %r = func.call @sdiree_group_norm_apply_workgroup(%x_base, %x_off, %ab_base,
            %ab_off, %o_base, %o_off, %N, %H, %W, %C, %RB, %PAD, %TAIL, %SILU, %split, %wb, %wn)
            : (memref<f32>, index, memref<f32>, index, memref<bf16>, index, index, index, index,
            index, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{n}x{h}x{w}x{c}xf32>, %ab: tensor<{n}x2x{c}xf32>)
      -> {out_type} {{
    %n = arith.constant {n} : index
    %h = arith.constant {h} : index
    %w = arith.constant {w} : index
    %c = arith.constant {c} : index
    %rb = arith.constant {rb} : index
    %pad = arith.constant {pad} : index
    %tail = arith.constant {tail} : index
    %silu = arith.constant {silu} : index
    %sx = arith.constant {sx} : index
    %so = arith.constant {so} : index
    %nb = arith.constant {nb} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nb, %n](%x, %ab, %n, %h, %w, %c, %rb, %pad, %tail,
        %silu, %sx, %so)
        : (tensor<{n}x{h}x{w}x{c}xf32>, tensor<{n}x2x{c}xf32>, index, index, index, index,
           index, index, index, index, index, index) -> {out_type}
    util.return %0 : {out_type}
  }}
}}
"""
)


def _apply_shape(s, rb: int, pad: int, tail: int, silu: int, split: int) -> list[int]:
    n, h, w, c = s
    c = 2 * c if split else c
    if not pad:
        return [n, h, w, c]
    return [n * (h + 2) * (w + 2) + tail, c]


@functools.cache
def _make_ops():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    stats_loader = template_loader(_STATS_TEMPLATE)
    apply_loader = template_loader(_APPLY_TEMPLATE)
    library = def_library("sdiree_group_norm")

    @CustomOp.register(library=library)
    class group_norm_stats(CustomOp):
        signature = "group_norm_stats(Tensor x, int pb) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel, 1, 1, lambda s, pb: ([s[0][0], -(-s[0][1] // pb), 2, s[0][2]], torch.float32)
            )

        def eager_execute(self, x, pb):
            return _eager_stats(x, pb)

        def generate(self, ksel, kb):
            n, p, c = RankedTensorType(kb.arg_bindings[0].type).shape
            pb = ksel.arg_descs[1].v
            emit_call(
                stats_loader,
                kb,
                KERNEL,
                f"sdiree_group_norm_stats_{n}x{p}x{c}b{pb}",
                1,
                n=n,
                p=p,
                c=c,
                pb=pb,
                nb=-(-p // pb),
            )

    @CustomOp.register(library=library)
    class group_norm_apply(CustomOp):
        signature = (
            "group_norm_apply(Tensor x, Tensor ab, int rb, int pad, int tail, int silu,"
            " int split) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 2, 5, lambda s, *v: (_apply_shape(s[0], *v), torch.bfloat16))

        def eager_execute(self, x, ab, rb, pad, tail, silu, split):
            return _eager_apply(x, ab, rb, pad, tail, silu, split)

        def generate(self, ksel, kb):
            n, h, w, c = RankedTensorType(kb.arg_bindings[0].type).shape
            rb, pad, tail, silu, split = (ksel.arg_descs[i].v for i in range(2, 7))
            out = _apply_shape((n, h, w, c), rb, pad, tail, silu, split)
            emit_call(
                apply_loader,
                kb,
                KERNEL,
                f"sdiree_group_norm_apply_{n}x{h}x{w}x{c}p{pad}s{silu}x{split}",
                2,
                n=n,
                h=h,
                w=w,
                c=c,
                rb=rb,
                pad=pad,
                tail=tail,
                silu=silu,
                split=split,
                sx=n * h * w * c,
                so=out[0] * out[1] * (1 if pad else out[2] * out[3]),
                nb=-(-h // rb),
                out_type="tensor<" + "x".join(map(str, out)) + "xbf16>",
            )

    return group_norm_stats, group_norm_apply
