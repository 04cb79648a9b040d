"""`--arch auto` picks the preset of the first real GPU, else lavapipe, and says why."""

from __future__ import annotations

import pytest
from vulkan_fakes import fake_vulkan_caps

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
        ("Intel(R) Arc(tm) A770 Graphics (DG2)", "arc"),
        ("AMD Radeon RX 580 Series (RADV POLARIS10)", "gcn"),
        ("NVIDIA GeForce GTX 1080", "baseline"),
    ],
)
def test_real_gpu_preferred_over_lavapipe(monkeypatch, name, arch):
    """Where Vulkan cannot be asked for properties, the device's name decides."""
    fake(monkeypatch, [LLVMPIPE, DeviceInfo("vulkan", 1, 2, name, "gpu")])
    monkeypatch.setattr(arch_select, "caps_for", lambda name: None)
    picked, why = arch_select.auto_arch(VK)
    assert picked == arch and name in why


def caps(name, vendor, lo=32, hi=64, coop=False, shared=65536):
    return fake_vulkan_caps(
        name=name, vendor_id=vendor, subgroup_size=lo, min_subgroup_size=lo, max_subgroup_size=hi,
        cooperative_matrix=coop, shared_memory_bytes=shared,
    )  # fmt: skip


@pytest.mark.parametrize(
    "props,arch",
    [
        # names no preset matches: the properties alone decide
        (caps("AMD Radeon Graphics (RADV GFX1151)", 0x1002, coop=True), "rdna3"),
        (caps("AMD Radeon Graphics (RADV GFX1036)", 0x1002), "rdna2"),
        (caps("AMD Radeon Graphics (RADV RAVEN)", 0x1002, lo=64), "gcn"),
        (caps("NVIDIA Graphics Device", 0x10DE, lo=32, hi=32, coop=True, shared=49152), "ampere"),
        (caps("Intel(R) Graphics (BMG G21)", 0x8086, lo=8, hi=32), "arc"),
        # rdna3's kernels need no cooperative matrices (iree 3.13's are unusable): an RDNA3 on
        # a driver without them still gets rdna3
        (caps("AMD Radeon RX 7900 XTX (RADV GFX1100)", 0x1002), "rdna3"),
        # a name match breaks a tie between presets the device fits
        (caps("NVIDIA GeForce RTX 4090", 0x10DE, lo=32, hi=32, coop=True, shared=49152), "ada"),
        # the NVIDIA presets need no cooperative matrices (their kernels are SIMT): a GPU
        # without them (Pascal) fits ampere
        (caps("NVIDIA GeForce GTX 1080", 0x10DE, lo=32, hi=32, shared=49152), "ampere"),
        # a GPU that offers less shared memory than a preset's kernels use fits none: baseline
        (caps("NVIDIA GeForce GTX 1080", 0x10DE, lo=32, hi=32, shared=32768), "baseline"),
    ],
)
def test_properties_pick_the_arch(monkeypatch, props, arch):
    fake(monkeypatch, [LLVMPIPE, DeviceInfo("vulkan", 1, 2, props.name + " (driver 1.0)", "gpu")])
    monkeypatch.setattr(
        arch_select, "caps_for", lambda name: props if name.startswith(props.name) else None
    )
    picked, why = arch_select.auto_arch(VK)
    assert picked == arch, why
    if arch != "baseline":
        assert "reports" in why and "subgroup" in why


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


@pytest.mark.parametrize(
    "asked,dtype,says", [(None, "fp32", "dtype: fp32, as"), ("fp16", "fp16", "note:")]
)
def test_auto_on_a_gpu_without_fp16_compiles_fp32(
    monkeypatch, tiny_model, tmp_path, asked, dtype, says
):
    """Polaris on RADV reports no shaderFloat16: the default fp16 would be refused at run time."""
    import io

    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    polaris = caps("AMD Radeon RX 580 Series (RADV POLARIS10)", 0x1002, lo=64)
    polaris = polaris.__class__(**{**polaris.__dict__, "fp16": False})
    fake(monkeypatch, [DeviceInfo("vulkan", 0, 2, polaris.name + " (radv)", "gpu")])
    monkeypatch.setattr(arch_select, "caps_for", lambda name: polaris)
    log = io.StringIO()
    opts = CompileOptions(tiny_model, "vulkan-spirv", dtype=asked, out=tmp_path / "a")
    plan = resolve(opts, Reporter(stream=log))
    assert plan.arch == "gcn" and plan.dtype == dtype
    assert says in log.getvalue() and "has no fp16 arithmetic" in log.getvalue()
