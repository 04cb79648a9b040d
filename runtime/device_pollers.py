"""A CPU Vulkan device's completion pollers, kept at the lowest priority while no call is on it.

iree 3.13's Vulkan driver gives each queue of a device a completion thread that waits in
`vkWaitSemaphores(WAIT_ANY, no timeout)` on two timeline semaphores. A GPU driver blocks there.
lavapipe (Mesa 22.3) answers a wait-any by polling the clock, so an idle lavapipe device keeps
two threads running flat out for as long as it lives, and sdiree keeps a Vulkan device for the
process (device.create_device). On a 2-core machine that was both cores taken from whatever
else the process or the machine did (compile/NOTES.md, "lavapipe's idle spin").

So the device's threads that stay runnable while it is idle are moved to SCHED_IDLE when it is
created, and back to the normal policy while a call runs on it (`in_use`): a poller starved by
other work would otherwise delay each call's completion. Leaving SCHED_IDLE needs root or
RLIMIT_NICE; a process that could not go back leaves the pollers as iree made them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

_SAMPLES = 5  # a poller is runnable at every look; a thread with work to finish is not
_EVERY_S = 0.01


def threads() -> set[int]:
    """This process's thread ids (Linux); empty elsewhere."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _runnable(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False


def spinning(candidates: set[int]) -> set[int]:
    """Those of candidates runnable at each of a few looks 10 ms apart."""
    found = set(candidates)
    for _ in range(_SAMPLES):
        if not found:
            break
        time.sleep(_EVERY_S)
        found = {t for t in found if _runnable(t)}
    return found


def can_restore() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to the normal policy."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    if os.geteuid() == 0:
        return True
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20  # nice 0 allowed
    except (ImportError, OSError, AttributeError):
        return False


class Pollers:
    """One device's pollers: idle priority, normal while `in_use` is entered (nesting counts)."""

    def __init__(self, tids: set[int]):
        self.tids = set(tids)
        self._users = 0
        self._lock = threading.Lock()
        self._set(idle=True)

    def _set(self, idle: bool) -> None:
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        for tid in list(self.tids):
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:  # the thread ended with its device
                self.tids.discard(tid)
            except OSError:  # refused (a sandbox): leave it as it is from now on
                if idle:
                    self.tids.discard(tid)
                else:  # cannot come back: stop managing them
                    self.tids.clear()
                    return

    @contextlib.contextmanager
    def in_use(self):
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._set(idle=False)
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._set(idle=True)


_BY_DEVICE: dict[int, Pollers] = {}  # id(device) -> its pollers


def register(device, before: set[int]) -> None:
    """After creating device (before: the threads there were), find its pollers and idle them."""
    if can_restore():
        pollers = Pollers(spinning(threads() - before))
        if pollers.tids:  # some spin, and going idle was allowed
            _BY_DEVICE[id(device)] = pollers


@contextlib.contextmanager
def in_use(device):
    """While a call (or a load) runs on device: its pollers, if any, at normal priority."""
    pollers = _BY_DEVICE.get(id(device))
    if pollers is None:
        yield
        return
    with pollers.in_use():
        yield
