"""Choose the device an artifact runs on, and refuse one its arch cannot run correctly.

A module compiled for a GPU arch (rdna3, ampere, ...) runs on a device that lacks what the arch
assumes (a CPU Vulkan implementation such as llvmpipe, or a GPU without cooperative matrices or
with other subgroup sizes) without an error and returns NaN, so that pairing is refused unless
forced, with a message that names what is missing and the arch to compile for. The device's
reported properties decide (runtime/arch_fit.py); names decide where Vulkan cannot be asked or
the artifact predates `device_requires` in its manifest.
"""

from __future__ import annotations

from .arch_fit import fitting_arches, unmet
from .device import CPU_DRIVERS, DeviceInfo, find_device, list_devices, pick_preferred
from .errors import UserError
from .manifest import Manifest
from .targets import load_registry
from .vulkan_caps import caps_for


def _driver_ok(manifest_driver: str, device_driver: str) -> bool:
    if manifest_driver in CPU_DRIVERS:
        return device_driver in CPU_DRIVERS
    return device_driver == manifest_driver


def suggested_arch(manifest: Manifest, device: DeviceInfo) -> str | None:
    """The preset of the artifact's target that fits device, if any."""
    target = load_registry().targets.get(manifest.target)
    if target is None:
        return None
    caps = caps_for(device.name) if device.driver == "vulkan" else None
    fits = fitting_arches(target, caps, manifest.data.get("dtype")) if caps else []
    if fits:
        return fits[0]
    for arch in target.arches.values():
        if arch.cpu_emulated == device.is_cpu_emulation and arch.matches_device(device.name):
            return arch.name
    return None


def _check_properties(manifest: Manifest, device: DeviceInfo) -> None:
    """Raise if the device's reported properties lack what the artifact's arch needs."""
    requires = manifest.data["target"].get("device_requires")
    caps = caps_for(device.name) if requires else None
    if caps is None:
        return
    missing = unmet(requires, caps, manifest.data.get("dtype"))
    if not missing:
        return
    target = load_registry().targets.get(manifest.target)
    fits = fitting_arches(target, caps, manifest.data.get("dtype")) if target else []
    fix = (
        f"compile with --arch {fits[0]}" if fits else "compile with --dtype fp32 or --arch baseline"
    )
    raise UserError(
        f"this artifact was compiled for vulkan arch {manifest.arch}, which needs "
        f"{'; '.join(missing)}: device '{device.name}' does not have it; {fix}, or pass "
        "--force-device to try anyway"
    )


def _check_cpu(manifest: Manifest) -> None:
    """Raise if this CPU lacks features the artifact's linked kernels execute (sdiree's AMX
    kernel: without AMX the process dies of an illegal instruction)."""
    from .cpu_features import host_cpu_features

    missing = sorted(set(manifest.data["target"].get("cpu_requires", ())) - host_cpu_features())
    if missing:
        raise UserError(
            f"this artifact's modules run matmuls on a kernel that needs {', '.join(missing)}, "
            "which this CPU lacks (it was compiled on another CPU); compile the model on this "
            "machine, or pass --force-device to try anyway (it will crash)"
        )


def check_arch(manifest: Manifest, device: DeviceInfo) -> str | None:
    """Raise if the artifact's arch cannot run correctly on device; return a warning or None."""
    if device.driver in CPU_DRIVERS:
        _check_cpu(manifest)
    if device.driver != "vulkan":
        return None
    _check_properties(manifest, device)
    cpu_built = bool(manifest.data["target"].get("arch_cpu_emulated"))
    fit = suggested_arch(manifest, device)
    if device.is_cpu_emulation and not cpu_built:
        raise UserError(
            f"this artifact was compiled for vulkan arch {manifest.arch}, which returns wrong "
            f"results (NaN) on the CPU device '{device.name}'; compile with --arch "
            f"{fit or 'lavapipe'}, or pass --force-device to try anyway"
        )
    if not device.is_cpu_emulation and not cpu_built and fit and fit != manifest.arch:
        raise UserError(
            f"this artifact was compiled for vulkan arch {manifest.arch}, but device "
            f"'{device.name}' is {fit}; compile with --arch {fit}, or pass --force-device"
        )
    if not device.is_cpu_emulation and cpu_built:
        return (
            f"this artifact was compiled for lavapipe but runs on GPU '{device.name}': compile "
            f"with --arch {fit or 'auto'} for speed"
        )
    return None


def choose_device(
    manifest: Manifest, spec: str | None, force: bool = False
) -> tuple[DeviceInfo, str]:
    """(device, why) for manifest; spec is the --device value or None for the default."""
    driver = manifest.driver
    if spec:
        info = find_device(spec, driver)
        if not _driver_ok(driver, info.driver):
            raise UserError(
                f"--device {spec} uses the {info.driver} driver, but this artifact was compiled "
                f"for {manifest.target} ({driver}); pick a {driver} device or recompile with "
                "another --target"
            )
        why = f"--device {spec}"
    else:
        devices = list_devices(driver)
        if not devices:
            raise UserError(
                f"no {driver} device found for this {manifest.target} artifact; run "
                "`sdiree devices`, or compile for another target (e.g. --target cpu)"
            )
        info = pick_preferred(devices)
        why = "default: " + (
            "a real GPU"
            if not info.is_cpu_emulation and info.driver not in CPU_DRIVERS
            else "the only fitting device"
        )
    if not force:
        warning = check_arch(manifest, info)
        if warning:
            why += f" (warning: {warning})"
    return info, why
