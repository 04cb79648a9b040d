"""Default device choice and the arch/device check, on fake device lists and on this machine."""

from __future__ import annotations

import pytest
from vulkan_fakes import fake_vulkan_caps

from sdiree.runtime import device_select
from sdiree.runtime.device import DeviceInfo, find_device, list_devices
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import Manifest

LLVMPIPE = DeviceInfo("vulkan", 0, 1, "llvmpipe (LLVM 15.0.6, 256 bits)", "cpu")
RADEON = DeviceInfo("vulkan", 1, 2, "AMD Radeon RX 7900 XTX (RADV GFX1100)", "gpu")
RTX = DeviceInfo("vulkan", 2, 3, "NVIDIA GeForce RTX 4090", "gpu")


def manifest(target="vulkan-spirv", arch="lavapipe", driver="vulkan", cpu=True):
    data = {
        "target": {"name": target, "arch": arch, "driver": driver, "arch_cpu_emulated": cpu},
    }
    return Manifest(root=None, data=data)


def fake(monkeypatch, devices):
    monkeypatch.setattr(device_select, "list_devices", lambda driver: devices)


def test_default_prefers_real_gpu(monkeypatch):
    fake(monkeypatch, [LLVMPIPE, RADEON])
    info, why = device_select.choose_device(manifest(arch="rdna3", cpu=False), None)
    assert info == RADEON and "GPU" in why


def test_gpu_arch_on_lavapipe_refused(monkeypatch):
    fake(monkeypatch, [LLVMPIPE])
    with pytest.raises(UserError, match="compile with --arch lavapipe"):
        device_select.choose_device(manifest(arch="rdna3", cpu=False), None)
    info, _ = device_select.choose_device(manifest(arch="rdna3", cpu=False), None, force=True)
    assert info == LLVMPIPE


def test_wrong_gpu_family_refused(monkeypatch):
    fake(monkeypatch, [RTX])
    with pytest.raises(UserError, match="compile with --arch ada"):
        device_select.choose_device(manifest(arch="rdna3", cpu=False), None)


def test_lavapipe_build_on_gpu_warns(monkeypatch):
    fake(monkeypatch, [RADEON])
    info, why = device_select.choose_device(manifest(), None)
    assert info == RADEON and "--arch rdna3" in why


def test_no_device_for_driver(monkeypatch):
    fake(monkeypatch, [])
    with pytest.raises(UserError, match="no hip device"):
        device_select.choose_device(manifest("rocm", "gfx942", "hip", False), None)


def test_find_device_by_index_and_name_here():
    devices = list_devices("vulkan")
    assert devices, "lavapipe expected (apt-get install mesa-vulkan-drivers)"
    assert find_device("vulkan:0", "vulkan") == devices[0]
    assert find_device("0", "vulkan") == devices[0]
    assert find_device("llvmpipe", "vulkan") == devices[0]
    assert find_device("local-task", "vulkan").driver == "local-task"
    with pytest.raises(UserError, match="index 0-"):
        find_device(f"vulkan:{len(devices)}", "vulkan")


def caps(**kw):
    polaris = dict(
        name="AMD Radeon RX 580 Series (RADV POLARIS10)", device_id=0x67DF, subgroup_size=64,
        min_subgroup_size=64, fp16=False,
    )  # fmt: skip
    return fake_vulkan_caps(**{**polaris, **kw})


POLARIS = DeviceInfo("vulkan", 0, 1, "AMD Radeon RX 580 Series (RADV POLARIS10) (radv)", "gpu")


def gpu_manifest(arch, dtype):
    from sdiree.runtime.targets import load_registry

    m = manifest(arch=arch, cpu=False)
    m.data["target"]["device_requires"] = load_registry().target("vulkan-spirv").arch(arch).device
    m.data["dtype"] = dtype
    return m


@pytest.mark.parametrize(
    "arch,dtype,props,error",
    [
        # RADV on Polaris has no fp16 arithmetic: an fp16 gcn module is refused, fp32 runs
        ("gcn", "fp16", {}, "fp16 arithmetic.*--dtype fp32"),
        ("gcn", "fp32", {}, None),
        ("gcn", "fp16", {"fp16": True}, None),
        # an rdna2 module may use subgroups of 32: not on a wave64-only GCN
        ("rdna2", "fp32", {}, "subgroup size 32 \\(it runs 64-64\\).*--arch gcn"),
        # rdna3's kernels need nothing an RDNA2 lacks, but its name picks rdna2
        (
            "rdna3",
            "fp16",
            {"min_subgroup_size": 32, "fp16": True, "name": "AMD Radeon (GFX1036)"},
            "compiled for vulkan arch rdna3.*--arch rdna2",
        ),
    ],
)
def test_device_properties_checked(monkeypatch, arch, dtype, props, error):
    monkeypatch.setattr(device_select, "caps_for", lambda name: caps(**props))
    fake(monkeypatch, [POLARIS])
    if error is None:
        info, _ = device_select.choose_device(gpu_manifest(arch, dtype), None)
        assert info == POLARIS
    else:
        with pytest.raises(UserError, match=error):
            device_select.choose_device(gpu_manifest(arch, dtype), None)
