"""`sdiree bench`'s worker protocol: one side per process, driven one call at a time.

The parent starts each side as ``python -m sdiree.compile.bench_worker SIDE SPEC`` and sends it
JSON requests a line on stdin (``import``, ``load``, ``run`` a figure, ``quit``); the worker
answers one JSON line each on its original stdout (seconds, peak RSS, the side's info), while
anything else printed in it, by Python or C code, goes to its log. A failure is a reply with
``error`` (its traceback in the log), which the parent raises as a UserError naming the log.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .bench_memory import PeakRSS, rss_mb
from .bench_sides import SIDES, SdireeSide, TorchSide


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the parent bench process dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _side_class(side: str):
    if side in SIDES:
        return SdireeSide if side == "sdiree" else TorchSide
    from .peers import side_class

    return side_class(side)


def worker_main(side: str, spec_path: Path) -> int:
    """Serve one side: JSON requests on stdin, one JSON reply a line on the original stdout."""
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (by us or a library, Python or C) goes to the log
    spec = json.loads(Path(spec_path).read_text())
    cls = _side_class(side)
    runner = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            break
        try:
            if op == "import":
                rss0 = rss_mb()
                t0 = time.perf_counter()
                cls.imports()
                reply = {
                    "import_s": time.perf_counter() - t0,
                    "rss_at_start_mb": rss0,
                    "rss_after_imports_mb": rss_mb(),
                }
            elif op == "load":
                reply = {}
                with PeakRSS() as peak:
                    t0 = time.perf_counter()
                    runner = cls(spec)
                    reply["seconds"] = time.perf_counter() - t0
                gc.collect()
                reply.update(
                    peak_rss_load_mb=peak.peak_mb,
                    rss_after_load_mb=rss_mb(),
                    memory_method=peak.method,
                    torch_imported="torch" in sys.modules,
                    pid=os.getpid(),
                    **runner.info,
                )
            elif op == "run":
                fn = runner.figures[msg["figure"]]
                gc.collect()
                if hasattr(runner, "before_run"):
                    runner.before_run(msg["figure"])  # untimed, outside the peak
                rss0 = rss_mb()
                with PeakRSS() as peak:
                    for _ in range(msg.get("repeat", 1)):  # back to back: the last one timed
                        t0 = time.perf_counter()
                        outs = fn()
                        seconds = time.perf_counter() - t0
                reply = {
                    "seconds": seconds,
                    "peak_rss_mb": peak.peak_mb,
                    "rss_before_mb": rss0,
                    **runner.after_run(),
                }
                if msg.get("save"):
                    np.savez(msg["save"], *outs)
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, traceback to the log
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    return 0


class Worker:
    """The parent's handle on one side's worker process."""

    def __init__(self, side: str, spec_path: Path, log_path: Path):
        self.side = side
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sdiree.compile.bench_worker", side, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=env,
        )

    def ask(self, **msg) -> dict:
        from sdiree.runtime.errors import UserError

        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise UserError(
                f"the {self.side} bench worker died (exit {self.proc.returncode}) during "
                f"{msg.get('op')} {msg.get('figure', '')}: {self._log_tail()} (log: {self.log_path})"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise UserError(
                f"the {self.side} side failed during {msg.get('op')} {msg.get('figure', '')}: "
                f"{reply['error']} (log: {self.log_path})"
            )
        return reply

    def _log_tail(self) -> str:
        self._log.flush()
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "no output"

    def close(self, kill: bool = False) -> None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2:
        return worker_main(argv[0], Path(argv[1]))
    print("usage: python -m sdiree.compile.bench_worker SIDE SPEC (use `sdiree bench`)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
