"""Vulkan device properties of imagined GPUs, for tests of the arch choice and the runtime's check.

A module of its own (tests/ is on sys.path): `from conftest import ...` would find whichever
conftest.py pytest imported last under that name.
"""

from __future__ import annotations


def fake_vulkan_caps(**kw):
    """VulkanCaps of an imagined GPU (a discrete AMD wave32/64 card by default), for tests of
    what the arch choice and the runtime's check do with a device's reported properties."""
    from sdiree.runtime.vulkan_caps import VulkanCaps

    base = dict(
        name="AMD Radeon Graphics", vendor_id=0x1002, device_id=0x1234, device_type="discrete",
        api_version=(1, 3, 0), subgroup_size=32, min_subgroup_size=32, max_subgroup_size=64,
        subgroup_shuffle=True, subgroup_arithmetic=True, fp16=True, storage16=True, int8=True,
        cooperative_matrix=False, shared_memory_bytes=65536, max_invocations=1024,
        max_storage_buffer_range=1 << 31, extensions=frozenset(),
    )  # fmt: skip
    return VulkanCaps(**{**base, **kw})
