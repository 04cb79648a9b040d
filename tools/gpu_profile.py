"""Per-dispatch profile of one submodule call of an artifact, with IREE's own tools.

Runs `iree-run-module` on the artifact's module, its parameter archives and random inputs of the
manifest's signature with HAL device profiling on, then reduces the bundle with
`iree-profile dispatch --format=jsonl` to the dispatches that took the most device time. Used on
a lent GPU (tools/PERFORMANCE.md, "GPU") to find what a tuning spec should target; also runs on
lavapipe; not on cpu artifacts, whose pruned archives only sdiree's reader completes.
Needs iree-base-runtime, numpy and this checkout's sdiree (its inputs are `verify`'s).

    python tools/gpu_profile.py ARTIFACT --submodule unet --function denoise_cfg \\
        --device cuda [--mode dispatch-events] [--top 25] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def _tool(name: str) -> str:
    """The IREE tool from iree-base-runtime's own folder (also where the wheel was only unpacked,
    without its console scripts), else from PATH."""
    import iree.runtime

    here = Path(iree.runtime.__file__).parents[1] / "_runtime_libs" / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _inputs(manifest, submodule: str, function: str, work: Path, seed: int) -> list[str]:
    """`--input=@file.npy` flags of the inputs `sdiree.compile.verify` calls function with."""
    from sdiree.compile.verify import make_inputs  # torch-free

    args = []
    for i, a in enumerate(make_inputs(manifest, submodule, function, seed)):
        path = work / f"in{i}.npy"
        np.save(path, a)
        args.append(f"--input=@{path}")
    return args


def _param_flags(art: Path, sub: dict) -> list[str]:
    flags = [f"--parameters={sub['scope']}={art / sub['parameters']}"]
    for extra in sub.get("extra_parameters", []):  # derived and (cpu) encoded archives
        flags.append(f"--parameters={extra['scope']}={art / extra['path']}")
    return flags


def profile(a: argparse.Namespace) -> list[dict]:
    from sdiree.runtime.manifest import load_manifest

    art = a.artifact
    manifest = load_manifest(art)
    sub = manifest.data["submodules"][a.submodule]
    out = a.out or Path(tempfile.mkdtemp(prefix="sdiree-prof-"))
    out.mkdir(parents=True, exist_ok=True)
    prof = out / f"{a.submodule}.ireeprof"
    cmd = [
        _tool("iree-run-module"),
        f"--device={a.device}",
        f"--module={art / sub['vmfb']}",
        *_param_flags(art, sub),
        f"--function={a.function}",
        *_inputs(manifest, a.submodule, a.function, out, a.seed),
        f"--device_profiling_mode={a.mode}",
        f"--device_profiling_output={prof}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"iree-run-module failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    d = subprocess.run(
        [_tool("iree-profile"), "dispatch", "--format=jsonl", str(prof)],
        capture_output=True,
        text=True,
    )
    if d.returncode:
        sys.exit(f"iree-profile failed: {d.stderr.strip()[-2000:]}")
    (out / f"{a.submodule}.dispatch.jsonl").write_text(d.stdout)
    rows = [json.loads(line) for line in d.stdout.splitlines() if line.strip()]
    return [r for r in rows if r.get("type") == "dispatch_group"]


def _total_ns(row: dict) -> float | None:
    t = row.get("total_ns")
    return float(t) if row.get("time_ns_available") and isinstance(t, (int, float)) else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--submodule", default="unet")
    p.add_argument("--function", default="denoise_cfg")
    p.add_argument("--device", default="cuda", help="iree device: cuda, vulkan, local-task")
    p.add_argument("--mode", default="dispatch-events", help="--device_profiling_mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rows = profile(a)
    timed = [(r, _total_ns(r)) for r in rows]
    timed = [(r, t) for r, t in timed if t is not None]
    if not timed:
        print("no dispatch timing in the profile; first rows:")
        for r in rows[:5]:
            print(json.dumps(r)[:400])
        return
    total = sum(t for _, t in timed)
    print(f"{len(timed)} dispatch functions, {total / 1e6:.2f} ms of dispatch time in all")
    timed.sort(key=lambda rt: -rt[1])
    for r, t in timed[: a.top]:
        name, n = r.get("key", "?"), r.get("count", "")
        print(f"{t / 1e6:9.3f} ms {100 * t / total:5.1f} %  x{n}  {name}")


if __name__ == "__main__":
    main()
