"""Export choice `transformer: "channels_first"`: the UNet's transformer blocks traced on
[channels, tokens] activations instead of diffusers' [batch, tokens, channels].

diffusers turns each NCHW feature map into tokens-first rows (a transpose in, another out) and
runs every linear with the activation as the matmul's left operand. On llvm-cpu with data tiling
that left operand is packed into 16-row tiles, and the elementwise op that produced it (LayerNorm,
GEGLU's gate, attention's exp) is fused into the pack; iree 3.13 vectorizes such a pack across
the tile's rows, i.e. along the strided dimension, and for bf16 (16x2 tiles) only two elements
wide (compile/NOTES.md, "bf16 on an avx512_bf16 CPU"). Channels first, every linear is `W @ X`:
the activation is the right operand, whose pack reads contiguous tokens, and the feature map
needs no transpose at all (the guided call's two images sit side by side along the tokens).

Each block computes what diffusers' BasicTransformerBlock does (layer norms over channels,
self-attention, cross-attention, GEGLU feed-forward, residuals); attention is the `chunked`
choice's maths keys-first: per head and image, scores `k^T q` of a block of queries, the
softmax's max taken over the keys, exp fused into the pack of the second matmul `[v; 1] @ e`,
whose last row is the softmax's sums. Transformers this does not cover (another norm or
activation, patches, masks) keep diffusers' forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .attention import SCORE_BLOCK_BYTES, query_block

TRANSFORMER_CHOICES = ("native", "channels_first")


def _mm(layer, x: torch.Tensor) -> torch.Tensor:
    """A Linear (or 1x1 Conv2d) on [in, tokens] -> [out, tokens]."""
    w = layer.weight
    y = torch.mm(w.reshape(w.shape[0], -1), x)
    return y if layer.bias is None else y + layer.bias[:, None]


def _layer_norm(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the channels of [channels, tokens]."""
    mean = x.mean(dim=0, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dim=0, keepdim=True)
    y = centred * torch.rsqrt(var + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight[:, None]
    if norm.bias is not None:
        y = y + norm.bias[:, None]
    return y


def keys_first_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, budget: int | None = None
) -> torch.Tensor:
    """softmax(q^T k * scale) attention for one head and image, channels first: q [d, queries],
    k and v [d, keys] -> [d, queries]; blocks of queries whose scores fit budget bytes
    (SCORE_BLOCK_BYTES)."""
    d, nq = q.shape
    keys = k.shape[1]
    qc = query_block(nq, keys, q.element_size(), budget or SCORE_BLOCK_BYTES)
    k_t = (k * scale).t()
    v1 = torch.cat([v, torch.ones_like(v[:1])], dim=0)
    cols = []
    for i in range(0, nq, qc):
        s = torch.mm(k_t, q[:, i : i + qc])  # [keys, qc]
        e = torch.exp(s - s.amax(dim=0, keepdim=True))
        r = torch.mm(v1, e)  # [d + 1, qc]
        cols.append(r[:d] / r[d:])
    return torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]


def _attention(attn, x: torch.Tensor, context: torch.Tensor, images: int) -> torch.Tensor:
    """diffusers Attention (no mask, no norms of its own) on channels-first x [dim, images*T];
    context [ctx_dim, images*Tk] (x itself for self-attention)."""
    heads = attn.heads
    q, k, v = _mm(attn.to_q, x), _mm(attn.to_k, context), _mm(attn.to_v, context)
    dtype = q.dtype
    if attn.upcast_attention or attn.upcast_softmax:
        q, k, v = q.float(), k.float(), v.float()
    d = q.shape[0] // heads
    nq, nk = q.shape[1] // images, k.shape[1] // images
    per_image = []
    for b in range(images):
        heads_out = []
        for h in range(heads):
            rows = slice(h * d, (h + 1) * d)
            qh = q[rows, b * nq : (b + 1) * nq]
            kh, vh = k[rows, b * nk : (b + 1) * nk], v[rows, b * nk : (b + 1) * nk]
            heads_out.append(keys_first_attention(qh, kh, vh, attn.scale))
        per_image.append(torch.cat(heads_out))
    out = torch.cat(per_image, dim=1) if images > 1 else per_image[0]
    return _mm(attn.to_out[0], out.to(dtype)) / attn.rescale_output_factor


