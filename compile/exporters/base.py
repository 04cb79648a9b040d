"""What every exporter shares: tensor/function signatures and the turbine export call.

An exporter turns one diffusers/transformers submodule into an MLIR module whose parameters are
externalized under a scope (`#flow.parameter.named<"scope"::"name">`). Parameter names are those
of the inner model's own state dict, so one parameter archive serves every target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
NUMPY_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name

    def example(self) -> torch.Tensor:
        torch_dtype = {v: k for k, v in NUMPY_DTYPE_NAMES.items()}[self.dtype]
        if torch_dtype.is_floating_point:
            return torch.zeros(self.shape, dtype=torch_dtype)
        return torch.ones(self.shape, dtype=torch_dtype)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class FunctionSpec:
    """One entry function: its inputs, outputs and the Python callable traced for it."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    fn: Callable = field(compare=False, repr=False)

    def to_json(self) -> dict:
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }


@dataclass
class ExportPlan:
    """Everything needed to export one submodule and save its parameters."""

    submodule: str  # e.g. "unet", "vae_decoder"
    scope: str  # parameter scope, e.g. "unet", "vae"
    root: torch.nn.Module  # what the entry functions are traced on
    params_module: torch.nn.Module  # whose state dict names the parameters
    functions: list[FunctionSpec]
    # Export choices that change the MLIR (attention lowering, ...), for cache keys.
    options: dict = field(default_factory=dict)
    # Tag of the parameters computed at export (e.g. "winograd2"), saved apart from the model's
    # own; None when there are none.
    derived: str | None = None

    def signature_json(self) -> dict:
        return {f.name: f.to_json() for f in self.functions}


def export_to_mlir(plan: ExportPlan, mlir_path: Path, strict: bool = False) -> None:
    """Trace every entry function of plan and write one MLIR module (bytecode) to mlir_path.

    torch.export runs non-strict by default here: it traces the Python as it runs instead of
    first analysing its bytecode with dynamo. That gives the same MLIR for every exporter and
    export choice (tests/compile/exporters/test_base.py) in about half the time: the SD 1.5-size
    UNet with the cpu preset exports in 212 s instead of 426 s (tools/PERFORMANCE.md).
    """
    from iree.turbine import aot

    aot.externalize_module_parameters(plan.params_module, external_scope=plan.scope)
    fxb = aot.FxProgramsBuilder(plan.root)
    for spec in plan.functions:
        args = tuple(t.example() for t in spec.inputs)
        fxb.export_program(spec.fn, name=spec.name, args=args, strict=strict)
    output = aot.export(fxb, module_name=plan.submodule)
    output.save_mlir(mlir_path)


def save_parameters(
    module: torch.nn.Module, path: Path, derived: bool = False, source=None
) -> None:
    """Write module's parameters and persistent buffers to an .irpa archive at path: the
    model's own ones, or (derived=True) only those computed at export.

    With source (compile/weight_source.py: where the loaded weights lie), a placeholder
    parameter (compile/placeholders.py) is read from it, one tensor at a time, and a derived one
    computed from it; without, every tensor is the module's own."""
    from ..archive_writer import ArchiveEntry, write_archive
    from .derived import derived_weight_maker, is_derived

    entries = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if is_derived(name) != derived:
            continue
        make = _tensor_maker(name, tensor, source, derived_weight_maker)
        entries.append(ArchiveEntry(name, tensor.dtype, tuple(tensor.shape), make))
    write_archive(entries, path)


def _tensor_maker(name, tensor, source, derived_weight_maker):
    """Where the archive takes name's bytes from: a file range, or a function making it."""
    from ..placeholders import is_placeholder
    from .derived import is_derived

    if source is None or not is_placeholder(tensor):
        if is_placeholder(tensor):
            raise ValueError(f"{name} is a placeholder and no weight source was given")
        return lambda: tensor.detach()
    dtype = tensor.dtype
    if is_derived(name):
        return derived_weight_maker(name, tuple(tensor.shape), dtype, source)
    in_file = source.file_range(name, dtype)
    return in_file if in_file is not None else (lambda: source.tensor(name).to(dtype))
