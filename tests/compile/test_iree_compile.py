"""compile/iree_compile: a failed compile leaves its log and no vmfb; a later success clears it.
A killed compile leaves no compiler child running, and no empty log or temporary vmfb."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from sdiree.compile import iree_compile
from sdiree.compile.iree_compile import compile_mlir
from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import remove_stale_temps
from sdiree.runtime.targets import load_registry

GOOD = """
func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %r = arith.addf %a, %a : tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def test_failure_log_then_success_removes_it(tmp_path):
    flags = load_registry().target("cpu").compile_flags("x86-64-v3", "fp32")
    src, vmfb, log = tmp_path / "m.mlir", tmp_path / "m.vmfb", tmp_path / "m.compile.log"
    src.write_text(GOOD.replace("arith.addf", "arith.nosuchop"))
    with pytest.raises(UserError, match=r"iree-compile failed for m\.mlir: .*full log"):
        compile_mlir(src, vmfb, flags, log)
    assert log.is_file() and "nosuchop" in log.read_text() and not vmfb.exists()
    src.write_text(GOOD)
    compile_mlir(src, vmfb, flags, log)
    assert vmfb.stat().st_size > 0 and not log.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# A stand-in iree-compile (called as `tool MLIR -o OUT FLAGS...`) that starts its output, says
# its pid, then compiles "forever", so it can be killed midway.
SLOW_TOOL = """#!/bin/sh
printf partial > "$3"
echo $$ > "$PIDFILE"
exec sleep 120
"""

# compile_mlir in a process of its own, with the stand-in tool; Ctrl-C ends it as the CLI does.
# Python's Ctrl-C handler is set explicitly: a process started in a shell's background job
# inherits SIGINT ignored and Python then installs none (a terminal's CLI always has it).
HARNESS = """
import signal
import sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
import sdiree.compile.iree_compile as ic
ic.iree_compile_tool = lambda: sys.argv[1]
d = Path(sys.argv[2])
try:
    ic.compile_mlir(d / "m.mlir", d / "m.vmfb", [], d / "m.compile.log")
except KeyboardInterrupt:
    sys.exit(130)
"""


def _tool(tmp_path, body: str) -> str:
    tool = tmp_path / "fake-iree-compile"
    tool.write_text(body)
    tool.chmod(0o755)
    return str(tool)


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_compiler_child_dies_with_its_parent(tmp_path, how):
    work = tmp_path / "work"
    work.mkdir()
    (work / "m.mlir").write_text(GOOD)
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", HARNESS, _tool(tmp_path, SLOW_TOOL), str(work)],
        env={**os.environ, "PIDFILE": str(pidfile)},
        stderr=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.is_file() and pidfile.read_text().strip()):
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert psutil.Process(child).ppid() == parent.pid
        parent.send_signal(how)
        parent.wait(timeout=30)
        assert _gone(child), f"iree-compile (pid {child}) outlived its parent killed by {how!r}"
    finally:
        parent.kill()
        parent.wait()
        if child and not _gone(child, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    assert "Traceback" not in parent.stderr.read()
    left = sorted(p.name for p in work.iterdir())
    if how == signal.SIGKILL:
        # Nothing runs in a SIGKILLed process: its temp is left for the next run to remove.
        assert left == [f".m.vmfb.{parent.pid}.tmp.vmfb", "m.mlir"]
        assert [p.name for p in remove_stale_temps(work)] == [left[0]]
    else:
        assert left == ["m.mlir"]


@pytest.mark.parametrize(
    "body,says",
    [
        (
            '#!/bin/sh\nprintf partial > "$3"\nkill -KILL $$\n',
            "iree-compile was killed by SIGKILL while compiling m.mlir (out of memory?",
        ),
        ("#!/bin/sh\nexit 3\n", "iree-compile failed for m.mlir (exit status 3) without any"),
    ],
    ids=["killed", "silent-failure"],
)
def test_compiler_death_is_reported_without_empty_log_or_temp(tmp_path, body, says):
    src, vmfb, log = tmp_path / "m.mlir", tmp_path / "m.vmfb", tmp_path / "m.compile.log"
    src.write_text(GOOD)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(iree_compile, "iree_compile_tool", lambda: _tool(tmp_path, body))
        with pytest.raises(UserError) as info:
            compile_mlir(src, vmfb, [], log)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake-iree-compile", "m.mlir"]


def test_missing_compiler_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(iree_compile, "iree_compile_tool", lambda: str(tmp_path / "nope"))
    (tmp_path / "m.mlir").write_text(GOOD)
    with pytest.raises(UserError, match="cannot run iree-compile .*sdiree\\[compile\\]"):
        compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb", [], tmp_path / "m.log")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mlir"]


