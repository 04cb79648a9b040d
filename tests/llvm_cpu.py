"""Compile a traced MLIR module for this machine's CPU with iree's llvm-cpu and call its `main`:
how the exporter tests check that a graph runs through iree as it does in torch."""

from __future__ import annotations

import numpy as np

# the cpu target's data tiling and matmul ukernels (specs/targets.json)
DATA_TILING = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")


def run_main(
    mlir: str, *inputs: np.ndarray, flags: tuple[str, ...] = (), cpu: str = "host"
) -> np.ndarray:
    return call_main(compile_main(mlir, flags, cpu), *inputs)


def compile_main(mlir: str, flags: tuple[str, ...] = (), cpu: str = "host") -> bytes:
    from iree.compiler import compile_str

    extra = [f"--iree-llvmcpu-target-cpu={cpu}", *flags]
    return compile_str(mlir, target_backends=["llvm-cpu"], extra_args=extra)


def host_has_amx() -> bool:
    from sdiree.runtime.cpu_features import host_cpu_features

    return {"amx_tile", "amx_bf16"} <= host_cpu_features()


def host_runs_kernels() -> bool:
    """Whether this CPU runs sdiree's kernels as the traces link them now (the `kernel_isa` that
    compile/exporters/amx_matmul.py's set_kernel_isa set: AMX's, or AVX-512 bf16's)."""
    from sdiree.compile.exporters import KERNEL_FEATURES
    from sdiree.compile.exporters.amx_matmul import current_kernel_isa
    from sdiree.runtime.cpu_features import host_cpu_features

    return set(KERNEL_FEATURES[current_kernel_isa()]) <= host_cpu_features()


def run_amx_main(
    mlir: str, *inputs: np.ndarray, kernel: str = "sdiree_amx_bf16_matmul_workgroup"
) -> np.ndarray | None:
    """Compile a module that links one of sdiree's kernels (compile/exporters/amx_matmul.py,
    attention_amx.py) and call its main where this CPU runs them (host_runs_kernels); elsewhere
    cross-compile it for an AMX CPU (the kernel must link) and return None."""
    runs = host_runs_kernels()
    vmfb = compile_main(mlir, DATA_TILING, "host" if runs else "sapphirerapids")
    assert kernel.encode() in vmfb
    return call_main(vmfb, *inputs) if runs else None


def call_main(vmfb: bytes, *inputs: np.ndarray) -> np.ndarray:
    import iree.runtime as rt

    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return np.asarray(ctx.modules.module.main(*inputs).to_host())


def host_unet_takes_panels(arch: str = "host") -> bool:
    """Whether a cpu fp32 compile for arch exports the UNet's linears as weight panels (on a CPU
    without avx512f: `if_cpu_lacks` in specs/targets.json)."""
    from sdiree.runtime.targets import load_registry

    cpu = load_registry().target("cpu")
    return cpu.export_for("unet", "fp32", arch).get("linear") == "panels"


def unet_winograd_read_in_place(manifest) -> set[str]:
    """The UNet's derived Winograd weights that its module reads as they are, not through its
    encoder: under `matmul_kernel: f32` (a cpu fp32 compile on an AVX-512 CPU without AMX) a
    product's weight is packed [N / 64, K, 64] in the graph (compile/exporters/linear_f32.py),
    which for one panel of outputs (the tiny model's 64-channel convs; none at SD 1.5 size) is
    a reshape: nothing for the encoder to pack, so the artifact keeps those in their archive."""
    from sdiree.compile.exporters.linear_f32 import PANEL

    if manifest.data["submodules"]["unet"]["export"].get("matmul_kernel") != "f32":
        return set()
    derived = manifest.submodules["unet"].encoder.derived
    return {k for k, (shape, _) in derived.items() if shape[-1] == PANEL}


def host_fp32_splits() -> bool:
    """Whether a `host` cpu fp32 compile puts the UNet and VAE on sdiree's AMX kernels with
    bf16x3 operands (an AMX CPU: `if_cpu_has` in specs/targets.json). Their encoded weights are
    then computed, not laid out: no layout is learned and their archives are not pruned."""
    from sdiree.runtime.targets import load_registry

    cpu = load_registry().target("cpu")
    return cpu.export_for("unet", "fp32", "host").get("amx_operands") == "bf16x3"


def avx2_cpu_fp32() -> tuple[str, str, str]:
    """The cpu fp32 artifact compiled for a CPU without AVX-512, its UNet's linears weight
    panels (host_unet_takes_panels): `host`'s on such a CPU, else `x86-64-v3`'s."""
    return ("cpu", "host", "fp32") if host_unet_takes_panels() else ("cpu", "x86-64-v3", "fp32")


def laid_out_cpu_fp32() -> tuple[str, str, str]:
    """The cpu fp32 artifact whose encoded weights are layouts of its archives (what the prune,
    layout and LoRA re-pack tests need): `host`'s, or on an AMX CPU (host_fp32_splits)
    `x86-64-v3`'s, which runs on any CPU of the suite."""
    return ("cpu", "x86-64-v3", "fp32") if host_fp32_splits() else ("cpu", "host", "fp32")
