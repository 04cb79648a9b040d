"""Export choices `conv: "matmul"` and `"winograd"`: every Conv2d traced as plain matmuls.

IREE's llvm-cpu backend data-tiles plain matmuls onto its mmt4d ukernels (~2x the throughput of
its direct NCHW convolutions on this kind of CPU), but it does not data-tile convolutions, nor
the batched matmul-like ops its own im2col rewrite produces. So for cpu the exporter states each
convolution as matmuls itself: "matmul" is channels-last im2col, [N·OH·OW, KH·KW·C] @
[KH·KW·C, O]; "winograd" turns 3x3 stride-1 convolutions into Winograd F(2x2,3x3) (16 batched
matmuls over 2x2 output tiles, 2.25x fewer multiplies) and the rest into im2col. Weights keep
their parameter names; their reshapes and transforms depend on parameters only, which IREE
hoists to load time.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

# "native": torch's Conv2d as traced; "matmul": im2col + matmul; "winograd": Winograd F(2x2,3x3)
# for 3x3 stride-1 convs on even sizes (2.25x fewer multiplies), im2col + matmul for the rest.
# Its transformed weights are 16/9 the size of the originals; IREE hoists them to load time only
# under a raised --iree-opt-const-expr-max-size-increase-threshold (else they are recomputed on
# every call: 3.5 s of a 36 s UNet call).
CONV_CHOICES = ("native", "matmul", "winograd")

# Winograd F(m x m, 3x3) transforms (Lavin & Gray 2015): Y = A^T [(G g G^T) * (B^T d B)] A, per
# (m+2)x(m+2) input tile. F(2x2,3x3) needs 16 multiplies per 4 outputs instead of 36.
WINOGRAD = {
    2: (
        ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
        ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0)),
        ((1, 1, 1, 0), (0, 1, -1, -1)),
    ),
    4: (
        (
            (4, 0, -5, 0, 1, 0),
            (0, -4, -4, 1, 1, 0),
            (0, 4, -4, -1, 1, 0),
            (0, -2, -1, 2, 1, 0),
            (0, 2, -1, -2, 1, 0),
            (0, 4, 0, -5, 0, 1),
        ),
        (
            (1 / 4, 0.0, 0.0),
            (-1 / 6, -1 / 6, -1 / 6),
            (-1 / 6, 1 / 6, -1 / 6),
            (1 / 24, 1 / 12, 1 / 6),
            (1 / 24, -1 / 12, 1 / 6),
            (0.0, 0.0, 1.0),
        ),
        ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1)),
    ),
}
WINOGRAD_TILE = 2


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


def winograd_applies(conv: torch.nn.Conv2d, x: torch.Tensor, m: int = WINOGRAD_TILE) -> bool:
    return (
        tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and tuple(conv.padding) == (1, 1)
        and x.shape[2] % m == 0
        and x.shape[3] % m == 0
    )


def conv2d_winograd(conv: torch.nn.Conv2d, x: torch.Tensor, m: int = WINOGRAD_TILE):
    """A 3x3, stride 1, padding 1 convolution as Winograd F(m x m, 3x3): (m+2)^2 batched
    matmuls over the tiles; anything else falls back to conv2d_as_matmul."""
    if not winograd_applies(conv, x, m):
        return conv2d_as_matmul(conv, x)
    bt, g, at = WINOGRAD[m]
    t = m + 2
    n, c, h, w = x.shape
    o = conv.weight.shape[0]
    th, tw = h // m, w // m
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1))
    # d[i][j]: element (i, j) of every overlapping t x t input tile, [N, th, tw, C]
    d = [[xp[:, i : i + m * th : m, j : j + m * tw : m, :] for j in range(t)] for i in range(t)]
    rows = [[_combine(bt[r], [d[i][j] for i in range(t)]) for j in range(t)] for r in range(t)]
    v = torch.stack([_combine(bt[s], rows[r]) for r in range(t) for s in range(t)])
    gm = torch.tensor(g, dtype=conv.weight.dtype)
    u = torch.einsum("xa,ocab,yb->xyco", gm, conv.weight, gm).reshape(t * t, c, o)
    prod = torch.bmm(v.reshape(t * t, n * th * tw, c), u).reshape(t, t, n, th, tw, o)
    half = [[_combine(at[a], [prod[r][s] for r in range(t)]) for s in range(t)] for a in range(m)]
    y = torch.stack([torch.stack([_combine(at[b], half[a]) for b in range(m)]) for a in range(m)])
    # y[a][b][n, ty, tx, o] is output pixel (m*ty + a, m*tx + b)
    y = y.permute(2, 3, 0, 4, 1, 5).reshape(n, h, w, o)
    if conv.bias is not None:
        y = y + conv.bias
    return y.permute(0, 3, 1, 2)


def _supported(conv: torch.nn.Conv2d) -> bool:
    return (
        conv.groups == 1
        and tuple(conv.dilation) == (1, 1)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


def convs_as_matmuls(model: torch.nn.Module, winograd: bool = False) -> int:
    """Rebind the forward of every supported Conv2d in `model`; returns how many."""
    forward = conv2d_winograd if winograd else conv2d_as_matmul
    count = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and _supported(m):
            m.forward = types.MethodType(forward, m)
            count += 1
    return count


def set_conv_lowering(model: torch.nn.Module, conv: str) -> None:
    """Apply the target's `export.conv` choice to every Conv2d of model."""
    if conv not in CONV_CHOICES:
        raise ValueError(f"export conv choice must be one of {CONV_CHOICES}, not {conv!r}")
    if conv != "native":
        convs_as_matmuls(model, winograd=conv == "winograd")
