"""Attention export choices for diffusers models (UNet, VAE): how attention is traced.

- `sdpa`: one fused scaled_dot_product_attention op (IREE's attention op; GPU targets).
- `sdpa_pow2`: the fused op with the head dim zero-padded to a power of two (at least 64), the
  scale still that of the real dim, the padding sliced off after. iree 3.13's cuda and rocm
  codegen give the attention op matrix cores (NV_MMA_SYNC, MFMA, WMMA) only at head dims 64, 128
  and 256 (and key counts that are multiples of 64): SD 1.5's 40, 80 and 160 ran on plain FMA
  lanes, 71 % of an fp16 UNet call's kernel time on an H200 (compile/NOTES.md). Zeros change
  neither the scores nor the output.
- `sdpa_pow2_keys`: `sdpa_pow2`, and key counts padded to a multiple of 64 with zero keys and
  values masked out (-30000 added to their scores), so that cross-attention's 77 text tokens
  get the tensor-core schedule too (iree's cuda configuration shows it). Not in any preset:
  unmeasured on a GPU, where another cross-attention rewrite came out non-finite
  (compile/NOTES.md); a variant for the next GPU session (tools/device_variants.sh).
- `decomposed`: diffusers' classic bmm-softmax-bmm (AttnProcessor).
- `fused_f32`: attention without a mask, f32, its head dim a multiple of 8 up to 160, as one
  dispatch to sdiree's fp32 attention kernel (attention_f32.py: AVX-512 FMA, the projections read
  and written as they are, online softmax in L1); other attention as `chunked`. For llvm-cpu on
  AVX-512 CPUs without AMX (whose fp32 takes the AMX kernels' split operands instead).
- `chunked`: matmul-exp-matmul per head, cut into blocks of queries whose score tile fits in
  cache, with the softmax normalization moved after the second matmul. Made for llvm-cpu, where
  the decomposed form writes and re-reads the whole score tensor (16x4096x4096 fp32, 1 GB, at
  512x512) several times: per block the scores stay in the last-level cache, and the row sums
  come out of the second matmul (a column of ones appended to V) instead of a separate pass over
  the scores. Same maths as softmax: exp(s - max) is divided by its own row sum.
  Each head is its own pair of 2-D matmuls: iree 3.13's data-tiled llvm-cpu code runs a
  1x1024x4096x40 batch_matmul ~1.5x slower than the same 1024x4096x40 matmul, and a 4-head
  batch_matmul (32x32 latents) or a 16-head one (cross-attention) ~15-25 % slower than
  per-head matmuls (tools/PERFORMANCE.md).

Attention upcast (SD 2.x's `upcast_attention: true`, whose fp16 attention scores overflow):
`decomposed` (diffusers' get_attention_scores) and `chunked` compute such a layer's scores in
fp32; diffusers' fused AttnProcessor2_0 does not (torch's fused kernels accumulate in fp32
inside, IREE's attention op is not known to), so under `sdpa` those layers get
UpcastSdpaProcessor: the same fused op on fp32 query, key and value.
"""

from __future__ import annotations

import torch

from . import attention_amx, attention_f32
from .amx_matmul import MULTIPLE, amx_matmul, fits, is_split, operand, pack_b, weight_operand
from .amx_matmul import register as register_amx
from .linear_amx import casts_input

# Largest score block (one head's queries x keys, in bytes of the score dtype) a chunk may hold,
# unless the export choice `attention_block_bytes` says otherwise. 16 MiB measured best on a Zen
# 8 MiB-L3 CPU (4-16 MiB all within noise; one 1 GB block 1.2x slower); the cpu preset asks 4 MiB,
# measured faster on Zen 5 (compile/NOTES.md, twenty-fourth session).
SCORE_BLOCK_BYTES = 16 << 20

ATTENTIONS = ("sdpa", "sdpa_pow2", "sdpa_pow2_keys", "decomposed", "chunked", "fused_f32")


