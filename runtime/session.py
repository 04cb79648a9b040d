"""A loaded artifact: its modules and parameters in one IREE context on one device.

Parameters are loaded through an io_parameters module backed by a ParameterIndex over the
archive files (memory-mapped, never copied into Python; on a CPU Vulkan device, page-aligned
copies the device imports: runtime/weights/imported.py). Every call checks its inputs against
the names, shapes and dtypes the manifest declares before the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import device_pollers, residency
from .device import CPU_DRIVERS, DeviceInfo, create_device, forget_device, to_host
from .errors import UserError
from .host_memory import keep_freed_host_memory, release_freed_heap
from .manifest import FunctionDecl, Manifest
from .weights.overrides import LoadedWeights, WeightOverrides
from .weights.pages import load_archive

T = TypeVar("T")


class Session:
    def __init__(
        self,
        manifest: Manifest,
        device_info: DeviceInfo,
        submodules: Iterable[str],
        overrides: WeightOverrides | None = None,
        fresh_device: bool = False,
        debug_sink=None,
    ):
        import iree.runtime as rt

        self.manifest = manifest
        self.device_info = device_info
        self.overrides = overrides
        self.debug_sink = debug_sink  # an iree HalModuleDebugSink: sees traced tensors (tools/)
        submodules = tuple(submodules)
        if device_info.driver in CPU_DRIVERS:
            keep_freed_host_memory()
        gpu = device_info.driver not in CPU_DRIVERS
        try:
            self._open(submodules, fresh_device)
        except RuntimeError as e:
            # lavapipe rarely loses its device while the context loads parameters; a fresh
            # device then loads them fine. A second loss goes to the caller.
            if not is_device_lost(e, gpu=gpu):
                if gpu:  # a failed load may leave state behind on the device: not shared on
                    forget_device(device_info)
                raise
            self._open(submodules, fresh=True)
        self._functions = {}
        for name, vm in self._vm_modules.items():
            for fname in manifest.submodules[name].functions:
                fn = vm.lookup_function(fname)
                if fn is None:
                    raise UserError(f"{name}.vmfb has no function {fname}; recompile the model")
                self._functions[(name, fname)] = rt.FunctionInvoker(self.context, self.device, fn)

    def _open(self, submodules: Iterable[str], fresh: bool = False) -> None:
        """Take the device (a new one if fresh), then one context holding the parameters and
        modules on it."""
        self.device = create_device(self.device_info, fresh)
        with device_pollers.in_use(self.device):
            self._load(submodules)

    def _load(self, submodules: tuple[str, ...]) -> None:
        """The context on self.device: the parameters' and modules' (uploads run on it)."""
        import iree.runtime as rt

        manifest, device_info = self.manifest, self.device_info
        self.instance = rt.VmInstance()
        hal = rt.create_hal_module(self.instance, self.device, debug_sink=self.debug_sink)
        modules = [hal]
        # a CPU Vulkan device (lavapipe) imports page-aligned weights: not its HAL's pool memory,
        # which its calls overwrite at SD 1.5 size (runtime/weights/imported.py)
        self.weights = LoadedWeights(
            manifest,
            tuple(submodules),
            self.overrides,
            self.device,
            importable=device_info.driver == "vulkan" and device_info.is_cpu_emulation,
        )
        providers = self.weights.providers()
        if providers:
            modules.insert(0, rt.create_io_parameters_module(self.instance, *providers))
        self._vm_modules = {}
        for name in submodules:
            sub = manifest.submodules[name]
            self._vm_modules[name] = map_module(self.instance, manifest.path(sub.vmfb))
        self.context = rt.VmContext(self.instance, modules=[*modules, *self._vm_modules.values()])

    def release(self, submodules: Iterable[str]) -> int:
        """Give back what these submodules hold resident once their phase of a run is over:
        the mapped pages of their weights and the freed heap (runtime/residency.py). Their
        next call reads the pages back from the page cache. cpu drivers only; returns the
        bytes of address space released (0: nothing, elsewhere or SDIREE_PHASE_MEMORY=keep)."""
        if self.device_info.driver not in CPU_DRIVERS or not residency.enabled():
            return 0
        manifest = self.manifest
        scopes = {
            scope
            for name in submodules
            if name in self._vm_modules
            for _, scope in manifest.submodules[name].archives()
        }
        files = set().union(*(self.weights.file_ids.get(s, set()) for s in scopes))
        released = residency.release_mapped(files)
        release_freed_heap()
        return released

    def decl(self, submodule: str, function: str) -> FunctionDecl:
        return self.manifest.submodules[submodule].functions[function]

    def call(self, submodule: str, function: str, *args: np.ndarray) -> list[np.ndarray]:
        decl = self.decl(submodule, function)
        if len(args) != len(decl.inputs):
            raise ValueError(f"{submodule}.{function} takes {len(decl.inputs)} inputs")
        for a, d in zip(args, decl.inputs, strict=True):
            if tuple(a.shape) != d.shape or a.dtype != np.dtype(d.dtype):
                raise ValueError(
                    f"{submodule}.{function} input '{d.name}' must be {d.dtype}{list(d.shape)}, "
                    f"got {a.dtype}{list(a.shape)}"
                )
        with device_pollers.in_use(self.device):
            results = self._functions[(submodule, function)](*map(np.ascontiguousarray, args))
            if not isinstance(results, (list, tuple)):
                results = [results]
            return [to_host(self.device, r) for r in results]


def map_module(instance, path: Path):
    """A VmModule over a read-only memory map of a .vmfb.

    iree's VmModule.mmap opens the file for writing ("r+b") though it maps it read-only, which
    fails on a read-only file system or a shared model the user may not write; this does what
    it does with the file opened for reading.
    """
    import mmap

    import iree.runtime as rt

    with open(path, "rb") as f:
        if hasattr(mmap, "MAP_SHARED"):
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        else:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return rt.VmModule.wrap_buffer(instance, mapped, close_buffer=True)


def parameter_providers(archives: list[tuple[str, Path]], load=load_archive) -> list:
    """One parameter provider per scope, over every archive [(scope, path)] of that scope
    (ordinary or paged, sdiree.runtime.weights.pages), each added by load(index, path)."""
    import iree.runtime as rt

    indices = {}
    for scope, path in archives:
        load(indices.setdefault(scope, rt.ParameterIndex()), path)
    return [index.create_provider(scope=scope) for scope, index in indices.items()]


def is_device_lost(error: BaseException, gpu: bool = False) -> bool:
    """VK_ERROR_DEVICE_LOST, or the DATA_LOSS a fence await reports when its queue failed with
    it (the message then names no Vulkan error); on a GPU driver (gpu), also a bare DATA_LOSS
    from loading parameters (on cpu that is the archive's own fault, not a device's)."""
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "DEVICE_LOST" in text
        or ("DATA_LOSS" in text and "hal.fence.await" in text)
        # lavapipe once in a CI run, beside a full-size compile: "DATA_LOSS; while invoking
        # native function io_parameters.load" (compile/NOTES.md, "Vulkan on lavapipe in CI")
        or (gpu and "DATA_LOSS" in text and "io_parameters.load" in text)
        # iree 3.13's Vulkan driver, rarely, while loading parameters from host memory (1 of 8
        # SD 1.5-size opens with --weights on lavapipe); the next open on a new device works
        or ("no staged Vulkan backing" in text and "io_parameters.load" in text)
    )


def with_fresh_device_on_loss(
    manifest: Manifest,
    device_info: DeviceInfo,
    submodules: Iterable[str],
    work: Callable[[Session], T],
    warn: Callable[[str], None],
    overrides: WeightOverrides | None = None,
) -> T:
    """Open a session and run `work` on it; if the device is lost, once more on a fresh device.

    A lost device (VK_ERROR_DEVICE_LOST: a driver reset, a GPU hang, or lavapipe's rare loss
    while loading parameters) poisons that device handle for good, but a newly created one
    works. A second loss is reported as a one-line error.
    """
    submodules = tuple(submodules)
    gpu = device_info.driver not in CPU_DRIVERS
    try:
        return work(Session(manifest, device_info, submodules, overrides))
    except RuntimeError as e:
        if not is_device_lost(e, gpu):
            raise
        warn(
            f"the {device_info.label} device was lost ({_first_line(e)}); retrying once on a fresh one"
        )
    try:
        return work(Session(manifest, device_info, submodules, overrides, fresh_device=True))
    except RuntimeError as e:
        if not is_device_lost(e, gpu):
            raise
        raise UserError(
            f"the {device_info.label} device ({device_info.name}) was lost twice "
            f"({_first_line(e)}); check the driver (`sdiree devices`) or pick another --device"
        ) from None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
