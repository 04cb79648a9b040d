"""`--arch auto`: pick the preset that fits this machine's first real GPU.

The device's own properties decide (runtime/vulkan_caps.py, runtime/arch_fit.py): its vendor,
subgroup sizes, cooperative matrices and shared memory against each preset's `device` needs.
Device names (`device_match`) only break ties, and decide alone where Vulkan cannot be asked.
A module compiled for a GPU arch returns NaN on a CPU Vulkan implementation without any error,
so when only lavapipe/llvmpipe is present the lavapipe preset is chosen.
"""

from __future__ import annotations

from sdiree.runtime.arch_fit import fitting_arches
from sdiree.runtime.device import list_devices
from sdiree.runtime.errors import UserError
from sdiree.runtime.targets import Target
from sdiree.runtime.vulkan_caps import caps_for


def _by_properties(target: Target, name: str) -> tuple[str, str] | None:
    caps = caps_for(name) if target.driver == "vulkan" else None
    if caps is None:
        return None
    fits = fitting_arches(target, caps)
    if fits:
        return fits[0], f"'{name}' reports {caps.summary()}"
    return None


def device_without_fp16(target: Target) -> str | None:
    """The name of the device `--arch auto` picks for, when it reports no fp16 arithmetic or
    16-bit storage (Polaris on RADV): an fp16 build would be refused there at run time."""
    if target.driver != "vulkan":
        return None
    devices = list_devices(target.driver)
    real = [d for d in devices if not d.is_cpu_emulation] or devices
    caps = caps_for(real[0].name) if real else None
    return real[0].name if caps is not None and not (caps.fp16 and caps.storage16) else None


def auto_arch(target: Target) -> tuple[str, str]:
    """(arch, reason) for target on this machine's devices of the target's driver."""
    devices = list_devices(target.driver)
    if not devices:
        raise UserError(
            f"--arch auto found no {target.driver} device on this machine; pass --arch, one of "
            f"{', '.join(target.arches)}"
        )
    real = [d for d in devices if not d.is_cpu_emulation]
    for d in real:
        picked = _by_properties(target, d.name)
        if picked:
            return picked
        for arch in target.arches.values():
            if not arch.cpu_emulated and arch.matches_device(d.name):
                return arch.name, f"first GPU is '{d.name}' (by its name)"
    if real:
        fallback = "baseline" if "baseline" in target.arches else next(iter(target.arches))
        return fallback, f"GPU '{real[0].name}' matches no preset; {fallback} is safe but slow"
    picked = _by_properties(target, devices[0].name)
    if picked:
        return picked
    for arch in target.arches.values():
        if arch.cpu_emulated and arch.matches_device(devices[0].name):
            return arch.name, f"only a CPU implementation is present: '{devices[0].name}'"
    raise UserError(
        f"--arch auto: no preset fits device '{devices[0].name}'; pass --arch explicitly"
    )
