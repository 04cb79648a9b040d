"""Compile a traced MLIR module for this machine's CPU with iree's llvm-cpu and call its `main`:
how the exporter tests check that a graph runs through iree as it does in torch."""

from __future__ import annotations

import numpy as np

# the cpu target's data tiling and matmul ukernels (specs/targets.json)
DATA_TILING = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")


def run_main(mlir: str, *inputs: np.ndarray, flags: tuple[str, ...] = ()) -> np.ndarray:
    import iree.runtime as rt
    from iree.compiler import compile_str

    vmfb = compile_str(
        mlir, target_backends=["llvm-cpu"], extra_args=["--iree-llvmcpu-target-cpu=host", *flags]
    )
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return np.asarray(ctx.modules.module.main(*inputs).to_host())


def host_unet_takes_panels() -> bool:
    """Whether a `host` cpu fp32 compile exports the UNet's linears as weight panels (on a CPU
    without avx512f: `if_cpu_lacks` in specs/targets.json)."""
    from sdiree.runtime.targets import load_registry

    cpu = load_registry().target("cpu")
    return cpu.export_for("unet", "fp32", "host").get("linear") == "panels"
