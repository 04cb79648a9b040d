"""Run iree-compile on one MLIR module with a target's flags; the vmfb appears atomically.

The compiler child never outlives sdiree: on Linux the kernel kills it when its parent dies
(even by SIGKILL), and an interrupted or terminated compile kills and reaps it before its
temporary output is removed.

A compiler that stops using CPU altogether is deadlocked, not slow: iree 3.13's tuning-spec
loader holds a lock while its parser verifies in parallel, and a worker waiting there can pick
up another executable's configuration pass that waits for the same lock forever (compile/
NOTES.md; ~1 config-only compile in 60 with `--iree-codegen-tuning-spec-path` on 2 cores, which
rocm's specs take). Such a compile is killed after STALL_S seconds without any CPU time in its
whole process tree, and run again; the last try runs single-threaded, where no worker exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sdiree.runtime.cli import INSTALL_HINT
from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import atomic_path, atomic_write_bytes, temp_path_for

PR_SET_PDEATHSIG = 1
STALL_S = 180.0  # seconds without CPU time in the compiler's process tree: a deadlock
POLL_S = 5.0
UNTHREADED = ["--mlir-disable-threading"]  # no worker threads: no such deadlock
# What each try adds to the command: the same again once, then without threads.
TRIES = ([], [], UNTHREADED)


def iree_compile_tool() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def compiler_version() -> str:
    from importlib.metadata import version

    return version("iree-base-compiler")


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGKILL the child once this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit for the block, so that `finally` clauses (killing the child,
    removing temporary files) run; Python's default SIGTERM ends the process without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tree_cpu_ticks(pid: int) -> int | None:
    """CPU clock ticks used so far by pid and its live descendants (iree-compile may run a
    linker as a child); None where /proc does not say (not Linux)."""
    total, todo, seen = 0, [pid], False
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            seen = True
            for task in os.listdir(f"/proc/{p}/task"):
                todo += map(int, Path(f"/proc/{p}/task/{task}/children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def _run_once(cmd: list[str], stdin: Path | None = None) -> tuple[int, str, bool]:
    """Run cmd (reading the file stdin, if given): its exit status, its stderr and stdout, and
    whether it was killed for making no progress. The child is killed and reaped if this
    returns by an exception (Ctrl-C, SIGTERM)."""
    with _sigterm_unwinds(), open(stdin or os.devnull, "rb") as source:
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=source,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                preexec_fn=_die_with_parent(),
            )
        except OSError as e:
            raise UserError(
                f"cannot run iree-compile ({e}); reinstall the compile extra: {INSTALL_HINT}"
            ) from None
        try:
            ticks, progressed = None, time.monotonic()
            while True:
                try:
                    out, err = proc.communicate(timeout=POLL_S)
                    return proc.returncode, err + out, False
                except subprocess.TimeoutExpired:
                    now = _tree_cpu_ticks(proc.pid)
                    if now is None or now != ticks:
                        ticks, progressed = now, time.monotonic()
                    elif time.monotonic() - progressed >= STALL_S:
                        proc.kill()
                        out, err = proc.communicate()
                        return proc.returncode, err + out, True
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _run(cmd: list[str], mlir: Path, stdin: Path | None = None) -> tuple[int, str]:
    """Run cmd, again when it deadlocks (the module docstring); the last try without threads."""
    for n, extra in enumerate(TRIES, 1):
        code, output, stalled = _run_once([*cmd, *extra], stdin)
        if not stalled:
            return code, output
        if n < len(TRIES):
            how = " without threads" if TRIES[n] else ""
            print(
                f"sdiree: iree-compile used no CPU for {STALL_S:.0f} s on {mlir.name} (an iree "
                f"deadlock); compiling it again{how}",
                file=sys.stderr,
                flush=True,
            )
    raise UserError(
        f"iree-compile stopped making progress on {mlir.name} {len(TRIES)} times, the last "
        "without threads: look for a process holding the machine (`top`), then compile again"
    )


def compile_mlir(
    mlir: Path,
    vmfb: Path,
    flags: list[str],
    log_path: Path,
    f16_matrix_operands: bool = False,
    from_stdin: bool = False,
) -> int:
    """Compile mlir to vmfb; on failure write the compiler output (if any) to log_path and raise.
    A log left by an earlier failure is removed once the module compiles. f16_matrix_operands:
    compile, rewrite the SPIR-V cooperative-matrix shaders to multiply their f16 matrices
    (compile/spirv_f16_operands.py) and compile again with those substituted. Returns how many
    executables were rewritten. from_stdin: iree-compile reads mlir from its stdin, so the
    module does not record mlir's path (a temp name, for MLIR without locations of its own
    such as iree's parameter encoder: the same module from any path, byte for byte)."""
    rewritten = 0
    with atomic_path(vmfb) as tmp:
        if not f16_matrix_operands:
            _compile_once(mlir, tmp, flags, log_path, from_stdin)
        else:
            from .spirv_f16_operands import rewrite_dump

            # a killed compile's folder is swept as its temp files are (remove_stale_temps)
            work = temp_path_for(vmfb.with_name(f"{vmfb.stem}.spirv"))
            try:
                dump, subst = work / "dump", work / "subst"
                dump_flag = f"--iree-hal-dump-executable-binaries-to={dump}"
                _compile_once(mlir, tmp, [*flags, dump_flag], log_path, from_stdin)
                rewritten = rewrite_dump(dump, subst)
                if rewritten:
                    tmp.unlink()
                    sub = f"--iree-hal-substitute-executable-objects-from={subst}"
                    _compile_once(mlir, tmp, [*flags, sub], log_path, from_stdin)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    log_path.unlink(missing_ok=True)
    return rewritten


def _compile_once(
    mlir: Path, out: Path, flags: list[str], log_path: Path, from_stdin: bool = False
) -> None:
    source = "-" if from_stdin else str(mlir)
    code, output = _run(
        [iree_compile_tool(), source, "-o", str(out), *flags], mlir, mlir if from_stdin else None
    )
    if code < 0:
        raise UserError(_killed_message(mlir, -code, output, log_path))
    if code != 0 or not out.exists():
        first = next(
            (ln for ln in output.splitlines() if "error:" in ln),
            output.strip().splitlines()[0] if output.strip() else "",
        )
        if not output.strip():
            raise UserError(
                f"iree-compile failed for {mlir.name} (exit status {code}) without any output"
            )
        atomic_write_bytes(log_path, output.encode())
        raise UserError(
            f"iree-compile failed for {mlir.name}: {first.strip()[:300]} (full log: {log_path})"
        )


def _killed_message(mlir: Path, signum: int, output: str, log_path: Path) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = (
        " (out of memory? the kernel's OOM killer sends SIGKILL: see `dmesg`, close other "
        "programs or compile a smaller --height/--width)"
        if signum == signal.SIGKILL
        else ""
    )
    log = ""
    if output.strip():
        atomic_write_bytes(log_path, output.encode())
        log = f"; its output so far: {log_path}"
    return f"iree-compile was killed by {name} while compiling {mlir.name}{why}{log}"
