"""Load one submodule of an artifact on its target's device, call nothing, and print the
process's memory (JSON): on a CPU device such as lavapipe, device memory is host memory, so
RssAnon is what the module's weights and load-time copies take.

    python tools/load_memory.py ARTIFACT SUBMODULE [--driver vulkan]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, MiB."""
    fields = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("submodule")
    ap.add_argument("--driver", help="IREE driver (default: the manifest's target's)")
    args = ap.parse_args()

    import iree.runtime as rt

    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import parameter_providers
    from sdiree.runtime.targets import load_registry

    m = load_manifest(args.artifact)
    sub = m.submodules[args.submodule]
    driver = args.driver or load_registry().targets[m.target].driver
    archives = [(scope, m.path(path)) for path, scope in sub.archives()]
    device = rt.get_driver(driver).create_default_device()
    instance = rt.VmInstance()
    before = status()
    t0 = time.perf_counter()
    params = rt.create_io_parameters_module(instance, *parameter_providers(archives))
    hal = rt.create_hal_module(instance, device)
    module = rt.VmModule.mmap(instance, str(m.path(sub.vmfb)))
    context = rt.VmContext(instance, modules=[params, hal, module])
    seconds = time.perf_counter() - t0
    print(json.dumps({
        "artifact": str(args.artifact), "submodule": args.submodule, "load_s": round(seconds, 1),
        "before_mib": before, "after_mib": status(),
        "archives": {p.name: p.stat().st_size for _, p in archives},
    }))  # fmt: skip
    del context


if __name__ == "__main__":
    main()
