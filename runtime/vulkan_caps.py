"""What each Vulkan device says it can do, read from the Vulkan loader with ctypes.

`--arch auto` and the runtime's arch check use these properties, not device names: vendor and
device id, device type (a CPU implementation such as lavapipe reports itself as one), subgroup
sizes, fp16 arithmetic and 16-bit storage, cooperative matrices (tensor cores), shared memory
and the largest storage buffer. Only the Vulkan loader (libvulkan.so.1) is needed; where it is
missing or fails, `query()` returns an empty list and callers fall back to name matching.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import lru_cache

VENDORS = {
    0x1002: "AMD",
    0x10DE: "NVIDIA",
    0x8086: "Intel",
    0x10005: "Mesa",
    0x13B5: "ARM",
    0x5143: "Qualcomm",
    0x106B: "Apple",
}
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

# sTypes (vulkan_core.h)
_APPLICATION_INFO, _INSTANCE_CREATE_INFO = 0, 1
_PROPERTIES_2, _FEATURES_2 = 1000059001, 1000059000
_SUBGROUP_PROPERTIES = 1000094000
_SUBGROUP_SIZE_CONTROL_PROPERTIES = 1000225000
_FLOAT16_INT8_FEATURES = 1000082000
_16BIT_STORAGE_FEATURES = 1000083000
_API_1_3 = (1 << 22) | (3 << 12)
_SUBGROUP_SHUFFLE, _SUBGROUP_ARITHMETIC = 0x10, 0x08

# VkPhysicalDeviceProperties is 824 bytes; the fields read here sit at fixed offsets.
_PROPS_SIZE = 824
_OFF_LIMITS = 296  # after apiVersion..deviceType (20), deviceName[256], pipelineCacheUUID[16], pad
_OFF_MAX_STORAGE_BUFFER_RANGE = _OFF_LIMITS + 7 * 4
_OFF_MAX_SHARED_MEMORY = _OFF_LIMITS + 64 + 38 * 4
_OFF_MAX_INVOCATIONS = _OFF_LIMITS + 64 + 42 * 4


@dataclass(frozen=True)
class VulkanCaps:
    name: str
    vendor_id: int
    device_id: int
    device_type: str  # discrete, integrated, cpu, ...
    api_version: tuple[int, int, int]
    subgroup_size: int  # the default
    min_subgroup_size: int
    max_subgroup_size: int
    subgroup_shuffle: bool
    subgroup_arithmetic: bool
    fp16: bool  # shaderFloat16
    storage16: bool  # storageBuffer16BitAccess
    int8: bool
    cooperative_matrix: bool  # VK_KHR_cooperative_matrix or VK_NV_cooperative_matrix
    shared_memory_bytes: int
    max_invocations: int
    max_storage_buffer_range: int
    extensions: frozenset[str]

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, f"0x{self.vendor_id:04x}")

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def supports_subgroup_size(self, size: int) -> bool:
        return self.min_subgroup_size <= size <= self.max_subgroup_size

    def summary(self) -> str:
        return (
            f"{self.vendor} {self.device_type} 0x{self.device_id:04x}, subgroup "
            f"{self.min_subgroup_size}-{self.max_subgroup_size}, fp16 "
            f"{'yes' if self.fp16 and self.storage16 else 'no'}, cooperative matrix "
            f"{'yes' if self.cooperative_matrix else 'no'}, shared memory "
            f"{self.shared_memory_bytes // 1024} KiB"
        )


class _AppInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("pApplicationName", ctypes.c_char_p),
        ("applicationVersion", ctypes.c_uint32),
        ("pEngineName", ctypes.c_char_p),
        ("engineVersion", ctypes.c_uint32),
        ("apiVersion", ctypes.c_uint32),
    ]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.POINTER(_AppInfo)),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


class _Props2(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("properties", ctypes.c_uint8 * _PROPS_SIZE),
    ]


class _SubgroupProps(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("subgroupSize", ctypes.c_uint32),
        ("supportedStages", ctypes.c_uint32),
        ("supportedOperations", ctypes.c_uint32),
        ("quadOperationsInAllStages", ctypes.c_uint32),
    ]


class _SizeControlProps(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("minSubgroupSize", ctypes.c_uint32),
        ("maxSubgroupSize", ctypes.c_uint32),
        ("maxComputeWorkgroupSubgroups", ctypes.c_uint32),
        ("requiredSubgroupSizeStages", ctypes.c_uint32),
    ]


class _Features2(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("features", ctypes.c_uint32 * 55),
    ]


class _Float16Int8(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("shaderFloat16", ctypes.c_uint32),
        ("shaderInt8", ctypes.c_uint32),
    ]


class _Storage16(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("storageBuffer16BitAccess", ctypes.c_uint32),
        ("uniformAndStorageBuffer16BitAccess", ctypes.c_uint32),
        ("storagePushConstant16", ctypes.c_uint32),
        ("storageInputOutput16", ctypes.c_uint32),
    ]


class _ExtProps(ctypes.Structure):
    _fields_ = [("extensionName", ctypes.c_char * 256), ("specVersion", ctypes.c_uint32)]


def _u32(buf, off: int) -> int:
    return int.from_bytes(bytes(buf[off : off + 4]), "little")


def _loader():
    name = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    return ctypes.CDLL(name)


def _device_caps(vk, dev) -> VulkanCaps:
    size_ctl = _SizeControlProps(_SUBGROUP_SIZE_CONTROL_PROPERTIES, None)
    subgroup = _SubgroupProps(
        _SUBGROUP_PROPERTIES, ctypes.cast(ctypes.pointer(size_ctl), ctypes.c_void_p)
    )
    props = _Props2(_PROPERTIES_2, ctypes.cast(ctypes.pointer(subgroup), ctypes.c_void_p))
    vk.vkGetPhysicalDeviceProperties2(dev, ctypes.byref(props))
    p = props.properties
    api = _u32(p, 0)
    name = bytes(p[20:276]).split(b"\0", 1)[0].decode("utf-8", "replace")

    storage = _Storage16(_16BIT_STORAGE_FEATURES, None)
    f16 = _Float16Int8(
        _FLOAT16_INT8_FEATURES, ctypes.cast(ctypes.pointer(storage), ctypes.c_void_p)
    )
    feats = _Features2(_FEATURES_2, ctypes.cast(ctypes.pointer(f16), ctypes.c_void_p))
    vk.vkGetPhysicalDeviceFeatures2(dev, ctypes.byref(feats))

    count = ctypes.c_uint32(0)
    vk.vkEnumerateDeviceExtensionProperties(dev, None, ctypes.byref(count), None)
    exts = (_ExtProps * count.value)()
    vk.vkEnumerateDeviceExtensionProperties(dev, None, ctypes.byref(count), exts)
    ext_names = frozenset(e.extensionName.decode() for e in exts[: count.value])

    sub_size = subgroup.subgroupSize
    lo = size_ctl.minSubgroupSize or sub_size
    hi = size_ctl.maxSubgroupSize or sub_size
    return VulkanCaps(
        name=name,
        vendor_id=_u32(p, 8),
        device_id=_u32(p, 12),
        device_type=DEVICE_TYPES.get(_u32(p, 16), "other"),
        api_version=(api >> 22, (api >> 12) & 0x3FF, api & 0xFFF),
        subgroup_size=sub_size,
        min_subgroup_size=lo,
        max_subgroup_size=hi,
        subgroup_shuffle=bool(subgroup.supportedOperations & _SUBGROUP_SHUFFLE),
        subgroup_arithmetic=bool(subgroup.supportedOperations & _SUBGROUP_ARITHMETIC),
        fp16=bool(f16.shaderFloat16),
        storage16=bool(storage.storageBuffer16BitAccess),
        int8=bool(f16.shaderInt8),
        cooperative_matrix=bool(
            ext_names & {"VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix"}
        ),
        shared_memory_bytes=_u32(p, _OFF_MAX_SHARED_MEMORY),
        max_invocations=_u32(p, _OFF_MAX_INVOCATIONS),
        max_storage_buffer_range=_u32(p, _OFF_MAX_STORAGE_BUFFER_RANGE),
        extensions=ext_names,
    )


@lru_cache(maxsize=1)
def query() -> tuple[VulkanCaps, ...]:
    """Every Vulkan 1.1+ physical device, in the loader's order; () if Vulkan cannot be asked."""
    try:
        vk = _loader()
        app = _AppInfo(_APPLICATION_INFO, None, b"sdiree", 1, b"sdiree", 1, _API_1_3)
        info = _InstanceInfo(_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
        instance = ctypes.c_void_p()
        if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
            return ()
    except (OSError, AttributeError):
        return ()
    try:
        count = ctypes.c_uint32(0)
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        devs = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devs)
        out = []
        for dev in devs[: count.value]:
            head = (ctypes.c_uint8 * _PROPS_SIZE)()
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(dev), head)
            if _u32(head, 0) < (1 << 22 | 1 << 12):  # Vulkan 1.0 only: no properties2
                continue
            out.append(_device_caps(vk, ctypes.c_void_p(dev)))
        return tuple(out)
    finally:
        vk.vkDestroyInstance(instance, None)


def caps_for(name: str) -> VulkanCaps | None:
    """The properties of the device named name, if known. iree's vulkan driver lists a device as
    its Vulkan deviceName followed by " (driver name and version)"."""
    devices = query()
    for caps in devices:
        if caps.name == name:
            return caps
    for caps in devices:
        if name.startswith(caps.name + " ("):
            return caps
    return None


def main() -> None:
    for c in query():
        print(f"{c.name}: {c.summary()}; max storage buffer {c.max_storage_buffer_range >> 20} MiB")


if __name__ == "__main__":
    main()