def query_block(queries: int, keys: int, itemsize: int, budget: int) -> int:
    """Queries per block: halved until one head's score block fits the budget (or is odd)."""
    q = queries
    while q * keys * itemsize > budget and q % 2 == 0:
        q //= 2
    return q


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    budget: int = SCORE_BLOCK_BYTES,
    matmul: str = "iree",
    split: bool = False,
) -> torch.Tensor:
    """softmax(query @ key^T * scale + mask) @ value on [batch*heads, tokens, dim] tensors.
    matmul (export choice `matmul_kernel`) `amx`: the fused AMX attention kernel where it fits
    (attention_amx.py), else both matmuls on sdiree's AMX matmul where the token counts fit it
    (amx_operands); split: export choice `amx_operands: bf16x3` (amx_matmul.py)."""
    if matmul == "amx" and query.dtype == torch.float32 and attention_amx.fits(query, key, mask):
        return attention_amx.amx_attention(query, key, value, scale, split)
    bh, nq, d = query.shape
    qc = query_block(nq, key.shape[1], query.element_size(), budget)
    query = query * scale
    value1 = torch.cat([value, torch.ones_like(value[..., :1])], dim=-1)
    amx = matmul == "amx" and fits(qc, key.shape[1], MULTIPLE) and query.dtype == torch.float32
    if amx:
        query, key, value1 = amx_operands(query, key, value1, split)
    heads = []
    for h in range(bh):
        k_t = key[h].t() if not amx else pack_b(weight_operand(key[h], split))
        v_h = value1[h] if not amx else pack_b(weight_operand(value1[h].t(), split))
        rows = []
        for i in range(0, nq, qc):
            q = query[h, i : i + qc]
            s = torch.mm(q, k_t) if not amx else amx_matmul(q, k_t, split)
            if mask is not None:  # [batch*heads, 1 or queries, keys]
                s = s + (mask[h] if mask.shape[1] == 1 else mask[h, i : i + qc])
            e = torch.exp(s - s.amax(dim=-1, keepdim=True))
            r = torch.mm(e, v_h) if not amx else amx_matmul(operand(e, split), v_h, split)
            rows.append(r[:, :d] / r[:, d : d + 1])
        heads.append(torch.cat(rows) if len(rows) > 1 else rows[0])
    return torch.stack(heads)


def amx_operands(query, key, value1, split: bool = False):
    """query, key and [value | 1] for the AMX kernel: the query as its operand (bf16, or split),
    their last dim zero-padded to a multiple of 32 (SD 1.5's heads: 40 -> 64, 80 -> 96, 160;
    zeros add nothing to a score, and the padded output columns are dropped)."""
    d, dv = query.shape[-1], value1.shape[-1]
    pad, pad_v = -d % MULTIPLE, -dv % MULTIPLE
    query = operand(torch.nn.functional.pad(query, (0, pad)), split)
    key = torch.nn.functional.pad(key, (0, pad))
    value1 = torch.nn.functional.pad(value1, (0, pad_v))
    return query, key, value1


class ChunkedAttnProcessor:
    """diffusers attention processor: AttnProcessor's projections around chunked_attention."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        batch, keys, _ = (
            encoder_hidden_states if encoder_hidden_states is not None else hidden_states
        ).shape
        mask = attn.prepare_attention_mask(attention_mask, keys, batch)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        context = hidden_states  # self-attention reads the normalized states
        if encoder_hidden_states is not None:
            context = encoder_hidden_states
            if attn.norm_cross:
                context = attn.norm_encoder_hidden_states(context)
        key, value = attn.to_k(context), attn.to_v(context)
        if self.heads_in_place(query, key, attn.heads, mask):
            # a fused kernel on the projections as they are: no head split or merge
            out = self.attend_heads(query, key, value, attn.heads, attn.scale)
            if not casts_input(attn.to_out[0]):  # else it takes the kernel's bf16 as it is
                out = out.to(query.dtype)
            hidden_states = attn.to_out[1](attn.to_out[0](out))
        else:
            key, value = attn.head_to_batch_dim(key), attn.head_to_batch_dim(value)
            query = attn.head_to_batch_dim(query)
            dtype = query.dtype
            if attn.upcast_attention or attn.upcast_softmax:
                query, key, value = query.float(), key.float(), value.float()
                mask = None if mask is None else mask.float()
            out = self.attend(query, key, value, attn.scale, mask).to(dtype)
            hidden_states = attn.to_out[1](attn.to_out[0](attn.batch_to_head_dim(out)))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def __init__(self, block_bytes: int | None = None, matmul: str = "iree", split: bool = False):
        self.block_bytes = block_bytes or SCORE_BLOCK_BYTES
        self.matmul = matmul
        self.split = split

    def attend(self, query, key, value, scale, mask):
        return chunked_attention(
            query, key, value, scale, mask, self.block_bytes, self.matmul, self.split
        )

    def heads_in_place(self, query, key, heads: int, mask) -> bool:
        """Whether attention on these projections goes to the fused AMX kernel as they are
        (`matmul_kernel: amx`, float32, what attention_amx.fits takes)."""
        return (
            self.matmul == "amx"
            and query.dtype == torch.float32
            and key.dtype == torch.float32
            and attention_amx.fits_heads(query, key, heads, mask)
        )

    def attend_heads(self, query, key, value, heads: int, scale: float):
        return attention_amx.amx_attention_heads(query, key, value, heads, scale, self.split)


class FusedF32AttnProcessor(ChunkedAttnProcessor):
    """`fused_f32`: attention that fits sdiree's fp32 attention kernel (attention_f32.py) as one
    dispatch on the projections as they are; the rest (masks, odd head dims) `chunked`."""

    def heads_in_place(self, query, key, heads: int, mask) -> bool:
        return attention_f32.fits_heads(query, key, heads, mask)

    def attend_heads(self, query, key, value, heads: int, scale: float):
        return attention_f32.f32_attention_heads(query, key, value, heads, scale)


def fused_attention(query, key, value, scale, mask):
    """The fused op on [batch*heads, tokens, dim] tensors, as one batch of heads (its 4-D form)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=None if mask is None else mask[None],
        scale=scale,
    )  # fmt: skip
    return out[0]


