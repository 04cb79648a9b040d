"""Write an SD 1.5, SD 2.1 or SDXL base 1.0-architecture diffusers folder with random weights
at the real sizes.

The configs are the released models' (no download): SD 1.5 and SD 2.1 (768x768, v-prediction)
from sdiree's shipped presets (specs/models/sd15, specs/models/sd21), SDXL base 1.0 from
specs/models/sdxl (two text encoders: CLIP ViT-L and OpenCLIP bigG with its projection; the
"text_time" UNet with transformer_layers_per_block [1, 2, 10]; the VAE with scaling 0.13025 and
force_upcast; EulerDiscreteScheduler; force_zeros_for_empty_prompt). So compile and run times,
memory and parameter archive sizes are those of the real model (fp32: SD 1.5 about 4.3 GB,
SD 2.1 about 5.2 GB, SDXL about 13.9 GB) without downloading it. The images are noise: use it
for performance work, never for image quality.

Every tokenizer is CLIP's real BPE (sdiree's specs/models/clip-bpe: 49,408 tokens,
<|startoftext|> 49406, <|endoftext|> 49407) with the preset's tokenizer configs (SD 2.1's and
SDXL's tokenizer_2 pad with "!", as OpenCLIP's does). Weights are safetensors under the names
from_pretrained reads without a variant (sdiree reads no other): fp32 by default, fp16 with
`--dtype fp16` (the weights the real repos' ".fp16" variant files hold, under the plain names).
Every config is the preset's as it is, as in the real repos, whose fp32 and fp16 files share
one config: SDXL's text encoder configs say "torch_dtype": "float16" over fp32 files, and
transformers 5 loads a model in its config's dtype unless told otherwise. Initialisation is each layer's own (diffusers: PyTorch's defaults;
transformers: the model's post-init), deterministic from the seed.

Memory: a diffusers component (UNet, VAE) is built on torch's meta device and written one layer
at a time, each layer initialised, written and dropped before the next, so even SDXL's 10 GB
UNet never sits in memory; a text encoder (at most 2.8 GB, SDXL's bigG) is built whole, written
tensor by tensor and freed before the next component. The folder is written under a temporary
name beside OUT_DIR and renamed when complete (an existing OUT_DIR is replaced).
Needs the compile extra (torch, diffusers, transformers).

    python tools/make_random_sd.py --family sd15|sd21|sdxl OUT_DIR [--seed 0] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

# family: (its preset folder, sdiree's family name in specs/families.json, label)
FAMILIES = {
    "sd15": ("specs:sd15", "sd1", "SD 1.5"),
    "sd21": ("specs:sd21", "sd2", "SD 2.1 (768x768, v-prediction)"),
    "sdxl": ("specs:sdxl", "sdxl", "SDXL base 1.0"),
}
DTYPES = ("fp32", "fp16")
# The components with weights, and the width keys of their configs, divided by `narrow` (tests
# only); layer and head counts are kept, so a narrowed model has the real depth and structure.
WEIGHTED = {
    "unet": (
        "block_out_channels",
        "cross_attention_dim",
        "norm_num_groups",
        "addition_time_embed_dim",
        "projection_class_embeddings_input_dim",
    ),
    "vae": ("block_out_channels", "norm_num_groups"),
    "text_encoder": ("hidden_size", "intermediate_size", "projection_dim"),
    "text_encoder_2": ("hidden_size", "intermediate_size", "projection_dim"),
}
WEIGHT_FILES = {
    "diffusers": "diffusion_pytorch_model.safetensors",
    "transformers": "model.safetensors",
}
CONFIG_FILES = {"scheduler": "scheduler_config.json"}  # every other component: config.json
_ST_DTYPES = {"float32": "F32", "float16": "F16"}


def preset_dir(family: str) -> Path:
    """The folder of configs (no weights) the family's model is written from."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    where = FAMILIES[family][0]
    if where.startswith("specs:"):
        from sdiree.compile.single_file import presets_dir

        return presets_dir() / where.removeprefix("specs:")
    return Path(where)


def read_preset(family: str, narrow: int = 1) -> tuple[dict, dict[str, dict]]:
    """(model_index.json, {component: its config}) of a family, widths divided by narrow."""
    root = preset_dir(family)
    index = json.loads((root / "model_index.json").read_text())
    configs = {}
    for comp in components(index):
        fname = CONFIG_FILES.get(comp, "config.json")
        if (root / comp / fname).is_file():
            configs[comp] = json.loads((root / comp / fname).read_text())
    return index, {c: narrowed(c, cfg, narrow) for c, cfg in configs.items()}


def components(index: dict) -> list[str]:
    """The model_index.json entries that are [library, class] pairs."""
    return [
        k
        for k, v in index.items()
        if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None
    ]


