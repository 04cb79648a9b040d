"""Time a module call with its weights resident against the same call right after
Session.release (its pages dropped from RSS, read back from the page cache), alternating in one
process, and report RSS around each: what the phase release of `sdiree run` costs the first
call of each phase.

    python tools/release_bench.py ARTIFACT [--submodule unet] [--function denoise_cfg] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from sdiree.runtime.device import list_devices
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.session import Session


def status_mb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024
    return out


def inputs(session: Session, sub: str, fn: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for d in session.decl(sub, fn).inputs:
        if np.dtype(d.dtype).kind in "iu":
            out.append(rng.integers(0, 1000, d.shape).astype(d.dtype))
        else:
            out.append(rng.standard_normal(d.shape).astype(d.dtype))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--submodule", default="unet")
    p.add_argument("--function", default="denoise_cfg")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    manifest = load_manifest(a.artifact)
    session = Session(manifest, list_devices("local-task")[0], [a.submodule])
    args = inputs(session, a.submodule, a.function)

    def call() -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        out = session.call(a.submodule, a.function, *args)[0]
        return time.perf_counter() - t0, out

    _, ref = call()  # first call: faults everything in once
    rows = []
    for r in range(a.rounds):
        # alternate the order round by round so drift hits both
        for kind in ("resident", "released") if r % 2 == 0 else ("released", "resident"):
            released = session.release([a.submodule]) if kind == "released" else 0
            before = status_mb()
            seconds, out = call()
            rows.append(
                {
                    "round": r,
                    "kind": kind,
                    "seconds": round(seconds, 3),
                    "released_mb": released >> 20,
                    "rss_before": before,
                    "rss_after": status_mb(),
                    "same": bool(np.array_equal(out, ref)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    med = {
        k: float(np.median([x["seconds"] for x in rows if x["kind"] == k]))
        for k in ("resident", "released")
    }
    print(
        json.dumps(
            {"median_s": med, "released/resident": round(med["released"] / med["resident"], 4)}
        )
    )


if __name__ == "__main__":
    main()
