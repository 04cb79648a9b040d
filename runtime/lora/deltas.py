"""The weight change of one LoRA layer, in float32 numpy: LoRA/LoCon, LoHa, LoKr and full diffs.

Formulas (as kohya's sd-scripts, LyCORIS and A1111 define them; the scale is applied by the
caller):
- LoRA: ``up @ down`` with both flattened to matrices (a conv LoRA's down is
  (rank, in, kh, kw), its up (out, rank, 1, 1)); with a CP ``mid`` (rank, rank, kh, kw) the
  result is ``einsum("nmkl,in,mj->ijkl", mid, up, down)``.
- LoHa: ``(w1_a @ w1_b) * (w2_a @ w2_b)``; with CP factors t1/t2 each product is
  ``einsum("ijkl,jr,ip->prkl", t, w_b, w_a)`` (then w_a is (rank, out), w_b (rank, in)).
- LoKr: ``kron(w1, w2)`` with w1 = ``w1_a @ w1_b`` when decomposed, w2 likewise or
  ``einsum("ijkl,jr,ip->prkl", t2, w2_b, w2_a)`` with CP; a 4-D w2 takes w1 as (a, b, 1, 1).
- full: ``diff`` itself (and ``diff_b`` for the bias).
`shape` answers what a layer's change will be shaped like without computing it, so a LoRA
for another model is refused before any weight is touched.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("lora", "loha", "lokr", "full")


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _mat(a) -> np.ndarray:
    a = f32(a)
    return a.reshape(a.shape[0], -1)


def _cp(t, w_b, w_a) -> np.ndarray:
    return np.einsum("ijkl,jr,ip->prkl", f32(t), _mat(w_b), _mat(w_a), optimize=True)


def rank(kind: str, t: dict) -> int | None:
    """The rank the alpha is divided by (None: a factorization without one, scale 1)."""
    if kind == "lora":
        return int(t["down"].shape[0])
    if kind == "loha":
        return int(t["w1_b"].shape[0])
    if kind == "lokr":
        for role in ("w1_b", "w2_b"):
            if role in t:
                return int(t[role].shape[0])
    return None


def _lokr_factor_shape(t: dict, n: str) -> tuple[int, ...]:
    if f"w{n}" in t:
        return tuple(t[f"w{n}"].shape)
    a, b = t[f"w{n}_a"].shape, t[f"w{n}_b"].shape
    if f"t{n}" in t:
        return (a[1], b[1], *t[f"t{n}"].shape[2:])
    return (a[0], math.prod(b[1:]))


def shape(kind: str, t: dict) -> tuple[int, ...]:
    """The shape `delta` returns for these factors (ValueError when they do not fit together)."""
    if kind == "lora":
        up, down = t["up"].shape, t["down"].shape
        r_up = math.prod(up[1:])
        if "mid" in t:
            mid = t["mid"].shape
            if len(mid) != 4 or mid[:2] != (r_up, down[0]):
                raise ValueError(f"lora_mid {mid} does not fit lora_up {up}, lora_down {down}")
            return (up[0], math.prod(down[1:]), *mid[2:])
        if r_up != down[0]:
            raise ValueError(f"lora_up {up} and lora_down {down} have different ranks")
        return (up[0], *down[1:])
    if kind == "loha":
        if "t1" in t:
            a, b = t["w1_a"].shape, t["w1_b"].shape
            return (a[1], b[1], *t["t1"].shape[2:])
        s1 = (t["w1_a"].shape[0], math.prod(t["w1_b"].shape[1:]))
        s2 = (t["w2_a"].shape[0], math.prod(t["w2_b"].shape[1:]))
        if s1 != s2 or t["w1_a"].shape[1] != t["w1_b"].shape[0]:
            raise ValueError(f"hada_w1 {s1} and hada_w2 {s2} do not fit together")
        return s1
    if kind == "lokr":
        w1, w2 = _lokr_factor_shape(t, "1"), _lokr_factor_shape(t, "2")
        if len(w1) != 2:
            raise ValueError(f"lokr_w1 is {w1}, expected a matrix")
        if len(w2) == 4:
            return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])
        return (w1[0] * w2[0], w1[1] * math.prod(w2[1:]))
    if kind == "full":
        return tuple(t["diff"].shape)
    raise ValueError(f"no formula for {kind}")


def delta(kind: str, t: dict) -> np.ndarray:
    """The unscaled change of the layer's weight: a new float32 array (never a view of the
    file's tensors), shaped as `shape` says."""
    if kind == "lora":
        up, down = _mat(t["up"]), _mat(t["down"])
        if "mid" in t:
            return np.einsum("nmkl,in,mj->ijkl", f32(t["mid"]), up, down, optimize=True)
        return (up @ down).reshape(shape(kind, t))
    if kind == "loha":
        if "t1" in t:
            return _cp(t["t1"], t["w1_b"], t["w1_a"]) * _cp(t["t2"], t["w2_b"], t["w2_a"])
        w1 = _mat(t["w1_a"]) @ _mat(t["w1_b"])
        w1 *= _mat(t["w2_a"]) @ _mat(t["w2_b"])
        return w1
    if kind == "lokr":
        w1 = f32(t["w1"]) if "w1" in t else _mat(t["w1_a"]) @ _mat(t["w1_b"])
        if "w2" in t:
            w2 = f32(t["w2"])
        elif "t2" in t:
            w2 = _cp(t["t2"], t["w2_b"], t["w2_a"])
        else:
            w2 = _mat(t["w2_a"]) @ _mat(t["w2_b"])
        if w2.ndim == 4:
            return np.kron(w1[:, :, None, None], w2)
        return np.kron(w1, w2.reshape(w2.shape[0], -1))
    if kind == "full":
        return np.array(t["diff"], dtype=np.float32)
    raise ValueError(f"no formula for {kind}")
