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
self-attention, cross-attention, GEGLU feed-forward, residuals). Attention alone stays tokens
first, computed as the attention export choice says (cpu: `chunked`): channels first, every
scores matmul would contract over the rows of both q and k, so one of them would be a
transposed view, which iree 3.13 packs into a stack buffer inside the matmul's dispatch (over
the 32 KiB limit at SD sizes) and ran 2x slower (compile/NOTES.md). q, k and v are projected
from the activation's transposed view, the attention's output projected back channels first.
Transformers this does not cover (another norm or activation, patches, masks) keep diffusers'
forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .attention import fused_attention

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


def _attend(attn, q, k, v):
    """Attention on [batch*heads, tokens, dim] as the layer's export choice computes it (set by
    set_attention before this export: `chunked`, `sdpa_pow2*` and the upcast `sdpa` processors
    say how; diffusers' own `sdpa` and `decomposed` processors are the fused op and
    matmul-softmax-matmul)."""
    attend = getattr(attn.processor, "attend", None)
    if attend is not None:
        return attend(q, k, v, attn.scale, None)
    if type(attn.processor).__name__ == "AttnProcessor2_0":
        return fused_attention(q, k, v, attn.scale, None)
    return torch.bmm(q, k.transpose(1, 2)).mul(attn.scale).softmax(dim=-1).bmm(v)


def _attention(attn, x, context_tokens, images):
    """diffusers Attention on channels-first x [dim, images*T], tokens first inside: q, k, v
    projected from x's transposed view (and from context_tokens [images*Tk, ctx_dim] for
    cross-attention), attention per head as the attention export choice computes it, the output
    projected back to channels first."""
    heads = attn.heads
    xt = x.t()
    ctx = xt if context_tokens is None else context_tokens
    q, k, v = attn.to_q(xt), attn.to_k(ctx), attn.to_v(ctx)
    dtype = q.dtype
    if attn.upcast_attention or attn.upcast_softmax:
        q, k, v = q.float(), k.float(), v.float()
    d = q.shape[1] // heads

    def per_head(t):  # [images*T, heads*d] -> [images*heads, T, d]
        return t.reshape(images, -1, heads, d).permute(0, 2, 1, 3).reshape(images * heads, -1, d)

    out = _attend(attn, per_head(q), per_head(k), per_head(v))
    out = out.reshape(images, heads, -1, d).permute(0, 2, 1, 3).reshape(-1, heads * d)
    return _mm(attn.to_out[0], out.to(dtype).t()) / attn.rescale_output_factor


def _feed_forward(ff, x: torch.Tensor) -> torch.Tensor:
    geglu, out = ff.net[0], ff.net[-1]
    hidden, gate = _mm(geglu.proj, x).chunk(2, dim=0)
    return _mm(out, hidden * F.gelu(gate))


def _block(block, x, context_tokens, images, prefix_images=None):
    """A BasicTransformerBlock on [dim, images*T]; with prefix_images, x holds only the first
    prefix_images images' tokens (guidance's halves share them), the self-attention runs on
    those, and its result is repeated to all `images`. (x is not a slice of a repeated tensor:
    iree 3.13 fails to vectorize a residual add on such a slice in the data-tiled layout.)"""
    if prefix_images:
        n = _layer_norm(block.norm1, x)
        x = (x + _attention(block.attn1, n, None, prefix_images)).repeat(1, images // prefix_images)
    else:
        x = x + _attention(block.attn1, _layer_norm(block.norm1, x), None, images)
    if block.attn2 is not None:
        n = _layer_norm(block.norm2, x)
        x = x + _attention(block.attn2, n, context_tokens, images)
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
    context_tokens = None
    if encoder_hidden_states is not None:
        context_tokens = encoder_hidden_states.reshape(-1, encoder_hidden_states.shape[-1])
    for i, block in enumerate(self.transformer_blocks):
        # with a shared prefix x holds the first half's tokens until the first block repeats it
        shared = prefix if i == 0 else None
        x = _block(block, x, context_tokens, b, shared)
    x = _mm(self.proj_out, x)
    x = x.reshape(-1, b, h * w).transpose(0, 1).reshape(b, -1, h, w) + residual
    if not return_dict:
        return (x,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=x)


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
