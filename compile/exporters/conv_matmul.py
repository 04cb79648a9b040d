"""Export choices `conv: "matmul"`, `"winograd"` and `"winograd4"`: every Conv2d traced as matmuls.

IREE's llvm-cpu backend data-tiles plain matmuls onto its mmt4d ukernels (~2x the throughput of
its direct NCHW convolutions on this kind of CPU), but it does not data-tile convolutions, nor
the batched matmul-like ops its own im2col rewrite produces. So for cpu the exporter states each
convolution as matmuls itself: "matmul" is channels-last im2col, [N·OH·OW, KH·KW·C] @
[KH·KW·C, O]; "winograd" turns 3x3 stride-1 convolutions into Winograd F(2x2,3x3) (16 batched
matmuls over 2x2 output tiles, 2.25x fewer multiplies) and the rest into im2col; "winograd4"
does the same with F(4x4,3x3) (36 batched matmuls over 4x4 tiles, 4x fewer multiplies). The model's
weights keep their parameter names; each Winograd conv also gets its transformed weight as a
parameter of its own (`<conv>.weight_winograd`, computed here in float64), saved to a separate
archive. What is left to do with weights inside the module (transposes, data-tiling packs) is
hoisted by IREE and, for targets with `encode_parameters`, computed at compile time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import types

import torch
import torch.nn.functional as F

from sdiree.runtime.weights.winograd import WINOGRAD, WINOGRAD_PARAM

from ..placeholders import is_placeholder, mark, placeholder

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
CONV_CHOICES = ("native", "matmul", "winograd", "winograd4", "pointwise_einsum")
# The Winograd choices and their output tile size m of F(m x m, 3x3).
WINOGRAD_TILES = {"winograd": 2, "winograd4": 4}

WINOGRAD_TILE = WINOGRAD_TILES["winograd"]
# Export choice `winograd_output`: how a Winograd conv's products are transformed back:
# "batched" (stacked into one tensor first) or "interleaved" (F(2x2) only; faster at the UNet's
# sizes, see _inverse_interleaved).
WINOGRAD_OUTPUTS = ("batched", "interleaved")


def conv2d_as_matmul(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    o, _, kh, kw = conv.weight.shape
    sh, sw = conv.stride
    ph, pw = conv.padding
    oh = (h + 2 * ph - kh) // sh + 1
    ow = (w + 2 * pw - kw) // sw + 1
    xh = x.permute(0, 2, 3, 1)
    if ph or pw:
        xh = F.pad(xh, (0, 0, pw, pw, ph, ph))
    windows = [
        xh[:, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    cols = torch.cat(windows, dim=-1) if len(windows) > 1 else windows[0]
    weight = conv.weight.permute(2, 3, 1, 0).reshape(kh * kw * c, o)
    out = torch.mm(cols.reshape(n * oh * ow, kh * kw * c), weight)
    if conv.bias is not None:
        out = out + conv.bias
    return out.reshape(n, oh, ow, o).permute(0, 3, 1, 2)


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
):
    """A 3x3, stride 1, padding 1 convolution as Winograd F(m x m, 3x3): (m+2)^2 matmuls over
    the tiles; anything else falls back to conv2d_as_matmul. Where the input's side is at least
    split_min_side (export choice `winograd_split_min_side`) they are one matmul per tile
    element, their products transformed back as output (WINOGRAD_OUTPUTS) says; elsewhere one
    batched matmul (see _winograd_batched)."""
    if not winograd_applies(conv, x, m):
        return conv2d_as_matmul(conv, x)
    u = getattr(conv, WINOGRAD_PARAM, None)
    if u is None:
        u = winograd_weight(conv.weight, m)
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1))  # [N, H+2, W+2, C]
    n, c, h, w = x.shape
    th, tw = h // m, w // m
    shape = (n, th, tw, u.shape[-1])
    if split_min_side is not None and min(h, w) >= split_min_side:
        prods = _winograd_products(xp, u, m, th, tw)
        if output == "interleaved" and m == 2:
            y = _inverse_interleaved(prods, m, shape)
        else:
            y = _inverse_batched(torch.stack(prods), m, shape)
    else:
        y = _inverse_batched(_winograd_batched(xp, u, m, th, tw), m, shape)
    if conv.bias is not None:
        y = y + conv.bias
    return y.permute(0, 3, 1, 2)


def _winograd_batched(xp: torch.Tensor, u: torch.Tensor, m: int, th: int, tw: int):
    """All (m+2)^2 products M_rs = V_rs @ U_rs as one batched matmul over the stacked V_rs:
    [(m+2)^2, N·th·tw, O]. Each conv is a few dispatches (its compile, and its weight's
    encoding at compile time, cost what one conv's should); but the stacks are whole-tensor
    copies, and a bf16 conversion of them is packed element by element (compile/NOTES.md)."""
    bt = WINOGRAD[m][0]
    t = m + 2
    n, c = xp.shape[0], xp.shape[-1]
    # B^T d B over all tiles at once, one axis at a time on whole tensors (few traced ops: the
    # export's time grows with their number). Input row i of every tile row: [N, th, W+2, C].
    rows = [xp[:, i : i + m * th : m] for i in range(t)]
    bd = torch.stack([_combine(bt[r], rows) for r in range(t)])
    cols = [bd[:, :, :, j : j + m * tw : m] for j in range(t)]  # [t(r), N, th, tw, C]
    v = torch.stack([_combine(bt[s], cols) for s in range(t)], dim=1)  # [t(r), t(s), N, th, tw, C]
    return torch.bmm(v.reshape(t * t, n * th * tw, c), u)


def _winograd_products(xp: torch.Tensor, u: torch.Tensor, m: int, th: int, tw: int) -> list:
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
            prods.append(torch.mm(v.reshape(n * th * tw, c), u[r * t + s]))
    return prods


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


def conv1x1_as_einsum(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A 1x1, stride-1, unpadded convolution as a weight-first channel contraction."""
    if tuple(conv.kernel_size) != (1, 1) or tuple(conv.stride) != (1, 1) or any(conv.padding):
        return torch.nn.Conv2d.forward(conv, x)
    y = torch.einsum("oc,nchw->nohw", conv.weight[:, :, 0, 0], x)
    if conv.bias is not None:
        y = y + conv.bias[:, None, None]
    return y


def _supported(conv: torch.nn.Conv2d) -> bool:
    return (
        conv.groups == 1
        and tuple(conv.dilation) == (1, 1)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


# The non-Winograd lowerings; a Winograd choice's convs take conv2d_winograd with their tile.
LOWERINGS = {"matmul": conv2d_as_matmul, "pointwise_einsum": conv1x1_as_einsum}


def convs_as_matmuls(
    model: torch.nn.Module,
    conv: str = "matmul",
    tiles=None,
    winograd_output: str = "batched",
    split_min_side: int | None = None,
) -> int:
    """Rebind the forward of every supported Conv2d in `model` to the lowering named conv;
    returns how many. tiles ({conv: m}) picks a Winograd conv's own tile size; winograd_output
    and split_min_side are conv2d_winograd's."""
    forward = LOWERINGS.get(conv)
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and _supported(m):
            tile = (tiles or {}).get(m, WINOGRAD_TILES.get(conv))
            if tile == 0:  # plain, by the tiles' choice
                lowering = conv2d_as_matmul
            elif tile is None:
                lowering = forward
            else:
                lowering = functools.partial(
                    conv2d_winograd, m=tile, output=winograd_output, split_min_side=split_min_side
                )
            m.forward = types.MethodType(lowering, m)
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


def _eligible_3x3(mod) -> bool:
    return isinstance(mod, torch.nn.Conv2d) and _supported(mod) and _winograd_kernel(mod)


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


def derived_tag(tiles_by_name: dict[str, int]) -> str | None:
    """The name of a derived-weights archive: `winograd<m>` when every conv has tile m, else
    the tiles and a digest of which conv has which (archives are reused by name, and the same
    rule gives other convs other tiles at another image size)."""
    used = sorted(set(tiles_by_name.values()))
    if not used:
        return None
    if len(used) == 1:
        return f"winograd{used[0]}"
    digest = hashlib.sha256(json.dumps(sorted(tiles_by_name.items())).encode()).hexdigest()
    return f"winograd{'+'.join(map(str, used))}-{digest[:8]}"


def is_derived(name: str) -> bool:
    """A parameter computed at export (not in the model's files): saved to its own archive."""
    return name.endswith("." + WINOGRAD_PARAM)


def set_conv_lowering(
    model: torch.nn.Module,
    conv: str,
    tiles: dict[torch.nn.Conv2d, int] | None = None,
    winograd_output: str = "batched",
    split_min_side: int | None = None,
) -> str | None:
    """Apply the target's `export.conv` choice to every Conv2d of model, with tiles ({conv:
    m}, Winograd choices only) overriding the choice's tile per conv; winograd_output and
    split_min_side (export choices `winograd_output`, `winograd_split_min_side`) are
    conv2d_winograd's. Returns a tag naming the derived parameters it added (None when it added
    none)."""
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
    convs_as_matmuls(model, conv, tiles, winograd_output, split_min_side)
    return derived_tag(add_winograd_weights(model, m, tiles)) if m else None
