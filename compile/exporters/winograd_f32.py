"""Winograd F(2x2,3x3) convolutions in fp32 as two dispatches to sdiree's kernels
(specs/kernels/winograd_f32.c, AVX-512 FMA), export choice `winograd_kernel: fused` under
`matmul_kernel: f32` (the bf16 pair is winograd_fused.py).

conv2d_winograd_nhwc with its products on the fp32 matmul kernel traces a conv as a row
transform, 16 transformed tiles written one dispatch each, 16 product dispatches whose results
the inverse transform reads back, and the bias, a resnet's time embedding and its skip added
after: ~40 dispatches, each a barrier of the task workers, and ~25 passes over the activations.
Here `wino2f_input` reads the conv's input as it is ([N, H, W, C] f32, the padding implied) and
writes its transformed tiles [16, M, C] once; `wino2f_conv` computes the 16 products on FMA
register tiles and adds each into the tiles' 2x2 outputs where they lie in the result [N, H, W,
O], which it first sets to the bias plus a per-image add (a resnet's time embedding) and a
residual (its skip). The weight is the conv's `weight_winograd` (winograd.py) packed as the fp32
matmul kernel's B operand per tile element, a constant expression the parameter encoder
computes at compile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from sdiree.runtime.weights.winograd import WINOGRAD, WINOGRAD_PARAM

from .amx_matmul import (
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    residual_values,
    select_static,
    template_loader,
)
from .winograd_fused import CONV_TEMPLATE, conv_products, eager_inverse

KERNEL = "winograd_f32"
ISA_FLAGS = ("-mavx512f",)
CPU_FEATURES = ("avx512f",)
MARK = "sdiree_winograd_f32"
PANEL = 64  # the kernel's NR: output channels a register tile (and a packed B panel)
TILE_BLOCK = 256  # tiles a workgroup of the products at most (the kernel's TB_MAX bounds it)
MIN_WORKGROUPS = 8  # the products' grid halves its channel blocks below this


def fuse(model: torch.nn.Module, tiles: dict | None, m: int) -> int:
    """Mark model's F(2x2) Winograd convs (tile m or their own in tiles) for the kernels, the
    ops registered; how many."""
    register()
    marked = 0
    for mod in model.modules():
        if (
            isinstance(mod, torch.nn.Conv2d)
            and (tiles or {}).get(mod, m) == 2
            and tuple(mod.kernel_size) == (3, 3)
            and tuple(mod.stride) == (1, 1)
            and tuple(mod.padding) == (1, 1)
            and tuple(mod.dilation) == (1, 1)
            and mod.groups == 1
        ):
            setattr(mod, MARK, True)
            marked += 1
    return marked


def takes(conv, xh_shape, dtype=torch.float32) -> bool:
    """Whether conv (marked) on a channels-last input of xh_shape goes to the kernels: static
    even sides, input channels a multiple of 16 and output channels of 64, fp32."""
    n, h, w, c = xh_shape
    return (
        getattr(conv, MARK, False)
        and all(isinstance(d, int) for d in (n, h, w, c))
        and h % 2 == 0
        and w % 2 == 0
        and c % 16 == 0
        and conv.out_channels % PANEL == 0
        and dtype == conv.weight.dtype == torch.float32
        and getattr(conv, WINOGRAD_PARAM, None) is not None
    )


def blocks(m: int, n: int) -> tuple[int, int]:
    """The products' workgroup block (tiles, output channels): up to TILE_BLOCK tiles in equal
    blocks by 128 channels (the block's outputs, its V rows for one depth step and one B strip
    in L2; a B strip serves all of its tiles, where the split products' 48-row blocks read the
    weight from memory several times over), the channels halved while the grid is too small to
    keep both workers busy."""
    blocks_m = -(-m // TILE_BLOCK)
    tb = -(-m // blocks_m)
    nb = 128 if n % 128 == 0 else PANEL
    while blocks_m * (n // nb) < MIN_WORKGROUPS and nb % (2 * PANEL) == 0:
        nb //= 2
    return tb, nb


def pack(u: torch.Tensor) -> torch.Tensor:
    """A transformed weight [16, C, O] as the kernel's B operand [16, O / 64, C, 64]."""
    t, c, o = u.shape
    return u.reshape(t, c, o // PANEL, PANEL).permute(0, 2, 1, 3)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    t, j, c, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(t, c, j * PANEL)


def conv3x3_nhwc(conv: torch.nn.Conv2d, xh: torch.Tensor, add=None, residual=None):
    """residual + conv(xh) + add for a channels-last input [N, H, W, C] (takes(conv, xh.shape)
    holds), add [N or 1, O] and residual [N, H, W, O] where given: [N, H, W, O] f32."""
    n, h, w, _ = xh.shape
    packed = pack(getattr(conv, WINOGRAD_PARAM))
    vec = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels)
    vec = vec[None] if add is None else vec + add
    return conv_products(_CONV, _CONV_RES, _INPUT(xh), packed, vec, residual, n, h, w)


_INPUT = KernelOp("wino2f_input", lambda: _make_ops()[0])
_CONV = KernelOp("wino2f_conv", lambda: _make_ops()[1])
_CONV_RES = KernelOp("wino2f_conv_res", lambda: _make_ops()[2])


def register() -> None:
    _INPUT.register()
    _CONV.register()
    _CONV_RES.register()


def object_path() -> str:
    """The kernels' object, built once into the user cache (compile/kernel_objects.py)."""
    from ..kernel_objects import build_object

    return str(build_object(KERNEL, ISA_FLAGS))


