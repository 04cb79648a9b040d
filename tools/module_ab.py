"""Time one submodule function across artifacts of one model, in turn, with parity to the first.

For compile variants (export choices, flags, tuning specs) of the same model and size: each
artifact's module is loaded in one process, called on the same inputs (`sdiree.compile.verify`'s),
warmed up, then timed round by round, A B C A B C ..., so drift hits every variant alike. Prints
per artifact the median and range of a call in seconds, the ratio to the first artifact's
median, and its output's relative difference (max abs / max |first|) and PSNR against the
first's. torch-free: iree-base-runtime, numpy and this checkout's sdiree.

    python tools/module_ab.py ART_A ART_B ... [--submodule unet] [--function denoise_cfg]
        [--runs 10] [--warmup 2] [--device cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _session(art: Path, submodule: str, device: str | None):
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session

    manifest = load_manifest(art)
    info, _ = choose_device(manifest, device)  # as `sdiree run` picks it
    return manifest, Session(manifest, info, (submodule,))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", type=Path, nargs="+")
    p.add_argument("--submodule", default="unet")
    p.add_argument("--function", default="denoise_cfg")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", help="as for `sdiree run` (default: the driver's first device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    from sdiree.compile.verify import compare, make_inputs

    sides = []
    for art in a.artifacts:
        t0 = time.perf_counter()
        manifest, session = _session(art, a.submodule, a.device)
        inputs = make_inputs(manifest, a.submodule, a.function, a.seed)
        out = None
        for _ in range(max(1, a.warmup)):
            out = session.call(a.submodule, a.function, *inputs)
        sides.append({"artifact": str(art), "session": session, "inputs": inputs, "out": out,
                      "load_s": time.perf_counter() - t0, "times": []})  # fmt: skip
        print(f"loaded {art} in {sides[-1]['load_s']:.1f} s", flush=True)
    for _ in range(a.runs):
        for s in sides:
            t0 = time.perf_counter()
            s["session"].call(a.submodule, a.function, *s["inputs"])
            s["times"].append(time.perf_counter() - t0)
    first = sides[0]
    base = float(np.median(first["times"]))
    report = []
    for s in sides:
        med = float(np.median(s["times"]))
        max_abs, scale, psnr = compare(first["out"][0], s["out"][0])
        row = {
            "artifact": s["artifact"],
            "median_s": med,
            "min_s": min(s["times"]),
            "max_s": max(s["times"]),
            "ratio": med / base,
            "rel_vs_first": max_abs / scale,
            "psnr_vs_first": psnr,
            "finite": bool(np.all(np.isfinite(s["out"][0]))),
            "load_s": s["load_s"],
        }
        report.append(row)
        print(
            f"{row['median_s']:.4f} s ({row['min_s']:.4f}-{row['max_s']:.4f}) x{row['ratio']:.3f}"
            f"  rel {row['rel_vs_first']:.2e}  {psnr:.1f} dB  finite={row['finite']}"
            f"  {s['artifact']}"
        )
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
