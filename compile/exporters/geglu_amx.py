"""A GEGLU feed-forward's projection and gate traced as one dispatch to sdiree's AMX kernel
(`sdiree_amx_bf16_geglu_workgroup` in specs/kernels/amx_bf16_matmul.c): out = (x W_v^T + b_v) *
gelu(x W_g^T + b_g), bf16, the GELU the exact one.

As two kernel products and an elementwise pass, SD 1.5's 64x64 level wrote the two [8192, 1280]
f32 halves to memory and read them back (168 MB a block); here each workgroup keeps its value and
gate blocks in L1 and writes only the bf16 result, which the next linear reads as its bf16 input.
The weight is packed interleaved by 32 rows (value 32, gate 32, ...), the bias likewise, so one
workgroup's 64 packed columns are one block of 32 outputs' value and gate: constant expressions
of the parameters, which the parameter encoder computes at compile.
"""

from __future__ import annotations

import torch

from .amx_matmul import (
    BLOCK_M,
    GRID_MN,
    KERNEL,
    MULTIPLE,
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    operand,
    pack_b,
    product,
    select_static,
    template_loader,
    unpack_b,
    weight_operand,
)

# one workgroup's packed columns: 32 outputs' value and gate
BLOCK_N = 2 * MULTIPLE


def interleave(t: torch.Tensor, inner: int, rows: int = MULTIPLE) -> torch.Tensor:
    """[2 * inner, ...] (value rows, then gate rows) interleaved by `rows` rows (32 here; the
    fp32 kernel's panel of 64 in linear_f32.py)."""
    v = t[:inner].reshape(inner // rows, rows, *t.shape[1:])
    g = t[inner:].reshape(inner // rows, rows, *t.shape[1:])
    return torch.stack([v, g], dim=1).reshape(t.shape)


def amx_geglu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: bool = False
) -> torch.Tensor:
    """x [M, K] (cast to bf16) through a GEGLU projection weight [2 * inner, K] and bias: [M,
    inner] bf16, or with split (`amx_operands: bf16x3`) [M, 2 * inner], its hi and lo parts
    (`register()` first, outside a trace)."""
    inner = weight.shape[0] // 2
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=torch.float32)
    packed = pack_b(weight_operand(interleave(weight, inner), split))
    return _OP(operand(x, split), packed, interleave(bias, inner), int(split))


_OP = KernelOp("amx_geglu", lambda: _make_op())
register = _OP.register


_TEMPLATE = (
    TEMPLATE_HEAD
    + GRID_MN
    + """    builtin.module {{
      func.func private @sdiree_amx_bf16_geglu_workgroup(memref<bf16>, index, memref<bf16>,
          index, memref<f32>, index, memref<bf16>, index, index, index, index, index, index,
          index) -> i32 attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%a: !stream.binding, %b: !stream.binding, %bias: !stream.binding,
          %o: !stream.binding, %M: index, %N: index, %K: index) {{
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
        %c2 = arith.constant 2 : index
        %wn = stream.dispatch.workgroup.id[0] : index
        %wm = stream.dispatch.workgroup.id[1] : index
        %sa = arith.muli %M, %K : index
        %sb = arith.muli %N, %K : index
        %mn = arith.muli %M, %N : index
        %so = arith.divui %mn, {out_div} : index
"""
    + buffer_views(
        ("a", "bf16", "sa"), ("b", "bf16", "sb"), ("bias", "f32", "N"), ("o", "bf16", "so")
    )
    + """        %split = arith.constant {split} : index
        %r = func.call @sdiree_amx_bf16_geglu_workgroup(%a_base, %a_off, %b_base, %b_off,
            %bias_base, %bias_off, %o_base, %o_off, %M, %N, %K, %split, %wn, %wm) : (memref<bf16>,
            index, memref<bf16>, index, memref<f32>, index, memref<bf16>, index, index, index,
            index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%a: tensor<{m}x{k}xbf16>, %b: tensor<{j}x{k2}x16x2xbf16>,
      %bias: tensor<{n}xf32>) -> tensor<{m}x{inner}xbf16> {{
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %k = arith.constant {k} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n](%a, %b, %bias, %m, %n, %k)
        : (tensor<{m}x{k}xbf16>, tensor<{j}x{k2}x16x2xbf16>, tensor<{n}xf32>, index, index,
           index) -> tensor<{m}x{inner}xbf16>
    util.return %0 : tensor<{m}x{inner}xbf16>
  }}
}}
"""
)


def _eager(a: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, split: int) -> torch.Tensor:
    y = product(a, unpack_b(packed), bool(split)) + bias  # interleaved columns
    m, n = y.shape
    y = y.reshape(m, n // BLOCK_N, 2, MULTIPLE)
    value, gate = y[:, :, 0].reshape(m, n // 2), y[:, :, 1].reshape(m, n // 2)
    return operand(value * torch.nn.functional.gelu(gate), bool(split))


def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_amx_geglu"))
    class amx_bf16_geglu(CustomOp):
        signature = "amx_bf16_geglu(Tensor a, Tensor b, Tensor bias, int split) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel,
                3,
                1,
                lambda s, split: ([s[0][0], s[1][0] * (16 if split else 8)], torch.bfloat16),
            )

        def eager_execute(self, a, b, bias, split):
            return _eager(a, b, bias, split)

        def generate(self, ksel, kb):
            m, k = RankedTensorType(kb.arg_bindings[0].type).shape
            j, k2 = RankedTensorType(kb.arg_bindings[1].type).shape[:2]
            split = ksel.arg_descs[3].v
            emit_call(
                loader,
                kb,
                KERNEL,
                f"sdiree_amx_geglu_{m}x{k}x{j * 16}{'s' if split else ''}",
                3,
                split=split,
                out_div="%c1" if split else "%c2",
                block_m=BLOCK_M,
                block_n=BLOCK_N,
                m=m,
                k=k,
                n=j * 16,
                inner=j * (16 if split else 8),
                j=j,
                k2=k2,
            )

    return amx_bf16_geglu