def test_stale_temp_folders_are_swept_too(tmp_path):
    """The SPIR-V rewrite's working folder (compile_mlir with f16_matrix_operands) is named as a
    temp file is; a killed compile's is removed with them, a live process's is not."""
    from sdiree.runtime.fileutil import temp_path_for

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".unet.spirv.{dead.pid}.tmp.spirv"
    (stale / "dump").mkdir(parents=True)
    (stale / "dump" / "x.spv").write_bytes(b"\0" * 8)
    live = temp_path_for(tmp_path / "vae.spirv")
    live.mkdir()
    assert remove_stale_temps(tmp_path) == [stale]
    assert not stale.exists() and live.is_dir()


# A stand-in iree-compile whose first STALLS calls deadlock (alive, no CPU time) and whose later
# calls compile; each call's arguments go to CALLS, one line each.
STALLING_TOOL = """#!/bin/sh
echo "$*" >> "$CALLS"
if [ $(wc -l < "$CALLS") -le $STALLS ]; then exec sleep 60; fi
printf vmfb > "$3"
"""

# One that waits on a child doing the work (as iree-compile on its linker): its own CPU time
# stays flat for longer than the stall limit while the child's grows.
BUSY_CHILD_TOOL = """#!/bin/sh
echo "$*" >> "$CALLS"
"$PYTHON" -c "import time
t = time.monotonic()
while time.monotonic() - t < 2.5:
    pass"
printf vmfb > "$3"
"""


def _stall_run(tmp_path, monkeypatch, body: str, stalls: int) -> list[str]:
    calls = tmp_path / "calls"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("STALLS", str(stalls))
    monkeypatch.setenv("PYTHON", sys.executable)
    monkeypatch.setattr(iree_compile, "STALL_S", 1.0)
    monkeypatch.setattr(iree_compile, "POLL_S", 0.1)
    monkeypatch.setattr(iree_compile, "iree_compile_tool", lambda: _tool(tmp_path, body))
    src = tmp_path / "m.mlir"
    src.write_text(GOOD)
    try:
        compile_mlir(src, tmp_path / "m.vmfb", ["--flag"], tmp_path / "m.compile.log")
    finally:
        left = [p for p in psutil.Process().children(recursive=True) if "sleep" in p.name()]
        assert left == [], "a deadlocked compiler was left running"
    return calls.read_text().splitlines()


def test_deadlocked_compiler_is_run_again(tmp_path, monkeypatch, capsys):
    calls = _stall_run(tmp_path, monkeypatch, STALLING_TOOL, stalls=1)
    assert (tmp_path / "m.vmfb").read_text() == "vmfb"
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0].endswith("--flag")
    (said,) = capsys.readouterr().err.splitlines()
    assert (
        "iree-compile used no CPU for 1 s on m.mlir (an iree deadlock); compiling it again" in said
    )


def test_the_last_try_runs_without_threads_and_then_it_is_one_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(UserError) as info:
        _stall_run(tmp_path, monkeypatch, STALLING_TOOL, stalls=3)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.endswith("--mlir-disable-threading") for c in calls] == [False, False, True]
    said = str(info.value)
    assert "stopped making progress on m.mlir 3 times, the last without threads" in said
    assert "\n" not in said and not (tmp_path / "m.vmfb").exists()
    assert capsys.readouterr().err.splitlines()[-1].endswith("compiling it again without threads")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls", "fake-iree-compile", "m.mlir"]


def test_a_compiler_whose_child_works_is_not_stalled(tmp_path, monkeypatch):
    calls = _stall_run(tmp_path, monkeypatch, BUSY_CHILD_TOOL, stalls=0)
    assert len(calls) == 1 and (tmp_path / "m.vmfb").read_text() == "vmfb"


def test_a_module_read_from_stdin_is_the_same_from_any_path(tmp_path):
    """MLIR without locations of its own (iree's parameter encoder writes such) records the
    path it was read from; from stdin, the same text makes the same module wherever it lies."""
    text = (
        "func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
        "  %0 = arith.addf %a, %a : tensor<4xf32>\n"
        "  return %0 : tensor<4xf32>\n"
        "}\n"
    )
    flags = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu"]
    made = {}
    for where in ("a", "b"):
        mlir = tmp_path / f".{where}.encoder.mlir.{where}.tmp.mlir"
        mlir.write_text(text)
        for stdin in (False, True):
            vmfb = tmp_path / f"{where}-{stdin}.vmfb"
            iree_compile.compile_mlir(mlir, vmfb, flags, tmp_path / "log", from_stdin=stdin)
            made[where, stdin] = vmfb.read_bytes()
    assert made["a", False] != made["b", False]  # the path is in the module
    assert made["a", True] == made["b", True]
