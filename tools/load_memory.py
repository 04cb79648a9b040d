"""Load one submodule of an artifact on its target's device, optionally call it once on zero
inputs, and print the process's memory and the HAL allocator's statistics (JSON). On a CPU
device such as lavapipe, device memory is host memory, so RssAnon is what the module's weights
and load-time copies take; on a GPU, the allocator's live and peak device bytes are.

    python tools/load_memory.py ARTIFACT SUBMODULE [--driver cuda] [--params MODE] [--call FN]

`--params` says how the archives reach the module, to find what a load keeps on the device:
`map` as the runtime does (iree maps each file; paged archives as views over their pages),
`unpaged` the same with every paged archive first rewritten as an ordinary one (in /tmp),
`named` the ordinary archives restricted to the keys the module names, `fd` every archive read
through a file descriptor (`load_from_file_handle`; paged ones unpaged first), `importable`
each entry as a page-aligned copy a CPU Vulkan device imports (what a session does there,
runtime/weights/imported.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, MiB."""
    fields = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def hal_mib(device) -> dict[str, float]:
    """The allocator's device/host peak and live bytes, MiB ({} without statistics)."""
    a = device.allocator
    if not a.has_statistics:
        return {}
    s = a.statistics
    mib = 2**20
    return {
        "device_peak": round(s["device_bytes_peak"] / mib, 1),
        "device_live": round((s["device_bytes_allocated"] - s["device_bytes_freed"]) / mib, 1),
        "host_peak": round(s["host_bytes_peak"] / mib, 1),
        "host_live": round((s["host_bytes_allocated"] - s["host_bytes_freed"]) / mib, 1),
    }


def add_entries(index, path: Path, keep: list, wanted=lambda key: True) -> None:
    """Add to index the entries of the archive at path (ordinary or paged) that wanted(key)
    accepts, each over its mapped bytes (kept alive in keep)."""
    from sdiree.runtime.weights.pages import entry_views, splat_entries

    for key, pattern, length in splat_entries(path):
        if wanted(key):
            index.add_splat(key, np.frombuffer(pattern, np.uint8).copy(), length)
    for key, view in entry_views(path).items():
        if wanted(key):
            keep.append(view)
            index.add_buffer(key, view)


def unpaged(path: Path, work: Path) -> Path:
    """path itself when it is an ordinary archive, else an ordinary copy of its entries."""
    import iree.runtime as rt

    from sdiree.runtime.weights.pages import paged_layout

    probe = rt.ParameterIndex()
    probe.load(str(path))
    if paged_layout(probe) is None:
        return path
    index, views = rt.ParameterIndex(), []
    add_entries(index, path, views)
    out = work / path.name
    index.create_archive_file(str(out))
    return out


def providers(mode: str, archives: list[tuple[str, Path]], vmfb: Path, work: Path,
              keep: list) -> list:  # fmt: skip
    import iree.runtime as rt

    from sdiree.runtime.session import parameter_providers

    if mode == "map":
        return parameter_providers(archives)
    if mode == "importable":
        from sdiree.runtime.weights.imported import add_importable

        return parameter_providers(archives, lambda index, path: add_importable(index, path, keep))
    archives = [(scope, unpaged(p, work)) for scope, p in archives]
    if mode == "unpaged":
        return parameter_providers(archives)
    indices: dict[str, object] = {}
    named = vmfb.read_bytes()
    for scope, path in archives:
        index = indices.setdefault(scope, rt.ParameterIndex())
        if mode == "fd":
            keep.append(os.open(path, os.O_RDONLY))
            index.load_from_file_handle(rt.FileHandle.wrap_fd(keep[-1]), "irpa")
        elif mode == "named":
            add_entries(index, path, keep, lambda key: key.encode() in named)
        else:
            raise SystemExit(f"unknown --params {mode}")
    return [index.create_provider(scope=scope) for scope, index in indices.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("submodule")
    ap.add_argument("--driver", help="IREE driver (default: the manifest's target's)")
    ap.add_argument(
        "--params", default="map", choices=("map", "unpaged", "named", "fd", "importable")
    )
    ap.add_argument("--call", help="a function to call once on zero inputs after the load")
    args = ap.parse_args()

    import iree.runtime as rt

    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.targets import load_registry

    m = load_manifest(args.artifact)
    sub = m.submodules[args.submodule]
    driver = args.driver or load_registry().targets[m.target].driver
    archives = [(scope, m.path(path)) for path, scope in sub.archives()]
    device = rt.get_driver(driver).create_default_device()
    instance = rt.VmInstance()
    before = status()
    keep: list = []
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        found = providers(args.params, archives, m.path(sub.vmfb), Path(work), keep)
        params = rt.create_io_parameters_module(instance, *found)
        hal = rt.create_hal_module(instance, device)
        module = rt.VmModule.mmap(instance, str(m.path(sub.vmfb)))
        context = rt.VmContext(instance, modules=[params, hal, module])
        seconds = time.perf_counter() - t0
        report = {
            "artifact": str(args.artifact), "submodule": args.submodule, "params": args.params,
            "load_s": round(seconds, 1), "before_mib": before, "after_mib": status(),
            "hal_after_load_mib": hal_mib(device),
            "archives": {p.name: p.stat().st_size for _, p in archives},
        }  # fmt: skip
        if args.call:
            decl = sub.functions[args.call]
            fn = module.lookup_function(args.call)
            inputs = [np.zeros(d.shape, np.dtype(d.dtype)) for d in decl.inputs]
            t0 = time.perf_counter()
            rt.FunctionInvoker(context, device, fn)(*inputs)
            report["call_s"] = round(time.perf_counter() - t0, 3)
            report["hal_after_call_mib"] = hal_mib(device)
        print(json.dumps(report))
        del context
    for k in keep:
        if isinstance(k, int):
            os.close(k)


if __name__ == "__main__":
    main()
