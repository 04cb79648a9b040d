"""Self-attention traced as one dispatch to sdiree's fused AMX attention kernel
(specs/kernels/amx_bf16_attention.c): softmax(q k^T) v with the scores kept in each workgroup's
L1, under export choice `matmul_kernel: amx` with `attention: chunked` (attention.py).

The chunked path on the kernel's matmuls writes every chunk's scores (f32) to memory and reads
them back three times; at SD 1.5's 64x64 level that traffic cost more than the products. Here the
graph only pads and packs the keys and values: each head's keys zero-padded to a head dim that
is a multiple of 32 and packed as the B operand of q k^T, its values likewise as the B operand
of p v (amx_matmul.pack_b). q goes in as the projection wrote it (f32): each workgroup scales
its rows (by log2(e) too: the kernel's softmax takes powers of 2), casts and pads them itself.
The result is [batch*heads, queries, dim], bf16 (the output projection's operand) or float32
with `amx_operands: bf16x3`.

Key counts that are not a multiple of 32 (cross-attention's 77 text tokens) are zero-padded to
one, and the kernel takes the real count: the padded keys' scores are masked out before its
softmax, at any head dim (SD 1.5's 160 at the 16x16 and 8x8 levels too).

`fits`: no mask, query count a multiple of 32, a head dim of at most 160 (the kernel's
accumulator block); other attention keeps the chunked path.
"""

from __future__ import annotations

import math

import torch

