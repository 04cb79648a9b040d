"""What `sdiree run --weights/--lora/--vae` costs before the first step: time and peak RSS.

Each case runs in a fresh process: it opens the artifact's text encoder, UNet and VAE decoder
(as `sdiree run` does) with the compiled weights, or with a weights file / a LoRA / both, and
reports the time to prepare the replaced tensors (read, check, merge), the time to open the
session (on cpu this includes re-encoding the replaced weights with the artifact's kept
encoder, or reading them from the cache), and the process's peak RSS. The `compiled` case is
the baseline: what loading costs anyway.

    python tools/weights_bench.py ARTIFACT [--weights FILE] [--lora FILE[:X]] [--vae FILE]
        [--cases compiled,weights,weights-cached,lora] [--json OUT]

LoRA cases on cpu: `lora-encoder` runs the kept encoder over all the submodule's weights (the
path before the numpy re-pack, `SDIREE_ENCODED_REPACK=0`); `lora` re-packs the changed
weights by the encoder's learned layout, learning it first when the cache has none (all cases
share one temporary cache, so a later `lora-again` finds it). Each case's progress lines
(`unet: ...`) are kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one_case(artifact: Path, weights, lora, vae) -> dict:
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import Text2Image
    from sdiree.runtime.session import Session
    from sdiree.runtime.weights.sources import build_overrides, parse_lora_option

    manifest = load_manifest(artifact)
    info, _ = choose_device(manifest, None)
    t0 = time.perf_counter()
    loras = [parse_lora_option(lora)] if lora else []
    overrides, _, _ = build_overrides(
        manifest, Path(weights) if weights else None, Path(vae) if vae else None, loras
    )
    prepare = time.perf_counter() - t0
    rss_prepare = _peak_rss_gb()
    t0 = time.perf_counter()
    session = Session(manifest, info, Text2Image.SUBMODULES, overrides or None)
    open_s = time.perf_counter() - t0
    del session
    return {
        "prepare_s": round(prepare, 2),
        "open_s": round(open_s, 2),
        "peak_rss_gb_after_prepare": round(rss_prepare, 2),
        "peak_rss_gb": round(_peak_rss_gb(), 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--weights")
    ap.add_argument("--lora")
    ap.add_argument("--vae")
    ap.add_argument("--cases", default="compiled,weights,weights-cached,lora")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cache", type=Path, help="SDIREE_CACHE to use and keep (default: a temp)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one_case(a.artifact, a.weights, a.lora, a.vae)))
        return 0
    if a.cache:
        return _cases(a, {**os.environ, "SDIREE_CACHE": str(a.cache)})
    cache = tempfile.mkdtemp(prefix="weights-bench-cache-")  # encoded weights: GBs, removed
    try:
        return _cases(a, {**os.environ, "SDIREE_CACHE": cache})
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _cases(a, env) -> int:
    rows = {}
    for case in a.cases.split(","):
        args = {
            "compiled": [],
            "weights": ["--weights", a.weights],
            "weights-cached": ["--weights", a.weights],
            "lora": ["--lora", a.lora],
            "lora-encoder": ["--lora", a.lora],
            "lora-again": ["--lora", a.lora],
            "vae": ["--vae", a.vae],
        }[case]
        cmd = [sys.executable, __file__, str(a.artifact), "--one", *args]
        case_env = {**env, "SDIREE_ENCODED_REPACK": "0" if case == "lora-encoder" else "1"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=case_env)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return r.returncode
        rows[case] = {**json.loads(r.stdout.strip().splitlines()[-1])}
        rows[case]["log"] = [x for x in r.stderr.splitlines() if ": " in x and "Warning" not in x]
        rows[case]["process_s"] = round(time.perf_counter() - t0, 2)
        print(case, rows[case], flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
