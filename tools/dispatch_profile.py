"""Per-dispatch profile of one submodule call of an artifact, with IREE's own tools.

Runs `iree-run-module` on the artifact's module, its weights and random inputs of the manifest's
signature with HAL device profiling on, then reduces the bundle with `iree-profile dispatch
--format=jsonl` to the dispatches that took the most time, and (`--group`) to their totals by
kind (contractions by element types, reductions, elementwise, copies). The weights are first
written out as plain archives, each scope as sdiree's runtime serves it (paged and pruned cpu
archives are sdiree's own formats), so this needs disk for a copy of the submodule's weights.
Used on a lent GPU (tools/PERFORMANCE.md, "GPU") to find what a tuning spec should target, and
on cpu (`--device local-task`, host-execution timing; iree's Python runtime cannot capture a
profile). iree 3.13's cuda HAL cannot profile at all, so `--ncu` runs the same call under Nsight
Compute (`ncu`: kernel durations only, caches flushed before each kernel) and reads its CSV. On
cpu a profile keeps ~4,100 dispatch records: a larger call's later dispatches are dropped
(`iree-profile explain` says how many). Needs iree-base-runtime, numpy and this checkout's
sdiree (its inputs are `verify`'s).

    python tools/dispatch_profile.py ARTIFACT --submodule unet --function denoise_cfg \\
        --device cuda|vulkan|local-task [--mode dispatch-events] [--ncu] [--top 25] [--group]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
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


def _param_flags(manifest, submodule: str, work: Path) -> list[str]:
    """`--parameters` flags of plain archives holding what the runtime serves each scope."""
    from sdiree.runtime.weights.overrides import LoadedWeights

    weights = LoadedWeights(manifest, (submodule,), None, device=None)
    flags = []
    for scope, index in weights.indices.items():
        path = work / f"{scope}.irpa"
        index.create_archive_file(str(path))
        flags.append(f"--parameters={scope}={path}")
    return flags


def profile(a: argparse.Namespace) -> list[dict]:
    from sdiree.runtime.manifest import load_manifest

    art = a.artifact
    manifest = load_manifest(art)
    sub = manifest.data["submodules"][a.submodule]
    out = a.out or Path(tempfile.mkdtemp(prefix="sdiree-prof-"))
    out.mkdir(parents=True, exist_ok=True)
    prof = out / f"{a.submodule}.ireeprof"
    mode = a.mode or ("host-execution" if a.device.startswith("local") else "dispatch-events")
    params = out / "params"
    params.mkdir(exist_ok=True)
    try:  # a copy of the weights: not kept, whatever happens
        # one call pays the first touch of the call's transient memory (a 30 MB buffer's page
        # faults looked like a 65 ms reduction on cpu); --calls N times N calls in one process
        runner = ["iree-run-module"] if a.calls <= 1 else ["iree-benchmark-module"]
        cmd = [
            _tool(runner[0]),
            *([f"--benchmark_min_time={a.calls}x"] if a.calls > 1 else []),
            f"--device={a.device}",
            f"--module={art / sub['vmfb']}",
            *_param_flags(manifest, a.submodule, params),
            f"--function={a.function}",
            *_inputs(manifest, a.submodule, a.function, out, a.seed),
        ]
        if a.ncu:
            csv_path = out / f"{a.submodule}.ncu.csv"
            cmd = [_ncu(), *NCU_FLAGS, "--log-file", str(csv_path), *cmd]
        else:
            cmd += [f"--device_profiling_mode={mode}", f"--device_profiling_output={prof}"]
            cmd += [f"--device_profiling_flush_interval_ms={a.flush_ms}"] if a.flush_ms else []
        r = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        shutil.rmtree(params, ignore_errors=True)
    if a.ncu:
        if r.returncode:
            sys.exit(f"ncu failed ({r.returncode}): {(r.stderr + r.stdout).strip()[-2000:]}")
        rows = ncu_rows(csv_path.read_text())
        (out / f"{a.submodule}.dispatch.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in rows)
        )
        return rows
    print(f"profile bundle: {prof}", file=sys.stderr)
    if r.returncode:
        sys.exit(f"{runner[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    d = subprocess.run(
        [_tool("iree-profile"), "dispatch", "--format=jsonl", str(prof)],
        capture_output=True,
        text=True,
    )
    if d.returncode:
        sys.exit(f"iree-profile failed: {d.stderr.strip()[-2000:]}")
    (out / f"{a.submodule}.dispatch.jsonl").write_text(d.stdout)
    rows = [json.loads(line) for line in d.stdout.splitlines() if line.strip()]
    # device-timed rows, or (local-task) rows timed on the host around each dispatch
    return [r for r in rows if r.get("type") in ("dispatch_group", "host_dispatch_group")]


# Kernel durations only; the GPU's clocks left alone (the device README's advice).
NCU_FLAGS = [
    "--clock-control",
    "none",
    "--metrics",
    "gpu__time_duration.sum",
    "--csv",
    "--print-units",
    "base",
]


def _ncu() -> str:
    found = shutil.which("ncu") or next(
        (str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None
    )
    if not found:
        sys.exit("ncu (Nsight Compute) not found: --ncu needs it on PATH")
    return found


def ncu_rows(text: str) -> list[dict]:
    """Rows like `iree-profile dispatch`'s (key, count, total_ns) from ncu's CSV of
    gpu__time_duration, one row per kernel name, launches summed."""
    start = text.find('"ID"')
    if start < 0:
        sys.exit("ncu wrote no kernel rows: did the call launch any kernel?")
    rows: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO(text[start:])):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(rec["Metric Value"].replace(",", ""))
        if rec.get("Metric Unit") in ("usecond", "us"):
            ns *= 1e3
        elif rec.get("Metric Unit") in ("msecond", "ms"):
            ns *= 1e6
        row = rows.setdefault(
            rec["Kernel Name"],
            {
                "type": "dispatch_group",
                "key": rec["Kernel Name"],
                "count": 0,
                "total_ns": 0.0,
                "time_ns_available": True,
            },
        )
        row["count"] += 1
        row["total_ns"] += ns
    return list(rows.values())


def _total_ns(row: dict) -> float | None:
    t = row.get("total_ns")
    timed = row.get("time_ns_available") or row.get("type") == "host_dispatch_group"
    return float(t) if timed and isinstance(t, (int, float)) else None


def kind(name: str) -> str:
    """What a dispatch is, from the name iree gives it: contractions with their element types
    (`matmul bf16xbf16xf32`), `attention` (iree's fused op), `reduction`, `elementwise` (with a
    narrowing to bf16/f16 named apart), `copy`, `transpose`, `pack`, `encoding`, else `other`."""
    body = name.split("$", 1)[-1]
    if body.startswith("_encoding"):
        return "encoding"
    # iree's name (`f$async_dispatch_N_...`), or the CUDA kernel's (`f_async_dispatch_N_...`)
    body = re.sub(r"^(?:\w*?_)?async_dispatch_\d+_", "", body)
    types = re.findall(r"(?:b?f|i)\d+(?:x(?:b?f|i)\d+)*$", body)
    if body.startswith("attention"):
        return "attention"
    if "matmul" in body or "conv" in body or "contract" in body:
        return f"matmul {types[0] if types else '?'}"
    if "reduction" in body:
        return "reduction"
    if "elementwise" in body:
        narrowing = types and re.search(r"x(bf16|f16)$", types[0])
        return f"elementwise to {narrowing.group(1)}" if narrowing else "elementwise"
    for word, k in (("memcpy", "copy"), ("transpose", "transpose"), ("pack", "pack")):
        if word in body:
            return k
    return "other"


def by_kind(timed: list[tuple[dict, float]]) -> list[tuple[str, float, int]]:
    """(kind, total ns, dispatches) for each kind, the most time first."""
    totals: dict[str, list] = {}
    for r, t in timed:
        k = totals.setdefault(kind(r.get("key", "")), [0.0, 0])
        k[0] += t
        k[1] += int(r.get("count", 0))
    return sorted(((k, t, n) for k, (t, n) in totals.items()), key=lambda x: -x[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--submodule", default="unet")
    p.add_argument("--function", default="denoise_cfg")
    p.add_argument("--device", default="cuda", help="iree device: cuda, vulkan, local-task")
    p.add_argument(
        "--mode", help="--device_profiling_mode (host-execution on local-*, else dispatch-events)"
    )
    p.add_argument(
        "--ncu",
        action="store_true",
        help="time the kernels with Nsight Compute (cuda: no HAL profiling)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--calls",
        type=int,
        default=1,
        help="profile this many calls in one process (totals are over all of them)",
    )
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--group", action="store_true", help="totals by kind of dispatch first")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--flush-ms",
        type=int,
        default=20,
        help="flush profile records this often (0: at the end; cpu then keeps ~4,100)",
    )
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
    count = sum(int(r.get("count", 0)) for r, _ in timed)
    print(f"{len(timed)} dispatch functions, {count} dispatches, {total / 1e6:.2f} ms in all")

    def row(t: float, n, what: str) -> None:
        print(f"{t / 1e6:9.3f} ms {100 * t / total:5.1f} %  x{n}  {what}")

    if a.group:
        for k, t, n in by_kind(timed):
            row(t, n, k)
        print()
    timed.sort(key=lambda rt: -rt[1])
    for r, t in timed[: a.top]:
        row(t, r.get("count", ""), r.get("key", "?"))


if __name__ == "__main__":
    main()
