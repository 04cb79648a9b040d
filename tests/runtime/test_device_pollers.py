"""runtime/device_pollers.py: an idle lavapipe device's polling completion threads at SCHED_IDLE,
at the normal policy while a call runs, untouched where the process could not restore them."""

from __future__ import annotations

import os

import pytest

from sdiree.runtime import device_pollers
from sdiree.runtime.device import create_device, list_devices


def lavapipe():
    found = [d for d in list_devices("vulkan") if d.is_cpu_emulation]
    if not found:
        pytest.skip("no CPU Vulkan device (mesa-vulkan-drivers)")
    return found[0]


@pytest.fixture
def managed_afterwards():
    """For a test that leaves the process's lavapipe device unmanaged (pollers spinning at the
    normal policy): afterwards, once its monkeypatches are undone (ask for this fixture
    first), a new managed device replaces it. The process keeps its device for every later
    test, and an unmanaged one spun two cores' worth through the rest of the suite."""
    yield
    device = create_device(lavapipe(), fresh=True)
    assert id(device) in device_pollers._BY_DEVICE


def policies(tids) -> set[int]:
    return {os.sched_getscheduler(t) for t in tids}


def test_idle_lavapipe_pollers_are_sched_idle_and_normal_in_use():
    before = device_pollers.threads()
    device = create_device(lavapipe(), fresh=True)
    new = device_pollers.threads() - before
    spinners = device_pollers.spinning(new)
    assert spinners, "lavapipe no longer polls while idle: runtime/device_pollers.py can go"
    assert policies(spinners) == {os.SCHED_IDLE}
    assert os.SCHED_IDLE not in policies(new - spinners)  # its workers keep theirs
    with device_pollers.in_use(device):
        assert policies(spinners) == {os.SCHED_OTHER}
        with device_pollers.in_use(device):
            assert policies(spinners) == {os.SCHED_OTHER}
        assert policies(spinners) == {os.SCHED_OTHER}
    assert policies(spinners) == {os.SCHED_IDLE}


def test_a_process_that_could_not_restore_them_leaves_them_alone(managed_afterwards, monkeypatch):
    monkeypatch.setattr(device_pollers, "can_restore", lambda: False)
    before = device_pollers.threads()
    device = create_device(lavapipe(), fresh=True)
    spinners = device_pollers.spinning(device_pollers.threads() - before)
    assert spinners and policies(spinners) == {os.SCHED_OTHER}
    with device_pollers.in_use(device):  # nothing to do
        assert policies(spinners) == {os.SCHED_OTHER}


def test_restoring_needs_root_or_rlimit_nice(monkeypatch):
    import resource

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda r: (0, 0))
    assert not device_pollers.can_restore()
    monkeypatch.setattr(resource, "getrlimit", lambda r: (20, 20))
    assert device_pollers.can_restore()


def test_a_refused_policy_change_is_no_error(managed_afterwards, monkeypatch):
    """A sandbox that refuses sched_setscheduler: the device is created and used as iree made it."""

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    device = create_device(lavapipe(), fresh=True)
    assert id(device) not in device_pollers._BY_DEVICE
    with device_pollers.in_use(device):
        pass
    pollers = device_pollers.Pollers({os.getpid()})  # refused going idle: dropped
    assert not pollers.tids
