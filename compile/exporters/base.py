"""What every exporter shares: tensor/function signatures and the turbine export call.

An exporter turns one diffusers/transformers submodule into an MLIR module whose parameters are
externalized under a scope (`#flow.parameter.named<"scope"::"name">`). Parameter names are those
of the inner model's own state dict, so one parameter archive serves every target.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
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


def export_to_mlir(
    plan: ExportPlan, mlir_path: Path, strict: bool = False, one_trace: bool = True
) -> None:
    """Trace every entry function of plan and write one MLIR module (bytecode) to mlir_path.

    torch.export runs non-strict by default here: it traces the Python as it runs instead of
    first analysing its bytecode with dynamo. That gives the same MLIR for every exporter and
    export choice (tests/compile/exporters/test_base.py) in about half the time: the SD 1.5-size
    UNet with the cpu preset exports in 212 s instead of 426 s (tools/PERFORMANCE.md).

    With one_trace (the default) each function is traced once, decompositions applied as it
    is traced (`decomposed_while_traced`), instead of traced and then traced again by
    turbine's `run_decompositions`: the same IR for iree-compile in about half the time again.
    """
    from iree.turbine import aot

    aot.externalize_module_parameters(plan.params_module, external_scope=plan.scope)
    fxb = aot.FxProgramsBuilder(plan.root)
    with decomposed_while_traced() if one_trace else contextlib.nullcontext():
        for spec in plan.functions:
            args = tuple(t.example() for t in spec.inputs)
            fxb.export_program(spec.fn, name=spec.name, args=args, strict=strict)
    output = aot.export(fxb, module_name=plan.submodule)
    output.save_mlir(mlir_path)


@contextlib.contextmanager
def decomposed_while_traced() -> Iterator[None]:
    """Within it, turbine's `export_program` traces straight to the ATen graph it would get
    from two traces: torch.export's training graph, then `run_decompositions` with turbine's
    AOT table retracing all of it (half of an export's time, ~1.7 ms a node under cProfile on
    a 12k-node Winograd VAE). Here torch.export traces below autograd at once
    (`pre_dispatch=False`) with the table's post-autograd decompositions, and keeps the
    composite ops the table leaves alone (`aten.group_norm`, `aten.linear`) exactly as
    `run_decompositions` does. The graph differs only by `_assert_tensor_metadata` checks,
    which iree's torch input conversion drops: iree-compile's input is byte for byte the same
    (compile/NOTES.md, "Export"; tests/compile/exporters/test_base.py).

    These are torch's private functions; where a torch lacks them the two traces run."""
    from iree.turbine.aot import fx_programs

    api = _one_trace_api()
    if api is None:
        yield
        return
    trace, split, keep_composites = api
    to_aten, export_now = trace._export_to_aten_ir, trace._export
    composites, post_autograd = split(dict(fx_programs.current_aot_decompositions()))

    def traced_once(mod, args=(), kwargs=None, *, dynamic_shapes=None, strict=True):
        return export_now(mod, args, kwargs, dynamic_shapes, strict=strict, pre_dispatch=False)

    saved = torch.export.export, fx_programs.current_aot_decompositions
    trace._export_to_aten_ir = functools.partial(to_aten, decomp_table=post_autograd)
    torch.export.export = traced_once
    fx_programs.current_aot_decompositions = dict  # nothing left to decompose after it
    try:
        with keep_composites(composites):
            yield
    finally:
        trace._export_to_aten_ir = to_aten
        torch.export.export, fx_programs.current_aot_decompositions = saved


def _one_trace_api():
    """(torch.export._trace, the decomposition table's splitter, the composites' override)
    where this torch has them as decomposed_while_traced uses them, else None."""
    import torch.export._trace as trace
    from torch.export import exported_program as program

    try:
        split = program._split_decomp_table_to_cia_and_python_decomp
        keep_composites = program._override_composite_implicit_decomp
        to_aten = trace._export_to_aten_ir
    except AttributeError:
        return None
    if not hasattr(trace, "_export") or "decomp_table" not in inspect.signature(to_aten).parameters:
        return None
    return trace, split, keep_composites


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
