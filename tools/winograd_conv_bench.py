"""Time one 3x3 convolution exported as each of sdiree's Winograd forms, on this CPU.

The cpu preset's conv choices (F(2x2) or F(4x4) per input side, one batched matmul or one
matmul per tile element from `winograd_split_min_side`) were measured per CPU kind one conv
at a time: this is that measurement. For one conv (channels in = out, square input side,
batch), each variant is exported with iree-turbine, compiled with the shipped cpu target's fp32 UNet
flags for this machine's CPU (the registry's, `host` arch), loaded in this process, checked
against torch's conv2d (relative max error) and timed round by round, A B C A B C ..., so
drift hits every variant alike. Prints each variant's median, its ratio to the first's and
its error. Needs the compile extra.

    python tools/winograd_conv_bench.py CHANNELS SIDE BATCH VARIANT[,VARIANT...] [--runs 7]

A variant is `m:inverse:split`: m the output tile (2 or 4), inverse `batched` or
`interleaved` (F(2x2) only), split the least input side that splits the conv into one matmul
per tile element (0: never). `plain` is the conv as one im2col matmul, as the UNet's export
choice `plain_from_downscale` lowers its smallest convs (no transformed weights to hold). The
shipped UNet at 64x64 latents, e.g.:

    python tools/winograd_conv_bench.py 320 64 2 4:batched:16,2:interleaved:16,4:batched:0

`--kernels ISA` (amx or avx512_bf16) compiles with the cpu bf16 UNet flags instead and puts the
split products on sdiree's matmul kernel built for ISA (`m:inverse:split` as above, export
choice `matmul_kernel: amx`), and adds the variant `fused`: the conv on the fused Winograd
kernels (export choice `winograd_kernel: fused`, compile/exporters/winograd_fused.py), and
`direct`: the direct 3x3 conv kernel (compile/exporters/conv_amx.py, what a conv takes where
`direct_convs` puts it); each conv adds a residual, as a resnet's conv2 does (fused and direct:
in the kernel's epilogue). The cpu bf16 UNet
on a Zen 4, e.g.:

    python tools/winograd_conv_bench.py 320 64 2 2:interleaved:16,fused --kernels avx512_bf16
"""

from __future__ import annotations

import argparse
import functools
import time
import types

import numpy as np


def unet_flags(dtype: str = "fp32") -> list[str]:
    """iree-compile's flags for the UNet of a cpu compile in dtype for this machine's CPU (the
    shipped registry's, as `sdiree compile --target cpu` gives them)."""
    from sdiree.runtime.targets import load_registry

    return load_registry().target("cpu").compile_flags("host", dtype, "unet")


def build(
    channels: int,
    side: int,
    batch: int,
    m: int,
    inverse: str,
    split: int | None,
    kernels: str | None = None,
):
    """The conv as this variant (m 0: plain; -1: fused), compiled: (vmfb bytes, inputs, torch's
    output). With kernels (an ISA) on sdiree's kernels, bf16, plus a residual (m -2: the direct
    conv kernel)."""
    import iree.compiler as ic
    import iree.turbine.aot as aot
    import torch

    from sdiree.compile.exporters.im2col import conv2d_as_matmul
    from sdiree.compile.exporters.winograd import conv2d_winograd, winograd_weight
    from sdiree.runtime.weights.winograd import WINOGRAD_PARAM

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1).requires_grad_(False)
    matmul = "amx" if kernels else "iree"
    if m == -2:
        lowering = None
    elif m:
        u = winograd_weight(conv.weight.detach().double(), max(m, 2)).float()  # fused: F(2x2)
        conv.register_parameter(WINOGRAD_PARAM, torch.nn.Parameter(u, requires_grad=False))
        lowering = functools.partial(
            conv2d_winograd, m=m, output=inverse, split_min_side=split, matmul=matmul
        )
    else:
        lowering = functools.partial(conv2d_as_matmul, matmul=matmul)
    x = torch.randn(batch, channels, side, side)
    with torch.no_grad():
        ref = torch.nn.functional.conv2d(x, conv.weight, conv.bias, padding=1)
    if not kernels:
        conv.forward = types.MethodType(lowering, conv)
        mlir = aot.export(conv.eval(), args=(x,)).mlir_module.operation.get_asm()
        return ic.compile_str(mlir, extra_args=unet_flags()), (x.numpy(),), ref.numpy()
    return _build_on_kernels(conv, lowering, x, ref, {-1: "fused", -2: "direct"}.get(m), kernels)


