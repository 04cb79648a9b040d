"""compile/report.py: the Reporter's hook between stages (the driver hands freed memory back there)."""

from __future__ import annotations

import io

import pytest

from sdiree.compile.report import Reporter


def test_between_stages_runs_after_each_finished_stage():
    calls = []
    r = Reporter(stream=io.StringIO(), between_stages=lambda: calls.append(len(r.records)))
    with r.stage("export", "unet"):
        pass
    r.reused("compile", "unet")
    with pytest.raises(RuntimeError), r.stage("encode", "unet"):
        raise RuntimeError("failed")
    assert calls == [0]  # once, inside the stage's time: not after a reuse or a failure
    assert [x.status for x in r.records] == ["done", "reused"]
