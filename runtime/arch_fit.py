"""Which vulkan arch presets a device can run, from the properties it reports.

A preset's `device` entry in specs/targets.json says what its modules need (subgroup sizes,
cooperative matrices, shared memory); an fp16 module also needs fp16 arithmetic and 16-bit
storage. `--arch auto` picks the first preset of the device's vendor whose needs it meets (a
name match breaks ties), and the runtime refuses a module whose needs the device does not meet,
before running it: such a module returns NaN or wrong values without any error.
"""

from __future__ import annotations

from .targets import Arch, Target
from .vulkan_caps import VulkanCaps


def unmet(requires: dict, caps: VulkanCaps, dtype: str | None = None) -> list[str]:
    """What of requires (and of dtype) the device lacks, in words; [] when it has it all."""
    missing = []
    sizes = [s for s in requires.get("subgroup_sizes", ()) if not caps.supports_subgroup_size(s)]
    if sizes:
        missing.append(
            f"subgroup size {' and '.join(map(str, sizes))} (it runs "
            f"{caps.min_subgroup_size}-{caps.max_subgroup_size})"
        )
    if requires.get("cooperative_matrix") and not caps.cooperative_matrix:
        missing.append("cooperative matrices (VK_KHR_cooperative_matrix)")
    need = requires.get("shared_memory_bytes", 0)
    if need > caps.shared_memory_bytes:
        missing.append(
            f"{need // 1024} KiB of shared memory (it has {caps.shared_memory_bytes // 1024})"
        )
    if dtype == "fp16" and not (caps.fp16 and caps.storage16):
        missing.append(
            "fp16 arithmetic and 16-bit storage (shaderFloat16, storageBuffer16BitAccess)"
        )
    return missing


def _vendor_fits(arch: Arch, caps: VulkanCaps) -> bool:
    if arch.cpu_emulated != caps.is_cpu:
        return False
    ids = arch.device.get("vendor_ids")
    return not ids or caps.vendor_id in {int(v, 16) for v in ids}


def fitting_arches(target: Target, caps: VulkanCaps, dtype: str | None = None) -> list[str]:
    """The presets of target that caps' device runs, best first: registry order, with the ones
    whose device_match names the device moved to the front."""
    fits = [
        a.name
        for a in target.arches.values()
        if a.device and _vendor_fits(a, caps) and not unmet(a.device, caps, dtype)
    ]
    named = [n for n in fits if target.arches[n].matches_device(caps.name)]
    return named + [n for n in fits if n not in named]
