"""The `conv` export choice: which lowering every Conv2d of a model is traced with.

IREE's llvm-cpu backend data-tiles plain matmuls onto its mmt4d ukernels (~2x the throughput of
its direct NCHW convolutions on this kind of CPU), but it does not data-tile convolutions, nor
the batched matmul-like ops its own im2col rewrite produces. So for cpu the exporter states each
convolution as matmuls itself: "matmul" is im2col (im2col.py); "winograd" and "winograd4" turn
3x3 stride-1 convolutions into Winograd F(2x2,3x3) or F(4x4,3x3) matmuls over output tiles
(winograd.py) and the rest into im2col. What is left to do with weights inside the module
(transposes, data-tiling packs) is hoisted by IREE and, for targets with `encode_parameters`,
computed at compile time. This module binds the lowerings to the convs, and picks each conv's
Winograd tile from the size of its input.
"""

from __future__ import annotations

import functools
import types

import torch

from . import winograd_f32
from .amx_matmul import register as register_amx
from .conv_amx import MIN_WIDTH, conv3x3_amx, conv3x3_amx_nhwc, fits_conv
from .conv_amx import register as register_conv_amx
from .fhwc import DERIVED_TAG as FHWC_TAG
from .fhwc import add_fhwc_weights, conv_on_fhwc_filter
from .im2col import conv2d_as_matmul, conv2d_as_matmul_nhwc, supported
from .linear_f32 import register as register_f32
from .winograd import (
    WINOGRAD_OUTPUTS,
    WINOGRAD_TILES,
    add_winograd_weights,
    conv2d_winograd,
    conv2d_winograd_nhwc,
    derived_tag,
)
from .winograd_fused import WINOGRAD_KERNELS, fuse_winograd

# Each conv given a lowering also gets its channels-last form, [N, H, W, C] in and out, under
# this attribute (exporters that keep activations channels-last call it: vae_channels_last.py).
CHANNELS_LAST_FORWARD = "forward_channels_last"

# "native": torch's Conv2d as traced; "matmul": im2col + matmul; "winograd": Winograd F(2x2,3x3)
# for 3x3 stride-1 convs on even sizes (2.25x fewer multiplies), im2col + matmul for the rest.
# Its transformed weights are 16/9 the size of the originals. Packing them is hoisted to load
# time only under a raised --iree-opt-const-expr-max-size-increase-threshold.
# "winograd4": F(4x4,3x3) on sizes divisible by 4: 4x fewer multiplies and a smaller transformed
# input (36/16 of the input instead of 16/4), for ~3x the rounding error and weights 36/9 the
# size: worth it where activations outweigh weights (the VAE at 512x512: decode 38 -> 26 s).
# "pointwise_einsum": 1x1 stride-1 convs as einsum("oc,nchw->nohw") with the weight as the first
# operand, the rest native. iree 3.13's cuda fp16 (tensor core) codegen gets a contraction wrong
# when its first operand holds the output's inner dimension, which is how IREE itself rewrites a
# 1x1 NCHW conv (rel error ~1.3 on an H100); the weight-first einsum keeps the right order.
# "pointwise_einsum_fhwc": the same, every other conv on its filter stored channels-last, a
# derived parameter (fhwc.py): for targets that compile convs channels-last (cuda's UNet).
CONV_CHOICES = (
    "native",
    "matmul",
    "winograd",
    "winograd4",
    "pointwise_einsum",
    "pointwise_einsum_fhwc",
)


