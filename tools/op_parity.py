"""Op-level parity for a compile target: which building block of SD does a target miscompile?

A whole-model parity failure (tools/parity.py, `sdiree.compile.verify`) says that something is
wrong, not what. This tool exports each op SD is made of (linear, batched matmul, 1x1 / 3x3 /
strided convolutions, group and layer norm, softmax, SDPA, activations, upsampling, a resnet-like
chain) as its own small module at the chosen dtype, compiles it with the target's registry flags
plus each named flag variant, and checks every build against torch fp32 on the same
(dtype-rounded) inputs and weights.

  build (needs the compile extra; cross-compiles offline, so GPU builds can be made here):
    python tools/op_parity.py build DIR --target cuda --arch sm_80 --dtype fp16 \\
        --variant base= --variant no-vd=--iree-codegen-llvmgpu-use-vector-distribution=false
  run (torch-free; iree runtime and numpy only, so it runs where the device is):
    python tools/op_parity.py run DIR --driver cuda

`run` prints one row per op and one column per variant: rel = max|out - ref| / max|ref|, or
"FAIL" where the build did not compile. Exit status 0 either way: it is a diagnostic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _min_mask(q):
    """Causal additive mask filled with the dtype's minimum, as transformers' CLIP builds it."""
    import torch

    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(n, n, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)


def _clip(attention: str):
    """A small CLIP text transformer (random weights) returning its last hidden state."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(1)
    cfg = CLIPTextConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
    )
    model = CLIPTextModel(cfg).eval()
    model.set_attn_implementation(attention)

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, return_dict=False)[0]

    return Last()


