"""Where a test run that dies stopped, and a run of the tests it did not finish.

The suite's process has, rarely, died of SIGABRT late in a run (compile/NOTES.md, "The suite's
rare abort"), and pytest's summary died with it. With SDIREE_TEST_PROGRESS naming a file, each
test's node id is appended there when the test starts (`start ID`), when one of its phases fails
(`failed ID`) and when it ends (`end ID`): after a crash the last `start` without its `end` is
the test the process died in. With SDIREE_TEST_RESUME=1 as well, the tests that ended in that
file are deselected, so the run goes on from the test that crashed (it runs again). .ci/run
does both; tests/conftest.py imports these hooks.
"""

from __future__ import annotations

import os
from pathlib import Path

PROGRESS_ENV = "SDIREE_TEST_PROGRESS"
RESUME_ENV = "SDIREE_TEST_RESUME"

_out = None


def _write(kind: str, nodeid: str) -> None:
    global _out
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    if _out is None:
        _out = open(path, "a", buffering=1)  # noqa: SIM115  (line-buffered for the process's life)
    _out.write(f"{kind} {nodeid}\n")


def ended(path: Path) -> set[str]:
    """The node ids of the tests that ended in the progress file at path."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return set()
    return {ln[4:] for ln in lines if ln.startswith("end ")}


def unfinished(path: Path) -> list[str]:
    """The tests that started in the progress file at path and did not end, in order."""
    started: dict[str, None] = {}
    for ln in path.read_text().splitlines():
        kind, _, nodeid = ln.partition(" ")
        if kind == "start":
            started[nodeid] = None
        elif kind == "end":
            started.pop(nodeid, None)
    return list(started)


def deselect_ended(config, items: list) -> None:
    """Under SDIREE_TEST_RESUME=1, drop (and report as deselected) the tests that ended in the
    progress file."""
    path = os.environ.get(PROGRESS_ENV)
    if os.environ.get(RESUME_ENV) != "1" or not path:
        return
    done = ended(Path(path))
    gone = [i for i in items if i.nodeid in done]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if i.nodeid not in done]


def pytest_runtest_logstart(nodeid, location):
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("end", nodeid)


def record_failure(report) -> None:
    if report.failed:
        _write("failed", report.nodeid)
