"""Group a LoRA file's tensors by the layer they change, and tell each group's kind.

A key is ``<layer><suffix>``: the suffix names the factor (``.lora_down.weight``,
``.lora_A.weight``, ``.hada_w1_a``, ``.lokr_w2``, ``.alpha``...), the layer is either kohya's
flat spelling with a component prefix (``lora_unet_down_blocks_0_..._to_q``, ``lora_te_...``,
``lora_te1_``/``lora_te2_`` for SDXL's two text encoders) or a dotted module path, optionally
after a component prefix (``unet.``, ``text_encoder.``, ``text_encoder_2.``; a file with no
prefix at all is an attention-processor file of the UNet). diffusers' older spellings
(``.processor.to_q_lora.down.weight``, ``.lora.down.weight``, ``.lora_linear_layer.up.weight``)
are rewritten to module paths here. Nothing is matched against a model yet: see targets.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

# suffix -> (kind, role). Kinds handled by deltas.py: lora, loha, lokr, full; "common" roles
# belong to whatever kind the layer has. The rest are recognized only to be named in reports.
SUFFIXES: dict[str, tuple[str, str]] = {
    "lora_down.weight": ("lora", "down"),
    "lora_up.weight": ("lora", "up"),
    "lora_mid.weight": ("lora", "mid"),
    "lora_up.bias": ("lora", "up_bias"),
    "lora_A.weight": ("lora", "down"),
    "lora_B.weight": ("lora", "up"),
    "lora_B.bias": ("lora", "up_bias"),
    "lora.down.weight": ("lora", "down"),
    "lora.up.weight": ("lora", "up"),
    "lora.up.bias": ("lora", "up_bias"),
    "lora_linear_layer.down.weight": ("lora", "down"),
    "lora_linear_layer.up.weight": ("lora", "up"),
    "hada_w1_a": ("loha", "w1_a"),
    "hada_w1_b": ("loha", "w1_b"),
    "hada_w2_a": ("loha", "w2_a"),
    "hada_w2_b": ("loha", "w2_b"),
    "hada_t1": ("loha", "t1"),
    "hada_t2": ("loha", "t2"),
    "lokr_w1": ("lokr", "w1"),
    "lokr_w1_a": ("lokr", "w1_a"),
    "lokr_w1_b": ("lokr", "w1_b"),
    "lokr_w2": ("lokr", "w2"),
    "lokr_w2_a": ("lokr", "w2_a"),
    "lokr_w2_b": ("lokr", "w2_b"),
    "lokr_t2": ("lokr", "t2"),
    "diff": ("full", "diff"),
    "diff_b": ("full", "diff_b"),
    "alpha": ("common", "alpha"),
    "scale": ("common", "scale"),
    "dora_scale": ("dora", "dora_scale"),
    "lora_magnitude_vector": ("dora", "magnitude"),
    "lora_magnitude_vector.weight": ("dora", "magnitude"),
    "on_input": ("ia3", "on_input"),
    "oft_blocks": ("oft", "blocks"),
    "oft_diag": ("oft", "diag"),
    "oft_R": ("oft", "R"),
    "w_norm": ("norm", "w_norm"),
    "b_norm": ("norm", "b_norm"),
    "a1.weight": ("glora", "a1"),
    "a2.weight": ("glora", "a2"),
    "b1.weight": ("glora", "b1"),
    "b2.weight": ("glora", "b2"),
}
_BY_LENGTH = sorted(SUFFIXES, key=len, reverse=True)

KOHYA_PREFIXES = {
    "lora_unet_": "unet",
    "lora_te_": "text_encoder",
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
}
DOTTED_PREFIXES = ("unet", "text_encoder", "text_encoder_2")
LORA_COMPONENTS = frozenset(KOHYA_PREFIXES.values()) | frozenset(DOTTED_PREFIXES)  # submodules

# diffusers' attention-processor spellings: (pattern, replacement in the UNet, in a text encoder)
_OLD_ATTN = (
    (re.compile(r"\.to_q_lora\."), ".to_q.lora.", ".q_proj.lora."),
    (re.compile(r"\.to_k_lora\."), ".to_k.lora.", ".k_proj.lora."),
    (re.compile(r"\.to_v_lora\."), ".to_v.lora.", ".v_proj.lora."),
    (re.compile(r"\.to_out_lora\."), ".to_out.0.lora.", ".out_proj.lora."),
)


@dataclass
class FileLayer:
    """The tensors of one file that change one layer."""

    component: str | None  # "unet", "text_encoder"...; None: a prefix we do not know
    name: str  # kohya's flat name or a dotted module path, without the component prefix
    flat: bool
    label: str  # the layer as the file spells it, for messages
    kind: str = ""
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)

    def missing_roles(self) -> list[str]:
        """The factors its kind needs that the file lacks."""
        t = self.tensors
        cp = ["t1", "t2"] if "t1" in t or "t2" in t else []
        need = {
            "lora": ["down", "up"],
            "loha": ["w1_a", "w1_b", "w2_a", "w2_b", *cp],
            "lokr": (["w1"] if "w1" in t else ["w1_a", "w1_b"])
            + (["w2"] if "w2" in t else ["w2_a", "w2_b"]),
            "full": [] if "diff" in t or "diff_b" in t else ["diff"],
        }.get(self.kind, [])
        return [role for role in need if role not in t]


def _split(key: str) -> tuple[str, str] | None:
    """key -> (layer, suffix), or None when no known suffix ends it."""
    for suffix in _BY_LENGTH:
        if key.endswith("." + suffix) and len(key) > len(suffix) + 1:
            return key[: -len(suffix) - 1], suffix
    return None


def _layer_of(layer: str, unprefixed_is_unet: bool) -> tuple[str | None, str, bool]:
    """A layer as written -> (component, name, flat)."""
    for prefix, component in KOHYA_PREFIXES.items():
        if layer.startswith(prefix) and "." not in layer:
            return component, layer[len(prefix) :], True
    head, _, rest = layer.partition(".")
    if head in DOTTED_PREFIXES and rest:
        return head, rest, False
    if layer.startswith("lora_") and "." not in layer:
        return None, layer, True  # kohya-style prefix of another model family (lora_te3_...)
    return ("unet" if unprefixed_is_unet else None), layer, False


def _modernize(key: str) -> str:
    """diffusers' older spellings of a dotted key -> module path + a SUFFIXES suffix."""
    key = key.replace(".processor.", ".")
    text = key.startswith("text_encoder")
    for pattern, unet_form, text_form in _OLD_ATTN:
        key = pattern.sub(text_form if text else unet_form, key)
    return key


