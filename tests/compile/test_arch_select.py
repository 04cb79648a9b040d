"""`--arch auto` picks the preset of the first real GPU, else lavapipe, and says why."""

from __future__ import annotations

import pytest

from sdiree.compile import arch_select
from sdiree.runtime.device import DeviceInfo, list_devices
from sdiree.runtime.errors import UserError
from sdiree.runtime.targets import load_registry

VK = load_registry().target("vulkan-spirv")
LLVMPIPE = DeviceInfo("vulkan", 0, 1, "llvmpipe (LLVM 15.0.6, 256 bits)", "cpu")


def fake(monkeypatch, devices):
    monkeypatch.setattr(arch_select, "list_devices", lambda driver: devices)


@pytest.mark.parametrize(
    "name,arch",
    [
        ("AMD Radeon RX 7900 XTX (RADV GFX1100)", "rdna3"),
        ("AMD Radeon RX 6800 XT (RADV NAVI21)", "rdna2"),
        ("NVIDIA GeForce RTX 3090", "ampere"),
        ("NVIDIA GeForce RTX 4090", "ada"),
        ("NVIDIA H100 80GB HBM3", "ampere"),
        ("Intel(R) Arc(tm) A770 Graphics (DG2)", "baseline"),
    ],
)
def test_real_gpu_preferred_over_lavapipe(monkeypatch, name, arch):
    fake(monkeypatch, [LLVMPIPE, DeviceInfo("vulkan", 1, 2, name, "gpu")])
    picked, why = arch_select.auto_arch(VK)
    assert picked == arch and name in why


def test_lavapipe_when_only_cpu_vulkan(monkeypatch):
    fake(monkeypatch, [LLVMPIPE])
    assert arch_select.auto_arch(VK)[0] == "lavapipe"


def test_no_vulkan_device(monkeypatch):
    fake(monkeypatch, [])
    with pytest.raises(UserError, match="no vulkan device"):
        arch_select.auto_arch(VK)


def test_this_machine_picks_lavapipe():
    devices = list_devices("vulkan")
    if not devices:
        pytest.fail("no Vulkan device: install mesa-vulkan-drivers (lavapipe)")
    assert any(d.is_cpu_emulation for d in devices)
    if all(d.is_cpu_emulation for d in devices):
        assert arch_select.auto_arch(VK)[0] == "lavapipe"
