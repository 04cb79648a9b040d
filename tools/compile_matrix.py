"""Compile every (GPU target, arch preset, model) combination the registry has and tabulate it.

For each model given and each arch preset of each GPU target in specs/targets.json (CPU-emulated
presets such as lavapipe left out unless named), runs `sdiree compile MODEL --target T --arch A
--dtype D` under tools/compile_peaks.py and records whether it compiled (or the compiler's last
line where it did not), the wall time, the UNet's export and compile seconds, the driver's and
the largest iree-compile's peak RSS (the kernel's high-water marks) and the artifact's size. An
arch the registry refuses for the dtype is recorded with the registry's reason, not compiled.

Rows go to OUT/rows.jsonl as they finish; a rerun skips combinations already there, so a long
matrix can be stopped and resumed. Artifacts are deleted once measured unless --keep (SDXL's
are ~7 GB each); exports are cached by sdiree between archs as usual (SDIREE_CACHE).

    python tools/compile_matrix.py --out /tmp/matrix \\
        --model "SD 1.5 512²=/tmp/m/sd15-random" --model "SDXL 1024²=/tmp/m/sdxl-random"
    python tools/compile_matrix.py --out /tmp/matrix --table    # the markdown table only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from sdiree.runtime.targets import load_registry

PEAKS = Path(__file__).resolve().parent / "compile_peaks.py"
GIB = 2**30


def combinations(registry, targets=None, arches=None, dtype="fp16") -> list[dict]:
    """[{target, arch, refused}] for every GPU target's arch presets (a target is a GPU target
    unless it is named "cpu"); CPU-emulated presets only where `arches` names them."""
    out = []
    for tname, target in registry.targets.items():
        if tname == "cpu" or (targets and tname not in targets):
            continue
        for aname, arch in target.arches.items():
            if arches and aname not in arches:
                continue
            if arch.cpu_emulated and not (arches and aname in arches):
                continue
            refused = (
                arch.refused_dtypes.get(dtype)
                or target.refused_dtypes.get(dtype)
                or (None if dtype in target.dtypes else f"{tname} offers no {dtype}")
            )
            out.append({"target": tname, "arch": aname, "refused": refused})
    return out


def _size(path: Path) -> int:
    """Bytes of the regular files under path, each inode once."""
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def _last_line(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_one(
    sdiree: list[str], label: str, model: str, combo: dict, dtype: str, out: Path, keep: bool
) -> dict:
    row = {"model": label, "target": combo["target"], "arch": combo["arch"], "dtype": dtype}
    if combo["refused"]:
        return {**row, "result": "refused", "why": combo["refused"]}
    tag = f"{Path(model).name}-{combo['target']}-{combo['arch']}-{dtype}"
    art, peaks, log = out / "art" / tag, out / "json" / f"{tag}.json", out / "logs" / f"{tag}.log"
    for d in (art.parent, peaks.parent, log.parent):
        d.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(art, ignore_errors=True)
    cmd = [*sdiree, "compile", model, "--target", combo["target"], "--arch", combo["arch"]]
    cmd += ["--dtype", dtype, "--out", str(art)]
    with log.open("w") as err:
        code = subprocess.run(
            [sys.executable, str(PEAKS), "--json", str(peaks), "--", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=err,
        ).returncode
    p = json.loads(peaks.read_text()) if peaks.exists() else {}
    stages = p.get("stages", {})

    def secs(name):
        s = stages.get(name)
        return None if s is None else s.get("seconds")

    row.update(
        result="compiles" if code == 0 else "fails",
        why=None if code == 0 else _last_line(log),
        wall_s=p.get("wall_s"),
        unet_export_s=secs("export unet"),
        unet_compile_s=secs("compile unet"),
        driver_peak=p.get("driver_hwm"),
        child_peak=p.get("child_hwm"),
        artifact_bytes=_size(art) if code == 0 else None,
    )
    if not keep:
        shutil.rmtree(art, ignore_errors=True)
    return row


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def table(rows: list[dict]) -> str:
    def num(v, fmt):
        return "" if v is None else fmt.format(v)

    out = [
        "| model | target | arch | result | wall s | UNet export s | UNet compile s "
        "| driver peak GiB | largest iree-compile GiB | artifact GB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        result = r["result"] if r["result"] == "compiles" else f"{r['result']}: {r['why']}"
        if r["result"] == "refused":
            out.append(f"| {r['model']} | {r['target']} | {r['arch']} | {result} |||||||")
            continue
        export = "cached" if r.get("unet_export_s") is None else f"{r['unet_export_s']:.1f}"
        out.append(
            f"| {r['model']} | {r['target']} | {r['arch']} | {result} | "
            f"{num(r.get('wall_s'), '{:.0f}')} | {export} | "
            f"{num(r.get('unet_compile_s'), '{:.1f}')} | "
            f"{num(r.get('driver_peak') and r['driver_peak'] / GIB, '{:.2f}')} | "
            f"{num(r.get('child_peak') and r['child_peak'] / GIB, '{:.2f}')} | "
            f"{num(r.get('artifact_bytes') and r['artifact_bytes'] / 1e9, '{:.1f}')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", action="append", default=[], help="LABEL=PATH, repeatable")
    ap.add_argument("--targets", help="comma-separated (default: every GPU target)")
    ap.add_argument("--arches", help="comma-separated (default: every non-emulated preset)")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts")
    ap.add_argument("--table", action="store_true", help="print the table of OUT and stop")
    ap.add_argument("--sdiree", default="sdiree", help="the sdiree command (split on spaces)")
    args = ap.parse_args(argv)
    rows_path = args.out / "rows.jsonl"
    if not args.table:
        models = []
        for m in args.model:
            label, sep, path = m.partition("=")
            if not sep or not Path(path).is_dir():
                ap.error(f"--model {m!r}: give LABEL=PATH with PATH a model folder")
            models.append((label, path))
        targets, arches = (s.split(",") if s else None for s in (args.targets, args.arches))
        combos = combinations(load_registry(), targets, arches, args.dtype)
        args.out.mkdir(parents=True, exist_ok=True)
        done = {(r["model"], r["target"], r["arch"], r["dtype"]) for r in read_rows(rows_path)}
        for label, path in models:
            for c in combos:
                if (label, c["target"], c["arch"], args.dtype) in done:
                    continue
                print(f"{label} {c['target']} {c['arch']} ...", file=sys.stderr, flush=True)
                row = run_one(args.sdiree.split(), label, path, c, args.dtype, args.out, args.keep)
                print(f"  {row['result']} {row.get('why') or ''}", file=sys.stderr, flush=True)
                with rows_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(read_rows(rows_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
