"""Devices: list IREE drivers and devices, open one, and read results back to the host.

Vulkan devices are described by name and type (a CPU implementation such as llvmpipe is marked),
so callers can prefer a real GPU and match a device to an arch preset. Read-back goes through a
host-visible staging buffer because DeviceArray.to_host() cannot import host memory on Vulkan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from . import device_pollers
from .errors import UserError

# Drivers sdiree can run on, per manifest driver name.
CPU_DRIVERS = ("local-task", "local-sync")


@dataclass(frozen=True)
class DeviceInfo:
    driver: str
    index: int  # position among the driver's devices, as `--device vulkan:INDEX` names it
    device_id: int
    name: str
    kind: str  # "gpu", "cpu" (a CPU implementation of a GPU API, or the CPU itself), "other"

    @property
    def label(self) -> str:
        return self.driver if self.driver in CPU_DRIVERS else f"{self.driver}:{self.index}"

    @property
    def is_cpu_emulation(self) -> bool:
        return self.driver not in CPU_DRIVERS and self.kind == "cpu"


def _rt():
    import iree.runtime as rt

    return rt


def _device_kind(driver, device_id: int) -> str:
    try:
        info = driver.dump_device_info(device_id)
    except Exception:  # noqa: BLE001 - info is optional
        return "other"
    m = re.search(r"^type:\s*(\S+)", info, re.MULTILINE)
    if not m:
        return "other"
    t = m.group(1).lower()
    return "cpu" if t == "cpu" else ("gpu" if "gpu" in t else t)


def list_devices(driver_name: str) -> list[DeviceInfo]:
    """Devices of one driver; [] when the driver is missing or has no device."""
    rt = _rt()
    if driver_name in CPU_DRIVERS:
        return [DeviceInfo(driver_name, 0, 0, "host CPU", "cpu")]
    try:
        driver = rt.get_driver(driver_name)
        found = driver.query_available_devices()
    except Exception:  # noqa: BLE001 - no loader / no driver means no devices
        return []
    return [
        DeviceInfo(driver_name, i, d["device_id"], d["name"], _device_kind(driver, d["device_id"]))
        for i, d in enumerate(found)
    ]


def available_drivers() -> list[str]:
    return list(_rt().query_available_drivers())


def find_device(spec: str, wanted_driver: str) -> DeviceInfo:
    """Resolve a --device value: `local-task`, `vulkan`, `vulkan:1`, `1`, or part of a name."""
    if spec in CPU_DRIVERS:
        return list_devices(spec)[0]
    driver_name = wanted_driver if wanted_driver not in CPU_DRIVERS else "vulkan"
    sel = spec
    if ":" in spec:
        driver_name, sel = spec.split(":", 1)
    elif spec in ("vulkan", "cuda", "hip"):
        driver_name, sel = spec, ""
    devices = list_devices(driver_name)
    if not devices:
        raise UserError(
            f"no {driver_name} device found for --device {spec}; run `sdiree devices` to list them"
        )
    if sel == "":
        return pick_preferred(devices)
    if sel.isdigit():
        i = int(sel)
        if i >= len(devices):
            raise UserError(
                f"--device {spec}: there are {len(devices)} {driver_name} device(s) (index 0-"
                f"{len(devices) - 1}); run `sdiree devices`"
            )
        return devices[i]
    matches = [d for d in devices if sel.lower() in d.name.lower()]
    if not matches:
        raise UserError(
            f"--device {spec}: no {driver_name} device has '{sel}' in its name; run `sdiree devices`"
        )
    return matches[0]


def pick_preferred(devices: list[DeviceInfo]) -> DeviceInfo:
    """A real GPU before a CPU emulation, else the first device."""
    real = [d for d in devices if not d.is_cpu_emulation]
    return (real or devices)[0]


_GPU_DEVICES: dict = {}  # (driver, device id) -> the process's device for it


def create_device(info: DeviceInfo, fresh: bool = False):
    """The device for info, one per process and device, shared by its sessions: iree keeps the
    CPU drivers' one, this module a GPU's. A Vulkan device is not torn down when a session ends:
    lavapipe's teardown crashed the process now and then (compile/NOTES.md, "Vulkan devices
    kept"). fresh: replace it with a new one (a lost device stays lost)."""
    rt = _rt()
    if info.driver in CPU_DRIVERS:
        return rt.get_device(info.driver)
    key = (info.driver, info.device_id)
    if fresh or key not in _GPU_DEVICES:
        before = device_pollers.threads()
        _GPU_DEVICES[key] = rt.get_driver(info.driver).create_device(info.device_id)
        if info.driver == "vulkan" and info.is_cpu_emulation:  # lavapipe: runtime/device_pollers.py
            device_pollers.register(_GPU_DEVICES[key], before)
    return _GPU_DEVICES[key]


def forget_device(info: DeviceInfo) -> None:
    """The next create_device(info) makes a new device (sessions holding this one keep it)."""
    _GPU_DEVICES.pop((info.driver, info.device_id), None)


def to_host(device, array) -> np.ndarray:
    """Copy a result (DeviceArray) to a numpy array on any driver."""
    rt = _rt()
    if array.is_host_accessible:
        try:
            return np.array(array.to_host(), copy=True)
        except Exception:  # noqa: BLE001 - Vulkan cannot import host pointers; stage instead
            pass
    view = array._buffer_view
    nbytes = view.byte_length
    staging = device.allocator.allocate_buffer(
        memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
        allowed_usage=rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING,
        allocation_size=nbytes,
    )
    sem = device.create_semaphore(0)
    device.queue_copy(view.get_buffer(), staging, [], [(sem, 1)])
    sem.wait(1)
    return staging.map().asarray(array.shape, np.dtype(array.dtype)).copy()