from .amx_matmul import (
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

KERNEL = "amx_bf16_attention"
QUERY_BLOCK = 32  # the kernel's QB: queries a workgroup
MAX_DIM = 160  # the kernel's DV_MAX
# q is scaled by this too: the kernel's softmax takes powers of 2 (2^(s log2 e) = e^s)
LOG2_E = 1.4426950408889634


def padded(d: int) -> int:
    return -(-d // MULTIPLE) * MULTIPLE


def fits(query: torch.Tensor, key: torch.Tensor, mask) -> bool:
    """Whether attention on these [batch*heads, tokens, dim] operands can go to the kernel."""
    nq, nk, d = query.shape[1], key.shape[1], query.shape[-1]
    return (
        mask is None
        and all(isinstance(n, int) for n in (nq, nk))
        and nq % MULTIPLE == 0
        and padded(d) <= MAX_DIM
    )


def fits_heads(query: torch.Tensor, key: torch.Tensor, heads: int, mask) -> bool:
    """fits() for projections [batch, tokens, heads * dim] (amx_attention_heads)."""
    d = query.shape[-1] // heads
    return fits(query[:1, :, :d], key[:1, :, :d], mask)


def amx_attention(query, key, value, scale: float, split: bool = False) -> torch.Tensor:
    """softmax(query key^T * scale) value on [batch*heads, tokens, dim] fp32 tensors, on the
    kernel (`register()` first, outside a trace); split: `amx_operands: bf16x3`. float32."""
    return _attend(query[:, :, None], key, value, scale, split)[:, :, 0].float()


def amx_attention_heads(
    query, key, value, heads: int, scale: float, split: bool = False
) -> torch.Tensor:
    """The same on the projections [batch, tokens, heads * dim], the result in that layout too:
    the kernel reads each head's queries and writes its output in place (strided rows), so no
    transpose splits the heads of q or merges those of the output; without split the keys and
    values go from the projections to the kernel's operands in one pass of its own (pack_kv),
    with split their split is part of their packing; [batch, queries, heads * dim], bf16
    (float32 with split)."""
    b, nq, hd = query.shape
    d = hd // heads
    if not split:
        keys = key.shape[1]
        k, v = pack_kv(key, heads, 0), pack_kv(value, heads, 1)
        out = _OP(query.reshape(b, nq, heads, d).float(), k, v, d, keys, 0, scale * LOG2_E)
        return out.reshape(b, nq, hd)

    def by_head(t):  # in bf16: the projection's bias pass writes it so, half the bytes moved
        t = t.to(torch.float32 if split else torch.bfloat16)
        return t.reshape(b, -1, heads, d).permute(0, 2, 1, 3).reshape(b * heads, -1, d)

    out = _attend(query.reshape(b, nq, heads, d), by_head(key), by_head(value), scale, split)
    return out.reshape(b, nq, hd)


def _attend(q4, key, value, scale: float, split: bool) -> torch.Tensor:
    """q4 [batch, queries, heads, dim]; key, value [batch*heads, keys, dim]: [batch, queries,
    heads, dim]. The kernel takes q4 in f32 as it is (it scales, casts and pads its rows
    itself); with split, k's and v's hi and lo parts (amx_matmul.operand) along the head dim and
    along the keys."""
    F = torch.nn.functional
    d = q4.shape[-1]
    pad = padded(d) - d
    keys = key.shape[1]
    extra = -keys % MULTIPLE  # padded keys, masked out by the kernel
    # every pad and pack below in bf16 (the values the kernel reads, half the bytes); split, in
    # f32 until the parts are taken
    dt = torch.float32 if split else torch.bfloat16
    key, value = key.to(dt), value.to(dt)
    k = pack_b(weight_operand(F.pad(key, (0, pad, 0, extra)), split))
    v = pack_b(weight_operand(F.pad(value, (0, pad, 0, extra)).transpose(1, 2), split))
    return _OP(q4.float(), k, v, d, keys, int(split), scale * LOG2_E)


def pack_kv(x: torch.Tensor, heads: int, values: int) -> torch.Tensor:
    """A projection's keys or values (values 1) [batch, keys, heads * dim] as the attention
    kernel's k or v operand (_attend's without split), in one pass of the kernel's pack_kv:
    [batch*heads, padded keys / 16, D / 2, 16, 2] or [batch*heads, D / 16, padded keys / 2, 16,
    2] bf16, D the head dim padded to 32, the keys to 32."""
    return _PACK(x.float(), heads, values)


def _eager_pack(x: torch.Tensor, heads: int, values: int) -> torch.Tensor:
    b, nk, hd = x.shape
    d = hd // heads
    t = x.reshape(b, nk, heads, d).permute(0, 2, 1, 3).reshape(b * heads, nk, d)
    t = torch.nn.functional.pad(t.to(torch.bfloat16), (0, padded(d) - d, 0, -nk % MULTIPLE))
    return pack_b(t.transpose(1, 2) if values else t)


def _pack_shape(x_shape, heads: int, values: int) -> list[int]:
    b, nk, hd = x_shape
    d, nkp = padded(hd // heads), padded(nk)
    if values:
        return [b * heads, d // 16, nkp // 2, 16, 2]
    return [b * heads, nkp // 16, d // 2, 16, 2]


def _out_dtype(split) -> torch.dtype:
    return torch.float32 if split else torch.bfloat16


_OP = KernelOp("amx_attention", lambda: _make_op())
_PACK = KernelOp("amx_pack_kv", lambda: _make_pack_op())


def register() -> None:
    """The attention and pack_kv ops (before a trace)."""
    _OP.register()
    _PACK.register()


_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%nq: index, %bh: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_q})>()[%nq]
      %c1 = arith.constant 1 : index
      stream.return %x, %bh, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_amx_bf16_attention_workgroup(memref<f32>, index, memref<bf16>,
          index, memref<bf16>, index, memref<{odt}>, index, index, index, index, index, index,
          f32, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%q: !stream.binding, %k: !stream.binding, %v: !stream.binding,
          %o: !stream.binding, %BH: index, %NQ: index, %NK: index, %NKV: index, %D: index,
          %DQ: index, %QS: f32, %DV: index, %DO: index, %H: index) {{
        %c0 = arith.constant 0 : index
        %wq = stream.dispatch.workgroup.id[0] : index
        %wh = stream.dispatch.workgroup.id[1] : index
        %hq = arith.muli %BH, %NQ : index
        %hk = arith.muli %BH, %NK : index
        %sq = arith.muli %hq, %DQ : index
        %sk = arith.muli %hk, %D : index
        %sv = arith.constant {sv} : index
        %split = arith.constant {split} : index
        %so = arith.muli %hq, %DO : index
"""
    + buffer_views(
        ("q", "f32", "sq"), ("k", "bf16", "sk"), ("v", "bf16", "sv"), ("o", "{odt}", "so")
    )
    + """        %r = func.call @sdiree_amx_bf16_attention_workgroup(%q_base, %q_off, %k_base,
            %k_off, %v_base, %v_off, %o_base, %o_off, %NQ, %NK, %NKV, %D, %DQ, %QS, %DV, %DO,
            %H, %split, %wq, %wh) : (memref<f32>, index, memref<bf16>, index, memref<bf16>,
            index, memref<{odt}>, index, index, index, index, index, index, f32, index, index,
            index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%q: tensor<{b}x{nq}x{h}x{dq}xf32>,
      %k: tensor<{bh}x{kj}x{d2}x16x2xbf16>, %v: tensor<{bh}x{vj}x{nk2}x16x2xbf16>)
      -> tensor<{b}x{nq}x{h}x{do}x{odt}> {{
    %bh = arith.constant {bh} : index
    %nq = arith.constant {nq} : index
    %nk = arith.constant {nk} : index
    %nkv = arith.constant {nkv} : index
    %d = arith.constant {d} : index
    %dq = arith.constant {dq} : index
    %qs = arith.constant {qscale} : f32
    %dv = arith.constant {dv} : index
    %do = arith.constant {do} : index
    %h = arith.constant {h} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nq, %bh](%q, %k, %v, %bh, %nq, %nk, %nkv, %d, %dq,
        %qs, %dv, %do, %h)
        : (tensor<{b}x{nq}x{h}x{dq}xf32>, tensor<{bh}x{kj}x{d2}x16x2xbf16>,
           tensor<{bh}x{vj}x{nk2}x16x2xbf16>, index, index, index, index, index, index, f32,
           index, index, index)
        -> tensor<{b}x{nq}x{h}x{do}x{odt}>
    util.return %0 : tensor<{b}x{nq}x{h}x{do}x{odt}>
  }}
}}
"""
)


def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_amx_attention"))
    class amx_bf16_attention(CustomOp):
        signature = (
            "amx_bf16_attention(Tensor q, Tensor k, Tensor v, int d, int nk, int split, "
            "float qscale) -> (Tensor)"
        )

        def select(self, ksel):
            ksel.attr_float(6)
            select_static(ksel, 3, 3, lambda s, d, _, split: ([*s[0][:3], d], _out_dtype(split)))

        def eager_execute(self, q, k, v, d, nk, split, qscale):
            b, nq, h, _ = q.shape
            depth = k.shape[-3] * 2  # the products' depth (both parts with split)
            qs = torch.nn.functional.pad(q * qscale, (0, depth // (2 if split else 1) - d))
            heads = operand(qs, bool(split)).permute(0, 2, 1, 3).reshape(b * h, nq, depth)
            scores = product(heads, unpack_b(k), bool(split))  # in base-2 units
            scores[..., nk:] = -math.inf  # the padded keys
            p = torch.softmax(scores * math.log(2), dim=-1)
            if split:
                p = operand(p, True)
            out = product(p, unpack_b(v), bool(split))[..., :d]
            out = out.reshape(b, h, nq, d).permute(0, 2, 1, 3).contiguous()
            return out.to(_out_dtype(split))

        def generate(self, ksel, kb):
            b, nq, h, dq = RankedTensorType(kb.arg_bindings[0].type).shape
            bh, kj, d2, _, _ = RankedTensorType(kb.arg_bindings[1].type).shape
            _, vj, nk2, _, _ = RankedTensorType(kb.arg_bindings[2].type).shape
            d_out, nkv, split = (ksel.arg_descs[i].v for i in (3, 4, 5))
            qscale = ksel.arg_descs[6].v
            emit_call(
                loader,
                kb,
                KERNEL,
                # the scale is in the function: one function per scale
                f"sdiree_amx_attention_{b}x{nq}x{h}x{nkv}x{d2 * 2}x{d_out}s{split}"
                f"q{round(qscale * 1e6)}",
                3,
                split=split,
                odt="f32" if split else "bf16",
                qscale=f"{qscale:.9e}",
                sv=bh * vj * 16 * nk2 * 2,
                block_q=QUERY_BLOCK,
                b=b,
                h=h,
                bh=bh,
                nq=nq,
                nk=kj * 16,
                nkv=nkv,
                d=d2 * 2,
                dq=dq,
                dv=vj * 16,
                do=d_out,
                kj=kj,
                d2=d2,
                vj=vj,
                nk2=nk2,
            )

    return amx_bf16_attention


_PACK_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%nk: index, %bh: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_k})>()[%nk]
      %c1 = arith.constant 1 : index
      stream.return %x, %bh, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_amx_bf16_pack_kv_workgroup(memref<f32>, index, memref<bf16>,
          index, index, index, index, index, index, index, index, index) -> i32
          attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%x: !stream.binding, %o: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %wk = stream.dispatch.workgroup.id[0] : index
        %wh = stream.dispatch.workgroup.id[1] : index
        %sx = arith.constant {sx} : index
        %so = arith.constant {so} : index
        %NK = arith.constant {nk} : index
        %NKP = arith.constant {nkp} : index
        %H = arith.constant {h} : index
        %DQ = arith.constant {dq} : index
        %D = arith.constant {d} : index
        %values = arith.constant {values} : index
"""
    + buffer_views(("x", "f32", "sx"), ("o", "bf16", "so"))
    + """        %r = func.call @sdiree_amx_bf16_pack_kv_workgroup(%x_base, %x_off, %o_base, %o_off,
            %NK, %NKP, %H, %DQ, %D, %values, %wk, %wh) : (memref<f32>, index, memref<bf16>,
            index, index, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%x: tensor<{b}x{nk}x{hd}xf32>) -> {o_type} {{
    %nkp = arith.constant {nkp} : index
    %bh = arith.constant {bh} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%nkp, %bh](%x) : (tensor<{b}x{nk}x{hd}xf32>)
        -> {o_type}
    util.return %0 : {o_type}
  }}
}}
"""
)


def _make_pack_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_PACK_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_amx_pack_kv"))
    class amx_bf16_pack_kv(CustomOp):
        signature = "amx_bf16_pack_kv(Tensor x, int heads, int values) -> (Tensor)"

        def select(self, ksel):
            select_static(ksel, 1, 2, lambda s, h, v: (_pack_shape(s[0], h, v), torch.bfloat16))

        def eager_execute(self, x, heads, values):
            return _eager_pack(x, heads, values)

        def generate(self, ksel, kb):
            b, nk, hd = RankedTensorType(kb.arg_bindings[0].type).shape
            heads, values = (ksel.arg_descs[i].v for i in (1, 2))
            shape = _pack_shape((b, nk, hd), heads, values)
            emit_call(
                loader,
                kb,
                KERNEL,
                f"sdiree_amx_pack_{'v' if values else 'k'}_{b}x{nk}x{heads}x{hd // heads}",
                1,
                block_k=QUERY_BLOCK,
                sx=b * nk * hd,
                so=math.prod(shape),
                b=b,
                nk=nk,
                nkp=padded(nk),
                hd=hd,
                h=heads,
                bh=b * heads,
                dq=hd // heads,
                d=padded(hd // heads),
                values=values,
                o_type="tensor<" + "x".join(map(str, shape)) + "xbf16>",
            )

    return amx_bf16_pack_kv
