"""Benchmark sdiree against diffusers/torch on the same work: the `sdiree bench` command as a script.

Same options and the same code (`sdiree.compile.bench.run_bench`); see tools/PERFORMANCE.md for
the method and the figures taken. Needs the compile extra.

    python tools/bench.py MODEL_DIR --target cpu [--arch host] [--dtype fp32] \\
        [--height 512 --width 512] [--steps 20] [--runs 5] [--warmup 2] [--json PATH] \\
        [--torch-compile] [--torch-device cuda] [--torch-dtype fp16] [--out ARTIFACT_DIR] [--specs DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdiree.runtime.cli import INSTALL_HINT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path, help="diffusers model folder")
    ap.add_argument("--target", "-t", required=True, help="cpu, vulkan-spirv, rocm or cuda")
    ap.add_argument("--arch", default=None, help="chip preset of the target")
    ap.add_argument("--dtype", default=None, help="fp32 or fp16 (default: per target)")
    ap.add_argument("--height", type=int, default=None, help="image height (default: model's)")
    ap.add_argument("--width", type=int, default=None, help="image width (default: model's)")
    ap.add_argument("--steps", type=int, default=20, help="steps of the whole-image figure")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs per figure")
    ap.add_argument("--json", dest="json_path", type=Path, default=None, help="report file")
    ap.add_argument("--torch-compile", action="store_true", help="torch.compile the torch UNet")
    ap.add_argument("--torch-device", default=None, help="torch's device: cpu or cuda")
    ap.add_argument("--torch-dtype", default=None, help="torch's dtype (default: artifact's)")
    ap.add_argument("--out", "-o", type=Path, default=None, help="artifact directory")
    ap.add_argument("--device", "-d", default=None, help="sdiree device (as for `sdiree run`)")
    ap.add_argument("--prompt", "-p", default=None, help="prompt of the whole-image figure")
    ap.add_argument("--seed", type=int, default=42, help="seed of the inputs and of the image")
    ap.add_argument("--specs", type=Path, default=None, help="another specs directory")
    ap.add_argument("--peers", default=None, help="openvino,onnxruntime,... (the peers extra)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        from sdiree.compile.bench import DEFAULT_PROMPT, BenchOptions, run_bench
    except ImportError as e:
        print(
            f"error: tools/bench.py needs the compile extra: {INSTALL_HINT} ({e})",
            file=sys.stderr,
        )
        return 2
    from sdiree.runtime.errors import UserError

    try:
        run_bench(
            BenchOptions(
                model_dir=a.model_dir,
                target=a.target,
                arch=a.arch,
                dtype=a.dtype,
                height=a.height,
                width=a.width,
                steps=a.steps,
                runs=a.runs,
                warmup=a.warmup,
                json_path=a.json_path,
                torch_compile=a.torch_compile,
                torch_device=a.torch_device,
                torch_dtype=a.torch_dtype,
                out=a.out,
                device=a.device,
                prompt=a.prompt or DEFAULT_PROMPT,
                seed=a.seed,
                specs_dir=a.specs,
                peers=a.peers,
            )
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
