"""Query Vulkan physical-device properties directly through the Vulkan loader.

Kompute 0.9's Python API (``kp.Manager.get_device_properties``) exposes only a
handful of limits (name, workgroup count/size/invocations, timestamp period).
Choosing tile sizes and checking buffer sizes for attention kernels also needs
the subgroup size, shared-memory size, storage-buffer range, maximum
allocation size and device-local memory. This module reads them with plain
``ctypes`` so it depends on nothing but the standard library and the system
Vulkan loader. Devices are listed in loader order, which matches the device
index Kompute uses.

Run ``python -m vkattn._vkinfo`` to print one line per device.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    byref,
    c_char,
    c_char_p,
    c_float,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from dataclasses import asdict, dataclass
from typing import Callable, Optional

__all__ = ["DeviceInfo", "VulkanUnavailableError", "query_devices", "main"]

_INSTALL_HINT = (
    "Install a Vulkan loader and driver, e.g. on Debian/Ubuntu "
    "`apt-get install libvulkan1 mesa-vulkan-drivers` (Mesa's lavapipe is a "
    "software fallback), or your GPU vendor's Vulkan driver."
)


class VulkanUnavailableError(RuntimeError):
    """Raised when no usable Vulkan loader, instance or physical device exists."""


# --- C types -----------------------------------------------------------------

VkBool32 = c_uint32
VkDeviceSize = c_uint64
VkSampleCountFlags = c_uint32
VkFlags = c_uint32
VkStructureType = c_int32
VkResult = c_int32
VkInstance = c_void_p
VkPhysicalDevice = c_void_p

_STYPE_APPLICATION_INFO = 0
_STYPE_INSTANCE_CREATE_INFO = 1
_STYPE_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
_STYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES = 1000094000
_STYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES = 1000168000
_STYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES = 1000196000
_STYPE_PHYSICAL_DEVICE_FEATURES_2 = 1000059000
_STYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES = 1000225000
_STYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES = 1000225002
_EXT_SUBGROUP_SIZE_CONTROL = b"VK_EXT_subgroup_size_control"
_STYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES = 1000082000
_STYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES = 1000211000
_STYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR = 1000506000
_STYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR = 1000506001
_STYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_PROPERTIES_KHR = 1000506002
_EXT_SHADER_FLOAT16_INT8 = b"VK_KHR_shader_float16_int8"
_EXT_VULKAN_MEMORY_MODEL = b"VK_KHR_vulkan_memory_model"
_EXT_COOPERATIVE_MATRIX = b"VK_KHR_cooperative_matrix"
# VkComponentTypeKHR and VkScopeKHR values, by the names DeviceInfo.coopmat_shapes uses
_COMPONENT_TYPES = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64", 7: "u8", 8: "u16",
                    9: "u32", 10: "u64", 1000141000: "bf16", 1000491002: "e4m3", 1000491003: "e5m2"}
_SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queuefamily"}
_MEMORY_HEAP_DEVICE_LOCAL_BIT = 0x1
_MEMORY_PROPERTY_DEVICE_LOCAL, _MEMORY_PROPERTY_HOST_VISIBLE, _MEMORY_PROPERTY_HOST_COHERENT = 0x1, 0x2, 0x4
_MAX_PHYSICAL_DEVICE_NAME_SIZE = 256
_UUID_SIZE = 16
_MAX_MEMORY_TYPES = 32
_MAX_MEMORY_HEAPS = 16


def _make_api_version(major: int, minor: int, patch: int = 0) -> int:
    return (major << 22) | (minor << 12) | patch


_API_VERSION_1_1 = _make_api_version(1, 1)
_API_VERSION_1_2 = _make_api_version(1, 2)
_API_VERSION_1_3 = _make_api_version(1, 3)


class VkPhysicalDeviceLimits(Structure):
    _fields_ = [
        ("maxImageDimension1D", c_uint32),
        ("maxImageDimension2D", c_uint32),
        ("maxImageDimension3D", c_uint32),
        ("maxImageDimensionCube", c_uint32),
        ("maxImageArrayLayers", c_uint32),
        ("maxTexelBufferElements", c_uint32),
        ("maxUniformBufferRange", c_uint32),
        ("maxStorageBufferRange", c_uint32),
        ("maxPushConstantsSize", c_uint32),
        ("maxMemoryAllocationCount", c_uint32),
        ("maxSamplerAllocationCount", c_uint32),
        ("bufferImageGranularity", VkDeviceSize),
        ("sparseAddressSpaceSize", VkDeviceSize),
        ("maxBoundDescriptorSets", c_uint32),
        ("maxPerStageDescriptorSamplers", c_uint32),
        ("maxPerStageDescriptorUniformBuffers", c_uint32),
        ("maxPerStageDescriptorStorageBuffers", c_uint32),
        ("maxPerStageDescriptorSampledImages", c_uint32),
        ("maxPerStageDescriptorStorageImages", c_uint32),
        ("maxPerStageDescriptorInputAttachments", c_uint32),
        ("maxPerStageResources", c_uint32),
        ("maxDescriptorSetSamplers", c_uint32),
        ("maxDescriptorSetUniformBuffers", c_uint32),
        ("maxDescriptorSetUniformBuffersDynamic", c_uint32),
        ("maxDescriptorSetStorageBuffers", c_uint32),
        ("maxDescriptorSetStorageBuffersDynamic", c_uint32),
        ("maxDescriptorSetSampledImages", c_uint32),
        ("maxDescriptorSetStorageImages", c_uint32),
        ("maxDescriptorSetInputAttachments", c_uint32),
        ("maxVertexInputAttributes", c_uint32),
        ("maxVertexInputBindings", c_uint32),
        ("maxVertexInputAttributeOffset", c_uint32),
        ("maxVertexInputBindingStride", c_uint32),
        ("maxVertexOutputComponents", c_uint32),
        ("maxTessellationGenerationLevel", c_uint32),
        ("maxTessellationPatchSize", c_uint32),
        ("maxTessellationControlPerVertexInputComponents", c_uint32),
        ("maxTessellationControlPerVertexOutputComponents", c_uint32),
        ("maxTessellationControlPerPatchOutputComponents", c_uint32),
        ("maxTessellationControlTotalOutputComponents", c_uint32),
        ("maxTessellationEvaluationInputComponents", c_uint32),
        ("maxTessellationEvaluationOutputComponents", c_uint32),
        ("maxGeometryShaderInvocations", c_uint32),
        ("maxGeometryInputComponents", c_uint32),
        ("maxGeometryOutputComponents", c_uint32),
        ("maxGeometryOutputVertices", c_uint32),
        ("maxGeometryTotalOutputComponents", c_uint32),
        ("maxFragmentInputComponents", c_uint32),
        ("maxFragmentOutputAttachments", c_uint32),
        ("maxFragmentDualSrcAttachments", c_uint32),
        ("maxFragmentCombinedOutputResources", c_uint32),
        ("maxComputeSharedMemorySize", c_uint32),
        ("maxComputeWorkGroupCount", c_uint32 * 3),
        ("maxComputeWorkGroupInvocations", c_uint32),
        ("maxComputeWorkGroupSize", c_uint32 * 3),
        ("subPixelPrecisionBits", c_uint32),
        ("subTexelPrecisionBits", c_uint32),
        ("mipmapPrecisionBits", c_uint32),
        ("maxDrawIndexedIndexValue", c_uint32),
        ("maxDrawIndirectCount", c_uint32),
        ("maxSamplerLodBias", c_float),
        ("maxSamplerAnisotropy", c_float),
        ("maxViewports", c_uint32),
        ("maxViewportDimensions", c_uint32 * 2),
        ("viewportBoundsRange", c_float * 2),
        ("viewportSubPixelBits", c_uint32),
        ("minMemoryMapAlignment", c_size_t),
        ("minTexelBufferOffsetAlignment", VkDeviceSize),
        ("minUniformBufferOffsetAlignment", VkDeviceSize),
        ("minStorageBufferOffsetAlignment", VkDeviceSize),
        ("minTexelOffset", c_int32),
        ("maxTexelOffset", c_uint32),
        ("minTexelGatherOffset", c_int32),
        ("maxTexelGatherOffset", c_uint32),
        ("minInterpolationOffset", c_float),
        ("maxInterpolationOffset", c_float),
        ("subPixelInterpolationOffsetBits", c_uint32),
        ("maxFramebufferWidth", c_uint32),
        ("maxFramebufferHeight", c_uint32),
        ("maxFramebufferLayers", c_uint32),
        ("framebufferColorSampleCounts", VkSampleCountFlags),
        ("framebufferDepthSampleCounts", VkSampleCountFlags),
        ("framebufferStencilSampleCounts", VkSampleCountFlags),
        ("framebufferNoAttachmentsSampleCounts", VkSampleCountFlags),
        ("maxColorAttachments", c_uint32),
        ("sampledImageColorSampleCounts", VkSampleCountFlags),
        ("sampledImageIntegerSampleCounts", VkSampleCountFlags),
        ("sampledImageDepthSampleCounts", VkSampleCountFlags),
        ("sampledImageStencilSampleCounts", VkSampleCountFlags),
        ("storageImageSampleCounts", VkSampleCountFlags),
        ("maxSampleMaskWords", c_uint32),
        ("timestampComputeAndGraphics", VkBool32),
        ("timestampPeriod", c_float),
        ("maxClipDistances", c_uint32),
        ("maxCullDistances", c_uint32),
        ("maxCombinedClipAndCullDistances", c_uint32),
        ("discreteQueuePriorities", c_uint32),
        ("pointSizeRange", c_float * 2),
        ("lineWidthRange", c_float * 2),
        ("pointSizeGranularity", c_float),
        ("lineWidthGranularity", c_float),
        ("strictLines", VkBool32),
        ("standardSampleLocations", VkBool32),
        ("optimalBufferCopyOffsetAlignment", VkDeviceSize),
        ("optimalBufferCopyRowPitchAlignment", VkDeviceSize),
        ("nonCoherentAtomSize", VkDeviceSize),
    ]


class VkPhysicalDeviceSparseProperties(Structure):
    _fields_ = [
        ("residencyStandard2DBlockShape", VkBool32),
        ("residencyStandard2DMultisampleBlockShape", VkBool32),
        ("residencyStandard3DBlockShape", VkBool32),
        ("residencyAlignedMipSize", VkBool32),
        ("residencyNonResidentStrict", VkBool32),
    ]


class VkPhysicalDeviceProperties(Structure):
    _fields_ = [
        ("apiVersion", c_uint32),
        ("driverVersion", c_uint32),
        ("vendorID", c_uint32),
        ("deviceID", c_uint32),
        ("deviceType", c_int32),
        ("deviceName", c_char * _MAX_PHYSICAL_DEVICE_NAME_SIZE),
        ("pipelineCacheUUID", c_uint8 * _UUID_SIZE),
        ("limits", VkPhysicalDeviceLimits),
        ("sparseProperties", VkPhysicalDeviceSparseProperties),
    ]


class VkPhysicalDeviceProperties2(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("properties", VkPhysicalDeviceProperties),
    ]


class VkPhysicalDeviceSubgroupProperties(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("subgroupSize", c_uint32),
        ("supportedStages", VkFlags),
        ("supportedOperations", VkFlags),
        ("quadOperationsInAllStages", VkBool32),
    ]


class VkPhysicalDeviceMaintenance3Properties(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("maxPerSetDescriptors", c_uint32),
        ("maxMemoryAllocationSize", VkDeviceSize),
    ]


class VkPhysicalDeviceDriverProperties(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("driverID", c_uint32),
        ("driverName", c_char * 256),
        ("driverInfo", c_char * 256),
        ("conformanceVersion", c_uint8 * 4),
    ]


class VkPhysicalDeviceSubgroupSizeControlProperties(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("minSubgroupSize", c_uint32),
        ("maxSubgroupSize", c_uint32),
        ("maxComputeWorkgroupSubgroups", c_uint32),
        ("requiredSubgroupSizeStages", VkFlags),
    ]


class VkPhysicalDeviceSubgroupSizeControlFeatures(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("subgroupSizeControl", VkBool32),
        ("computeFullSubgroups", VkBool32),
    ]


class VkPhysicalDeviceFeatures2Head(Structure):
    """VkPhysicalDeviceFeatures2: sType, pNext and the 55 VkBool32 of VkPhysicalDeviceFeatures."""
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("features", VkBool32 * 55)]


class VkPhysicalDeviceShaderFloat16Int8Features(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("shaderFloat16", VkBool32),
                ("shaderInt8", VkBool32)]


class VkPhysicalDeviceVulkanMemoryModelFeatures(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("vulkanMemoryModel", VkBool32),
                ("vulkanMemoryModelDeviceScope", VkBool32),
                ("vulkanMemoryModelAvailabilityVisibilityChains", VkBool32)]


class VkPhysicalDeviceCooperativeMatrixFeaturesKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("cooperativeMatrix", VkBool32),
                ("cooperativeMatrixRobustBufferAccess", VkBool32)]


class VkPhysicalDeviceCooperativeMatrixPropertiesKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("cooperativeMatrixSupportedStages", VkFlags)]


class VkCooperativeMatrixPropertiesKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("MSize", c_uint32), ("NSize", c_uint32),
                ("KSize", c_uint32), ("AType", c_int32), ("BType", c_int32), ("CType", c_int32),
                ("ResultType", c_int32), ("saturatingAccumulation", VkBool32), ("scope", c_int32)]


class VkExtensionProperties(Structure):
    _fields_ = [("extensionName", c_char * 256), ("specVersion", c_uint32)]


class VkApplicationInfo(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("pApplicationName", c_char_p),
        ("applicationVersion", c_uint32),
        ("pEngineName", c_char_p),
        ("engineVersion", c_uint32),
        ("apiVersion", c_uint32),
    ]


class VkInstanceCreateInfo(Structure):
    _fields_ = [
        ("sType", VkStructureType),
        ("pNext", c_void_p),
        ("flags", VkFlags),
        ("pApplicationInfo", POINTER(VkApplicationInfo)),
        ("enabledLayerCount", c_uint32),
        ("ppEnabledLayerNames", POINTER(c_char_p)),
        ("enabledExtensionCount", c_uint32),
        ("ppEnabledExtensionNames", POINTER(c_char_p)),
    ]


class VkMemoryType(Structure):
    _fields_ = [("propertyFlags", VkFlags), ("heapIndex", c_uint32)]


class VkMemoryHeap(Structure):
    _fields_ = [("size", VkDeviceSize), ("flags", VkFlags)]


class VkPhysicalDeviceMemoryProperties(Structure):
    _fields_ = [
        ("memoryTypeCount", c_uint32),
        ("memoryTypes", VkMemoryType * _MAX_MEMORY_TYPES),
        ("memoryHeapCount", c_uint32),
        ("memoryHeaps", VkMemoryHeap * _MAX_MEMORY_HEAPS),
    ]


_PFN_GetPhysicalDeviceProperties2 = CFUNCTYPE(
    None, VkPhysicalDevice, POINTER(VkPhysicalDeviceProperties2)
)
_PFN_GetPhysicalDeviceFeatures2 = CFUNCTYPE(None, VkPhysicalDevice, c_void_p)

_VK_RESULT_NAMES = {
    0: "VK_SUCCESS",
    1: "VK_NOT_READY",
    5: "VK_INCOMPLETE",
    -1: "VK_ERROR_OUT_OF_HOST_MEMORY",
    -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
    -3: "VK_ERROR_INITIALIZATION_FAILED",
    -4: "VK_ERROR_DEVICE_LOST",
    -6: "VK_ERROR_LAYER_NOT_PRESENT",
    -7: "VK_ERROR_EXTENSION_NOT_PRESENT",
    -8: "VK_ERROR_FEATURE_NOT_PRESENT",
    -9: "VK_ERROR_INCOMPATIBLE_DRIVER",
    -10: "VK_ERROR_TOO_MANY_OBJECTS",
    -11: "VK_ERROR_FORMAT_NOT_SUPPORTED",
    -13: "VK_ERROR_UNKNOWN",
    -1000012000: "VK_ERROR_INVALID_SHADER_NV",
    -1000069000: "VK_ERROR_OUT_OF_POOL_MEMORY",
    1000297000: "VK_PIPELINE_COMPILE_REQUIRED",
}

_DEVICE_TYPES = {
    0: "other",
    1: "integrated_gpu",
    2: "discrete_gpu",
    3: "virtual_gpu",
    4: "cpu",
}

_SOFTWARE_NAME_MARKERS = ("llvmpipe", "lavapipe", "swiftshader")


def _result_name(result: int) -> str:
    return _VK_RESULT_NAMES.get(result, f"VkResult({result})")


def _triple(values: ctypes.Array) -> tuple[int, int, int]:
    return (int(values[0]), int(values[1]), int(values[2]))


def _format_version(version: int) -> str:
    return f"{(version >> 22) & 0x7F}.{(version >> 12) & 0x3FF}.{version & 0xFFF}"


# --- public API --------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """Compute-relevant properties of one Vulkan physical device."""

    index: int
    name: str
    device_type: str
    vendor_id: int
    device_id: int
    api_version: str
    driver_version: int
    max_storage_buffer_range: int
    max_memory_allocation_size: int
    max_compute_shared_memory_size: int
    max_compute_workgroup_invocations: int
    max_compute_workgroup_size: tuple[int, int, int]
    max_compute_workgroup_count: tuple[int, int, int]
    subgroup_size: int
    subgroup_supported_stages: int
    subgroup_supported_operations: int
    timestamp_period: float
    timestamp_compute_and_graphics: bool
    device_local_bytes: int
    # the first HOST_VISIBLE | HOST_COHERENT memory type (the one kp's host tensors get) is also
    # DEVICE_LOCAL: lavapipe, integrated GPUs (vkattn._kp: no staging copies there)
    host_memory_local: bool = False
    max_texel_buffer_elements: int = 0      # texels a uniform texel buffer view may hold
    driver_name: str = ""       # VkPhysicalDeviceDriverProperties (Vulkan 1.2 devices)
    driver_info: str = ""
    # VK_EXT_subgroup_size_control / Vulkan 1.3 (0 / False where the device has neither)
    min_subgroup_size: int = 0
    max_subgroup_size: int = 0
    required_subgroup_size_stages: int = 0
    subgroup_size_control: bool = False     # feature: a pipeline may require a subgroup size
    compute_full_subgroups: bool = False    # feature: .. and full subgroups in compute
    # features the cooperative-matrix kernel needs (False where the device does not offer them)
    shader_float16: bool = False            # VK_KHR_shader_float16_int8 / Vulkan 1.2
    vulkan_memory_model: bool = False       # VK_KHR_vulkan_memory_model / Vulkan 1.2
    vulkan_memory_model_device_scope: bool = False
    cooperative_matrix: bool = False        # VK_KHR_cooperative_matrix
    coopmat_stages: int = 0                 # its cooperativeMatrixSupportedStages
    # vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR, one string per listed shape:
    # "MxNxK A B C Result scope", e.g. "16x16x16 f16 f16 f32 f32 subgroup" (DeviceInfo.coopmat_shape)
    coopmat_shapes: tuple = ()

    def coopmat_shape(self, a: str = "f16", c: str = "f32", scope: str = "subgroup"):
        """(M, N, K) of a listed cooperative-matrix shape with A and B of type ``a`` and C and
        Result of type ``c`` at ``scope``, each side 8 or 16 (the shapes vkattn's kernel is
        built for), preferring 16x16x16, then the largest; None where the device lists none."""
        found = []
        for text in self.coopmat_shapes:
            parts = str(text).split()
            if len(parts) != 6 or parts[1:] != [a, a, c, c, scope]:
                continue
            mnk = tuple(int(x) for x in parts[0].split("x"))
            if all(v in (8, 16) for v in mnk):
                found.append(mnk)
        if not found:
            return None
        return max(found, key=lambda t: (t == (16, 16, 16), t[0] * t[1] * t[2]))

    @property
    def is_software(self) -> bool:
        """True for CPU implementations such as lavapipe/llvmpipe or SwiftShader."""
        lowered = self.name.lower()
        return self.device_type == "cpu" or any(m in lowered for m in _SOFTWARE_NAME_MARKERS)


def _load_loader() -> ctypes.CDLL:
    errors = []
    for name in ("libvulkan.so.1", "libvulkan.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise VulkanUnavailableError(
        "Could not load the Vulkan loader (" + "; ".join(errors) + "). " + _INSTALL_HINT
    )


def _bind(lib: ctypes.CDLL) -> None:
    lib.vkCreateInstance.argtypes = [
        POINTER(VkInstanceCreateInfo),
        c_void_p,
        POINTER(VkInstance),
    ]
    lib.vkCreateInstance.restype = VkResult
    lib.vkDestroyInstance.argtypes = [VkInstance, c_void_p]
    lib.vkDestroyInstance.restype = None
    lib.vkEnumeratePhysicalDevices.argtypes = [
        VkInstance,
        POINTER(c_uint32),
        POINTER(VkPhysicalDevice),
    ]
    lib.vkEnumeratePhysicalDevices.restype = VkResult
    lib.vkGetInstanceProcAddr.argtypes = [VkInstance, c_char_p]
    lib.vkGetInstanceProcAddr.restype = c_void_p
    lib.vkGetPhysicalDeviceProperties.argtypes = [
        VkPhysicalDevice,
        POINTER(VkPhysicalDeviceProperties),
    ]
    lib.vkGetPhysicalDeviceProperties.restype = None
    lib.vkGetPhysicalDeviceMemoryProperties.argtypes = [
        VkPhysicalDevice,
        POINTER(VkPhysicalDeviceMemoryProperties),
    ]
    lib.vkGetPhysicalDeviceMemoryProperties.restype = None
    lib.vkEnumerateDeviceExtensionProperties.argtypes = [
        VkPhysicalDevice, c_char_p, POINTER(c_uint32), c_void_p,
    ]
    lib.vkEnumerateDeviceExtensionProperties.restype = VkResult


def _create_instance(lib: ctypes.CDLL, api_version: int = _API_VERSION_1_1) -> c_void_p:
    app = VkApplicationInfo(
        sType=_STYPE_APPLICATION_INFO,
        pApplicationName=b"vkattn",
        applicationVersion=1,
        pEngineName=b"vkattn",
        engineVersion=1,
        apiVersion=api_version,
    )
    info = VkInstanceCreateInfo(
        sType=_STYPE_INSTANCE_CREATE_INFO, pApplicationInfo=ctypes.pointer(app)
    )
    instance = VkInstance()
    result = lib.vkCreateInstance(byref(info), None, byref(instance))
    if result != 0:
        raise VulkanUnavailableError(
            f"vkCreateInstance failed with {_result_name(result)}; no usable Vulkan driver "
            "was found. Install `mesa-vulkan-drivers` (lavapipe, a CPU fallback) or a "
            "GPU Vulkan driver."
        )
    return instance


def _enumerate_physical_devices(lib: ctypes.CDLL, instance: c_void_p) -> list[c_void_p]:
    count = c_uint32(0)
    result = lib.vkEnumeratePhysicalDevices(instance, byref(count), None)
    if result == 0 and count.value:
        handles = (VkPhysicalDevice * count.value)()
        result = lib.vkEnumeratePhysicalDevices(instance, byref(count), handles)
        if result in (0, 5):
            return [VkPhysicalDevice(handles[i]) for i in range(count.value)]
    reason = _result_name(result) if result != 0 else "0 devices"
    raise VulkanUnavailableError(
        f"vkEnumeratePhysicalDevices found no Vulkan devices ({reason}). Install "
        "`mesa-vulkan-drivers` (lavapipe, a CPU fallback) or a GPU Vulkan driver."
    )


def _properties2_fn(lib: ctypes.CDLL, instance: c_void_p) -> Optional[Callable[..., None]]:
    for name in (b"vkGetPhysicalDeviceProperties2", b"vkGetPhysicalDeviceProperties2KHR"):
        address = lib.vkGetInstanceProcAddr(instance, name)
        if address:
            return _PFN_GetPhysicalDeviceProperties2(address)
    return None


def _features2_fn(lib: ctypes.CDLL, instance: c_void_p) -> Optional[Callable[..., None]]:
    for name in (b"vkGetPhysicalDeviceFeatures2", b"vkGetPhysicalDeviceFeatures2KHR"):
        address = lib.vkGetInstanceProcAddr(instance, name)
        if address:
            return _PFN_GetPhysicalDeviceFeatures2(address)
    return None


def _device_extensions(lib: ctypes.CDLL, device: c_void_p) -> set:
    count = c_uint32(0)
    if lib.vkEnumerateDeviceExtensionProperties(device, None, byref(count), None) != 0 or not count.value:
        return set()
    arr = (VkExtensionProperties * count.value)()
    if lib.vkEnumerateDeviceExtensionProperties(device, None, byref(count), arr) not in (0, 5):
        return set()
    return {arr[i].extensionName for i in range(count.value)}


class _RawProperties:
    """Properties and chained extension structs for one device, as returned by the driver."""

    def __init__(self) -> None:
        self.maintenance3 = VkPhysicalDeviceMaintenance3Properties(
            sType=_STYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES
        )
        self.subgroup = VkPhysicalDeviceSubgroupProperties(
            sType=_STYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES,
            pNext=ctypes.cast(byref(self.maintenance3), c_void_p),
        )
        self.props2 = VkPhysicalDeviceProperties2(
            sType=_STYPE_PHYSICAL_DEVICE_PROPERTIES_2,
            pNext=ctypes.cast(byref(self.subgroup), c_void_p),
        )
        self.memory = VkPhysicalDeviceMemoryProperties()
        # Vulkan 1.2 core: asked for in a chain of its own, only of devices that have 1.2
        self.driver = VkPhysicalDeviceDriverProperties(sType=_STYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES)
        self.props2_driver = VkPhysicalDeviceProperties2(
            sType=_STYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=ctypes.cast(byref(self.driver), c_void_p))
        # Vulkan 1.3 core / VK_EXT_subgroup_size_control: asked for only where the device has one
        self.size_control = VkPhysicalDeviceSubgroupSizeControlProperties(
            sType=_STYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES)
        self.props2_size_control = VkPhysicalDeviceProperties2(
            sType=_STYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=ctypes.cast(byref(self.size_control), c_void_p))
        self.size_control_features = VkPhysicalDeviceSubgroupSizeControlFeatures(
            sType=_STYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES)
        self.features2 = VkPhysicalDeviceFeatures2Head(
            sType=_STYPE_PHYSICAL_DEVICE_FEATURES_2,
            pNext=ctypes.cast(byref(self.size_control_features), c_void_p))
        # what the cooperative-matrix kernel needs: a features chain of its own, of only the
        # structs the device has (core version or extension), and the matrix shapes
        self.float16_features = VkPhysicalDeviceShaderFloat16Int8Features(
            sType=_STYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES)
        self.memory_model_features = VkPhysicalDeviceVulkanMemoryModelFeatures(
            sType=_STYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES)
        self.coopmat_features = VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
            sType=_STYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR)
        self.coopmat_properties = VkPhysicalDeviceCooperativeMatrixPropertiesKHR(
            sType=_STYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_PROPERTIES_KHR)
        self.coopmat_shapes: tuple = ()

    def query_coopmat(self, lib, instance, device, get_props2, get_features2) -> None:
        """Fill the float16 / memory-model / cooperative-matrix features and the matrix shapes."""
        api = self.properties.apiVersion
        exts = _device_extensions(lib, device)
        chain = []
        if api >= _API_VERSION_1_2 or _EXT_SHADER_FLOAT16_INT8 in exts:
            chain.append(self.float16_features)
        if api >= _API_VERSION_1_2 or _EXT_VULKAN_MEMORY_MODEL in exts:
            chain.append(self.memory_model_features)
        has_cm = _EXT_COOPERATIVE_MATRIX in exts
        if has_cm:
            chain.append(self.coopmat_features)
        if chain:
            for first, nxt in zip(chain, chain[1:] + [None]):
                first.pNext = ctypes.cast(byref(nxt), c_void_p) if nxt is not None else None
            head = VkPhysicalDeviceFeatures2Head(sType=_STYPE_PHYSICAL_DEVICE_FEATURES_2,
                                                 pNext=ctypes.cast(byref(chain[0]), c_void_p))
            get_features2(device, ctypes.cast(byref(head), c_void_p))
            for st in chain:
                st.pNext = None
        if not has_cm:
            return
        props = VkPhysicalDeviceProperties2(sType=_STYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                            pNext=ctypes.cast(byref(self.coopmat_properties), c_void_p))
        get_props2(device, byref(props))
        self.coopmat_properties.pNext = None
        address = lib.vkGetInstanceProcAddr(instance, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        if not address:
            return
        fn = CFUNCTYPE(VkResult, VkPhysicalDevice, POINTER(c_uint32), c_void_p)(address)
        count = c_uint32(0)
        if fn(device, byref(count), None) != 0 or not count.value:
            return
        arr = (VkCooperativeMatrixPropertiesKHR * count.value)()
        for i in range(count.value):
            arr[i].sType = _STYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
        if fn(device, byref(count), ctypes.cast(arr, c_void_p)) not in (0, 5):
            return
        name = lambda t: _COMPONENT_TYPES.get(t, f"type{t}")
        self.coopmat_shapes = tuple(
            f"{p.MSize}x{p.NSize}x{p.KSize} {name(p.AType)} {name(p.BType)} {name(p.CType)} "
            f"{name(p.ResultType)}{' sat' if p.saturatingAccumulation else ''} "
            f"{_SCOPES.get(p.scope, f'scope{p.scope}')}"
            for p in arr[:count.value])

    @property
    def properties(self) -> VkPhysicalDeviceProperties:
        return self.props2.properties


def _query_raw() -> list[_RawProperties]:
    lib = _load_loader()
    try:
        _bind(lib)
    except AttributeError as exc:
        raise VulkanUnavailableError(
            f"The Vulkan loader is incomplete ({exc}). {_INSTALL_HINT}"
        ) from exc
    instance = _create_instance(lib, _API_VERSION_1_2)
    try:
        get_props2 = _properties2_fn(lib, instance)
        get_features2 = _features2_fn(lib, instance)
        raws = []
        for device in _enumerate_physical_devices(lib, instance):
            raw = _RawProperties()
            lib.vkGetPhysicalDeviceProperties(device, byref(raw.props2.properties))
            if get_props2 is not None and raw.properties.apiVersion >= _API_VERSION_1_1:
                get_props2(device, byref(raw.props2))
            if get_props2 is not None and raw.properties.apiVersion >= _API_VERSION_1_2:
                get_props2(device, byref(raw.props2_driver))
            if (get_props2 is not None and get_features2 is not None
                    and raw.properties.apiVersion >= _API_VERSION_1_1
                    and (raw.properties.apiVersion >= _API_VERSION_1_3
                         or _EXT_SUBGROUP_SIZE_CONTROL in _device_extensions(lib, device))):
                get_props2(device, byref(raw.props2_size_control))
                get_features2(device, ctypes.cast(byref(raw.features2), c_void_p))
            if (get_props2 is not None and get_features2 is not None
                    and raw.properties.apiVersion >= _API_VERSION_1_1):
                raw.query_coopmat(lib, instance, device, get_props2, get_features2)
            lib.vkGetPhysicalDeviceMemoryProperties(device, byref(raw.memory))
            raws.append(raw)
        return raws
    finally:
        lib.vkDestroyInstance(instance, None)


def _host_memory_local(memory) -> bool:
    """DeviceInfo.host_memory_local from VkPhysicalDeviceMemoryProperties (kp takes the first
    memory type whose flags include the ones it asks for)."""
    want = _MEMORY_PROPERTY_HOST_VISIBLE | _MEMORY_PROPERTY_HOST_COHERENT
    for t in memory.memoryTypes[: memory.memoryTypeCount]:
        if t.propertyFlags & want == want:
            return bool(t.propertyFlags & _MEMORY_PROPERTY_DEVICE_LOCAL)
    return False


def _device_info(index: int, raw: _RawProperties) -> DeviceInfo:
    props = raw.properties
    limits = props.limits
    heaps = raw.memory.memoryHeaps[: raw.memory.memoryHeapCount]
    return DeviceInfo(
        index=index,
        name=props.deviceName.decode("utf-8", errors="replace"),
        device_type=_DEVICE_TYPES.get(props.deviceType, "other"),
        vendor_id=props.vendorID,
        device_id=props.deviceID,
        api_version=_format_version(props.apiVersion),
        driver_version=props.driverVersion,
        max_storage_buffer_range=limits.maxStorageBufferRange,
        max_texel_buffer_elements=limits.maxTexelBufferElements,
        max_memory_allocation_size=raw.maintenance3.maxMemoryAllocationSize,
        max_compute_shared_memory_size=limits.maxComputeSharedMemorySize,
        max_compute_workgroup_invocations=limits.maxComputeWorkGroupInvocations,
        max_compute_workgroup_size=_triple(limits.maxComputeWorkGroupSize),
        max_compute_workgroup_count=_triple(limits.maxComputeWorkGroupCount),
        subgroup_size=raw.subgroup.subgroupSize,
        subgroup_supported_stages=raw.subgroup.supportedStages,
        subgroup_supported_operations=raw.subgroup.supportedOperations,
        timestamp_period=float(limits.timestampPeriod),
        timestamp_compute_and_graphics=bool(limits.timestampComputeAndGraphics),
        device_local_bytes=sum(h.size for h in heaps if h.flags & _MEMORY_HEAP_DEVICE_LOCAL_BIT),
        host_memory_local=_host_memory_local(raw.memory),
        driver_name=raw.driver.driverName.decode("utf-8", errors="replace"),
        driver_info=raw.driver.driverInfo.decode("utf-8", errors="replace"),
        min_subgroup_size=raw.size_control.minSubgroupSize,
        max_subgroup_size=raw.size_control.maxSubgroupSize,
        required_subgroup_size_stages=raw.size_control.requiredSubgroupSizeStages,
        subgroup_size_control=bool(raw.size_control_features.subgroupSizeControl),
        compute_full_subgroups=bool(raw.size_control_features.computeFullSubgroups),
        shader_float16=bool(raw.float16_features.shaderFloat16),
        vulkan_memory_model=bool(raw.memory_model_features.vulkanMemoryModel),
        vulkan_memory_model_device_scope=bool(raw.memory_model_features.vulkanMemoryModelDeviceScope),
        cooperative_matrix=bool(raw.coopmat_features.cooperativeMatrix),
        coopmat_stages=raw.coopmat_properties.cooperativeMatrixSupportedStages,
        coopmat_shapes=raw.coopmat_shapes,
    )


def _raw_limits() -> list[VkPhysicalDeviceLimits]:
    """Full VkPhysicalDeviceLimits per device (uncached; for diagnostics and tests)."""
    return [raw.properties.limits for raw in _query_raw()]


_cache: Optional[list[DeviceInfo]] = None
_cache_lock = threading.Lock()


def query_devices(refresh: bool = False) -> list[DeviceInfo]:
    """Return one DeviceInfo per Vulkan physical device, in loader (Kompute index) order.

    The result is computed once per process; pass ``refresh=True`` to query again.
    Raises VulkanUnavailableError when no loader, instance or device is available.
    """
    global _cache
    with _cache_lock:
        if _cache is None or refresh:
            _cache = [_device_info(i, raw) for i, raw in enumerate(_query_raw())]
        return list(_cache)


def _describe(info: DeviceInfo) -> str:
    wg = "x".join(map(str, info.max_compute_workgroup_size))
    return (
        f"[{info.index}] {info.name} ({info.device_type}"
        f"{', software' if info.is_software else ''}) "
        f"Vulkan {info.api_version} subgroup={info.subgroup_size} "
        f"shared={info.max_compute_shared_memory_size}B "
        f"wg_invocations={info.max_compute_workgroup_invocations} "
        f"wg_size={wg} storage_range={info.max_storage_buffer_range} "
        f"max_alloc={info.max_memory_allocation_size} device_local={info.device_local_bytes} "
        f"timestamp_period={info.timestamp_period:g}ns"
        + (f" subgroup_sizes={info.min_subgroup_size}..{info.max_subgroup_size}"
           f"{' pinnable' if info.subgroup_size_control and info.required_subgroup_size_stages & 0x20 else ''}"
           f"{' full' if info.compute_full_subgroups else ''}" if info.max_subgroup_size else "")
        + (f" coopmat={'/'.join(s.split()[0] for s in info.coopmat_shapes if ' f16 f16 f32 f32' in s)}"
           if info.cooperative_matrix and info.coopmat_shapes else "")
        + (f" driver={info.driver_name} {info.driver_info}" if info.driver_name else "")
    )


def main(argv: Optional[list] = None) -> int:
    """One line per device; ``--json``: a JSON list of the DeviceInfo fields (for a parent process
    that needs another environment's devices, e.g. RADV's null hardware)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        devices = query_devices()
    except VulkanUnavailableError as exc:
        print(json.dumps({"error": str(exc)}) if "--json" in argv else f"Vulkan unavailable: {exc}")
        return 1
    if "--json" in argv:
        print(json.dumps([asdict(d) for d in devices]))
        return 0
    for info in devices:
        print(_describe(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
