"""The suite's background compiles: one worker process (WORKER) that compiles, one job at a time,
what the collected tests will need, while the tests that need none of it run beside it.

Two kinds of job: the shared tiny models' artifacts (CompiledArtifacts, keyed by target, arch
and dtype; tests/conftest.py's fixtures), and the builds a test file makes for itself with its own
options (Queued: a specs copy, another size), declared at the module's top so that the session
queues them at its start instead of compiling them in the foreground when the file's tests come.
A test that needs a job not started yet compiles it itself; one whose job is under way compiles
the next queued job meanwhile, so both cores stay busy. $SDIREE_TEST_QUEUE_LOG names a file where
each compile's start and end and each test's wait are written (seconds since the epoch), to see
the suite's critical path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from subprocess import PIPE, Popen

import pytest

TESTS = Path(__file__).resolve().parent


class AheadQueue:
    """One background thread for every queued job, run one at a time (a second beside the
    tests would oversubscribe the 2 cores) in one worker process (WORKER) that lives while the
    queue has jobs. A job is (owner, key): owner a CompiledArtifacts or a Queued."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: list[tuple] = []  # (owner, key), not started yet
        self.proc: Popen | None = None  # the worker (WORKER)
        self.worker_log = None  # its stderr
        self.stopped = False
        self._thread: threading.Thread | None = None
        # The environment at the first queued job (the session's $SDIREE_CACHE): a compile
        # started while a test has monkeypatched it (its own cache) would otherwise write the
        # shared artifacts' archives into that test's cache.
        self.env: dict[str, str] | None = None

    def add(self, owner, keys, behind: tuple | None = None) -> None:
        """Queue owner's keys last, or right behind the job `behind` (owner, key) while that
        one is still queued (at the front once it has started)."""
        with self.lock:
            if self.env is None:
                self.env = dict(os.environ)
            at = len(self.items)
            if behind is not None:
                at = self.items.index(behind) + 1 if behind in self.items else 0
            self.items[at:at] = [(owner, k) for k in keys]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()

    def take_back(self, owner, key) -> bool:
        """Remove a job not started yet (its test compiles it itself); True if it was queued."""
        with self.lock:
            if (owner, key) in self.items:
                self.items.remove((owner, key))
                return True
            return False

    def steal(self):
        """The next job not started yet, for a process that would otherwise wait: (owner, key,
        the Future its own get() waits on), or None."""
        with self.lock:
            return self._pop()

    def _next(self):
        with self.lock:
            job = self._pop()
            if job is None:
                self._thread = None
                if self.proc is not None:  # the worker ends once its stdin does
                    self.proc.stdin.close()
                    self.proc = None
            return job

    def _pop(self):
        """(owner, key, its Future) of the first job not started, marked started; the lock held."""
        if self.stopped or not self.items:
            return None
        owner, key = self.items.pop(0)
        owner._ahead[key] = Future()
        return owner, key, owner._ahead[key]

    def _run(self) -> None:
        while (job := self._next()) is not None:
            owner, key, future = job
            queue_log("start", owner, key)
            try:
                future.set_result(self._compile(owner.options(key)))
            except BaseException as error:  # handed to the test that waits for it
                future.set_exception(error)
            queue_log("end", owner, key)

    def _compile(self, options: dict) -> tuple[int, str]:
        """(exit status, output) of one compile in the worker process, started when needed."""
        if self.proc is None or self.proc.poll() is not None:
            self.worker_log = tempfile.TemporaryFile()  # noqa: SIM115 - the worker's stderr, for its life
            # its own process group: stop() kills it with its iree-compile child
            self.proc = Popen(
                [sys.executable, "-c", WORKER], stdin=PIPE, stdout=PIPE,
                stderr=self.worker_log, text=True, start_new_session=True, env=self.env,
            )  # fmt: skip
        self.proc.stdin.write(json.dumps(options) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if answer:
            answer = json.loads(answer)
            return answer["code"], answer["output"]
        code = self.proc.wait()
        self.worker_log.seek(0)
        tail = self.worker_log.read()[-4000:].decode(errors="replace")
        return code or 1, f"the background compile process died (exit status {code}):\n{tail}"

    def stop(self) -> None:
        """At the session's end: no compile goes on writing into its temporary folders."""
        with self.lock:
            self.stopped = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


QUEUE = AheadQueue()


@contextlib.contextmanager
def _session_cache(queued: bool):
    """A queued job compiled by a waiting test uses the session's $SDIREE_CACHE, whatever that
    test set it to."""
    if not queued or QUEUE.env is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDIREE_CACHE", QUEUE.env["SDIREE_CACHE"])
        yield


_QUEUE_LOG = os.environ.get("SDIREE_TEST_QUEUE_LOG")  # a file: when each compile starts and ends


def queue_log(event: str, owner, key, where: str = "background") -> None:
    if _QUEUE_LOG:
        import time

        with open(_QUEUE_LOG, "a") as f:
            f.write(f"{time.time():.1f} {event} {where} {owner.label(key)}\n")


# CompileOptions' fields that are paths (JSON carries them as strings)
_PATH_FIELDS = ("model_dir", "out", "specs_dir", "config_dir", "vae", "artifacts_root")


def compile_options(fields: dict):
    """CompileOptions from its fields as JSON carries them."""
    from sdiree.compile.driver import CompileOptions

    paths = {k: Path(fields[k]) for k in _PATH_FIELDS if fields.get(k) is not None}
    tuples = {}
    if "sizes" in fields:
        tuples["sizes"] = tuple(tuple(s) for s in fields["sizes"])
    if fields.get("submodules"):
        tuples["submodules"] = tuple(fields["submodules"])
    return CompileOptions(**{**fields, **paths, **tuples})


def json_fields(fields: dict) -> dict:
    """fields with its paths and tuples as JSON carries them (compile_options reads them back)."""
    return json.loads(json.dumps(fields, default=str))


# The background compiles' process, one for the whole queue: torch, diffusers and iree import
# once, not at each job's start (~7 s each). One job per line on stdin, CompileOptions' fields
# (JSON); each answered by one line on stdout, {"code": exit status, "output": what `sdiree
# compile` prints, or the traceback}. Anything else written to fd 1 goes to stderr.
WORKER = f"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, {str(TESTS)!r})
from compile_queue import compile_options
from sdiree.compile.driver import compile_model
from sdiree.compile.report import Reporter
for line in sys.stdin:
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            compile_model(compile_options(json.loads(line)), Reporter(stream=out))
        except BaseException:
            traceback.print_exc()
            code = 1
    answers.write(json.dumps({{"code": code, "output": out.getvalue()}}) + "\\n")
    answers.flush()
"""


class _Job:
    """What a job's owner shares: its compile in this process, and the wait for one queued."""

    def __init__(self):
        self._ahead: dict[tuple, Future] = {}  # started in the background

    def options(self, key: tuple) -> dict:
        raise NotImplementedError

    def label(self, key: tuple) -> str:
        raise NotImplementedError

    def _outcome(self, key: tuple) -> str:
        """key's compile output: compiled here when not started (taken back from the queue
        if it was there), else waited for while this process compiles what is queued next."""
        QUEUE.take_back(self, key)  # not started: compiled here instead
        with QUEUE.lock:
            started = self._ahead.get(key)
        if started is None:
            return self._compile_here(key)
        queue_log("wait", self, key, "foreground")
        while not started.done() and (job := QUEUE.steal()) is not None:
            owner, other, future = job
            owner._compile_here(other, future)
        code, output = started.result()
        queue_log("got", self, key, "foreground")
        if code != 0:
            raise RuntimeError(f"compile {self.label(key)} failed (exit {code}):\n{output}")
        return output

    def _compile_here(self, key: tuple, future: Future | None = None) -> str:
        """Compile key in this process and return its output. A job taken from the queue (its
        future given) hands its outcome to the test that waits for it, not to the one compiling
        it."""
        from sdiree.compile.driver import compile_model
        from sdiree.compile.report import Reporter

        queue_log("start", self, key, "foreground")
        said = io.StringIO()
        try:
            with _session_cache(future is not None):
                compile_model(compile_options(self.options(key)), Reporter(stream=said))
        except Exception as error:
            if future is None:
                raise
            future.set_exception(error)
        else:
            if future is not None:
                future.set_result((0, said.getvalue()))
        queue_log("end", self, key, "foreground")
        return said.getvalue()


class CompiledArtifacts(_Job):
    """Compile-once cache keyed by (target, arch, dtype), with an optional queue of keys that a
    background process compiles one after another while the tests run."""

    def __init__(
        self, model: Path, root: Path, size=None, sizes: tuple = (), submodules: tuple = ()
    ):
        super().__init__()
        self.model = model
        self.root = root
        self.size = size  # `--height/--width`, (height, width) px; None: the model's own
        self.sizes = sizes  # `--sizes` besides the main one, (height, width) px
        self.submodules = submodules  # () is every submodule of the model's family
        self._done: dict = {}

    def out_dir(self, target: str, arch: str, dtype: str) -> Path:
        main = "" if self.size is None else "@{}x{}".format(*self.size)
        more = "".join(f"+{h}x{w}" for h, w in self.sizes)
        return self.root / self.model.name / f"{target}-{arch}-{dtype}{main}{more}"

    def label(self, key: tuple) -> str:
        return f"{self.model.name}/{self.out_dir(*key).name}"

    def options(self, key: tuple) -> dict:
        """CompileOptions' fields (JSON-able) for the artifact of key."""
        target, arch, dtype = key
        return json_fields(dict(
            model_dir=self.model, target=target, arch=arch, dtype=dtype, out=self.out_dir(*key),
            sizes=self.sizes, height=self.size and self.size[0], width=self.size and self.size[1],
            submodules=self.submodules or None,
        ))  # fmt: skip

    def compile_ahead(self, keys) -> None:
        QUEUE.add(self, keys)

    def get(self, target: str, arch: str, dtype: str) -> Path:
        key = (target, arch, dtype)
        if key not in self._done:
            self._outcome(key)
            self._done[key] = self.out_dir(*key)
        return self._done[key]


class Queued(_Job):
    """A build one test file makes for itself, declared at its module's top:
    `BUILD = Queued("name", prepare)`, prepare(root, model) giving the CompileOptions fields
    (paths may be Path) for the tiny SD 1.x model at `model`, writing what they name (a specs
    copy) under the empty folder `root`. tests/conftest.py queues every collected module's
    Queued at the session's start, behind the tiny model's cpu fp32 artifact (whose exports the
    tests' own cpu compiles reuse); the file's fixture calls result(), which waits for it (or
    compiles it, when not queued)."""

    KEY = ("build",)

    def __init__(self, name: str, prepare: Callable[[Path, Path], dict]):
        super().__init__()
        self.name = name
        self.prepare = prepare
        self.root: Path | None = None
        self.fields: dict | None = None
        self._output: str | None = None

    def label(self, key: tuple) -> str:
        return f"queued/{self.name}"

    def options(self, key: tuple) -> dict:
        return self.fields

    def _ready(self, model: Path, tmp_path_factory) -> None:
        if self.fields is None:
            root = tmp_path_factory.mktemp(self.name)  # a new one if an earlier prepare failed
            self.fields = json_fields(self.prepare(root, model))
            self.root = root

    def queue(self, model: Path, tmp_path_factory, behind: tuple | None = None) -> None:
        self._ready(model, tmp_path_factory)
        QUEUE.add(self, [self.KEY], behind=behind)

    def result(self, model: Path, tmp_path_factory) -> tuple[Path, str]:
        """(root, what the compile printed), once it is built."""
        self._ready(model, tmp_path_factory)
        if self._output is None:
            self._output = self._outcome(self.KEY)
        return self.root, self._output


def declared(module) -> list[Queued]:
    """The Queued builds a test module declares (at its top, alone or in a dict's values)."""
    found = []
    for value in vars(module).values():
        for v in value.values() if isinstance(value, dict) else (value,):
            if isinstance(v, Queued):
                found.append(v)
    return found
