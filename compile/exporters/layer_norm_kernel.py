"""LayerNorm as one dispatch to sdiree's kernel (`sdiree_layer_norm_workgroup` in
specs/kernels/norms.c), its result bf16: the transformer blocks' norms, whose outputs only
the AMX linears read (as bf16).

iree 3.13 compiles a LayerNorm as a pass that computes the mean and writes the centred tensor
and one that computes the variance and writes the normalized one (SD 1.5's 64x64 level: 2x 10.5
MB read, 10.5 + 5 MB written, ~2.3 ms a norm); the kernel reads each row once (its later reads
hit L1) and writes bf16 once. Under export choice `matmul_kernel: amx` with the UNet
channels-last (`set_layer_norm_kernel`, unet.py); a norm whose rows or width do not fit keeps
its own forward.
"""

from __future__ import annotations

import functools
import struct
import types

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
from .group_norm_kernel import KERNEL

BLOCK_ROWS = 64  # rows a workgroup


def set_layer_norm_kernel(model: torch.nn.Module) -> int:
    """Bind the kernel's forward to every LayerNorm of model's transformer blocks whose Linears
    all take bf16 (`linear: amx`: linear_amx.casts_input); how many."""
    from .linear_amx import casts_input

    _OP.register()
    bound = 0
    for block in model.modules():
        if type(block).__name__ != "BasicTransformerBlock":
            continue
        if not all(casts_input(m) for m in block.modules() if isinstance(m, torch.nn.Linear)):
            continue
        for m in block.modules():
            if isinstance(m, torch.nn.LayerNorm) and fits(m):
                m.forward = types.MethodType(layer_norm_forward, m)
                bound += 1
    return bound


def fits(norm: torch.nn.LayerNorm) -> bool:
    return (
        len(norm.normalized_shape) == 1
        and norm.normalized_shape[0] % 16 == 0
        and norm.weight is not None
        and norm.bias is not None
    )


def layer_norm_forward(self: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """self(x) in bf16 (under `amx_operands: bf16x3` its hi and lo parts, amx_matmul.operand),
    on the kernel where x's rows are static."""
    c, split = x.shape[-1], is_split(self)
    rows = x.numel() // c if all(isinstance(d, int) for d in x.shape) else None
    if rows is None:
        y = torch.nn.functional.layer_norm(
            x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps
        )
        return operand(y, split)
    gb = torch.stack([self.weight.float(), self.bias.float()])
    eps_bits = struct.unpack("<I", struct.pack("<f", self.eps))[0]
    y = _OP(x.float().reshape(rows, c), gb, eps_bits, int(split))
    return y.reshape(*x.shape[:-1], y.shape[-1])


_OP = KernelOp("layer_norm", lambda: _make_op())
register = _OP.register


def _eager(x: torch.Tensor, gb: torch.Tensor, eps_bits: int, split: int) -> torch.Tensor:
    eps = struct.unpack("<f", struct.pack("<I", eps_bits))[0]
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], gb[0], gb[1], eps)
    return operand(y, bool(split))


_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%m: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block})>()[%m]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_layer_norm_workgroup(memref<f32>, index, memref<f32>, index,
          memref<bf16>, index, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %gb: !stream.binding, %o: !stream.binding,
          %M: index, %C: index, %RB: index, %EPS: index) {{
        %c0 = arith.constant 0 : index
        %c2 = arith.constant 2 : index
        %wm = stream.dispatch.workgroup.id[0] : index
        %sx = arith.muli %M, %C : index
        %sg = arith.muli %C, %c2 : index
        %split = arith.constant {split} : index
        %so = arith.constant {so} : index
"""
    + buffer_views(("x", "f32", "sx"), ("gb", "f32", "sg"), ("o", "bf16", "so"))
    + """        %r = func.call @sdiree_layer_norm_workgroup(%x_base, %x_off, %gb_base, %gb_off,
            %o_base, %o_off, %M, %C, %RB, %EPS, %split, %wm) : (memref<f32>, index, memref<f32>,
            index, memref<bf16>, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{m}x{c}xf32>, %gb: tensor<2x{c}xf32>)
      -> tensor<{m}x{oc}xbf16> {{
    %m = arith.constant {m} : index
    %c = arith.constant {c} : index
    %rb = arith.constant {block} : index
    %eps = arith.constant {eps} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m](%x, %gb, %m, %c, %rb, %eps)
        : (tensor<{m}x{c}xf32>, tensor<2x{c}xf32>, index, index, index, index)
        -> tensor<{m}x{oc}xbf16>
    util.return %0 : tensor<{m}x{oc}xbf16>
  }}
}}
"""
)


@functools.cache
def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_layer_norm"))
    class layer_norm_bf16(CustomOp):
        signature = "layer_norm_bf16(Tensor x, Tensor gb, int eps_bits, int split) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel, 2, 2, lambda s, eps, split: ([s[0][0], s[0][1] * (1 + split)], torch.bfloat16)
            )

        def eager_execute(self, x, gb, eps_bits, split):
            return _eager(x, gb, eps_bits, split)

        def generate(self, ksel, kb):
            m, c = RankedTensorType(kb.arg_bindings[0].type).shape
            eps, split = ksel.arg_descs[2].v, ksel.arg_descs[3].v
            emit_call(
                loader,
                kb,
                KERNEL,
                f"sdiree_layer_norm_{m}x{c}s{split}",
                2,
                m=m,
                c=c,
                oc=c * (1 + split),
                so=m * c * (1 + split),
                split=split,
                block=BLOCK_ROWS,
                eps=eps,
            )

    return layer_norm_bf16
