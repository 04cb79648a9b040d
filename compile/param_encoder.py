"""Precompute at compile time what a module would otherwise compute from its weights at load.

With data tiling (and the cpu Winograd export) every weight is repacked, and the 3x3 ones
transformed, by the module's initializer: for SD 1.5's UNet on cpu that is ~20 s and ~15 GB of
peak memory on every load. iree-compile can split that work into a separate *encoder* module
(`--iree-parameter-encoder-output-file`); running the encoder once writes the results to a
parameter archive, and the main module then loads them instead of computing them.

IREE's own driver for this, `iree-encode-parameters`, is not in the iree-base-runtime wheel, so
`run_encoder` does what it does through the Python runtime: the encoder's exported functions are
found by their `iree.encode.function` reflection attribute; `indices` lists the output
parameters (per scope: kind, key, byte length, alignment or splat pattern); `steps` and then
`encode` (coarse-fences ABI) fill them through an io_parameters provider backed by writable
views of the output archive, laid out beforehand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sdiree.runtime.fileutil import atomic_path
from sdiree.runtime.session import parameter_providers

SPLAT, DATA = 0, 1


def encoder_flags(encoder_mlir: Path, scope: str) -> list[str]:
    """Flags that make iree-compile write the encoder module and load encoded parameters
    from scope (overlay mode: the original archive still supplies everything else)."""
    return [
        f"--iree-parameter-encoder-output-file={encoder_mlir}",
        f"--iree-parameter-encoder-output-scope={scope}",
        "--iree-parameter-encoder-mode=overlay",
    ]


def _text(ref) -> str:
    import iree.runtime as rt

    return bytes(memoryview(ref.deref(rt.VmBuffer))).decode()


def run_encoder(
    encoder_vmfb: Path, inputs: list[tuple[str, Path]], scope: str, out: Path, driver: str
) -> int:
    """Run encoder_vmfb over the input archives [(scope, path)] and write the parameters it
    produces for `scope` to out (atomically). Returns how many parameters were written; 0
    (and no file) when the module had nothing to precompute."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    device = rt.get_driver(driver).create_default_device()
    module = rt.VmModule.mmap(instance, str(encoder_vmfb))
    functions = {}
    for name in module.function_names:
        fn = module.lookup_function(name)
        role = fn.reflection.get("iree.encode.function")
        if role:
            functions[role] = fn
    if "indices" not in functions or "encode" not in functions:
        raise RuntimeError(f"{encoder_vmfb.name} is not a parameter encoder module")

    sources = parameter_providers(inputs)

    def context(*extra_providers):
        params = rt.create_io_parameters_module(instance, *sources, *extra_providers)
        hal = rt.create_hal_module(instance, device)
        return rt.VmContext(instance, modules=[params, hal, module])

    def invoke(ctx, fn, args=None, results=1):
        out_list = rt.VmVariantList(results)
        ctx.invoke(fn, args or rt.VmVariantList(0), out_list)
        return out_list

    # The archive is laid out first, zero-filled, then its data entries are mapped writable and
    # handed to the encoder: its output goes to the page cache, not to gigabytes of process
    # memory (the SD 1.5-size UNet's is 10 GB).
    layout = rt.ParameterIndex()
    lengths = {}
    scopes = invoke(context(), functions["indices"]).get_as_list(0)
    for i in range(scopes.size):
        entry_scope = scopes.get_as_list(i)
        if _text(entry_scope.get_variant(0)) != scope:
            continue
        entries = entry_scope.get_as_list(1)
        for j in range(entries.size):
            e = entries.get_as_list(j)
            kind, key, length = e.get_variant(0), _text(e.get_variant(1)), e.get_variant(3)
            if kind == SPLAT:
                pattern_bytes = e.get_variant(5)
                pattern = np.array([e.get_variant(4)], np.uint64).view(np.uint8)[:pattern_bytes]
                layout.add_splat(key, pattern.copy(), length)
            else:
                layout.add_buffer(key, np.zeros(length, np.uint8))  # untouched pages: no RSS
                lengths[key] = length
    count = len(layout.items())
    if count == 0:
        return 0
    with atomic_path(out) as tmp:
        written = layout.create_archive_file(str(tmp))
        offsets = {k: e.file_storage[1] for k, e in written.items() if k in lengths}
        mapped = np.memmap(tmp, np.uint8, mode="r+")
        output = rt.ParameterIndex()
        for key, length in lengths.items():
            output.add_buffer(key, mapped[offsets[key] : offsets[key] + length], writable=True)
        ctx = context(output.create_provider(scope=scope))
        steps = invoke(ctx, functions["steps"]).get_as_list(0) if "steps" in functions else None
        signal = rt.HalFence.create_at(device.create_semaphore(0), 1)
        args = rt.VmVariantList(3)
        if steps is None:
            args.push_ref(None)
        else:
            args.push_list(steps)
        args.push_ref(rt.HalFence(0))  # nothing to wait for
        args.push_ref(signal)
        ctx.invoke(functions["encode"], args, rt.VmVariantList(0))
        signal.wait()
        mapped.flush()
        del ctx, output, mapped, written
    return count


def loads_with(vmfb: Path, archives: list[tuple[str, Path]], driver: str) -> bool:
    """Whether vmfb finds every parameter it needs in archives [(scope, path)]: its
    initializers run here, so with encoded weights this is a cheap load."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    device = rt.get_driver(driver).create_default_device()
    providers = parameter_providers(archives)
    # Held in names: a module freed while VmContext raises turns the error into a SystemError.
    params = rt.create_io_parameters_module(instance, *providers)
    hal = rt.create_hal_module(instance, device)
    module = rt.VmModule.mmap(instance, str(vmfb))
    try:
        rt.VmContext(instance, modules=[params, hal, module])
    except ValueError as e:
        if "no parameter found" in str(e) or "no provider registered" in str(e):
            return False
        raise
    return True