def _ops():
    """name -> (torch module, input shapes). Shapes keep SD's layouts at small sizes."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from sdiree.compile.exporters.im2col import conv2d_as_matmul

    class Fn(nn.Module):
        def __init__(self, fn, *mods):
            super().__init__()
            self.mods = nn.ModuleList(mods)
            self.fn = fn

        def forward(self, *xs):
            return self.fn(self.mods, *xs)

    def single(mod):
        return Fn(lambda m, x: m[0](x), mod)

    return {
        "linear": (single(nn.Linear(64, 128)), [(2, 77, 64)]),
        "proj_1024x320": (single(nn.Linear(320, 320)), [(2, 1024, 320)]),
        "bmm": (Fn(lambda m, a, b: torch.bmm(a, b)), [(8, 256, 64), (8, 64, 256)]),
        "conv3x3": (single(nn.Conv2d(32, 64, 3, padding=1)), [(2, 32, 32, 32)]),
        "conv1x1": (single(nn.Conv2d(64, 64, 1)), [(2, 64, 32, 32)]),
        "conv3x3_s2": (single(nn.Conv2d(64, 64, 3, stride=2, padding=1)), [(2, 64, 32, 32)]),
        "groupnorm": (single(nn.GroupNorm(32, 64)), [(2, 64, 32, 32)]),
        "layernorm": (single(nn.LayerNorm(64)), [(2, 256, 64)]),
        "softmax": (Fn(lambda m, x: torch.softmax(x, -1)), [(2, 4, 256, 256)]),
        "sdpa": (
            Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v)),
            [(2, 4, 256, 32)] * 3,
        ),
        "gelu": (Fn(lambda m, x: F.gelu(x)), [(2, 256, 128)]),
        "silu": (Fn(lambda m, x: F.silu(x)), [(2, 256, 128)]),
        "upsample": (Fn(lambda m, x: F.interpolate(x, scale_factor=2.0)), [(2, 64, 16, 16)]),
        "conv1x1_nobias": (single(nn.Conv2d(64, 64, 1, bias=False)), [(2, 64, 32, 32)]),
        "conv1x1_as_matmul": (
            Fn(lambda m, x: conv2d_as_matmul(m[0], x), nn.Conv2d(64, 64, 1)),
            [(2, 64, 32, 32)],
        ),
        "conv1x1_einsum": (
            Fn(
                lambda m, x: (
                    torch.einsum("oc,nchw->nohw", m[0].weight[:, :, 0, 0], x)
                    + m[0].bias[:, None, None]
                ),
                nn.Conv2d(64, 64, 1),
            ),
            [(2, 64, 32, 32)],
        ),
        "sdpa_causal": (
            Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            [(2, 4, 77, 32)] * 3,
        ),
        "sdpa_minmask": (
            Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_min_mask(q))),
            [(2, 4, 77, 32)] * 3,
        ),
        "quick_gelu": (Fn(lambda m, x: x * torch.sigmoid(1.702 * x)), [(2, 77, 128)]),
        "clip_text_sdpa": (_clip("sdpa"), [torch.randint(0, 1000, (1, 77))]),
        "clip_text_eager": (_clip("eager"), [torch.randint(0, 1000, (1, 77))]),
        "resnet_chain": (
            Fn(
                lambda m, x: m[1](F.silu(m[0](x))) + x,
                nn.GroupNorm(32, 64),
                nn.Conv2d(64, 64, 3, padding=1),
            ),
            [(2, 64, 32, 32)],
        ),
    }


def build(args) -> int:
    import numpy as np
    import torch
    from iree.turbine import aot

    from sdiree.compile.exporters.base import TORCH_DTYPES
    from sdiree.compile.iree_compile import iree_compile_tool
    from sdiree.runtime.targets import load_registry

    target = load_registry().target(args.target)
    flags = target.compile_flags(args.arch, args.dtype)
    variants = dict(v.split("=", 1) for v in args.variant) or {"base": ""}
    dtype = TORCH_DTYPES[args.dtype]
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    index = {"target": args.target, "arch": args.arch, "dtype": args.dtype, "ops": {}}
    for name, (mod, shapes) in _ops().items():
        if args.only and name not in args.only:
            continue
        mod = mod.eval().to(dtype)
        xs = [s if isinstance(s, torch.Tensor) else torch.randn(s).to(dtype) for s in shapes]
        with torch.no_grad():
            ref = mod.float()(*[x.float() if x.is_floating_point() else x for x in xs]).numpy()
            mod = mod.to(dtype)
        np.savez(out / f"{name}.npz", ref=ref, **{f"x{i}": x.numpy() for i, x in enumerate(xs)})
        mlir = out / f"{name}.mlir"
        aot.export(mod, args=tuple(xs)).save_mlir(mlir)
        builds = {}
        for vname, vflags in variants.items():
            vmfb = out / f"{name}.{vname}.vmfb"
            extra = vflags.split() if vflags else []
            if "--no-O3" in extra:
                extra.remove("--no-O3")
                base = [f for f in flags if not f.startswith("--iree-opt-level")]
            else:
                base = flags
            proc = subprocess.run(
                [iree_compile_tool(), str(mlir), "-o", str(vmfb), *base, *extra],
                capture_output=True,
                text=True,
            )
            ok = proc.returncode == 0
            builds[vname] = ok
            err = "" if ok else next((ln for ln in proc.stderr.splitlines() if "error" in ln), "?")
            print(f"{name:14s} {vname:12s} {'ok' if ok else 'FAIL ' + err[:150]}", flush=True)
        mlir.unlink()
        index["ops"][name] = builds
    index["variants"] = variants
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return 0


def run(args) -> int:
    import numpy as np
    from iree import runtime as rt

    out = Path(args.dir)
    index = json.loads((out / "index.json").read_text())
    variants = list(index["variants"])
    config = rt.Config(args.driver)
    print(f"{index['target']} {index['arch']} {index['dtype']} on {args.driver}")
    print("| op | " + " | ".join(variants) + " |")
    print("| --- |" + " ---: |" * len(variants))
    for name, builds in index["ops"].items():
        data = np.load(out / f"{name}.npz")
        xs = [data[f"x{i}"] for i in range(len(data.files) - 1)]
        ref = data["ref"]
        cells = []
        for vname in variants:
            if not builds.get(vname):
                cells.append("FAIL")
                continue
            try:
                vmfb = rt.VmModule.copy_buffer(
                    config.vm_instance, (out / f"{name}.{vname}.vmfb").read_bytes()
                )
                ctx = rt.SystemContext(vm_modules=[vmfb], config=config)
                got = np.asarray(ctx.modules.module.main(*xs).to_host()).astype(np.float32)
                rel = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
                cells.append(f"{rel:.1e}" + ("" if np.isfinite(got).all() else " nan"))
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                cells.append(f"ERR {str(e).splitlines()[0][:40]}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--target", required=True)
    b.add_argument("--arch", required=True)
    b.add_argument("--dtype", default="fp16")
    b.add_argument(
        "--variant", action="append", default=[], help="NAME=FLAGS ('--no-O3' drops -O3)"
    )
    b.add_argument("--only", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--driver", required=True)
    args = p.parse_args(argv)
    return build(args) if args.cmd == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
