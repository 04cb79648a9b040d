"""Winograd F(m x m, 3x3) weight transforms, shared by the cpu export and the runtime.

The cpu export computes each 3x3 convolution's transformed weight G g G^T once, as a parameter
of its own (`<conv>.weight_winograd`, compile/exporters/winograd.py); the runtime computes
the same from replaced weights (`sdiree run --weights/--lora`), in float64 as the export does.
"""

from __future__ import annotations

import numpy as np

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
# The transformed weight G g G^T is computed at export and saved as a parameter of its own, so
# the compiled module only repacks it (which the parameter encoder then does at compile time).
WINOGRAD_PARAM = "weight_winograd"


def winograd_weight(weight: np.ndarray, tiles: int) -> np.ndarray:
    """G g G^T of a [O, C, 3, 3] weight for `tiles` = (m+2)^2 transformed taps, computed in
    float64: [(m+2)^2, C, O] in weight's dtype."""
    t = round(tiles**0.5)
    m = t - 2
    if m not in WINOGRAD or t * t != tiles or weight.ndim != 4 or weight.shape[2:] != (3, 3):
        raise ValueError(f"no Winograd transform with {tiles} taps for a {weight.shape} weight")
    g = np.asarray(WINOGRAD[m][1], np.float64)
    o, c = weight.shape[:2]
    # (G g G^T)[x, y] = sum over a, b of G[x, a] G[y, b] g[a, b]: kron(G, G) [t*t, 9] times
    # the weight laid out [9, C*O], which is the result's layout: ~30x faster than a
    # three-operand einsum at SD 1.5 size (memory traffic, not arithmetic, is the cost).
    k = np.kron(g, g)  # k[x*t + y, a*3 + b] = G[x, a] G[y, b]
    w = np.ascontiguousarray(np.asarray(weight, np.float64).reshape(o, c, 9).transpose(2, 1, 0))
    return (k @ w.reshape(9, c * o)).reshape(t * t, c, o).astype(weight.dtype)