def group_layers(tensors: Mapping[str, np.ndarray]) -> tuple[list[FileLayer], list[str]]:
    """The file's layers in file order, and the keys that fit no known LoRA layout."""
    prefixed = any(
        k.startswith(tuple(KOHYA_PREFIXES)) or k.split(".", 1)[0] in DOTTED_PREFIXES
        for k in tensors
    )
    layers: dict[str, FileLayer] = {}
    unknown: list[str] = []
    for key, array in tensors.items():
        split = _split(key if key.startswith("lora_") else _modernize(key))
        if split is None:
            unknown.append(key)
            continue
        layer_name, suffix = split
        kind, role = SUFFIXES[suffix]
        layer = layers.get(layer_name)
        if layer is None:
            component, name, flat = _layer_of(layer_name, unprefixed_is_unet=not prefixed)
            layer = layers[layer_name] = FileLayer(component, name, flat, label=layer_name)
        if role in layer.tensors or (kind != "common" and layer.kind and layer.kind != kind):
            layer.kind = "mixed"
        elif kind != "common" and layer.kind != "mixed":
            layer.kind = kind
        layer.tensors[role] = array
        layer.keys.append(key)
    out = []
    for layer in layers.values():
        if not layer.kind:  # an alpha with no weights: nothing it could be applied to
            unknown.extend(layer.keys)
        else:
            out.append(layer)
    return out, unknown