def _feed_forward(ff, x: torch.Tensor) -> torch.Tensor:
    geglu, out = ff.net[0], ff.net[-1]
    hidden, gate = _mm(geglu.proj, x).chunk(2, dim=0)
    return _mm(out, hidden * F.gelu(gate))


def _block(block, x, context, images, prefix_images=None):
    """A BasicTransformerBlock on [dim, images*T]; with prefix_images, the self-attention (which
    sees only the latents, the same for guidance's two halves) runs on the first prefix_images
    images' tokens and is repeated."""
    if prefix_images:
        half = x[:, : prefix_images * (x.shape[1] // images)]
        n = _layer_norm(block.norm1, half)
        x = (half + _attention(block.attn1, n, n, prefix_images)).repeat(1, images // prefix_images)
    else:
        n = _layer_norm(block.norm1, x)
        x = x + _attention(block.attn1, n, n, images)
    if block.attn2 is not None:
        x = x + _attention(block.attn2, _layer_norm(block.norm2, x), context, images)
    return x + _feed_forward(block.ff, _layer_norm(block.norm3, x))


def _channels_first_forward(
    self, hidden_states, encoder_hidden_states=None, *args, return_dict=True, **kwargs
):
    """Transformer2DModel.forward for continuous NCHW input, channels first inside."""
    masks = [kwargs.get(n) for n in ("attention_mask", "encoder_attention_mask")]
    if any(m is not None for m in masks) or args:
        raise ValueError("the channels_first transformer export takes no attention masks")
    b, c, h, w = hidden_states.shape
    residual = hidden_states
    prefix = getattr(self, "cfg_prefix_batch", None)
    prefix = prefix if prefix and b == 2 * prefix else None
    # with a shared prefix the norm and input projection also run on the first half only
    x = hidden_states[:prefix] if prefix else hidden_states
    x = self.norm(x)
    n = x.shape[0]
    x = x.reshape(n, c, h * w).transpose(0, 1).reshape(c, n * h * w)
    x = _mm(self.proj_in, x)
    if prefix:
        x = x.repeat(1, b // n)
    context = None
    if encoder_hidden_states is not None:
        context = encoder_hidden_states.transpose(1, 2).transpose(0, 1)
        context = context.reshape(context.shape[0], -1)
    for i, block in enumerate(self.transformer_blocks):
        x = _block(
            block, x, context if block.attn2 is not None else None, b, prefix if i == 0 else None
        )
    x = _mm(self.proj_out, x)
    x = x.reshape(c, b, h * w).transpose(0, 1).reshape(b, c, h, w) + residual
    return (x,) if not return_dict else types.SimpleNamespace(sample=x)


def covered(transformer: torch.nn.Module) -> bool:
    """Whether a module is a Transformer2DModel this export reproduces."""
    if type(transformer).__name__ != "Transformer2DModel":
        return False
    if not getattr(transformer, "is_input_continuous", False):
        return False
    for block in transformer.transformer_blocks:
        if block.norm_type != "layer_norm" or block.pos_embed is not None:
            return False
        if block.only_cross_attention or getattr(block, "_chunk_size", None) is not None:
            return False
        if type(block.ff.net[0]).__name__ != "GEGLU":
            return False
        for attn in (block.attn1, block.attn2):
            if attn is None:
                continue
            if attn.residual_connection or attn.norm_cross or attn.group_norm is not None:
                return False
            if attn.spatial_norm is not None or getattr(attn, "norm_q", None) is not None:
                return False
        if block.attn1.is_cross_attention:
            return False
    return True


def set_transformer_layout(model: torch.nn.Module, choice: str) -> int:
    """Rebind the forward of every covered Transformer2DModel in model for choice; returns how
    many ("native" restores diffusers' own)."""
    if choice not in TRANSFORMER_CHOICES:
        raise ValueError(
            f"unknown transformer export choice {choice!r}; one of {TRANSFORMER_CHOICES}"
        )
    count = 0
    for m in model.modules():
        if covered(m):
            if choice == "channels_first":
                m.forward = types.MethodType(_channels_first_forward, m)
                m.channels_first = True
            else:
                m.__dict__.pop("forward", None)
                m.__dict__.pop("channels_first", None)
            count += 1
    return count
