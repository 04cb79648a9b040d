"""Write random LoRA files for a tiny diffusers model, in the layouts people download.

Every linear and conv layer of the UNet and the text encoder gets random factors, the same
ones in every layout (they are drawn from the seed and the layer's name), so one layout's
merge can be checked against another's: the tests compare sdiree's merge with diffusers'
`load_lora_weights` on these files, and a layout diffusers cannot read with the same factors
written in one it can. Ranks and alphas vary from layer to layer. Layouts (`--format`):

- ``kohya``: kohya's sd-scripts, ``lora_unet_<diffusers path>``/``lora_te_<path>`` with
  ``.lora_down.weight``, ``.lora_up.weight``, ``.alpha``; 3x3 convs as LoCon (3x3 down, 1x1 up).
- ``kohya-ldm``: the same with the UNet named after the original layout (``input_blocks_1_1``,
  ``middle_block``, ``output_blocks``, ``in_layers_2``...), as some trainers write.
- ``kohya-cp``: kohya's LoCon with CP-decomposed 3x3 convs (``.lora_mid.weight``).
- ``peft``: diffusers/PEFT, ``unet.<path>.lora_A.weight``/``lora_B.weight``,
  ``text_encoder.text_model.<path>...``, ranks and alphas in the ``lora_adapter_metadata``
  diffusers writes (``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``).
- ``peft-noalpha``: the same without metadata (scale 1).
- ``diffusers-old``: diffusers' attention-processor layout (``processor.to_q_lora.down``,
  ``.lora.down.weight``, text encoder ``to_q_lora``/``lora_linear_layer``), no alpha.
- ``loha``: LyCORIS LoHa (``hada_w1_a``...; 3x3 convs CP-decomposed with ``hada_t1/_t2``).
- ``lokr``: LyCORIS LoKr (whole and decomposed factors, 4-D w2 and CP ``lokr_t2`` on 3x3
  convs).
- ``full``: LyCORIS full diffs (``diff``, ``diff_b``).

    python tools/make_tiny_lora.py MODEL_DIR OUT.safetensors --format kohya [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np

FORMATS = (
    "kohya",
    "kohya-ldm",
    "kohya-cp",
    "peft",
    "peft-noalpha",
    "diffusers-old",
    "loha",
    "lokr",
    "full",
)
COMPONENT_FILES = {
    "unet": "unet/diffusion_pytorch_model.safetensors",
    "text_encoder": "text_encoder/model.safetensors",
}
KOHYA = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
TEXT_MODEL = "text_model."


def model_shapes(model_dir: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """{component: {key: shape}} of a diffusers model folder's UNet and text encoder."""
    from safetensors import safe_open

    out = {}
    for component, rel in COMPONENT_FILES.items():
        with safe_open(Path(model_dir) / rel, framework="numpy") as f:
            names = f.keys()
            out[component] = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    return out


def read_lora(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A LoRA file's (tensors, metadata), as sdiree's own reader returns them."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
    return load_file(str(path)), metadata


def lora_layers(shapes: dict[str, dict[str, tuple[int, ...]]]) -> list[tuple[str, str, tuple]]:
    """(component, layer path with the text encoder's ``text_model.``, weight shape) of every
    linear and conv layer a LoRA trainer would target."""
    out = []
    for component, keys in shapes.items():
        for key, shape in sorted(keys.items()):
            if not key.endswith(".weight") or len(shape) not in (2, 4) or "embeddings." in key:
                continue
            path = key[: -len(".weight")]
            if component == "text_encoder" and not path.startswith(TEXT_MODEL):
                path = TEXT_MODEL + path
            out.append((component, path, shape))
    return out


def _rng(seed: int, path: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(path.encode())])


