"""Benchmark sdiree against diffusers/torch on the same work: the `sdiree bench` command as a script.

The same options and the same code: this only hands its arguments to `sdiree bench`
(`sdiree.runtime.cli`), which runs `sdiree.compile.bench.run_bench`; see tools/PERFORMANCE.md for
the method and the figures taken. Needs the compile extra (and the peers extra for `--peers`).

    python tools/bench.py MODEL_DIR --target cpu [--arch host] [--dtype fp32] \\
        [--height 512 --width 512] [--steps 20] [--runs 5] [--warmup 2] [--json PATH] \\
        [--torch-compile] [--torch-device cuda] [--torch-dtype fp16] [--out ARTIFACT_DIR] \\
        [--specs DIR] [--peers openvino,onnxruntime]
"""

from __future__ import annotations

import sys

from sdiree.runtime.cli import main as sdiree_main


def main(argv: list[str] | None = None) -> None:
    sdiree_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