def narrowed(component: str, config: dict, narrow: int) -> dict:
    """config with its width keys (WEIGHTED) divided by narrow; ValueError where one does not
    divide."""
    out = dict(config)
    for key in WEIGHTED.get(component, ()) if narrow != 1 else ():
        if out.get(key) is None:
            continue
        values = out[key] if isinstance(out[key], list) else [out[key]]
        if any(v % narrow for v in values):
            raise ValueError(f"{component}.{key} = {out[key]} is not divisible by {narrow}")
        scaled = [v // narrow for v in values]
        out[key] = scaled if isinstance(out[key], list) else scaled[0]
    return out


def build(index: dict, component: str, config: dict, device: str = "meta"):
    """The component's module from its config, float32, on device ("meta": no memory)."""
    import importlib

    import torch

    library, cls_name = index[component]
    cls = getattr(importlib.import_module(library), cls_name)
    with torch.device(device):
        if library == "diffusers":
            return cls.from_config(config)
        return cls(cls.config_class.from_dict(config))


def parameter_counts(family: str, narrow: int = 1) -> dict[str, int]:
    """{component: parameter count} of the family's model, built on the meta device."""
    index, configs = read_preset(family, narrow)
    counts = {}
    for comp in components(index):
        if comp in WEIGHTED:
            module = build(index, comp, configs[comp])
            counts[comp] = sum(p.numel() for p in module.parameters())
    return counts


def _layerwise_tensors(module, names: list[str]) -> Iterator:
    """The state-dict tensors of a meta-device diffusers module, in names' order: each layer
    materialised on cpu and initialised (its reset_parameters, PyTorch's default init) when its
    first tensor is due, dropped back to meta after its last."""
    import torch

    owners = {}
    for mod_name, mod in module.named_modules():
        for attr, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            owners[f"{mod_name}.{attr}" if mod_name else attr] = (mod, attr)
    last_of = {id(owners[n][0]): n for n in names}
    with torch.no_grad():
        for name in names:
            mod, attr = owners[name]
            tensor = getattr(mod, attr)
            if tensor.is_meta:
                if not hasattr(mod, "reset_parameters"):
                    raise RuntimeError(f"{type(mod).__name__} ({name}) has no initialiser")
                mod.to_empty(device="cpu", recurse=False)
                mod.reset_parameters()
                tensor = getattr(mod, attr)
            yield tensor
            if last_of[id(mod)] == name:
                mod.to_empty(device="meta", recurse=False)


def write_safetensors_stream(path: Path, shapes: dict[str, tuple], dtype, tensors: Iterator):
    """A safetensors file of the tensors named in shapes (in its order), each cast to dtype as
    it comes: the header is written from the shapes first, so no two tensors need be held."""
    import torch

    st_dtype = _ST_DTYPES[str(dtype).removeprefix("torch.")]
    size = torch.tensor([], dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * size
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, tensor in zip(shapes, tensors, strict=True):
            if tuple(tensor.shape) != tuple(shapes[name]):
                raise RuntimeError(f"{name}: shape {tuple(tensor.shape)}, header {shapes[name]}")
            data = tensor.detach().to(dtype).contiguous().reshape(-1)
            f.write(data.view(torch.uint8).numpy().tobytes())
        if f.tell() != 8 + len(raw) + offset:
            raise RuntimeError(
                f"{path}: wrote {f.tell()} bytes, header says {8 + len(raw) + offset}"
            )


def write_component(out: Path, index: dict, component: str, config: dict, seed: int, dtype):
    """The component's config and weights (initialised from seed) into out/component."""
    import torch

    library = index[component][0]
    folder = out / component
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    if library == "diffusers":
        module = build(index, component, config, "meta")
        tensors = module.state_dict()
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        stream = _layerwise_tensors(module, list(shapes))
    else:
        module = build(index, component, config, "cpu")
        tensors = module.state_dict()
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        stream = iter(tensors.values())
    write_safetensors_stream(folder / WEIGHT_FILES[library], shapes, dtype, stream)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_random_sd(
    out_dir: Path, family: str = "sd15", seed: int = 0, dtype: str = "fp32", narrow: int = 1
) -> Path:
    """Write the family's full-size random pipeline to out_dir (narrow > 1 divides every width
    by it: small models for tests); returns out_dir."""
    import torch

    from sdiree.compile.single_file import write_clip_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    out_dir = Path(out_dir)
    index, configs = read_preset(family, narrow)
    root = preset_dir(family)
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        for i, comp in enumerate(components(index)):
            library, cls_name = index[comp]
            if comp in WEIGHTED:
                write_component(tmp, index, comp, configs[comp], seed + i, torch_dtype)
            elif cls_name == "CLIPTokenizer":
                write_clip_tokenizer(tmp / comp, root / comp)
            else:  # the scheduler: its preset file as it is
                (tmp / comp).mkdir()
                shutil.copyfile(root / comp / CONFIG_FILES[comp], tmp / comp / CONFIG_FILES[comp])
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None, family: str | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    if family is None:
        parser.add_argument("--family", choices=tuple(FAMILIES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    args = parser.parse_args(argv)
    family = family or args.family
    make_random_sd(args.out_dir, family=family, seed=args.seed, dtype=args.dtype)
    label = FAMILIES[family][2]
    print(f"wrote {label}-architecture pipeline with random {args.dtype} weights to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
