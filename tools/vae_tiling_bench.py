"""Peak memory and time of a tiled VAE decode at several sizes, each in a fresh process.

Loads only an artifact's VAE decoder (runtime Session, torch-free) and decodes random latents
of each asked side with runtime/vae_tiling.decode_latents: whole where the module takes that
size, else in tiles of the module's size (edge tiles from full tiles moved inward where the
module has no function of their shape). Each size runs in its own process, one after another,
so each peak RSS (getrusage ru_maxrss: weights mapped and touched, plus working memory) is that
size's alone. Prints a table; --json writes the rows.

    python tools/vae_tiling_bench.py artifacts/sd15-random/cpu-host-fp32-512x512-b1 \\
        --latents 64 128 256
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def rss_now_mib(kind: str = "Rss") -> float:
    """This process's resident memory now: all of it (Rss), its heap and other anonymous
    memory (Anonymous), or mapped files such as the weights (the rest)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(artifact: Path, side: int, seed: int, trace: bool = False) -> dict:
    """One size in this process: load, decode once, report (trace: RSS after each call)."""
    import numpy as np

    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session
    from sdiree.runtime.vae_tiling import decode_latents, module_shapes, tile_starts

    manifest = load_manifest(artifact)
    info, _ = choose_device(manifest, None)
    t0 = time.perf_counter()
    session = Session(manifest, info, ("vae_decoder",))
    load_s = time.perf_counter() - t0
    rss_loaded = rss_now_mib()
    if trace:
        call = session.call

        def traced(*args):
            t = time.perf_counter()
            out = call(*args)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            sys.stderr.write(
                f"call {args[1]} {args[2].shape[-2:]}: {time.perf_counter() - t:.1f} s, RSS "
                f"{rss_now_mib():.0f} MiB (heap {rss_now_mib('Anonymous'):.0f}), peak {peak:.0f}\n"
            )
            return out

        session.call = traced
    decl = session.decl("vae_decoder", "decode").inputs[0]
    batch, channels, th, tw = decl.shape
    dtype = np.dtype(decl.dtype)
    latents = np.random.default_rng(seed).standard_normal((batch, channels, side, side))
    calls = 1
    if (side, side) != (th, tw):
        calls = len(tile_starts(side, max(th, tw))) ** 2
    t0 = time.perf_counter()
    image = decode_latents(session, latents.astype(np.float32), batch, dtype)
    decode_s = time.perf_counter() - t0
    return {
        "latent": side,
        "image": image.shape[-1],
        "module_latent": [th, tw],
        "functions": len(module_shapes(manifest, "vae_decoder")),
        "calls": calls,
        "load_s": round(load_s, 2),
        "decode_s": round(decode_s, 2),
        "s_per_call": round(decode_s / calls, 2),
        "rss_after_load_mib": round(rss_loaded),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        # glibc keeps freed heap (runtime/host_memory.py): the heap now is about its peak
        "anon_after_mib": round(rss_now_mib("Anonymous")),
        "file_after_mib": round(rss_now_mib("Rss") - rss_now_mib("Anonymous")),
        "finite": bool(np.isfinite(image).all()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path, help="artifact directory (its vae_decoder is used)")
    ap.add_argument("--latents", type=int, nargs="+", default=[64, 128, 256], metavar="N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--trace", action="store_true", help="RSS after each call, to stderr")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one size, JSON out
    a = ap.parse_args(argv)
    if a.one is not None:
        print(json.dumps(measure(a.artifact, a.one, a.seed, a.trace)))
        return 0
    rows = []
    for side in a.latents:
        cmd = [sys.executable, __file__, str(a.artifact), "--one", str(side), "--seed", str(a.seed)]
        proc = subprocess.run(cmd + ["--trace"] * a.trace, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{r['image']:>5}² ({r['latent']}² latents): {r['calls']:>3} call(s) of "
            f"{r['module_latent'][0]}², decode {r['decode_s']:.1f} s ({r['s_per_call']:.1f} "
            f"s/call), peak RSS {r['peak_rss_mib']} MiB (after load {r['rss_after_load_mib']}; "
            f"after decode heap {r.get('anon_after_mib')}, files {r.get('file_after_mib')}), "
            f"finite {r['finite']}",
            flush=True,
        )
    base = rows[0]["peak_rss_mib"]
    for r in rows[1:]:
        print(f"{r['image']}² peak - {rows[0]['image']}² peak: {r['peak_rss_mib'] - base} MiB")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