def conv1x1_as_einsum(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A 1x1, stride-1, unpadded convolution as a weight-first channel contraction."""
    if tuple(conv.kernel_size) != (1, 1) or tuple(conv.stride) != (1, 1) or any(conv.padding):
        return torch.nn.Conv2d.forward(conv, x)
    y = torch.einsum("oc,nchw->nohw", conv.weight[:, :, 0, 0], x)
    if conv.bias is not None:
        y = y + conv.bias[:, None, None]
    return y


# The non-Winograd lowerings; a Winograd choice's convs take conv2d_winograd with their tile.
LOWERINGS = {
    "matmul": conv2d_as_matmul,
    "pointwise_einsum": conv1x1_as_einsum,
    "pointwise_einsum_fhwc": conv_on_fhwc_filter,
}


def convs_as_matmuls(
    model: torch.nn.Module,
    conv: str = "matmul",
    tiles=None,
    winograd_output: str = "batched",
    split_min_side: int | None = None,
    matmul_kernel: str = "iree",
    direct: set | frozenset = frozenset(),
) -> int:
    """Rebind the forward of every supported Conv2d in `model` to the lowering named conv;
    returns how many. tiles ({conv: m}) picks a Winograd conv's own tile size; winograd_output,
    split_min_side and matmul_kernel (as its `matmul`) are conv2d_winograd's; the convs in
    direct take the AMX conv kernel (conv_amx.py)."""
    if matmul_kernel == "amx":
        register_amx()
    if matmul_kernel == "f32":
        register_f32()
    if direct:
        register_conv_amx()
    forward = LOWERINGS.get(conv)
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and supported(m):
            tile = (tiles or {}).get(m, WINOGRAD_TILES.get(conv))
            channels_last = None
            if m in direct:
                lowering, channels_last = conv3x3_amx, conv3x3_amx_nhwc
            elif tile == 0 or (tile is None and forward is conv2d_as_matmul):
                lowering = functools.partial(conv2d_as_matmul, matmul=matmul_kernel)
                channels_last = functools.partial(conv2d_as_matmul_nhwc, matmul=matmul_kernel)
            elif tile is None:
                lowering = forward
            else:
                kw = {
                    "m": tile,
                    "output": winograd_output,
                    "split_min_side": split_min_side,
                    "matmul": matmul_kernel,
                }
                lowering = functools.partial(conv2d_winograd, **kw)
                channels_last = functools.partial(conv2d_winograd_nhwc, **kw)
            m.forward = types.MethodType(lowering, m)
            if channels_last is not None:
                setattr(m, CHANNELS_LAST_FORWARD, types.MethodType(channels_last, m))
            count += 1
    return count


def conv_input_sides(model: torch.nn.Module, run) -> dict[torch.nn.Conv2d, int]:
    """The smaller spatial side of the input each Conv2d of model gets in run(), a forward of
    model on inputs it makes itself; run on fake tensors, so nothing is computed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sides = {}

    def record(mod, args):
        sides[mod] = min(args[0].shape[-2:])

    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    hooks = [m.register_forward_pre_hook(record) for m in convs]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return sides


def tiles_by_side(
    sides: dict, small: int, large: int, min_side: int | None, plain_max_side: int = 0
) -> dict:
    """{conv: tile}: the large tile where the conv's input side is at least min_side, none (0:
    a plain im2col matmul) where it is at most plain_max_side, the small one between. Large
    inputs are where a bigger tile pays: its saving grows with the activations, while its cost
    (transformed weights (m+2)^2/9 the 3x3 weights) does not; on the smallest inputs even
    F(2x2)'s 16/9 is more weight memory than its multiplies save."""

    def tile(side: int) -> int:
        if side <= plain_max_side:
            return 0
        return large if min_side is not None and side >= min_side else small

    return {conv: tile(side) for conv, side in sides.items()}


# export choice `direct_convs` (the UNet's, under `matmul_kernel: amx`): `wide`, the 3x3 convs
# direct_convs() picks on the direct conv kernel; `none`, every 3x3 conv Winograd, its products on
# the matmul kernel (fewer products: where they are dear, on vdpbf16ps without AMX)
DIRECT_CONVS = ("wide", "none")


def direct_convs(model: torch.nn.Module, sides: dict | None = None) -> set:
    """The convs of model that take the AMX conv kernel under `matmul_kernel: amx`: those it
    fits whose input side (sides: {conv: side}, from conv_input_sides) is at least MIN_WIDTH;
    none without sides."""
    sides = sides or {}
    return {m for m in model.modules() if fits_conv(m) and sides.get(m, 0) >= MIN_WIDTH}


def set_conv_lowering(
    model: torch.nn.Module,
    conv: str,
    tiles: dict[torch.nn.Conv2d, int] | None = None,
    winograd_output: str = "batched",
    split_min_side: int | None = None,
    matmul_kernel: str = "iree",
    sides: dict | None = None,
    direct_choice: str = "wide",
    winograd_kernel: str = "none",
) -> str | None:
    """Apply the target's `export.conv` choice to every Conv2d of model, with tiles ({conv:
    m}, Winograd choices only) overriding the choice's tile per conv; winograd_output and
    split_min_side and matmul_kernel (export choices `winograd_output`,
    `winograd_split_min_side`, `matmul_kernel`) are conv2d_winograd's. Under `matmul_kernel:
    amx` the 3x3 convs of direct_convs(model, sides) take the AMX conv kernel instead, with no
    transformed weight, unless direct_choice (export choice `direct_convs`) is `none`; with
    winograd_kernel (export choice `winograd_kernel`) `fused` the F(2x2) Winograd convs take
    sdiree's fused Winograd kernels where they fit (winograd_fused.py; under `matmul_kernel:
    f32` the fp32 ones, winograd_f32.py). Returns a tag naming the
    derived parameters it added (None when it added none)."""
    if conv not in CONV_CHOICES:
        raise ValueError(f"export conv choice must be one of {CONV_CHOICES}, not {conv!r}")
    if winograd_output not in WINOGRAD_OUTPUTS:
        raise ValueError(
            f"export winograd_output choice must be one of {WINOGRAD_OUTPUTS}, "
            f"not {winograd_output!r}"
        )
    m = WINOGRAD_TILES.get(conv)
    if tiles and not m:
        raise ValueError(f"per-conv Winograd tiles need a Winograd conv choice, not {conv!r}")
    if conv == "native":
        return None
    if direct_choice not in DIRECT_CONVS:
        raise ValueError(f"export direct_convs choice must be one of {DIRECT_CONVS}")
    if winograd_kernel not in WINOGRAD_KERNELS:
        raise ValueError(f"export winograd_kernel choice must be one of {WINOGRAD_KERNELS}")
    wide = matmul_kernel == "amx" and direct_choice == "wide"
    direct = direct_convs(model, sides) if wide else set()
    if direct and m:
        tiles = {**(tiles or {}), **{c: 0 for c in direct}}  # no transformed weight
    convs_as_matmuls(model, conv, tiles, winograd_output, split_min_side, matmul_kernel, direct)
    if winograd_kernel == "fused" and matmul_kernel == "amx" and m:
        fuse_winograd(model, tiles, m, direct)
    if winograd_kernel == "fused" and matmul_kernel == "f32" and m:
        winograd_f32.fuse(model, tiles, m)
    if conv == "pointwise_einsum_fhwc":
        return FHWC_TAG if add_fhwc_weights(model) else None
    return derived_tag(add_winograd_weights(model, m, tiles), whole=not direct) if m else None
