"""Winograd F(m x m, 3x3) convolutions as matmuls (export choices `winograd`, `winograd4`),
and the transformed weights they read.

A 3x3, stride-1, padding-1 Conv2d becomes (m+2)^2 matmuls over the input's m x m output tiles:
F(2x2,3x3) does 2.25x fewer multiplies than im2col, F(4x4,3x3) 4x fewer. Each such conv gets its
transformed weight as a parameter of its own (`<conv>.weight_winograd`, [(m+2)^2, C, O], computed
in float64), saved to a separate archive; the runtime recomputes it from the conv's weight for
weight files and LoRAs (runtime/weights/winograd.py).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F

from sdiree.runtime.weights.winograd import WINOGRAD, WINOGRAD_PARAM

from ..placeholders import is_placeholder, mark, placeholder
from . import linear_f32, winograd_f32, winograd_fused
from .amx_matmul import (
    fits_padded,
    is_split,
    operand,
    pack_b,
    padded_matmul,
    weight_operand,
)
from .im2col import conv2d_as_matmul_nhwc, supported

# The Winograd choices and their output tile size m of F(m x m, 3x3).
WINOGRAD_TILES = {"winograd": 2, "winograd4": 4}

WINOGRAD_TILE = WINOGRAD_TILES["winograd"]
# Export choice `winograd_output`: how a Winograd conv's products are transformed back:
# "batched" (stacked into one tensor first) or "interleaved" (F(2x2) only; faster at the UNet's
# sizes, see _inverse_interleaved).
WINOGRAD_OUTPUTS = ("batched", "interleaved")
MATMUL_KERNELS = ("iree", "amx", "f32")  # the split products' kernel: _product


def _combine(coeffs, terms):
    """sum(c * t) over the nonzero integer coefficients; +-1 become adds and subtracts."""
    out = None
    for c, t in zip(coeffs, terms, strict=True):
        if c == 0:
            continue
        if out is None:
            out = t if c == 1 else (-t if c == -1 else t * c)
        else:
            out = out + t if c == 1 else (out - t if c == -1 else out + t * c)
    return out


def _winograd_kernel(conv: torch.nn.Conv2d) -> bool:
    """3x3, stride 1, padding 1: the convolutions Winograd F(m x m, 3x3) computes."""
    return (
        tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and tuple(conv.padding) == (1, 1)
    )


def winograd_applies(conv: torch.nn.Conv2d, x: torch.Tensor, m: int = WINOGRAD_TILE) -> bool:
    return _winograd_kernel(conv) and x.shape[2] % m == 0 and x.shape[3] % m == 0


def winograd_weight(weight: torch.Tensor, m: int = WINOGRAD_TILE) -> torch.Tensor:
    """G g G^T for every (output, input) channel pair of a 3x3 weight: [(m+2)^2, C, O]."""
    t = m + 2
    g = torch.tensor(WINOGRAD[m][1], dtype=weight.dtype, device=weight.device)
    o, c = weight.shape[:2]
    return torch.einsum("xa,ocab,yb->xyco", g, weight, g).reshape(t * t, c, o)


def conv2d_winograd(
    conv: torch.nn.Conv2d,
    x: torch.Tensor,
    m: int = WINOGRAD_TILE,
    output: str = "batched",
    split_min_side: int | None = None,
    matmul: str = "iree",
):
    """A 3x3, stride 1, padding 1 convolution as Winograd F(m x m, 3x3): (m+2)^2 matmuls over
    the tiles; anything else falls back to conv2d_as_matmul. Where the input's side is at least
    split_min_side (export choice `winograd_split_min_side`) they are one matmul per tile
    element, their products transformed back as output (WINOGRAD_OUTPUTS) says; elsewhere one
    batched matmul (see _winograd_batched). matmul (export choice `matmul_kernel`) `amx` sends
    the split products that fit it to sdiree's AMX kernel (amx_matmul.py), `f32` to sdiree's
    fp32 FMA kernel (linear_f32.py)."""
    xh = x.permute(0, 2, 3, 1)  # conv2d_as_matmul's own first step where Winograd does not apply
    return conv2d_winograd_nhwc(conv, xh, m, output, split_min_side, matmul).permute(0, 3, 1, 2)


def conv2d_winograd_nhwc(
    conv: torch.nn.Conv2d,
    xh: torch.Tensor,
    m: int = WINOGRAD_TILE,
    output: str = "batched",
    split_min_side: int | None = None,
    matmul: str = "iree",
):
    """conv2d_winograd on a channels-last input [N, H, W, C], its output channels-last too."""
    n, h, w, c = xh.shape
    if not (_winograd_kernel(conv) and h % m == 0 and w % m == 0):
        return conv2d_as_matmul_nhwc(conv, xh, matmul)
    if m == 2 and winograd_fused.takes(conv, xh.shape):
        return winograd_fused.conv3x3_wino_nhwc(conv, xh)
    if m == 2 and winograd_f32.takes(conv, xh.shape, xh.dtype):
        return winograd_f32.conv3x3_nhwc(conv, xh)
    u = getattr(conv, WINOGRAD_PARAM, None)
    if u is None:
        u = winograd_weight(conv.weight, m)
    xp = F.pad(xh, (0, 0, 1, 1, 1, 1))  # [N, H+2, W+2, C]
    th, tw = h // m, w // m
    shape = (n, th, tw, u.shape[-1])
    if matmul == "amx" and is_split(conv):
        matmul = SPLIT_AMX
    if split_min_side is not None and min(h, w) >= split_min_side:
        prods = _winograd_products(xp, u, m, th, tw, matmul)
        if output == "interleaved" and m == 2:
            y = _inverse_interleaved(prods, m, shape)
        else:
            y = _inverse_batched(torch.stack(prods), m, shape)
    else:
        y = _inverse_batched(_winograd_batched(xp, u, m, th, tw, matmul), m, shape)
    if conv.bias is not None:
        y = y + conv.bias
    return y


def _winograd_batched(
    xp: torch.Tensor, u: torch.Tensor, m: int, th: int, tw: int, matmul: str = "iree"
):
    """All (m+2)^2 products M_rs = V_rs @ U_rs as one batched matmul over the stacked V_rs:
    [(m+2)^2, N·th·tw, O]. Each conv is a few dispatches (its compile, and its weight's
    encoding at compile time, cost what one conv's should); but the stacks are whole-tensor
    copies, and a bf16 conversion of them is packed element by element (compile/NOTES.md).
    Under `amx` the batch is one dispatch to sdiree's AMX kernel where it fits (_product)."""
    bt = WINOGRAD[m][0]
    t = m + 2
    n, c = xp.shape[0], xp.shape[-1]
    # B^T d B over all tiles at once, one axis at a time on whole tensors (few traced ops: the
    # export's time grows with their number). Input row i of every tile row: [N, th, W+2, C].
    rows = [xp[:, i : i + m * th : m] for i in range(t)]
    bd = torch.stack([_combine(bt[r], rows) for r in range(t)])
    cols = [bd[:, :, :, j : j + m * tw : m] for j in range(t)]  # [t(r), N, th, tw, C]
    v = torch.stack([_combine(bt[s], cols) for s in range(t)], dim=1)  # [t(r), t(s), N, th, tw, C]
    return _product(v.reshape(t * t, n * th * tw, c), u, matmul)


def _winograd_products(
    xp: torch.Tensor, u: torch.Tensor, m: int, th: int, tw: int, matmul: str = "iree"
) -> list:
    """M_rs = V_rs @ U_rs for every tile element (r, s), r-major: [N·th·tw, O] each, where
    V_rs = (B^T d B)_rs of every tile d of the padded channels-last input xp. Each V_rs is an
    elementwise op on strided slices of one row transform, which iree fuses into the packing
    of its matmul's operand (with bf16 operands, the conversion too). One batched matmul
    needed all V_rs stacked first: whole-tensor copies, and a bf16 conversion iree flattened to
    1-D and packed element by element (one 320-channel 64² conv, batch 2: bf16 101 -> 41 ms;
    tools/PERFORMANCE.md, nineteenth session)."""
    bt = WINOGRAD[m][0]
    t = m + 2
    n, c = xp.shape[0], xp.shape[-1]
    rows = [xp[:, i : i + m * th : m] for i in range(t)]  # tile row i: [N, th, W+2, C]
    prods = []
    for r in range(t):
        bd = _combine(bt[r], rows)
        cols = [bd[:, :, j : j + m * tw : m] for j in range(t)]
        for s in range(t):
            v = _combine(bt[s], cols)
            prods.append(_product(v.reshape(n * th * tw, c), u[r * t + s], matmul))
    return prods


# `matmul` of the products of a conv marked for `amx_operands: bf16x3` (amx_matmul.set_split)
SPLIT_AMX = "amx_split"


def _product(v: torch.Tensor, u: torch.Tensor, matmul: str) -> torch.Tensor:
    """V_rs @ U_rs ([M, C] @ [C, O], or a batch of them); under `amx`, on sdiree's AMX kernel
    where it fits (bf16 operands, U_rs packed for the kernel: a constant expression of the
    transformed weight, which the parameter encoder computes at compile)."""
    if matmul in ("amx", SPLIT_AMX) and fits_padded(v.shape[-2], u.shape[-1], u.shape[-2]):
        split = matmul == SPLIT_AMX
        packed = pack_b(weight_operand(u.transpose(-1, -2), split))
        return padded_matmul(operand(v, split), packed, split)
    if matmul == "f32" and linear_f32.fits_matmul(v, u):
        return linear_f32.f32_matmul(v, u)
    return torch.mm(v, u) if v.dim() == 2 else torch.bmm(v, u)


def _inverse_interleaved(prods: list, m: int, shape: tuple) -> torch.Tensor:
    """A^T M A by columns then rows on the separate products, the m x m outputs of each tile
    interleaved into the image: no op reads more than m+2 products. The faster inverse at the
    UNet's sizes (one 320-channel 64² conv: bf16 49.5 -> 41 ms, fp32 68.5 -> 55 ms against
    stacking the outputs first); F(2x2) only (F(4x4)'s overran llvm-cpu's 32 KiB stack limit),
    and not for the VAE (its resnets' residual adds, fused with a 1x1 shortcut's matmul,
    overran it too)."""
    at = WINOGRAD[m][2]
    t = m + 2
    n, th, tw, o = shape
    half = [[_combine(at[b], prods[r * t : (r + 1) * t]) for b in range(m)] for r in range(t)]
    y = torch.stack(
        [
            torch.stack(
                [_combine(at[a], [h[b] for h in half]).reshape(n, th, tw, o) for b in range(m)],
                dim=3,
            )
            for a in range(m)
        ],
        dim=2,
    )  # [N, th, m(a), tw, m(b), O]: output pixel (m*ty + a, m*tx + b)
    return y.reshape(n, th * m, tw * m, o)


def _inverse_batched(prods: torch.Tensor, m: int, shape: tuple) -> torch.Tensor:
    """A^T M A on the products as one [(m+2)^2, N·th·tw, O] tensor, over the tile columns s,
    then the rows r, whole tensors at a time."""
    at = WINOGRAD[m][2]
    t = m + 2
    n, th, tw, o = shape
    prod = prods.reshape(t, t, n, th, tw, o)
    by_col = [prod[:, s] for s in range(t)]
    half = torch.stack([_combine(at[b], by_col) for b in range(m)], dim=1)  # [t(r), m(b), ...]
    by_row = [half[r] for r in range(t)]
    y = torch.stack([_combine(at[a], by_row) for a in range(m)])  # [m(a), m(b), N, th, tw, O]
    # y[a][b][n, ty, tx, o] is output pixel (m*ty + a, m*tx + b)
    return y.permute(2, 3, 0, 4, 1, 5).reshape(n, th * m, tw * m, o)


def _eligible_3x3(mod) -> bool:
    return isinstance(mod, torch.nn.Conv2d) and supported(mod) and _winograd_kernel(mod)


def add_winograd_weights(model: torch.nn.Module, m: int = WINOGRAD_TILE, tiles=None) -> dict:
    """Give every 3x3, stride-1, padding-1 Conv2d of model its transformed weight as a parameter
    of its own (`<conv>.weight_winograd`), computed here in float64 from the original, for
    tile m or the conv's own in tiles. Returns {conv name: tile} of the convs that have one."""
    out = {}
    for name, mod in model.named_modules():
        if not _eligible_3x3(mod):
            continue
        tile = (tiles or {}).get(mod, m)
        if tile == 0:  # this conv runs as a plain matmul: no transformed weight
            continue
        have = getattr(mod, WINOGRAD_PARAM, None)
        if have is not None and have.shape[0] != (tile + 2) ** 2:
            # The VAE's decoder and encoder share one model and one derived-weights archive.
            had = round(have.shape[0] ** 0.5) - 2
            raise ValueError(
                f"this model already has Winograd F({had}x{had},3x3) weights, not "
                f"F({tile}x{tile},3x3): give submodules that share weights the same export "
                "conv choice"
            )
        if have is None:  # else a second plan on the same model (the VAE's)
            mod.register_parameter(WINOGRAD_PARAM, _winograd_parameter(mod.weight, tile))
        out[name] = tile
    return out


def _winograd_parameter(weight: torch.nn.Parameter, tile: int) -> torch.nn.Parameter:
    """The transformed weight of a 3x3 conv weight; a placeholder of its shape when the weight
    is one (the archive computes it from the model's files: `derived_weight_maker`)."""
    if is_placeholder(weight):
        o, c = weight.shape[:2]
        u = placeholder(((tile + 2) ** 2, c, o), weight.dtype)
        return mark(torch.nn.Parameter(u, requires_grad=False))
    with torch.no_grad():
        u = _derive(weight.detach(), tile)
    return torch.nn.Parameter(u, requires_grad=False)


def _derive(weight: torch.Tensor, tile: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The transformed weight, computed in float64 and rounded once, to dtype (default: the
    weight's)."""
    return winograd_weight(weight.double(), tile).to(dtype or weight.dtype)


def derived_weight_maker(name: str, shape: tuple[int, ...], dtype: torch.dtype, source):
    """A function computing derived parameter name (of shape, in dtype) from the conv weight
    as the model's files hold it: in float64, rounded once to dtype, so an fp16 file compiled in
    fp32 gets fp32-exact transformed weights (on a model loaded in dtype `add_winograd_weights`
    computes the same)."""
    conv_weight = name[: -len(WINOGRAD_PARAM)] + "weight"
    tile = round(shape[0] ** 0.5) - 2
    if (tile + 2) ** 2 != shape[0] or tile not in WINOGRAD:
        raise ValueError(f"{name}: shape {shape} is no Winograd weight")

    def make() -> torch.Tensor:
        with torch.no_grad():
            return _derive(source.tensor(conv_weight), tile, dtype)

    return make


def derived_tag(tiles_by_name: dict[str, int], whole: bool = True) -> str | None:
    """The name of a derived-weights archive: `winograd<m>` when every conv has tile m, else
    the tiles and a digest of which conv has which (archives are reused by name, and the same
    rule gives other convs other tiles at another image size); with the digest too where not
    every eligible conv has one (whole False: the AMX conv kernel took some)."""
    used = sorted(set(tiles_by_name.values()))
    if not used:
        return None
    if len(used) == 1 and whole:
        return f"winograd{used[0]}"
    digest = hashlib.sha256(json.dumps(sorted(tiles_by_name.items())).encode()).hexdigest()
    return f"winograd{'+'.join(map(str, used))}-{digest[:8]}"