def _build_on_kernels(conv, lowering, x, ref, kernel: str | None, isa: str):
    """The conv on sdiree's kernels for isa, channels-last, plus a residual (kernel `fused` or
    `direct`: in that kernel's epilogue)."""
    import iree.compiler as ic
    import iree.turbine.aot as aot
    import torch

    from sdiree.compile.exporters import conv_amx, winograd_fused
    from sdiree.compile.exporters.amx_matmul import register, set_kernel_isa

    set_kernel_isa(isa)
    register()
    winograd_fused.register()
    conv_amx.register()
    if kernel == "fused":
        winograd_fused.mark(conv)

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, xh, res):
            if kernel == "fused":
                return winograd_fused.conv3x3_wino_nhwc(self.conv, xh, None, res)
            if kernel == "direct":
                n, h, w, c = xh.shape
                _, _, tail = conv_amx.padded_rows(n, h, w)
                xp = torch.nn.functional.pad(xh, (0, 0, 1, 1, 1, 1)).reshape(-1, c)
                xp = torch.nn.functional.pad(xp, (0, 0, 0, tail)).to(torch.bfloat16)
                return conv_amx.conv3x3_amx_padded(self.conv, xp, n, h, w, residual=res)
            return lowering(self.conv, xh.permute(0, 3, 1, 2)).permute(0, 2, 3, 1) + res

    xh = x.permute(0, 2, 3, 1).contiguous()
    res = torch.randn(xh.shape)
    mlir = aot.export(Conv(), args=(xh, res)).mlir_module.operation.get_asm()
    want = ref.permute(0, 2, 3, 1) + res
    vmfb = ic.compile_str(mlir, extra_args=unet_flags("bf16"))
    return vmfb, (xh.numpy(), res.numpy()), want.numpy()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("channels", type=int)
    p.add_argument("side", type=int)
    p.add_argument("batch", type=int)
    p.add_argument(
        "variants", help="m:inverse:split or plain[,...], e.g. 4:batched:16,2:interleaved:16,plain"
    )
    p.add_argument("--kernels", choices=("amx", "avx512_bf16"), help="bf16 on sdiree's kernels")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)

    import iree.runtime as rt

    from sdiree.compile.exporters.winograd import WINOGRAD_OUTPUTS, WINOGRAD_TILES

    tiles = {str(m) for m in WINOGRAD_TILES.values()}
    forms = []
    for text in a.variants.split(","):
        if text == "plain":
            forms.append((text, "0", "batched", "0"))
            continue
        if text in ("fused", "direct") and a.kernels:
            forms.append((text, "-1" if text == "fused" else "-2", "batched", "0"))
            continue
        parts = text.split(":")
        m, inverse, split = parts if len(parts) == 3 else ("", "", "")
        if (
            m not in tiles
            or inverse not in WINOGRAD_OUTPUTS
            or not split.isdigit()
            or (inverse == "interleaved" and m != "2")
        ):
            p.error(
                f"variant {text!r} is not plain or m:inverse:split (m {'/'.join(sorted(tiles))}; inverse "
                f"{' or '.join(WINOGRAD_OUTPUTS)}, interleaved for m 2 only; split >= 0)"
            )
        forms.append((text, m, inverse, split))
    calls = []
    for text, m, inverse, split in forms:
        vmfb, x, ref = build(
            a.channels, a.side, a.batch, int(m), inverse, int(split) or None, a.kernels
        )
        ctx = rt.SystemContext(config=rt.Config("local-task"))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        fn = ctx.modules.module["main"]
        err = float(np.abs(np.asarray(fn(*x)) - ref).max() / np.abs(ref).max())
        calls.append((text, fn, x, err))
    times: dict[str, list[float]] = {c[0]: [] for c in calls}
    for i in range(a.warmup + a.runs):
        for name, fn, x, _ in calls:
            t = time.perf_counter()
            fn(*x)
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t)
    rows, first = [], None
    for name, _, _, err in calls:
        med = float(np.median(times[name])) * 1e3
        first = first or med
        rows.append({"variant": name, "ms": med, "ratio": med / first, "rel_err": err})
        shape = f"{a.channels} ch {a.side}² batch {a.batch}"
        print(f"{shape}  {name:18s} {med:9.2f} ms  x{med / first:.3f}  rel err {err:.1e}")
    return rows


if __name__ == "__main__":
    main()
