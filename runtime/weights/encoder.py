"""Run a parameter-encoder module: precompute what a module derives from its weights.

With data tiling (and the cpu Winograd export) every weight is repacked, and the 3x3 ones
transformed, by the module's initializer. iree-compile can split that work into an *encoder*
module (compile/param_encoder.py); running it once writes the results to a parameter archive
that the main module then loads instead of computing them. Compile runs it on the model's own
weights; the runtime runs the encoder an artifact keeps on replaced weights (`--weights`,
`--lora`), so those need no recompile.

IREE's own driver for this, `iree-encode-parameters`, is not in the iree-base-runtime wheel, so
`run_encoder` does what it does through the Python runtime: the encoder's exported functions are
found by their `iree.encode.function` reflection attribute; `indices` lists the output
parameters (per scope: kind, key, byte length, alignment or splat pattern); `steps` and then
`encode` (coarse-fences ABI) fill them through an io_parameters provider backed by a writable
file handle on the output archive, laid out beforehand (or by arrays the caller gives).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..fileutil import atomic_path
from . import irpa_writer

SPLAT, DATA = 0, 1


def _text(ref) -> str:
    import iree.runtime as rt

    return bytes(memoryview(ref.deref(rt.VmBuffer))).decode()


def file_io(device) -> bool:
    """Whether device's driver moves parameters to and from file descriptors: iree 3.13's
    local drivers do; its Vulkan driver refuses ("Vulkan fd file transfers require a
    proactor-backed async file handle"), so there the files are mapped."""
    from ..device import CPU_DRIVERS

    return str(device).split(":")[0] in CPU_DRIVERS  # a HalDevice's str is its driver's id


def encoder_device(encoder, device):
    """The device an artifact's kept encoder (a manifest EncoderDecl) runs on: device, unless
    the encoder names another driver (a GPU artifact's encoder is compiled for the host CPU)."""
    if not encoder.driver or str(device).split(":")[0] == encoder.driver:
        return device
    return driver_device(encoder.driver)


@functools.cache
def driver_device(driver: str):
    """The default device of an IREE driver, created once per process."""
    import iree.runtime as rt

    return rt.get_driver(driver).create_default_device()


@contextlib.contextmanager
def input_providers(archives: list[tuple[str, Path]]) -> Iterator[list]:
    """Parameter providers over an encoder's input archives [(scope, path)], mapped (session.
    parameter_providers). Read through file handles instead, iree 3.13's local-task driver read
    each step's parameter into a newly mapped transient buffer, so the kernel zeroed and faulted
    in every page of the inputs once more: SD 1.5's bf16 UNet encoder spent 33.4 s, ~70 % of it
    in pread, where mapped it takes 9.8 s (compile/NOTES.md, sixty-fourth session). The mapped
    pages are the page cache's, which holds them either way; they count in the process's RSS
    as file pages while it runs. Drop the providers (and contexts over them) before the block
    ends."""
    from ..session import parameter_providers

    providers = parameter_providers(archives)
    yield providers
    providers.clear()


def run_encoder(
    encoder_vmfb: Path, sources: list, scope: str, out: Path | None, device, into=None
) -> int:
    """Run encoder_vmfb on device over the parameter providers `sources` (its inputs' scopes)
    and write the parameters it produces for `scope` to out (atomically), or with `into`
    ({key: writable uint8 array} of every data parameter) into those arrays. Returns how
    many parameters were written; 0 (and no file) when the module had nothing to
    precompute. out is written through a file handle where the driver can (file_io), else
    through a writable mapping."""
    import iree.runtime as rt

    from ..session import map_module

    instance = rt.VmInstance()
    module = map_module(instance, Path(encoder_vmfb))
    functions = {}
    for name in module.function_names:
        fn = module.lookup_function(name)
        role = fn.reflection.get("iree.encode.function")
        if role:
            functions[role] = fn
    if "indices" not in functions or "encode" not in functions:
        raise RuntimeError(f"{encoder_vmfb.name} is not a parameter encoder module")

    def context(*extra_providers):
        params = rt.create_io_parameters_module(instance, *sources, *extra_providers)
        hal = rt.create_hal_module(instance, device)
        return rt.VmContext(instance, modules=[params, hal, module])

    def invoke(ctx, fn, args=None, results=1):
        out_list = rt.VmVariantList(results)
        ctx.invoke(fn, args or rt.VmVariantList(0), out_list)
        return out_list

    # The archive is laid out first, its data a sparse range until written (irpa_writer), then
    # the encoder writes its data entries through a file handle (or a mapping).
    layout: list[irpa_writer.Entry] = []
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
                layout.append(irpa_writer.Entry(key, length, splat=pattern.tobytes()))
            else:
                layout.append(irpa_writer.Entry(key, length))
                lengths[key] = length
    count = len(layout)
    if count == 0:
        return 0
    if into is not None:
        if {k: len(into.get(k, ())) for k in lengths} != lengths:
            raise ValueError("the output buffers do not match the encoder's parameters")
        output = rt.ParameterIndex()
        for key in lengths:
            output.add_buffer(key, into[key], writable=True)
        _encode(functions, context(output.create_provider(scope=scope)), device)
        return count
    with atomic_path(out) as tmp:
        mapped = not file_io(device)  # a full disk must fail here, not under the mapping
        offsets = irpa_writer.create(tmp, layout, reserve=mapped)
        if mapped:
            _encode_to_mapping(functions, context, device, scope, tmp, lengths, offsets)
        else:
            _encode_to_file(functions, context, device, scope, tmp, lengths, offsets)
    return count


def _encode_to_mapping(functions, context, device, scope, path, lengths, offsets) -> None:
    """Encode into the data entries of the laid-out archive at path through a writable
    mapping of it (its dirty pages count in the process's RSS until written back)."""
    import iree.runtime as rt

    mapped = np.memmap(path, np.uint8, mode="r+")
    output = rt.ParameterIndex()
    for key, length in lengths.items():
        output.add_buffer(key, mapped[offsets[key] : offsets[key] + length], writable=True)
    ctx = context(output.create_provider(scope=scope))
    _encode(functions, ctx, device)
    mapped.flush()
    del ctx, output, mapped


def _encode_to_file(functions, context, device, scope, path, lengths, offsets) -> None:
    """Encode into the data entries of the laid-out archive at path through a writable file
    handle: the encoder's results are written to the file, never mapped (a writable mapping of
    the SD 1.5-size UNet's 11 GB output held ~10 GiB of dirty file pages in the process)."""
    import iree.runtime as rt

    fd = os.open(path, os.O_RDWR)
    try:
        handle = rt.FileHandle.wrap_fd(fd, readable=True, writable=True)
        output = rt.ParameterIndex()
        for key, length in lengths.items():
            output.add_from_file_handle(key, handle, length, offsets[key])
        ctx = context(output.create_provider(scope=scope))
        _encode(functions, ctx, device)
        del ctx, output, handle
        os.fsync(fd)
    finally:
        os.close(fd)  # iree does not close a wrapped fd


def _encode(functions: dict, ctx, device) -> None:
    """Call the encoder's `steps` then `encode` in ctx, and wait for it."""
    import iree.runtime as rt

    steps = None
    if "steps" in functions:
        out = rt.VmVariantList(1)
        ctx.invoke(functions["steps"], rt.VmVariantList(0), out)
        steps = out.get_as_list(0)
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