class UpcastSdpaProcessor(ChunkedAttnProcessor):
    """The fused op (`sdpa`) for a layer that asks for attention upcast: query, key and value
    enter it in fp32 (ChunkedAttnProcessor's casts), the result returns to the model's dtype."""

    def attend(self, query, key, value, scale, mask):
        return fused_attention(query, key, value, scale, mask)


# sdpa_pow2_keys: key counts padded to a multiple of this; padded keys' scores get MASKED_OUT
# (finite in fp16, exp() of it is 0 next to any real score).
KEY_MULTIPLE = 64
MASKED_OUT = -30000.0


def pow2_dim(dim: int, least: int = 64) -> int:
    """The head dim sdpa_pow2 pads to: the next power of two, at least `least`."""
    return max(least, 1 << (dim - 1).bit_length())


class Pow2SdpaProcessor(ChunkedAttnProcessor):
    """`sdpa_pow2`: the fused op on query, key and value zero-padded along the head dim. A layer
    that asks for attention or softmax upcast gets them in fp32 (ChunkedAttnProcessor's casts;
    plain `sdpa` upcasts attention-upcast layers only, so the VAE, whose attention upcasts its
    softmax, stays on `sdpa` in the registry)."""

    pad_keys = False

    def attend(self, query, key, value, scale, mask):
        keys = key.shape[1]
        if self.pad_keys and keys % KEY_MULTIPLE:
            extra = KEY_MULTIPLE - keys % KEY_MULTIPLE
            key, value = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (key, value))
            if mask is None:
                mask = torch.zeros(1, 1, keys, dtype=query.dtype)
            mask = torch.nn.functional.pad(mask, (0, extra), value=MASKED_OUT)
        d = query.shape[-1]
        pad = pow2_dim(d) - d
        if pad:
            query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
        return fused_attention(query, key, value, scale, mask)[..., :d]


class Pow2KeysSdpaProcessor(Pow2SdpaProcessor):
    """`sdpa_pow2_keys`: Pow2SdpaProcessor with key counts padded and masked to a multiple of 64."""

    pad_keys = True


def set_attention(
    model: torch.nn.Module,
    attention: str,
    block_bytes: int | None = None,
    matmul: str = "iree",
) -> None:
    """Give every attention layer of a diffusers model the processor for an export choice
    (under `sdpa`, layers that ask for attention upcast get UpcastSdpaProcessor); block_bytes:
    `chunked`'s score block budget (export choice `attention_block_bytes`), matmul its matmuls'
    kernel (export choice `matmul_kernel`)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    processors = {
        "sdpa": AttnProcessor2_0,
        "sdpa_pow2": Pow2SdpaProcessor,
        "sdpa_pow2_keys": Pow2KeysSdpaProcessor,
        "decomposed": AttnProcessor,
        "chunked": ChunkedAttnProcessor,
        "fused_f32": FusedF32AttnProcessor,
    }
    if attention not in processors:
        raise ValueError(f"unknown attention export choice {attention!r}; one of {ATTENTIONS}")
    processor = processors[attention]
    # diffusers' own processors take no arguments; ours take the chunked block budget
    ours = issubclass(processor, ChunkedAttnProcessor)
    if matmul == "amx":
        register_amx()
        attention_amx.register()
    if attention == "fused_f32":
        attention_f32.register()
    split = is_split(model)  # export choice `amx_operands: bf16x3` (amx_matmul.set_split)
    model.set_attn_processor(processor(block_bytes, matmul, split) if ours else processor())
    if attention == "sdpa":
        from diffusers.models.attention_processor import Attention

        for module in model.modules():
            # upcast_attention only: the VAE's softmax-upcast layers keep the fused op as
            # before, so SD 1.x exports do not change
            if isinstance(module, Attention) and module.upcast_attention:
                module.set_processor(UpcastSdpaProcessor())
