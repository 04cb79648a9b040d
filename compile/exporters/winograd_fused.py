"""Winograd F(2x2,3x3) convolutions as two dispatches to sdiree's kernels
(specs/kernels/winograd_bf16.c), export choice `winograd_kernel: fused` (under `matmul_kernel:
amx`, bf16 operands).

conv2d_winograd_nhwc on the matmul kernel traces a conv as a row transform, 16 casts of the
transformed tiles, 16 product dispatches whose f32 results the inverse transform reads back, and
the bias and a resnet's skip added after: ~25 passes over the activations, which on a CPU
without AMX cost about half as much as the products. Here the conv's input is the zero-padded
bf16 rows the direct conv kernel reads (conv_amx.py: a pad and cast, or the GroupNorm kernel's
output), `wino_input` writes its transformed tiles [16, M, C] bf16 in one pass, and
`wino_conv` computes the 16 products and adds each straight into the tiles' 2x2 outputs,
writing only the real pixels [N, H, W, O] f32 with the bias, a per-image add (a resnet's time
embedding) and a residual added. The weight is the conv's `weight_winograd` (winograd.py)
packed for the kernels, a constant expression the parameter encoder computes at compile.

The products' operands are as in conv2d_winograd's bf16 path (transformed tiles rounded to
bf16, products summed in f32), except that the tiles are transformed from the bf16 input rather
than from f32: one rounding more, within bf16's class.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from sdiree.runtime.weights.winograd import WINOGRAD, WINOGRAD_PARAM

from .amx_matmul import (
    GRID_MN,
    MULTIPLE,
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    is_split,
    pack_b,
    residual_values,
    select_static,
    template_loader,
    unpack_b,
)

KERNEL = "winograd_bf16"
WINOGRAD_KERNELS = ("none", "fused")  # export choice `winograd_kernel`
MARK = "sdiree_winograd_fused"
TILE_BLOCK_MAX = 64  # specs/kernels/winograd_bf16.c TB_MAX
MIN_WORKGROUPS = 8  # the products' grid splits the output channels below this


def mark(conv: torch.nn.Conv2d) -> None:
    """Send conv (a Winograd F(2x2) conv on the matmul kernel) to the fused kernels where its
    input fits (takes)."""
    setattr(conv, MARK, True)


def fuse_winograd(model: torch.nn.Module, tiles: dict | None, m: int, direct) -> int:
    """Mark model's F(2x2) Winograd convs (tile m or their own in tiles; not those in direct,
    on the direct conv kernel) for the fused kernels, the ops registered; how many."""
    register()
    marked = 0
    for mod in model.modules():
        if (
            isinstance(mod, torch.nn.Conv2d)
            and mod not in direct
            and (tiles or {}).get(mod, m) == 2
            and tuple(mod.kernel_size) == (3, 3)
            and tuple(mod.stride) == (1, 1)
            and tuple(mod.padding) == (1, 1)
            and tuple(mod.dilation) == (1, 1)
            and mod.groups == 1
        ):
            mark(mod)
            marked += 1
    return marked


def takes(conv, xh_shape) -> bool:
    """Whether conv (marked) on a channels-last input of xh_shape goes to the kernels: static
    sides, even, channels in and out multiples of 32, plain bf16 operands."""
    n, h, w, c = xh_shape
    return (
        getattr(conv, MARK, False)
        and all(isinstance(d, int) for d in (n, h, w, c))
        and h % 2 == 0
        and w % 2 == 0
        and c % MULTIPLE == 0
        and conv.out_channels % MULTIPLE == 0
        and not is_split(conv)
        and getattr(conv, WINOGRAD_PARAM, None) is not None
    )


def tile_rows(n: int, h: int, w: int) -> int:
    """The transformed tiles' row count M: the tiles, rounded up to the kernels' 32."""
    return -(-(n * (h // 2) * (w // 2)) // MULTIPLE) * MULTIPLE


def blocks(m: int, o: int, k: int) -> tuple[int, int]:
    """The products' workgroup block (tiles, output channels): up to 128 tiles (their outputs
    on the kernel's stack; the B strips of one tile element reused over them from cache), the
    output channels split while the grid has fewer than MIN_WORKGROUPS."""
    tb = TILE_BLOCK_MAX if m % TILE_BLOCK_MAX == 0 else (64 if m % 64 == 0 else 32)
    nb = o
    while (m // tb) * (o // nb) < MIN_WORKGROUPS and nb % (2 * MULTIPLE) == 0:
        nb //= 2
    return tb, nb


def conv3x3_wino_nhwc(conv: torch.nn.Conv2d, xh: torch.Tensor, add=None, residual=None):
    """conv on a channels-last input [N, H, W, C] (takes(conv, xh.shape) holds): padded and
    cast, then conv3x3_wino_padded."""
    n, h, w, c = xh.shape
    xp = F.pad(xh, (0, 0, 1, 1, 1, 1)).reshape(n * (h + 2) * (w + 2), c).to(torch.bfloat16)
    return conv3x3_wino_padded(conv, xp, n, h, w, add, residual)


def conv3x3_wino_padded(conv, xp: torch.Tensor, n: int, h: int, w: int, add=None, residual=None):
    """conv on its zero-padded bf16 input rows (xp [N·(H+2)·(W+2) (+ any tail), C], as the
    direct conv kernel's), plus add ([N or 1, O]) and residual ([N, H, W, O]) where given:
    [N, H, W, O] f32."""
    u = getattr(conv, WINOGRAD_PARAM)  # [16, C, O]
    packed = pack_b(u.transpose(-1, -2))  # [16, O / 16, C / 2, 16, 2] bf16
    vec = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels)
    vec = vec.float()[None] if add is None else vec.float() + add.float()
    return conv_products(_CONV, _CONV_RES, _INPUT(xp, h, w, n), packed, vec, residual, n, h, w)


def conv_products(conv_op, conv_res_op, v, packed, vec, residual, n: int, h: int, w: int):
    """The products kernel's call on the transformed tiles v: the skip joins the kernel's
    epilogue where it has the output's shape, else it is added after."""
    o = vec.shape[-1]
    if residual is not None and tuple(residual.shape) == (n, h, w, o):
        return conv_res_op(v, packed, vec, residual.float(), h, w, n)
    y = conv_op(v, packed, vec, h, w, n)
    # a residual that broadcasts (guidance's shared prefix: one image's skip for two) after
    return y if residual is None else residual + y


_INPUT = KernelOp("wino2_input", lambda: _make_ops()[0])
_CONV = KernelOp("wino2_conv", lambda: _make_ops()[1])
_CONV_RES = KernelOp("wino2_conv_res", lambda: _make_ops()[2])


def register() -> None:
    _INPUT.register()
    _CONV.register()
    _CONV_RES.register()


def _eager_input(x: torch.Tensor, h: int, w: int, images: int) -> torch.Tensor:
    bt = torch.tensor(WINOGRAD[2][0], dtype=torch.float32)
    c = x.shape[-1]
    d = x[: images * (h + 2) * (w + 2)].float().reshape(images, h + 2, w + 2, c)
    # tiles' 4x4 windows: [N, th, tw, 4, 4, C]
    win = d.unfold(1, 4, 2).unfold(2, 4, 2).permute(0, 1, 2, 4, 5, 3)
    v = torch.einsum("ri,ntwijc,sj->rsntwc", bt, win, bt).reshape(16, -1, c)
    m = tile_rows(images, h, w)
    return F.pad(v, (0, 0, 0, m - v.shape[1])).to(torch.bfloat16)


def _eager_conv(v, packed, vec, res, h: int, w: int, images: int) -> torch.Tensor:
    return eager_inverse(v.float() @ unpack_b(packed).float(), vec, res, h, w, images)


def eager_inverse(prods, vec, res, h: int, w: int, images: int) -> torch.Tensor:
    """The F(2x2) outputs [N, H, W, O] of the products [16, M (>= the tiles), O], plus vec
    ([N or 1, O]) and res where given."""
    at = torch.tensor(WINOGRAD[2][2], dtype=torch.float32)
    th, tw = h // 2, w // 2
    o = prods.shape[-1]
    prods = prods[:, : images * th * tw].reshape(4, 4, images, th, tw, o)
    y = torch.einsum("ar,rsntwo,bs->ntawbo", at, prods, at).reshape(images, h, w, o)
    y = y + vec[:, None, None, :]
    return y if res is None else y + res


_INPUT_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%m: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv 32)>()[%m]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_wino2_input_workgroup(memref<bf16>, index, memref<bf16>, index,
          index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %v: !stream.binding, %M: index, %C: index,
          %H: index, %W: index, %I: index, %SX: index, %SV: index) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
