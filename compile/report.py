"""Stage reporting for `sdiree compile`: one line per stage with its time, a summary at the end."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StageRecord:
    stage: str
    item: str
    seconds: float
    status: str  # "done", "reused"


@dataclass
class Reporter:
    stream: object = field(default_factory=lambda: sys.stdout)
    records: list[StageRecord] = field(default_factory=list)
    # run after each stage that finished, given the seconds it took (compile/driver.py: its
    # freed memory handed back)
    between_stages: Callable[[float], object] | None = None

    def say(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    @contextlib.contextmanager
    def stage(self, stage: str, item: str = ""):
        label = f"{stage} {item}".strip()
        self.say(f"[{label}] ...")
        t0 = time.perf_counter()
        yield
        if self.between_stages is not None:
            self.between_stages(time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        self.records.append(StageRecord(stage, item, dt, "done"))
        self.say(f"[{label}] done in {dt:.1f}s")

    def reused(self, stage: str, item: str, why: str = "unchanged") -> None:
        self.records.append(StageRecord(stage, item, 0.0, "reused"))
        self.say(f"[{stage} {item}] reused ({why})")

    def summary(self) -> str:
        done = [r for r in self.records if r.status == "done"]
        reused = [r for r in self.records if r.status == "reused"]
        lines = ["summary:"]
        for r in self.records:
            what = f"{r.stage} {r.item}".strip()
            lines.append(
                f"  {what:<28} {'reused' if r.status == 'reused' else f'{r.seconds:7.1f}s'}"
            )
        total = sum(r.seconds for r in done)
        lines.append(f"  {len(done)} stages run, {len(reused)} reused, {total:.1f}s of work")
        return "\n".join(lines)

    def timings(self) -> dict:
        return {
            f"{r.stage}:{r.item}" if r.item else r.stage: round(r.seconds, 3)
            for r in self.records
            if r.status == "done"
        }
