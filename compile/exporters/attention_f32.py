"""Attention traced as one dispatch to sdiree's fused fp32 attention kernel
(specs/kernels/f32_attention.c, AVX-512 FMA), under export choice `attention: fused_f32`.

iree 3.13 runs the `chunked` export (attention.py) on llvm-cpu as three dispatches and a pack
per block of queries of each head: at SD 1.5's 64x64 level that is ~9,000 of a UNet call's
~12,400 dispatches, each ending at a barrier of the task workers, and the scores written and
read back between them. The kernel reads q, k and v as the projections wrote them ([batch,
tokens, heads * dim], f32: no head split, no packing pass) and writes its output in that layout
too, so the output projection takes it as it is; softmax online in L1, f32 throughout.

`fits`: no mask, static token counts, f32, a head dim that is a multiple of 8 and at most 160
(the kernel's register tiles and L1 blocks); other attention keeps the chunked path. Any query
and key count (the last block of 32 queries may be short, cross-attention's 77 keys are taken
as they are).
"""

from __future__ import annotations

import torch

from .amx_matmul import (
    TEMPLATE_HEAD,
    KernelOp,
    buffer_views,
    emit_call,
    select_static,
    template_loader,
)

KERNEL = "f32_attention"
# what the kernel executes: AVX-512 Foundation only (its FMAs, roundscale and scalef)
ISA_FLAGS = ("-mavx512f",)
CPU_FEATURES = ("avx512f",)
QUERY_BLOCK = 32  # the kernel's QB: queries a workgroup
DIM_STEP, MAX_DIM = 8, 160  # the kernel's JT and DMAX
LOG2_E = 1.4426950408889634  # q is scaled by it too: the kernel's softmax takes powers of 2


def fits_heads(query: torch.Tensor, key: torch.Tensor, heads: int, mask) -> bool:
    """Whether attention on the projections [batch, tokens, heads * dim] can go to the kernel."""
    hd = query.shape[-1]
    d = hd // heads
    return (
        mask is None
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and all(isinstance(n, int) for n in (*query.shape, *key.shape))
        and hd == heads * d
        and d % DIM_STEP == 0
        and d <= MAX_DIM
    )


def f32_attention_heads(query, key, value, heads: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per head on the projections [batch, tokens, heads * dim], the
    result [batch, queries, heads * dim] float32 (`register()` first, outside a trace)."""
    return _OP(query, key, value, heads, scale * LOG2_E)


def reference(query, key, value, heads: int, qscale: float) -> torch.Tensor:
    """What the kernel computes, in torch (the op's eager form; qscale includes log2(e))."""
    b, nq, hd = query.shape
    d = hd // heads

    def split(t):
        return t.reshape(b, -1, heads, d).transpose(1, 2)

    scores = split(query) @ split(key).transpose(-1, -2) * (qscale / LOG2_E)
    out = torch.softmax(scores, dim=-1) @ split(value)
    return out.transpose(1, 2).reshape(b, nq, hd)


_OP = KernelOp("f32_attention", lambda: _make_op())
register = _OP.register


_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%nq: index, %bh: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_q})>()[%nq]
      %c1 = arith.constant 1 : index
      stream.return %x, %bh, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_f32_attention_workgroup(memref<f32>, index, memref<f32>, index,
          memref<f32>, index, memref<f32>, index, index, index, index, index, f32, index, index)
          -> i32 attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%q: !stream.binding, %k: !stream.binding, %v: !stream.binding,
          %o: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %wq = stream.dispatch.workgroup.id[0] : index
        %wh = stream.dispatch.workgroup.id[1] : index
        %sq = arith.constant {sq} : index
        %sk = arith.constant {sk} : index
        %NQ = arith.constant {nq} : index
        %NK = arith.constant {nk} : index
        %H = arith.constant {h} : index
        %D = arith.constant {d} : index
        %QS = arith.constant {qscale} : f32
"""
    + buffer_views(("q", "f32", "sq"), ("k", "f32", "sk"), ("v", "f32", "sk"), ("o", "f32", "sq"))
    + """        %r = func.call @sdiree_f32_attention_workgroup(%q_base, %q_off, %k_base, %k_off,
            %v_base, %v_off, %o_base, %o_off, %NQ, %NK, %H, %D, %QS, %wq, %wh)
            : (memref<f32>, index, memref<f32>, index, memref<f32>, index, memref<f32>, index,
               index, index, index, index, f32, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%q: tensor<{b}x{nq}x{hd}xf32>, %k: tensor<{b}x{nk}x{hd}xf32>,
      %v: tensor<{b}x{nk}x{hd}xf32>) -> tensor<{b}x{nq}x{hd}xf32> {{
    %nq = arith.constant {nq} : index
    %bh = arith.constant {bh} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nq, %bh](%q, %k, %v)
        : (tensor<{b}x{nq}x{hd}xf32>, tensor<{b}x{nk}x{hd}xf32>, tensor<{b}x{nk}x{hd}xf32>)
        -> tensor<{b}x{nq}x{hd}xf32>
    util.return %0 : tensor<{b}x{nq}x{hd}xf32>
  }}
}}
"""
)


def object_path() -> str:
    """The kernel's object, built once into the user cache (compile/kernel_objects.py)."""
    from ..kernel_objects import build_object

    return str(build_object(KERNEL, ISA_FLAGS))


def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_f32_attention"))
    class f32_attention(CustomOp):
        signature = (
            "f32_attention(Tensor q, Tensor k, Tensor v, int heads, float qscale) -> (Tensor)"
        )

        def select(self, ksel):
            ksel.attr_float(4)
            select_static(ksel, 3, 1, lambda s, _: (s[0], torch.float32))

        def eager_execute(self, q, k, v, heads, qscale):
            return reference(q, k, v, heads, qscale)

        def generate(self, ksel, kb):
            b, nq, hd = RankedTensorType(kb.arg_bindings[0].type).shape
            nk = RankedTensorType(kb.arg_bindings[1].type).shape[1]
            heads, qscale = ksel.arg_descs[3].v, ksel.arg_descs[4].v
            # the scale is in the function: one function per scale
            name = f"sdiree_f32_attention_{b}x{nq}x{nk}x{heads}x{hd // heads}q{round(qscale * 1e6)}"
            emit_call(
                loader,
                kb,
                KERNEL,
                name,
                3,
                path=object_path(),
                block_q=QUERY_BLOCK,
                b=b,
                nq=nq,
                nk=nk,
                h=heads,
                d=hd // heads,
                hd=hd,
                bh=b * heads,
                sq=b * nq * hd,
                sk=b * nk * hd,
                qscale=f"{qscale:.9e}",
            )

    return f32_attention