"""
    + buffer_views(("x", "bf16", "SX"), ("v", "bf16", "SV"))
    + """        %r = func.call @sdiree_wino2_input_workgroup(%x_base, %x_off, %v_base, %v_off, %M,
            %C, %H, %W, %I, %wg) : (memref<bf16>, index, memref<bf16>, index, index, index,
            index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{rows}x{c}xbf16>) -> tensor<16x{m}x{c}xbf16> {{
    %m = arith.constant {m} : index
    %c = arith.constant {c} : index
    %h = arith.constant {h} : index
    %w = arith.constant {w} : index
    %images = arith.constant {images} : index
    %sx = arith.constant {sx} : index
    %sv = arith.constant {sv} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m](%x, %m, %c, %h, %w, %images, %sx, %sv)
        : (tensor<{rows}x{c}xbf16>, index, index, index, index, index, index, index)
        -> tensor<16x{m}x{c}xbf16>
    util.return %0 : tensor<16x{m}x{c}xbf16>
  }}
}}
"""
)

# The products kernel of an F(2x2) conv: vt its V and U element type, u_type U's tensor type,
# workgroup the kernel's function (the bf16 one here, winograd_f32.py's; same arguments).
CONV_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_MN
    + """    builtin.module {{
      func.func private @{workgroup}(memref<{vt}>, index, memref<{vt}>, index,
          memref<f32>, index, memref<f32>, index, memref<f32>, index, index, index, index,
          index, index, index, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%v: !stream.binding, %u: !stream.binding, %add: !stream.binding,
          {res_arg}%c: !stream.binding, %M: index, %N: index, %K: index, %H: index, %W: index,
          %I: index, %AR: index, %SO: index) {{
        %c0 = arith.constant 0 : index
        %c16 = arith.constant 16 : index
        %has_res = arith.constant {has_res} : index
        %tb = arith.constant {block_m} : index
        %nb = arith.constant {block_n} : index
        %wn = stream.dispatch.workgroup.id[0] : index
        %wm = stream.dispatch.workgroup.id[1] : index
        %mk = arith.muli %M, %K : index
        %sv = arith.muli %mk, %c16 : index
        %nk = arith.muli %N, %K : index
        %su = arith.muli %nk, %c16 : index
        %sadd = arith.muli %AR, %N : index
"""
    + buffer_views(("v", "{vt}", "sv"), ("u", "{vt}", "su"), ("add", "f32", "sadd"))
    + "{res_view}"
    + buffer_views(("c", "f32", "SO"))
    + """        %r = func.call @{workgroup}(%v_base, %v_off, %u_base, %u_off,
            %add_base, %add_off, {res_base}, {res_off}, %c_base, %c_off, %M, %N, %K, %H, %W,
            %I, %AR, %has_res, %tb, %nb, %wn, %wm) : (memref<{vt}>, index, memref<{vt}>,
            index, memref<f32>, index, memref<f32>, index, memref<f32>, index, index, index,
            index, index, index, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%v: tensor<16x{m}x{k}x{vt}>, %u: {u_type},
      %add: tensor<{add_rows}x{n}xf32>{res_param}) -> tensor<{images}x{h}x{w}x{n}xf32> {{
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %k = arith.constant {k} : index
    %h = arith.constant {h} : index
    %w = arith.constant {w} : index
    %images = arith.constant {images} : index
    %add_rows = arith.constant {add_rows} : index
    %so = arith.constant {so} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n](%v, %u, %add, {res_operand}%m, %n, %k, %h,
        %w, %images, %add_rows, %so)
        : (tensor<16x{m}x{k}x{vt}>, {u_type}, tensor<{add_rows}x{n}xf32>,
           {res_type}index, index, index, index, index, index, index, index)
        -> tensor<{images}x{h}x{w}x{n}xf32>
    util.return %0 : tensor<{images}x{h}x{w}x{n}xf32>
  }}
}}
"""
)


def _conv_values(kb, ksel, has_res: bool) -> dict:
    from iree.turbine.support.ir_imports import RankedTensorType

    _, m, k = RankedTensorType(kb.arg_bindings[0].type).shape
    _, j, k2 = RankedTensorType(kb.arg_bindings[1].type).shape[:3]
    add_rows = RankedTensorType(kb.arg_bindings[2].type).shape[0]
    first = 4 if has_res else 3
    h, w, images = (ksel.arg_descs[i].v for i in range(first, first + 3))
    n = j * 16
    tb, nb = blocks(m, n, k)
    res_type = f"tensor<{images}x{h}x{w}x{n}xf32>"
    return dict(
        block_m=tb, block_n=nb, m=m, k=k, n=n, h=h, w=w, images=images,
        add_rows=add_rows, so=images * h * w * n, has_res=int(has_res),
        vt="bf16", u_type=f"tensor<16x{j}x{k2}x16x2xbf16>",
        workgroup="sdiree_wino2_conv_workgroup", **residual_values(has_res, res_type),
    )  # fmt: skip


def _shape_tag(x: dict) -> str:
    """What tells one conv call's function from another's (a function is made once a name)."""
    return f"{x['images']}x{x['h']}x{x['w']}x{x['k']}x{x['n']}a{x['add_rows']}"


@functools.cache
def _make_ops():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    input_loader = template_loader(_INPUT_TEMPLATE)
    conv_loader = template_loader(CONV_TEMPLATE)
    library = def_library("sdiree_winograd_fused")

    def conv_shape(s, h, w, images):
        return [images, h, w, s[1][1] * 16]

    @CustomOp.register(library=library)
    class wino2_input(CustomOp):
        signature = "wino2_input(Tensor x, int h, int w, int images) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel,
                1,
                3,
                lambda s, h, w, i: ([16, tile_rows(i, h, w), s[0][1]], torch.bfloat16),
            )

        def eager_execute(self, x, h, w, images):
            return _eager_input(x, h, w, images)

        def generate(self, ksel, kb):
            rows, c = RankedTensorType(kb.arg_bindings[0].type).shape
            h, w, images = (ksel.arg_descs[i].v for i in range(1, 4))
            m = tile_rows(images, h, w)
            emit_call(
                input_loader,
                kb,
                KERNEL,
                f"sdiree_wino2_input_{images}x{h}x{w}x{c}r{rows}",
                1,
                rows=rows, c=c, m=m, h=h, w=w, images=images, sx=rows * c, sv=16 * m * c,
            )  # fmt: skip

    @CustomOp.register(library=library)
    class wino2_conv(CustomOp):
        signature = (
            "wino2_conv(Tensor v, Tensor u, Tensor add, int h, int w, int images) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 3, 3, lambda s, *v: (conv_shape(s, *v), torch.float32))

        def eager_execute(self, v, u, add, h, w, images):
            return _eager_conv(v, u, add, None, h, w, images)

        def generate(self, ksel, kb):
            x = _conv_values(kb, ksel, False)
            name = f"sdiree_wino2_conv_{_shape_tag(x)}"
            emit_call(conv_loader, kb, KERNEL, name, 3, **x)

    @CustomOp.register(library=library)
    class wino2_conv_res(CustomOp):
        signature = (
            "wino2_conv_res(Tensor v, Tensor u, Tensor add, Tensor res, int h, int w,"
            " int images) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 4, 3, lambda s, *v: (conv_shape(s, *v), torch.float32))

        def eager_execute(self, v, u, add, res, h, w, images):
            return _eager_conv(v, u, add, res, h, w, images)

        def generate(self, ksel, kb):
            x = _conv_values(kb, ksel, True)
            name = f"sdiree_wino2_convr_{_shape_tag(x)}"
            emit_call(conv_loader, kb, KERNEL, name, 4, **x)

    return wino2_input, wino2_conv, wino2_conv_res