def _randn(rng: np.random.Generator, *shape: int, std: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _lora_factors(
    seed: int, path: str, shape: tuple, cp: bool = False, alphas: str = "varied"
) -> dict[str, np.ndarray]:
    """down (rank, in[, kh, kw]), up (out, rank[, 1, 1]), alpha; mid for a CP 3x3 conv.
    alphas "varied": each layer its own; "kohya": one for linear layers, one for convs (kohya's
    network_alpha and conv_alpha)."""
    rng = _rng(seed, path)
    rank = int(rng.choice([2, 4, 4, 4]))
    alpha = float(rng.choice([1.0, 2.0, rank, 8.0]))
    if alphas == "kohya":
        alpha = 4.0 if len(shape) == 2 else 1.0
    out_dim, in_dim = shape[0], shape[1]
    if len(shape) == 2:
        return {"down": _randn(rng, rank, in_dim), "up": _randn(rng, out_dim, rank), "alpha": alpha}
    kh, kw = shape[2:]
    if cp and (kh, kw) != (1, 1):
        return {
            "down": _randn(rng, rank, in_dim, 1, 1),
            "mid": _randn(rng, rank, rank, kh, kw),
            "up": _randn(rng, out_dim, rank, 1, 1),
            "alpha": alpha,
        }
    return {
        "down": _randn(rng, rank, in_dim, kh, kw),
        "up": _randn(rng, out_dim, rank, 1, 1),
        "alpha": alpha,
    }


def _flat(component: str, path: str) -> str:
    return KOHYA[component] + path.replace(".", "_")


def _kohya(layers, seed, alphas, ldm: bool = False, cp: bool = False) -> dict[str, np.ndarray]:
    if ldm:
        from sdiree.runtime.lora.ldm_names import ldm_unet_names

        unet_paths = [p for c, p, _ in layers if c == "unet"]
        to_ldm = {d: o for o, d in ldm_unet_names(unet_paths).items()}
    out = {}
    for component, path, shape in layers:
        f = _lora_factors(seed, path, shape, cp=cp, alphas=alphas)
        name = to_ldm[path] if ldm and component == "unet" else path
        stem = _flat(component, name)
        out[f"{stem}.lora_down.weight"] = f["down"]
        out[f"{stem}.lora_up.weight"] = f["up"]
        if "mid" in f:
            out[f"{stem}.lora_mid.weight"] = f["mid"]
        out[f"{stem}.alpha"] = np.array(f["alpha"], dtype=np.float32)
    return out


def _peft(layers, seed, alpha_style, with_alpha: bool) -> tuple[dict, dict[str, str]]:
    tensors, ranks, alphas = {}, {}, {}
    for component, path, shape in layers:
        f = _lora_factors(seed, path, shape, alphas=alpha_style)
        tensors[f"{component}.{path}.lora_A.weight"] = f["down"]
        tensors[f"{component}.{path}.lora_B.weight"] = f["up"]
        # peft matches patterns against module names, which lack "text_model." in
        # transformers 5: a pattern without it matches the module either way.
        module = path.removeprefix(TEXT_MODEL)
        ranks.setdefault(component, {})[module] = f["down"].shape[0]
        alphas.setdefault(component, {})[module] = f["alpha"]
    if not with_alpha:
        return tensors, {}
    config = {}
    for component in ranks:
        r = max(set(ranks[component].values()), key=list(ranks[component].values()).count)
        lora_alpha = 1.0
        config[f"{component}.r"] = r
        config[f"{component}.lora_alpha"] = lora_alpha
        config[f"{component}.rank_pattern"] = {m: v for m, v in ranks[component].items() if v != r}
        config[f"{component}.alpha_pattern"] = {
            m: v for m, v in alphas[component].items() if v != lora_alpha
        }
        config[f"{component}.target_modules"] = sorted(ranks[component])
    return tensors, {"lora_adapter_metadata": json.dumps(config, sort_keys=True)}


_OLD_UNET_ATTN = {"to_q": "to_q_lora", "to_k": "to_k_lora", "to_v": "to_v_lora"}
_OLD_TE_ATTN = {"q_proj": "to_q_lora", "k_proj": "to_k_lora", "v_proj": "to_v_lora"}


def _diffusers_old(layers, seed: int) -> dict[str, np.ndarray]:
    out = {}
    for component, path, shape in layers:
        f = _lora_factors(seed, path, shape)
        parent, _, leaf = path.rpartition(".")
        if component == "unet" and leaf in _OLD_UNET_ATTN:
            stem = f"{parent}.processor.{_OLD_UNET_ATTN[leaf]}"
        elif component == "unet" and path.endswith(".to_out.0"):
            stem = f"{path[: -len('.to_out.0')]}.processor.to_out_lora"
        elif component == "text_encoder" and leaf in _OLD_TE_ATTN:
            stem = f"{parent}.{_OLD_TE_ATTN[leaf]}"
        elif component == "text_encoder" and leaf == "out_proj":
            stem = f"{parent}.to_out_lora"
        elif component == "text_encoder":
            stem = f"{path}.lora_linear_layer"
        else:
            stem = f"{path}.lora"
        out[f"{component}.{stem}.down.weight"] = f["down"]
        out[f"{component}.{stem}.up.weight"] = f["up"]
    return out


def _loha(layers, seed: int) -> dict[str, np.ndarray]:
    out = {}
    for component, path, shape in layers:
        rng = _rng(seed, "loha:" + path)
        rank = int(rng.choice([2, 4]))
        stem = _flat(component, path)
        out_dim, in_dim = shape[:2]
        if len(shape) == 4 and shape[2:] != (1, 1):
            # CP: w_a (rank, out), w_b (rank, in), t (rank, rank, kh, kw)
            for n in "12":
                out[f"{stem}.hada_w{n}_a"] = _randn(rng, rank, out_dim, std=0.3)
                out[f"{stem}.hada_w{n}_b"] = _randn(rng, rank, in_dim, std=0.3)
                out[f"{stem}.hada_t{n}"] = _randn(rng, rank, rank, *shape[2:], std=0.3)
        else:
            fan_in = int(np.prod(shape[1:]))
            for n in "12":
                out[f"{stem}.hada_w{n}_a"] = _randn(rng, out_dim, rank, std=0.3)
                out[f"{stem}.hada_w{n}_b"] = _randn(rng, rank, fan_in, std=0.3)
        out[f"{stem}.alpha"] = np.array(float(rng.choice([1.0, rank, 4.0])), dtype=np.float32)
    return out


def _split(dim: int) -> tuple[int, int]:
    """dim = a * b with a the largest divisor <= sqrt(dim) (LyCORIS' factorization shape)."""
    a = max(d for d in range(1, int(dim**0.5) + 1) if dim % d == 0)
    return a, dim // a


def _lokr(layers, seed: int) -> dict[str, np.ndarray]:
    out = {}
    for i, (component, path, shape) in enumerate(layers):
        rng = _rng(seed, "lokr:" + path)
        stem = _flat(component, path)
        (out_a, k), (m, n) = _split(shape[0]), _split(shape[1])
        kernel = tuple(shape[2:])
        rank = 2
        variant = i % 3
        if variant == 2:
            out[f"{stem}.lokr_w1_a"] = _randn(rng, out_a, rank, std=0.3)
            out[f"{stem}.lokr_w1_b"] = _randn(rng, rank, m, std=0.3)
        else:
            out[f"{stem}.lokr_w1"] = _randn(rng, out_a, m, std=0.3)
        if variant == 0 and kernel:
            out[f"{stem}.lokr_w2"] = _randn(rng, k, n, *kernel, std=0.3)
        elif variant == 0:
            out[f"{stem}.lokr_w2"] = _randn(rng, k, n, std=0.3)
        elif kernel and kernel != (1, 1):
            out[f"{stem}.lokr_w2_a"] = _randn(rng, rank, k, std=0.3)
            out[f"{stem}.lokr_w2_b"] = _randn(rng, rank, n, std=0.3)
            out[f"{stem}.lokr_t2"] = _randn(rng, rank, rank, *kernel, std=0.3)
        else:
            fan_in = n * int(np.prod(kernel)) if kernel else n
            out[f"{stem}.lokr_w2_a"] = _randn(rng, k, rank, std=0.3)
            out[f"{stem}.lokr_w2_b"] = _randn(rng, rank, fan_in, std=0.3)
        out[f"{stem}.alpha"] = np.array(float(rng.choice([1.0, 2.0, 4.0])), dtype=np.float32)
    return out


def _full(layers, shapes, seed: int) -> dict[str, np.ndarray]:
    out = {}
    for component, path, shape in layers:
        rng = _rng(seed, "full:" + path)
        stem = _flat(component, path)
        out[f"{stem}.diff"] = _randn(rng, *shape, std=0.01)
        bias_key = f"{path.removeprefix(TEXT_MODEL) if component == 'text_encoder' else path}.bias"
        keys = shapes[component]
        bias = keys.get(bias_key) or keys.get(TEXT_MODEL + bias_key)
        if bias is not None:
            out[f"{stem}.diff_b"] = _randn(rng, *bias, std=0.01)
    return out


def make_tiny_lora(
    model_dir: Path,
    out: Path,
    fmt: str = "kohya",
    seed: int = 0,
    components: tuple[str, ...] = ("unet", "text_encoder"),
    convs: bool = True,
    alphas: str = "varied",
) -> Path:
    """Write a random LoRA for the model in `model_dir` to `out`; returns `out`. `alphas`
    ("varied" or "kohya") applies to the LoRA layouts (see `_lora_factors`)."""
    from safetensors.numpy import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    shapes = model_shapes(model_dir)
    layers = [
        (c, p, s) for c, p, s in lora_layers(shapes) if c in components and (convs or len(s) == 2)
    ]
    metadata: dict[str, str] = {}
    if fmt in ("kohya", "kohya-ldm", "kohya-cp"):
        tensors = _kohya(layers, seed, alphas, ldm=fmt == "kohya-ldm", cp=fmt == "kohya-cp")
        metadata = {"ss_network_module": "networks.lora"}
    elif fmt in ("peft", "peft-noalpha"):
        tensors, metadata = _peft(layers, seed, alphas, with_alpha=fmt == "peft")
    elif fmt == "diffusers-old":
        tensors = _diffusers_old(layers, seed)
    elif fmt == "loha":
        tensors = _loha(layers, seed)
        metadata = {"ss_network_module": "lycoris.kohya"}
    elif fmt == "lokr":
        tensors = _lokr(layers, seed)
        metadata = {"ss_network_module": "lycoris.kohya"}
    else:
        tensors = _full(layers, shapes, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata or None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=FORMATS, default="kohya")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unet-only", action="store_true")
    parser.add_argument("--no-convs", action="store_true", help="linear layers only")
    parser.add_argument(
        "--alphas",
        choices=("varied", "kohya"),
        default="varied",
        help="LoRA alphas: each layer its own, or kohya's two (linear, conv)",
    )
    args = parser.parse_args(argv)
    components = ("unet",) if args.unet_only else ("unet", "text_encoder")
    make_tiny_lora(
        args.model_dir,
        args.out,
        args.format,
        args.seed,
        components,
        convs=not args.no_convs,
        alphas=args.alphas,
    )
    print(f"wrote {args.format} LoRA for {args.model_dir} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
