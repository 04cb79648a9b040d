""".ci/pytest_resuming, .ci/crash_report and tests/suite_progress.py: a test run whose process
dies of SIGABRT names the test it died in (with its native stack where gdb can read the core),
runs once more from that test, and still fails for a test that failed before the crash or for
a second crash."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import suite_progress

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from suite_progress import (  # noqa: F401
    deselect_ended, pytest_runtest_logfinish, pytest_runtest_logstart, record_failure,
)

def pytest_collection_modifyitems(config, items):
    deselect_ended(config, items)

def pytest_runtest_logreport(report):
    record_failure(report)
"""

# test_crashes aborts the process the first time (every time with CRASH_ALWAYS=1)
TESTS = """
import os
from pathlib import Path

def test_a():
    pass

def test_fails():
    assert os.environ.get("FAIL") != "1"

def test_crashes():
    marker = Path("crashed-once")
    if os.environ.get("CRASH_ALWAYS") == "1" or not marker.exists():
        marker.touch()
        os.abort()

def test_after():
    pass
"""


def _run(where: Path, **env) -> subprocess.CompletedProcess:
    (where / "conftest.py").write_text(CONFTEST)
    (where / "test_x.py").write_text(TESTS)
    env = {**os.environ, "TMPDIR": str(where / "tmp"), **env}
    (where / "tmp").mkdir()
    for name in (suite_progress.PROGRESS_ENV, suite_progress.RESUME_ENV):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(ROOT / ".ci" / "pytest_resuming"), "-q", "-p", "no:cacheprovider"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_crash_is_named_and_the_run_goes_on_from_it(tmp_path):
    run = _run(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    said = "CRASH: the test process died of signal 6 during: test_x.py::test_crashes"
    assert said in out.splitlines()  # the report's first line
    last = run.stdout.rstrip().splitlines()[-1]
    assert last == f"{said} (the run resumed once from that test; the stacks are above)"
    assert "2 passed, 2 deselected" in out  # test_crashes again, then test_after
    if shutil.which("gdb") and "native stacks" in out:  # this machine wrote a core where it ran
        assert " in __GI_abort " in out or " in abort " in out  # the dying thread's C frames
        assert "in test_crashes" in out  # and the Python ones
        assert not list(tmp_path.glob("core*"))  # removed once read
    assert not list((tmp_path / "tmp").iterdir())  # the progress file and report removed


def test_a_failure_before_the_crash_still_fails_the_run(tmp_path):
    run = _run(tmp_path, FAIL="1")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "tests that failed before the crash:\nfailed test_x.py::test_fails" in out


def test_a_second_crash_fails_the_run(tmp_path):
    run = _run(tmp_path, CRASH_ALWAYS="1")
    assert run.returncode == 134, run.stdout + run.stderr


def test_progress_file_names_the_unfinished_test(tmp_path, monkeypatch):
    progress = tmp_path / "progress.txt"
    monkeypatch.setattr(suite_progress, "_out", None)
    monkeypatch.setenv(suite_progress.PROGRESS_ENV, str(progress))
    suite_progress.pytest_runtest_logstart("t::a", None)
    suite_progress.pytest_runtest_logfinish("t::a", None)
    suite_progress.pytest_runtest_logstart("t::b", None)
    suite_progress._out.close()
    monkeypatch.setattr(suite_progress, "_out", None)
    assert suite_progress.ended(progress) == {"t::a"}
    assert suite_progress.unfinished(progress) == ["t::b"]


@pytest.mark.parametrize("env", [{}, {suite_progress.RESUME_ENV: "1"}])
def test_without_a_progress_file_nothing_is_written_or_deselected(tmp_path, monkeypatch, env):
    monkeypatch.delenv(suite_progress.PROGRESS_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    suite_progress._write("start", "x")
    items = ["kept"]
    suite_progress.deselect_ended(None, items)
    assert items == ["kept"] and list(tmp_path.iterdir()) == []