def _eager_input(x: torch.Tensor) -> torch.Tensor:
    bt = torch.tensor(WINOGRAD[2][0], dtype=x.dtype)
    c = x.shape[-1]
    d = F.pad(x, (0, 0, 1, 1, 1, 1))
    win = d.unfold(1, 4, 2).unfold(2, 4, 2).permute(0, 1, 2, 4, 5, 3)  # [N, th, tw, 4, 4, C]
    return torch.einsum("ri,ntwijc,sj->rsntwc", bt, win, bt).reshape(16, -1, c)


_INPUT_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%m: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv 32)>()[%m]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_wino2f_input_workgroup(memref<f32>, index, memref<f32>, index,
          index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %v: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %M = arith.constant {m} : index
        %C = arith.constant {c} : index
        %H = arith.constant {h} : index
        %W = arith.constant {w} : index
        %I = arith.constant {images} : index
        %SX = arith.constant {sx} : index
        %SV = arith.constant {sv} : index
"""
    + buffer_views(("x", "f32", "SX"), ("v", "f32", "SV"))
    + """        %r = func.call @sdiree_wino2f_input_workgroup(%x_base, %x_off, %v_base, %v_off, %M,
            %C, %H, %W, %I, %wg) : (memref<f32>, index, memref<f32>, index, index, index,
            index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{images}x{h}x{w}x{c}xf32>) -> tensor<16x{m}x{c}xf32> {{
    %m = arith.constant {m} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m](%x)
        : (tensor<{images}x{h}x{w}x{c}xf32>) -> tensor<16x{m}x{c}xf32>
    util.return %0 : tensor<16x{m}x{c}xf32>
  }}
}}
"""
)


def _conv_values(kb, ksel, has_res: bool) -> dict:
    from iree.turbine.support.ir_imports import RankedTensorType

    _, m, k = RankedTensorType(kb.arg_bindings[0].type).shape
    j = RankedTensorType(kb.arg_bindings[1].type).shape[1]
    add_rows = RankedTensorType(kb.arg_bindings[2].type).shape[0]
    first = 4 if has_res else 3
    h, w, images = (ksel.arg_descs[i].v for i in range(first, first + 3))
    n = j * PANEL
    tb, nb = blocks(m, n)
    res_type = f"tensor<{images}x{h}x{w}x{n}xf32>"
    return dict(
        block_m=tb, block_n=nb, m=m, k=k, n=n, h=h, w=w, images=images, add_rows=add_rows,
        so=images * h * w * n, has_res=int(has_res), vt="f32",
        u_type=f"tensor<16x{j}x{k}x{PANEL}xf32>", workgroup="sdiree_wino2f_conv_workgroup",
        **residual_values(has_res, res_type),
    )  # fmt: skip


@functools.cache
def _make_ops():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    input_loader = template_loader(_INPUT_TEMPLATE)
    conv_loader = template_loader(CONV_TEMPLATE)
    library = def_library("sdiree_winograd_f32")

    def conv_shape(s, h, w, images):
        return [images, h, w, s[1][1] * PANEL]

    @CustomOp.register(library=library)
    class wino2f_input(CustomOp):
        signature = "wino2f_input(Tensor x) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel, 1, 0, lambda s: ([16, s[0][0] * (s[0][1] // 2) * (s[0][2] // 2), s[0][3]],
                                       torch.float32)
            )  # fmt: skip

        def eager_execute(self, x):
            return _eager_input(x)

        def generate(self, ksel, kb):
            images, h, w, c = RankedTensorType(kb.arg_bindings[0].type).shape
            m = images * (h // 2) * (w // 2)
            emit_call(
                input_loader,
                kb,
                KERNEL,
                f"sdiree_wino2f_input_{images}x{h}x{w}x{c}",
                1,
                path=object_path(),
                c=c, m=m, h=h, w=w, images=images, sx=images * h * w * c, sv=16 * m * c,
            )  # fmt: skip

    @CustomOp.register(library=library)
    class wino2f_conv(CustomOp):
        signature = (
            "wino2f_conv(Tensor v, Tensor u, Tensor add, int h, int w, int images) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 3, 3, lambda s, *v: (conv_shape(s, *v), torch.float32))

        def eager_execute(self, v, u, add, h, w, images):
            return eager_inverse(v @ unpack(u), add, None, h, w, images)

        def generate(self, ksel, kb):
            x = _conv_values(kb, ksel, False)
            name = f"sdiree_wino2f_conv_{_shape_tag(x)}"
            emit_call(conv_loader, kb, KERNEL, name, 3, path=object_path(), **x)

    @CustomOp.register(library=library)
    class wino2f_conv_res(CustomOp):
        signature = (
            "wino2f_conv_res(Tensor v, Tensor u, Tensor add, Tensor res, int h, int w,"
            " int images) -> (Tensor)"
        )

        def select(self, ksel):
            select_static(ksel, 4, 3, lambda s, *v: (conv_shape(s, *v), torch.float32))

        def eager_execute(self, v, u, add, res, h, w, images):
            return eager_inverse(v @ unpack(u), add, res, h, w, images)

        def generate(self, ksel, kb):
            x = _conv_values(kb, ksel, True)
            name = f"sdiree_wino2f_convr_{_shape_tag(x)}"
            emit_call(conv_loader, kb, KERNEL, name, 4, path=object_path(), **x)

    return wino2f_input, wino2f_conv, wino2f_conv_res


def _shape_tag(x: dict) -> str:
    """What tells one conv call's function from another's (a function is made once a name)."""
    return f"{x['images']}x{x['h']}x{x['w']}x{x['k']}x{x['n']}a{x['add_rows']}"
