"""Export choice `linear: "flat"`: every nn.Linear on an input of more than two dimensions traced
as one 2-D matmul over the flattened leading dimensions.

Traced as is, a Linear on a `[1, tokens, features]` input (the UNet's unguided batch-1 `denoise`,
the text encoders) reaches iree-compile as a batch matmul against the weight expanded to a batch
of one and transposed; IREE hoists that transpose out of the call as a constant expression, so
the module's initializer makes a second, transposed copy of nearly every linear weight and holds
both in device memory (SDXL's UNet: 4.4 GB on top of its 5.1 GB of weights, in one device
allocation larger than AMD's and Intel's Vulkan drivers allow). As one 2-D matmul the transpose
is folded into the contraction, as it already is in the guided `denoise_cfg` (whose graphs are
unchanged), and no copy is made. GPU targets use it; the cpu target packs its weights at compile
time anyway (parameter encoding) and keeps its graphs.

The choices `panels` (linear_panels.py), `amx` (linear_amx.py) and `f32` (linear_f32.py) are
bound here too.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .linear_amx import amx_forward, cast_forward, fits_linear, geglu_amx_forward, is_geglu
from .linear_f32 import f32_forward
from .linear_f32 import fits_linear as fits_f32
from .linear_f32 import geglu_forward as geglu_f32_forward
from .linear_panels import has_panels, heads_merged_inputs, panels_forward

LINEAR_CHOICES = ("native", "flat", "panels", "amx", "f32")


def _flat_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() <= 2:
        return F.linear(x, self.weight, self.bias)
    y = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def set_linear_lowering(model: torch.nn.Module, choice: str) -> int:
    """Rebind the forward of every nn.Linear in model to the lowering named choice (under
    `panels`, those with panels, and under `amx` and `f32` those whose features fit its kernel,
    and GEGLU feed-forwards as one dispatch to its GEGLU form; the others keep their own, under `amx`
    taking a bf16 input too); returns how many Linears were rebound to a lowering."""
    if choice not in LINEAR_CHOICES:
        raise ValueError(f"unknown linear lowering {choice!r}")
    count = 0
    merged_heads = heads_merged_inputs(model)
    for m in model.modules():
        if is_geglu(m):
            m.__dict__.pop("forward", None)
            if choice == "amx" and fits_linear(m.proj):
                m.forward = types.MethodType(geglu_amx_forward(m), m)
            elif choice == "f32" and fits_f32(m.proj) and m.proj.out_features % 128 == 0:
                m.forward = types.MethodType(geglu_f32_forward(m), m)
        if not isinstance(m, torch.nn.Linear):
            continue
        m.__dict__.pop("forward", None)  # the class's own forward again
        if choice == "flat":
            m.forward = types.MethodType(_flat_forward, m)
        elif choice == "panels" and has_panels(m) and id(m) not in merged_heads:
            m.forward = types.MethodType(panels_forward(m), m)
        elif choice == "amx" and fits_linear(m):
            m.forward = types.MethodType(amx_forward(m), m)
        elif choice == "amx":  # its own forward, on GEGLU's bf16 result too
            m.forward = types.MethodType(cast_forward, m)
            continue
        elif choice == "f32" and fits_f32(m):
            m.forward = types.MethodType(f32_forward(m), m)
        elif choice != "native":
            continue
        count += 1
    return count
