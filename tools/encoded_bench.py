"""A/B of a submodule's load and call between artifacts (e.g. raw vs paged encoded weights).

Each run is a fresh process that opens only the submodule, times the load (Session), calls one
function once on inputs drawn from a fixed seed, and reports the call's time and the process's
peak RSS (VmHWM); the outputs are saved so that the A and B outputs can be compared bit for
bit. FN may list several functions (`denoise_cfg,denoise`): called in turn in one process, so
the peak RSS counts every packed copy they use. Artifacts alternate (A, B, A, B...) so a noisy machine hits both alike.

    python tools/encoded_bench.py unet denoise_cfg[,denoise] ART_A ART_B [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _hwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def one(artifact: Path, sub: str, fn: str, out: Path) -> dict:
    import numpy as np

    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session

    m = load_manifest(artifact)
    info, _ = choose_device(m, None)
    t0 = time.perf_counter()
    session = Session(m, info, [sub])
    load_s = time.perf_counter() - t0
    rss_load = _hwm_gb()
    rng = np.random.default_rng(0)
    calls, outputs = {}, []
    for name in fn.split(","):  # several: called one after another in this process
        args = [
            rng.standard_normal(d.shape).astype(d.dtype) if d.name != "timestep" else
            np.full(d.shape, 500, d.dtype)
            for d in session.decl(sub, name).inputs
        ]  # fmt: skip
        t0 = time.perf_counter()
        outputs.append(session.call(sub, name, *args)[0])
        calls[name] = round(time.perf_counter() - t0, 2)
    np.save(out, np.concatenate([o.reshape(-1) for o in outputs]))
    return {"load_s": round(load_s, 3), "call_s": calls,
            "peak_rss_gb_load": round(rss_load, 2), "peak_rss_gb": round(_hwm_gb(), 2)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sub")
    ap.add_argument("fn")
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.artifacts[0], a.sub, a.fn, a.one)))
        return 0
    import numpy as np

    rows, outs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, art in enumerate(a.artifacts):
                out = Path(tmp) / f"{i}-{r}.npy"
                cmd = [sys.executable, __file__, a.sub, a.fn, str(art), "--one", str(out)]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode:
                    print(p.stderr, file=sys.stderr)
                    return p.returncode
                row = {"artifact": str(art), "round": r, **json.loads(p.stdout.splitlines()[-1])}
                rows.append(row)
                outs.setdefault(i, np.load(out))
                print(row, flush=True)
        same = all(np.array_equal(outs[0], o) for o in outs.values())
    print(f"outputs bit-identical across artifacts: {same}")
    for i, o in outs.items():  # other numerics (e.g. another conv lowering): how far apart
        if i and not np.array_equal(outs[0], o):
            d = np.abs(o.astype(np.float64) - outs[0])
            scale = float(np.abs(outs[0]).max())
            print(f"{a.artifacts[i]} vs {a.artifacts[0]}: max |diff| {d.max():.3g} "
                  f"({d.max() / scale:.3g} of the max), rms {np.sqrt((d**2).mean()):.3g}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "bit_identical": same}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
