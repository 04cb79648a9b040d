"""compile/report.py: the Reporter's hook between stages (the driver hands freed memory back there)."""

from __future__ import annotations

import io
import time

import pytest

from sdiree.compile.report import Reporter


def test_between_stages_runs_after_each_finished_stage():
    calls = []
    r = Reporter(stream=io.StringIO(), between_stages=lambda s: calls.append((len(r.records), s)))
    with r.stage("export", "unet"):
        time.sleep(0.05)
    r.reused("compile", "unet")
    with pytest.raises(RuntimeError), r.stage("encode", "unet"):
        raise RuntimeError("failed")
    # once, given the stage's seconds, inside the stage's time: not after a reuse or a failure
    assert [n for n, _ in calls] == [0]
    assert 0.05 <= calls[0][1] <= r.records[0].seconds
    assert [x.status for x in r.records] == ["done", "reused"]


def test_the_drivers_gc_pass_follows_only_stages_long_beside_it(monkeypatch):
    """compile/driver.py's hook: malloc_trim after every stage, a gc pass only after a stage
    of at least COLLECT_EVERY times the last pass (tiny models' short stages skip it)."""
    import gc

    from sdiree.compile import driver

    passes, trims = [], []

    def slow_pass(*args):
        time.sleep(0.02)
        passes.append(args)
        return 0

    monkeypatch.setattr(gc, "collect", slow_pass)
    monkeypatch.setattr(driver, "release_freed_heap", lambda: trims.append(1))
    back = driver._FreedMemoryBack()
    every = back.COLLECT_EVERY
    back(0.0)  # the first stage: nothing measured yet
    assert len(passes) == 1 and back.last_pass_s >= 0.02
    back(every * 0.01)  # shorter than COLLECT_EVERY passes: skipped
    assert len(passes) == 1
    back(every * back.last_pass_s)
    assert len(passes) == 2
    assert len(trims) == 3
