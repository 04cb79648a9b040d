"""The Vulkan properties read through the loader, on this machine's lavapipe."""

from __future__ import annotations

import pytest

from sdiree.runtime import vulkan_caps
from sdiree.runtime.arch_fit import fitting_arches, unmet
from sdiree.runtime.device import list_devices
from sdiree.runtime.targets import load_registry

VK = load_registry().target("vulkan-spirv")


@pytest.fixture(scope="module")
def lavapipe():
    caps = [c for c in vulkan_caps.query() if c.is_cpu]
    assert caps, "lavapipe expected (apt-get install mesa-vulkan-drivers)"
    return caps[0]


def test_lavapipe_reports_itself(lavapipe):
    assert lavapipe.vendor == "Mesa" and lavapipe.api_version >= (1, 3, 0)
    assert "llvmpipe" in lavapipe.name
    assert lavapipe.min_subgroup_size <= lavapipe.subgroup_size <= lavapipe.max_subgroup_size
    assert lavapipe.fp16 and lavapipe.storage16 and not lavapipe.cooperative_matrix
    # the fixed-offset limits read out of VkPhysicalDeviceLimits are lavapipe's known ones
    assert lavapipe.shared_memory_bytes == 32768 and lavapipe.max_invocations == 1024
    assert lavapipe.max_storage_buffer_range >= 128 << 20


def test_the_lavapipe_preset_fits_it_and_gpu_presets_do_not(lavapipe):
    assert unmet(VK.arch("lavapipe").device, lavapipe, "fp16") == []
    assert fitting_arches(VK, lavapipe, "fp16") == ["lavapipe"]
    missing = unmet(VK.arch("rdna3").device, lavapipe, "fp16")
    assert any("subgroup size" in m for m in missing)
    # no preset asks for cooperative matrices today (tests/specs/test_vulkan_cooperative_matrix.py)
    # but the check stands: lavapipe 22 offers none
    missing = unmet({"cooperative_matrix": True}, lavapipe, "fp16")
    assert missing == ["cooperative matrices (VK_KHR_cooperative_matrix)"]


def test_iree_device_names_map_to_their_properties(lavapipe):
    names = [d.name for d in list_devices("vulkan") if d.is_cpu_emulation]
    assert names and vulkan_caps.caps_for(names[0]) == lavapipe
    assert vulkan_caps.caps_for("no such GPU") is None


def test_no_vulkan_loader_means_no_properties(monkeypatch):
    def missing():
        raise OSError("libvulkan.so.1: cannot open shared object file")

    monkeypatch.setattr(vulkan_caps, "_loader", missing)
    vulkan_caps.query.cache_clear()
    try:
        assert vulkan_caps.query() == ()
    finally:
        vulkan_caps.query.cache_clear()
