"""Export choice `linear: "amx"`: every nn.Linear whose matmul fits sdiree's AMX kernel traced as
a dispatch to it (amx_matmul.py), its input cast to bf16 and its weight packed for the kernel.

For the cpu target's bf16 on CPUs with AMX (specs/targets.json `if_cpu_has.amx_bf16`). The
packing and cast of the weight are a constant expression of the parameter: iree's parameter
encoder computes them at compile, so the module reads the packed bf16 weight from the encoded
archive, as it reads its data-tiled packs. Linears whose sizes do not fit (a token count not a
multiple of 32, as the text's 77 tokens) keep their own forward, and iree's bf16 path.

A GEGLU feed-forward (diffusers' `proj` to value and gate halves, `value * gelu(gate)`) is one
dispatch to the kernel's GEGLU form (geglu_amx.py), which keeps both halves in the workgroup and
writes only the bf16 result, which the next linear takes as is: on the whole projection, iree added the bias in a pass of its own
over the [tokens, 2 x inner] f32 result, then GELU and product in another (SD 1.5's 64x64 level:
~250 MB of memory traffic a block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .amx_matmul import (
    MULTIPLE,
    fits,
    fits_padded,
    from_operand,
    is_split,
    operand,
    pack_b,
    padded_matmul,
    register,
    weight_operand,
)
from .geglu_amx import amx_geglu
from .geglu_amx import register as register_geglu


def fits_linear(linear: torch.nn.Linear) -> bool:
    """Whether any input could take linear to the kernel (its features fit)."""
    return fits(MULTIPLE, linear.out_features, linear.in_features)


def amx_forward(linear: torch.nn.Linear):
    """The forward to bind to linear under `amx` (the kernel's op registered)."""
    register()
    return _amx_forward


def _amx_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    # rows padded to the kernel's multiple (the text's 2 x 77 tokens, the cross-attention keys
    # and values: 154 -> 160; iree's bf16 matmul took 2.3 ms for SD 1.5's 1280-wide ones)
    split = is_split(self)
    if not fits_padded(x2.shape[0], self.out_features, self.in_features):
        return cast_forward(self, x)
    # the bias in the kernel's accumulators: iree added it in a pass of its own over the f32
    # result (fused with a residual add after it where there is one)
    w = pack_b(weight_operand(self.weight, split))
    y = padded_matmul(operand(x2, split), w, split, self.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def casts_input(module: torch.nn.Module) -> bool:
    """Whether module's forward takes a bf16 input as it is or casts it itself: a Linear on the
    kernel, or with cast_forward."""
    forward = getattr(getattr(module, "forward", None), "__func__", None)
    return forward in (_amx_forward, cast_forward)


def cast_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The Linear's own forward on x cast to its weight's dtype (a GEGLU's bf16 result: with
    `amx_operands: bf16x3` its hi and lo parts summed)."""
    if x.dtype == torch.bfloat16:
        x = from_operand(x, is_split(self))
    return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def geglu_amx_forward(geglu: torch.nn.Module):
    """The forward to bind to a GEGLU under `amx` (the kernel's ops registered)."""
    register()
    register_geglu()
    return geglu_forward


def is_geglu(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "GEGLU" and isinstance(
        getattr(module, "proj", None), torch.nn.Linear
    )


def geglu_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """diffusers GEGLU's forward as one dispatch to the kernel's GEGLU form (where the rows fit;
    else the projection's own forward, then the chunk)."""
    proj = self.proj
    x2 = x.reshape(-1, x.shape[-1])
    inner = proj.out_features // 2
    if not (fits(x2.shape[0], inner, proj.in_features) and fits_linear(proj)):
        value, gate = proj(x).chunk(2, dim=-1)
        return value * F.gelu(gate)
    # bf16, as the kernel writes it: the next linear takes it as is (cast to float here, iree
    # kept the cast and the linear's cast back as a pass of their own: 44 ms of SD 1.5's call)
    y = amx_geglu(x2, proj.weight, proj.bias, is_split(self))
    return y.reshape(*x.shape[:-1], y.shape[-1])
