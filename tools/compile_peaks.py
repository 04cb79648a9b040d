"""Time and peak memory of each stage of a command that reports stages as `sdiree compile` does.

Runs the command, reads its output (`[stage name] ...`, `[stage name] done in 1.2s`) and samples
the resident memory of the command and every process under it (iree-compile children) from
/proc every 0.2 s. Each stage gets the highest sample taken while it ran: the driver's RSS (with
its anonymous and file-mapped parts) and the largest child's. The whole run's peak is checked
against the kernel's own high-water marks of the driver (VmHWM) and of any child.

    python tools/compile_peaks.py [--json OUT] -- sdiree compile MODEL --target T --out DIR

The command's output is passed through to stderr; the markdown table goes to stdout. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

STAGE = re.compile(r"^\[([^\]]+)\] (\.\.\.|done in ([0-9.]+)s|reused.*)$")
GIB = 2**30


def _status(pid: int) -> dict[str, int]:
    """{field: bytes} of VmRSS, RssAnon, RssFile, VmHWM of pid ({} when it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _children(pid: int) -> list[int]:
    """Every process under pid (any depth)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                found.append(int(k))
                todo.append(int(k))
    return found


class Sampler:
    def __init__(self, pid: int):
        self.pid = pid
        self.stage = "(start)"
        self.rows: dict[str, dict] = {}
        self.order: list[str] = []
        self.child_hwm = 0
        self.driver_hwm = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def row(self, stage: str) -> dict:
        if stage not in self.rows:
            self.rows[stage] = {"driver": 0, "anon": 0, "file": 0, "child": 0, "seconds": None}
            self.order.append(stage)
        return self.rows[stage]

    def run(self) -> None:
        while not self.done.is_set():
            s = _status(self.pid)
            kids = [_status(k) for k in _children(self.pid)]
            with self.lock:
                r = self.row(self.stage)
                if s.get("VmRSS", 0) > r["driver"]:
                    r.update(driver=s["VmRSS"], anon=s.get("RssAnon", 0), file=s.get("RssFile", 0))
                self.driver_hwm = max(self.driver_hwm, s.get("VmHWM", 0))
                for k in kids:
                    r["child"] = max(r["child"], k.get("VmRSS", 0))
                    self.child_hwm = max(self.child_hwm, k.get("VmHWM", 0))
            time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    for line in proc.stdout:
        sys.stderr.write(line)
        m = STAGE.match(line.strip())
        if m:
            with sampler.lock:
                if m.group(2) == "...":
                    sampler.stage = m.group(1)
                    sampler.row(m.group(1))
                else:
                    if m.group(3):
                        sampler.row(m.group(1))["seconds"] = float(m.group(3))
                    sampler.stage = f"(after {m.group(1)})"
    code = proc.wait()
    wall = time.perf_counter() - t0
    sampler.done.set()
    thread.join()
    rows = [(k, sampler.rows[k]) for k in sampler.order if sampler.rows[k]["driver"]]
    print(f"command: `{' '.join(cmd)}` (exit {code}, wall {wall:.0f} s)\n")
    print("| stage | s | driver GiB (anon / file) | largest child GiB |")
    print("|---|---:|---|---:|")
    for name, r in rows:
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        print(
            f"| {name} | {secs} | {r['driver'] / GIB:.2f} ({r['anon'] / GIB:.2f} / "
            f"{r['file'] / GIB:.2f}) | {r['child'] / GIB:.2f} |"
        )
    print(
        f"\nHigh-water marks (kernel): driver {sampler.driver_hwm / GIB:.2f} GiB, "
        f"largest child {sampler.child_hwm / GIB:.2f} GiB"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "exit": code,
                    "wall_s": wall,
                    "stages": dict(rows),
                    "driver_hwm": sampler.driver_hwm,
                    "child_hwm": sampler.child_hwm,
                },
                indent=1,
            )
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
