"""Check that exporting in one trace gives iree-compile the same input as turbine's two traces.

compile/exporters/base.py exports each function in one trace, decompositions applied while it
traces (`decomposed_while_traced`, torch private API), instead of torch.export's training graph
retraced by `run_decompositions`. This tool exports every distinct export of a model both ways,
for each (target, arch, dtype) asked, and compares what `iree-compile --compile-to=input` makes
of them, byte for byte; run it on the tiny models (tools/make_tiny_sd.py) after a torch or
iree-turbine upgrade:

    python tools/export_parity.py MODEL_DIR [MODEL_DIR ...] [--combos cpu:host:fp32,...]

One line per export (SAME or DIFF, and both export times); exit status 1 on any DIFF.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_COMBOS = (
    "cpu:host:fp32,cpu:host:bf16,cpu:host:fp16,cpu:x86-64-v3:fp32,cpu:x86-64-v3:bf16,"
    "cpu:x86-64-v4-bf16:fp32,cpu:x86-64-v4-bf16:bf16,vulkan-spirv:lavapipe:fp32,"
    "vulkan-spirv:lavapipe:fp16,vulkan-spirv:baseline:fp32,vulkan-spirv:rdna3:fp16,"
    "vulkan-spirv:ampere:fp32,vulkan-spirv:ampere:fp16,rocm:gfx942:fp16,cuda:sm_80:fp16,"
    "cuda:sm_80:fp32"
)


def compiler_input(mlir: Path) -> str:
    """What iree-compile makes of an export before anything target-specific: its torch input
    conversion (which drops torch.export's `_assert_tensor_metadata` checks), as text."""
    from sdiree.compile.iree_compile import iree_compile_tool

    out = mlir.with_suffix(".input.mlir")
    cmd = [iree_compile_tool(), "--iree-input-type=torch", "--compile-to=input", str(mlir)]
    subprocess.run([*cmd, "-o", str(out)], check=True)
    return out.read_text()


def plan_of(model: Path, target: str, arch: str, dtype: str, work: Path):
    """The compile's plan (raises UserError where the registry refuses the combination)."""
    from sdiree.compile.plan import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    opts = CompileOptions(model, target=target, arch=arch, dtype=dtype, out=work / "artifact")
    return resolve(opts, Reporter())


def export_both(plan, sub: str, work: Path) -> tuple[bool, list[float]]:
    from sdiree.compile.driver import Builder
    from sdiree.compile.exporters import kernel_isa
    from sdiree.compile.exporters.amx_matmul import set_kernel_isa
    from sdiree.compile.exporters.base import export_to_mlir
    from sdiree.compile.report import Reporter

    texts, seconds = [], []
    for one in (True, False):
        b = Builder(plan, Reporter())  # a fresh model each time: planning may cast it
        xplan = b.export_plan(sub)
        set_kernel_isa(kernel_isa(b.export_options(sub)))
        mlir = work / f"{sub}-{one}.mlirbc"
        t = time.perf_counter()
        export_to_mlir(xplan, mlir, one_trace=one)
        seconds.append(time.perf_counter() - t)
        texts.append(compiler_input(mlir))
    return texts[0] == texts[1], seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--combos", default=DEFAULT_COMBOS, help="target:arch:dtype,...")
    args = ap.parse_args(argv)
    from sdiree.runtime.errors import UserError

    seen, diffs = set(), 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models:
            for combo in args.combos.split(","):
                target, arch, dtype = combo.split(":")
                try:
                    plan = plan_of(model, target, arch, dtype, work)
                except UserError as e:  # a refused combination (the registry's reason)
                    print(f"refused {model.name} {combo}: {e}", flush=True)
                    continue
                for sub in plan.submodules:
                    options = plan.target.export_for(sub, plan.dtype, plan.arch)
                    dtypes = [plan.export_dtype, plan.submodule_export_dtype(sub)]
                    key = json.dumps([str(model), sub, dtypes, options], sort_keys=True)
                    if key in seen:
                        continue
                    seen.add(key)
                    same, (once, twice) = export_both(plan, sub, work)
                    diffs += not same
                    print(
                        f"{'SAME' if same else 'DIFF'} {model.name} {combo} {sub}: "
                        f"{once:.1f} s in one trace, {twice:.1f} s in two",
                        flush=True,
                    )
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
