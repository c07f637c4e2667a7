"""Compiler statistics of compute pipelines, without a GPU (RADV's null device).

Mesa's RADV compiles for an AMD family whose GPU is not there in one of two ways, both set in the
environment before the Vulkan loader loads its drivers (:class:`NullMechanism`,
:func:`null_mechanism` picks one):

* Mesa up to 25: ``RADV_FORCE_FAMILY=<family>`` -- a physical device named ``Null hardware (RADV
  <FAMILY>)`` (RDNA3 is spelled gfx1100 in 22.3, navi31 in 25).
* Mesa 26 removed RADV_FORCE_FAMILY ("Please use AMDGPU drm-shim now"): ``LD_PRELOAD=<AMDGPU's
  drm-shim, libamdgpu_noop_drm_shim.so> AMDGPU_GPU_ID=<family>`` (Debian: mesa-drm-shim) --
  RADV opens a fake amdgpu device and names it as the product, e.g. ``AMD Radeon RX 7900 XTX
  (RADV NAVI31)``; the shim's names are code names (navi31, navi33, gfx1201 = RDNA4, phoenix, ...).
  LD_PRELOAD only acts when a process starts, so this works in child processes only.

Which one: the Mesa version read from RADV's library (:func:`mesa_version`) and whether the shim
is installed (:func:`drm_shim_library`); ``VKATTN_RADV_NULL=force-family|drm-shim`` overrides.
Family names are translated between the two spellings (:func:`canonical_family`).

Either device has no usable memory and runs nothing, but it compiles pipelines with ACO exactly as
for the real chip and answers ``VK_KHR_pipeline_executable_properties``: per pipeline executable,
the registers, spills, scratch, LDS, occupancy and ACO's instruction statistics. This module
drives that extension with plain ``ctypes`` (stdlib only, no ``kp``), on any Vulkan device that
offers it:

* :func:`compile_stats` -- compile jobs on the first device whose name contains ``device`` in
  *this* process (one VkInstance/VkDevice per call) and return their statistics.
* :func:`family_stats` -- the same for each AMD family, one fresh subprocess per family with
  the mechanism's variables set; families the installed Mesa does not know come back unavailable.
* :func:`available_families`, :func:`device_support` (extensions, optional features, subgroup
  sizes), :func:`format_table`, and a CLI: ``python -m vkattn.tools.vkpipeline attn --define KV_F16=1
  --spec 64,4,1,16,16,128,32,0,1,4,8 --family navi21,gfx1100``.

A job is :class:`Job` (or a tuple ``(name, spirv, spec, bindings)``): SPIR-V, uint32 spec constants
with constant_ids 0..n-1, and ``bindings`` storage buffers 0..n-1 in set 0. Optional feature names
(:data:`FEATURES`) are enabled at device creation only where the device supports them; the result
says which were enabled and which were not.

Mesa 26.1 (measured through the drm-shim): compute is still wave64 by default on every family,
"Subgroups per SIMD" still counts wave32 slots on gfx10+ (16 slots per SIMD on gfx10.3, gfx11
and gfx12: a small wave64 kernel reports 32, its wave32 build 16), and ACO adds static VALU, SALU,
VMEM, SMEM and VOPD counts to its statistics. The rule below is 22.3's; one difference was
measured on 26.1 -- a wave32 pipeline no longer gets twice the wave slots of a wave64 one -- and
``radv_waves_per_simd(..., mesa=(26, 1))`` applies it (tests/test_gpu_compile.py checks it
against the driver on navi21).

Reading RADV's numbers (Mesa 22.3, read from its source: radv_shader.c ``radv_get_max_waves``,
radv_pipeline.c ``radv_GetPipelineExecutableStatisticsKHR``, ac_gpu_info.c and the null winsys,
ACO's aco_ir.cpp ``init_program`` and aco_live_var_analysis.cpp)
-------------------------------------------------------------------------------------------------
Wave size. Kompute sets no required subgroup size, so a compute pipeline gets RADV's
``cs_wave_size``: wave64 on every family by default, gfx10/10.3/11 included. Only
``RADV_PERFTEST=cswave32`` makes it wave32, and only on gfx10+ (gfx8/9 have wave64 alone); even
then a shader that uses wide subgroup operations with a workgroup size that is a multiple of 64 is
kept at wave64. A pipeline may also ask for a size through ``VK_EXT_subgroup_size_control``
(:attr:`Job.subgroup_size`, supported 32..64 on gfx10+); ``subgroupSize`` of each executable says
what was chosen.

Registers. "VGPRs"/"SGPRs" are the allocation, not the live count: ACO rounds the highest register
used + 1 up to the allocation granule. VGPR granule: gfx8/9 4; gfx10 4 (wave64) / 8 (wave32);
gfx10.3 8 / 16; gfx11 (gfx1100/1101) 12 / 24, i.e. the same bytes per lane-group whatever the wave
size. SGPRs: gfx8/9 round (used + VCC/FLAT_SCRATCH/XNACK extras) up to 16 (96 on Tonga/Iceland);
gfx10+ always report 128 (SGPRs no longer limit occupancy). A wave64 on gfx10+ runs on a 32-lane
SIMD, so one wave64 VGPR costs two wave32 VGPRs of the register file. ACO 22.3 addresses at most
256 VGPRs, but only 128 on gfx11 (a stop-gap in init_program): a kernel that needs more spills
there first (seen: 132 allocated, 1093 spilled on gfx1100 where navi21 spills 175 of 256).

Waves per SIMD ("Subgroups per SIMD"). RADV takes the least of four limits, W = waves of the
pipeline's size per SIMD, w = 64 / wave_size:

* slots: ``max_wave64_per_simd * w`` -- max_wave64_per_simd is 10 on gfx9 (vega), 8 on
  gfx8 Polaris/VegaM, 10 other gfx8, 20 on gfx10, 16 on gfx10.3 and gfx11;
* SGPRs, gfx8/9 only: ``800 // align(SGPRs, 16)``;
* VGPRs: ``physical // granule_aligned(VGPRs)`` with physical = 256 (gfx8/9), 512 * w (gfx10,
  gfx10.3), 768 * w (gfx1100/1101) and the VGPR count aligned to 4/8 (wave64/32), then to 8/16 on
  gfx10.3 and 12/24 on gfx1100/1101;
* LDS, compute: ``lds_per_wave = align(LDS bytes, alloc granule) / ceil(workgroup / wave_size)``
  with the alloc granule 512 B (gfx7..gfx10) or 1024 B (gfx10.3+), and the LDS one SIMD may use
  ``64 KiB / 4 SIMDs = 16 KiB`` on gfx8/9 or, assuming WGP mode (which RADV uses for compute on
  gfx10+), ``128 KiB / 4 SIMDs = 32 KiB`` on gfx10+; limit ``ceil(lds_per_simd / lds_per_wave)``.
  Note the ceiling: it is the optimistic per-SIMD share, not the whole number of workgroups that
  fit in a CU/WGP (12 KiB of LDS on vega: RADV says 2 waves/SIMD, a CU fits 5 such one-wave
  workgroups = 1.25 per SIMD).

The value reported is W on gfx6..9 (wave64 units) and ``W * wave_size / 32`` on gfx10+: on gfx10+
"Subgroups per SIMD" counts wave32 slots, so a wave64 pipeline reporting 6 has 3 wave64 waves per
SIMD32. ``subgroups_per_simd_wave64`` of :class:`Executable` converts; :func:`radv_waves_per_simd`
computes the value from a budget (it reproduced the driver's number for 13 pipelines on 8 families,
wave64 and wave32). Budget for W waves per SIMD: VGPRs <= physical / W rounded down to the
granule (wave64: 256/W on gfx9, 512/W on gfx10/10.3, 768/W on gfx1100), and the LDS of a workgroup
of k waves below k * lds_per_simd / (W - 1) for RADV's count -- or, for what really fits, at most
floor(64 KiB (gfx9 CU) or 128 KiB (gfx10+ WGP) / LDS per workgroup) workgroups share the 4 SIMDs.

ACO's own statistics (22.3): Hash, Instructions, Copies, Branches, Latency (issue + stall cycles),
Inverse Throughput (estimated busy cycles of one wave), VMEM Clause, SMEM Clause, Pre-Sched SGPRs,
Pre-Sched VGPRs. "LDS size" is bytes per workgroup (ACO encodes it in 512 B blocks), "Scratch size"
bytes per subgroup (non-zero means spilling or private arrays), "Code size" bytes.

The null device's limits come from the null winsys, which matches ac_gpu_info for the values above
(except its gfx10+ SGPR file size, which no occupancy rule reads). Enabling an optional feature
does not change the code of a shader that does not use it (the same Hash either way): RADV
compiles what the SPIR-V says; features only make its use valid.

Processes. RADV reads RADV_FORCE_FAMILY when an instance is created, so :func:`compile_stats` in a
process whose environment has it works (the drm-shim must be preloaded when the process starts),
but :func:`family_stats` runs a fresh process per family:
an unknown family makes 22.3's null winsys ``abort()`` while enumerating devices, and invalid input
crashes the compiler instead of failing (seen: SIGSEGV for malformed SPIR-V, SIGFPE in ACO for a
workgroup over the 64 KiB of LDS on gfx8/9). A crashed job is reported and the next jobs compile in
a new process.
"""
from __future__ import annotations

import argparse
import base64
import ctypes
import glob
import json
import mmap
import os
import platform
import re
import signal
import subprocess
import sys
from contextlib import ExitStack
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, byref, c_char, c_char_p, c_double,
                    c_float, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p)
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

if __name__ == "__main__" and not __package__:
    # run as a file (``python3 vkattn/tools/vkpipeline.py``, and family_stats' children): import
    # vkattn's modules through bare packages, without the package __init__ (which imports kp)
    import types
    _here = os.path.dirname(os.path.abspath(__file__))
    _pkg = os.path.dirname(_here)
    sys.modules.setdefault("vkattn", types.ModuleType("vkattn")).__path__ = [_pkg]
    sys.modules.setdefault("vkattn.tools", types.ModuleType("vkattn.tools")).__path__ = [_here]
    __package__ = "vkattn.tools"

from ..compiler import compile_shader     # glslangValidator, cached; imports no kp
from .._vkinfo import (DeviceInfo, VkBool32, VkFlags, VkPhysicalDevice, VkPhysicalDeviceProperties2, VkResult,
                      VkStructureType, VulkanUnavailableError, _bind, _create_instance,
                      _enumerate_physical_devices, _format_version, _load_loader,
                      _make_api_version, _result_name)

__all__ = ["Job", "Executable", "JobResult", "CompileResult", "DeviceSupport", "FEATURES",
           "DEFAULT_FAMILIES", "SHIM_FAMILIES", "NVK_FAMILIES", "NVK_CHIPSETS", "NullMechanism",
           "null_mechanism", "nvk_mechanism", "compile_stats",
           "device_support", "family_stats", "available_families", "default_families",
           "family_device_info", "canonical_family", "radeon_icd", "radv_library", "mesa_version",
           "drm_shim_library", "radv_waves_per_simd", "spirv_bindings", "format_table", "main"]

NULL_DEVICE = "Null hardware"
#: families named in this project's studies (gfx8 Polaris, gfx9 Vega, gfx10 RDNA1, gfx10.3 RDNA2,
#: gfx11 RDNA3); Mesa 22.3 also knows e.g. tonga, fiji, vega20, navi14, navi22, navi23, gfx1101
DEFAULT_FAMILIES = ("polaris10", "vega10", "navi10", "navi21", "gfx1100")
#: the same chips as Mesa 26's drm-shim names them, plus gfx1201 (RDNA4); the shim also knows e.g.
#: bonaire, pitcairn, stoney, polaris12, vega20, raven, renoir, navi33, vangogh, rembrandt,
#: phoenix, strix1
SHIM_FAMILIES = ("polaris10", "vega10", "navi10", "navi21", "navi31", "gfx1201")

_API_1_3 = _make_api_version(1, 3)
_VK_SUCCESS, _VK_INCOMPLETE = 0, 5
_MAX_NAME = 256

# --- C types ---------------------------------------------------------------------------------

VkDevice = c_void_p
VkHandle = c_uint64          # non-dispatchable handles (module, layouts, pipeline)

_STYPE_DEVICE_QUEUE_CREATE_INFO = 2
_STYPE_DEVICE_CREATE_INFO = 3
_STYPE_SHADER_MODULE_CREATE_INFO = 16
_STYPE_PIPELINE_SHADER_STAGE_CREATE_INFO = 18
_STYPE_COMPUTE_PIPELINE_CREATE_INFO = 29
_STYPE_PIPELINE_LAYOUT_CREATE_INFO = 30
_STYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO = 32
_STYPE_PHYSICAL_DEVICE_FEATURES_2 = 1000059000
_STYPE_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
_STYPE_SUBGROUP_SIZE_CONTROL_PROPERTIES = 1000225000
_STYPE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO = 1000225001
_STYPE_PIPELINE_INFO = 1000269001
_STYPE_PIPELINE_EXECUTABLE_PROPERTIES = 1000269002
_STYPE_PIPELINE_EXECUTABLE_INFO = 1000269003
_STYPE_PIPELINE_EXECUTABLE_STATISTIC = 1000269004
_STYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION = 1000269005

_QUEUE_COMPUTE_BIT = 0x2
_SHADER_STAGE_COMPUTE_BIT = 0x20
_DESCRIPTOR_TYPE_STORAGE_BUFFER = 7
_PIPELINE_CREATE_CAPTURE_STATISTICS = 0x40
_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS = 0x80
_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS = 0x2
_EXT_PIPELINE_EXECUTABLE = "VK_KHR_pipeline_executable_properties"

# VkPhysicalDeviceFeatures: 55 VkBool32, in declaration order
_CORE_FEATURE_NAMES = tuple("""
robustBufferAccess fullDrawIndexUint32 imageCubeArray independentBlend geometryShader
tessellationShader sampleRateShading dualSrcBlend logicOp multiDrawIndirect
drawIndirectFirstInstance depthClamp depthBiasClamp fillModeNonSolid depthBounds wideLines
largePoints alphaToOne multiViewport samplerAnisotropy textureCompressionETC2
textureCompressionASTC_LDR textureCompressionBC occlusionQueryPrecise pipelineStatisticsQuery
vertexPipelineStoresAndAtomics fragmentStoresAndAtomics shaderTessellationAndGeometryPointSize
shaderImageGatherExtended shaderStorageImageExtendedFormats shaderStorageImageMultisample
shaderStorageImageReadWithoutFormat shaderStorageImageWriteWithoutFormat
shaderUniformBufferArrayDynamicIndexing shaderSampledImageArrayDynamicIndexing
shaderStorageBufferArrayDynamicIndexing shaderStorageImageArrayDynamicIndexing shaderClipDistance
shaderCullDistance shaderFloat64 shaderInt64 shaderInt16 shaderResourceResidency
shaderResourceMinLod sparseBinding sparseResidencyBuffer sparseResidencyImage2D
sparseResidencyImage3D sparseResidency2Samples sparseResidency4Samples sparseResidency8Samples
sparseResidency16Samples sparseResidencyAliased variableMultisampleRate inheritedQueries
""".split())


def _chained(name: str, fields: Sequence[str]) -> type:
    """A ``{sType, pNext, VkBool32 fields...}`` feature structure."""
    return type(name, (Structure,), {"_fields_": [("sType", VkStructureType), ("pNext", c_void_p)]
                                     + [(f, VkBool32) for f in fields]})


VkPhysicalDeviceFeatures2 = type("VkPhysicalDeviceFeatures2", (Structure,), {"_fields_": [
    ("sType", VkStructureType), ("pNext", c_void_p),
    ("features", type("VkPhysicalDeviceFeatures", (Structure,),
                      {"_fields_": [(f, VkBool32) for f in _CORE_FEATURE_NAMES]}))]})


@dataclass(frozen=True)
class _Block:
    """One chained feature structure: its sType, fields, extension and the core version (or None)."""
    struct: type
    stype: int
    extension: str
    core: Optional[tuple[int, int]]


_BLOCKS = (
    _Block(_chained("VkPhysicalDeviceShaderFloat16Int8Features", ("shaderFloat16", "shaderInt8")),
           1000082000, "VK_KHR_shader_float16_int8", (1, 2)),
    _Block(_chained("VkPhysicalDevice16BitStorageFeatures", (
        "storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess", "storagePushConstant16",
        "storageInputOutput16")), 1000083000, "VK_KHR_16bit_storage", (1, 1)),
    _Block(_chained("VkPhysicalDevice8BitStorageFeatures", (
        "storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess", "storagePushConstant8")),
        1000177000, "VK_KHR_8bit_storage", (1, 2)),
    _Block(_chained("VkPhysicalDeviceSubgroupSizeControlFeatures", (
        "subgroupSizeControl", "computeFullSubgroups")), 1000225002,
        "VK_EXT_subgroup_size_control", (1, 3)),
    _Block(_chained("VkPhysicalDeviceCooperativeMatrixFeaturesKHR", (
        "cooperativeMatrix", "cooperativeMatrixRobustBufferAccess")), 1000506000,
        "VK_KHR_cooperative_matrix", None),
    _Block(_chained("VkPhysicalDeviceVulkanMemoryModelFeatures", (
        "vulkanMemoryModel", "vulkanMemoryModelDeviceScope",
        "vulkanMemoryModelAvailabilityVisibilityChains")), 1000211000,
        "VK_KHR_vulkan_memory_model", (1, 2)),
    # float16 dot products accumulating in float32 (v_dot2_f32_f16): llama.cpp's scalar flash
    # attention picks its DOT2_F16 variant where the device lists it (Mesa 26 RADV, gfx10.3+)
    _Block(_chained("VkPhysicalDeviceShaderMixedFloatDotProductFeaturesVALVE", (
        "shaderMixedFloatDotProductFloat16AccFloat32", "shaderMixedFloatDotProductFloat16AccFloat16",
        "shaderMixedFloatDotProductBFloat16Acc", "shaderMixedFloatDotProductFloat8AccFloat32")),
        1000673000, "VK_VALVE_shader_mixed_float_dot_product", None),
    _Block(_chained("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR", (
        "pipelineExecutableInfo",)), 1000269000, _EXT_PIPELINE_EXECUTABLE, None),
)
_CORE_OPTIONAL = ("shaderInt16", "shaderInt64", "shaderFloat64")
#: optional feature names :func:`compile_stats` can enable (each only where supported)
FEATURES = _CORE_OPTIONAL + tuple(
    f for b in _BLOCKS for f, _ in b.struct._fields_[2:] if f != "pipelineExecutableInfo")


class VkPhysicalDeviceSubgroupSizeControlProperties(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("minSubgroupSize", c_uint32),
                ("maxSubgroupSize", c_uint32), ("maxComputeWorkgroupSubgroups", c_uint32),
                ("requiredSubgroupSizeStages", VkFlags)]


class VkExtensionProperties(Structure):
    _fields_ = [("extensionName", c_char * _MAX_NAME), ("specVersion", c_uint32)]


class VkQueueFamilyProperties(Structure):
    _fields_ = [("queueFlags", VkFlags), ("queueCount", c_uint32),
                ("timestampValidBits", c_uint32), ("minImageTransferGranularity", c_uint32 * 3)]


class VkDeviceQueueCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("queueFamilyIndex", c_uint32), ("queueCount", c_uint32),
                ("pQueuePriorities", POINTER(c_float))]


class VkDeviceCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("queueCreateInfoCount", c_uint32),
                ("pQueueCreateInfos", POINTER(VkDeviceQueueCreateInfo)),
                ("enabledLayerCount", c_uint32), ("ppEnabledLayerNames", POINTER(c_char_p)),
                ("enabledExtensionCount", c_uint32), ("ppEnabledExtensionNames", POINTER(c_char_p)),
                ("pEnabledFeatures", c_void_p)]


class VkShaderModuleCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("codeSize", c_size_t), ("pCode", POINTER(c_uint32))]


class VkDescriptorSetLayoutBinding(Structure):
    _fields_ = [("binding", c_uint32), ("descriptorType", c_int32), ("descriptorCount", c_uint32),
                ("stageFlags", VkFlags), ("pImmutableSamplers", c_void_p)]


class VkDescriptorSetLayoutCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("bindingCount", c_uint32), ("pBindings", POINTER(VkDescriptorSetLayoutBinding))]


class VkPushConstantRange(Structure):
    _fields_ = [("stageFlags", VkFlags), ("offset", c_uint32), ("size", c_uint32)]


class VkPipelineLayoutCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("setLayoutCount", c_uint32), ("pSetLayouts", POINTER(VkHandle)),
                ("pushConstantRangeCount", c_uint32),
                ("pPushConstantRanges", POINTER(VkPushConstantRange))]


class VkSpecializationMapEntry(Structure):
    _fields_ = [("constantID", c_uint32), ("offset", c_uint32), ("size", c_size_t)]


class VkSpecializationInfo(Structure):
    _fields_ = [("mapEntryCount", c_uint32), ("pMapEntries", POINTER(VkSpecializationMapEntry)),
                ("dataSize", c_size_t), ("pData", c_void_p)]


class VkPipelineShaderStageRequiredSubgroupSizeCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p),
                ("requiredSubgroupSize", c_uint32)]


class VkPipelineShaderStageCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("stage", c_int32), ("module", VkHandle), ("pName", c_char_p),
                ("pSpecializationInfo", POINTER(VkSpecializationInfo))]


class VkComputePipelineCreateInfo(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("flags", VkFlags),
                ("stage", VkPipelineShaderStageCreateInfo), ("layout", VkHandle),
                ("basePipelineHandle", VkHandle), ("basePipelineIndex", c_int32)]


class VkPipelineInfoKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("pipeline", VkHandle)]


class VkPipelineExecutablePropertiesKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("stages", VkFlags),
                ("name", c_char * _MAX_NAME), ("description", c_char * _MAX_NAME),
                ("subgroupSize", c_uint32)]


class VkPipelineExecutableInfoKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p), ("pipeline", VkHandle),
                ("executableIndex", c_uint32)]


class VkPipelineExecutableStatisticValueKHR(Union):
    _fields_ = [("b32", VkBool32), ("i64", c_int64), ("u64", c_uint64), ("f64", c_double)]


class VkPipelineExecutableStatisticKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p),
                ("name", c_char * _MAX_NAME), ("description", c_char * _MAX_NAME),
                ("format", c_int32), ("value", VkPipelineExecutableStatisticValueKHR)]


class VkPipelineExecutableInternalRepresentationKHR(Structure):
    _fields_ = [("sType", VkStructureType), ("pNext", c_void_p),
                ("name", c_char * _MAX_NAME), ("description", c_char * _MAX_NAME),
                ("isText", VkBool32), ("dataSize", c_size_t), ("pData", c_void_p)]


def _stat_value(stat: VkPipelineExecutableStatisticKHR):
    """The statistic as a Python value, by its format (BOOL32, INT64, UINT64, FLOAT64)."""
    fmt, v = stat.format, stat.value
    if fmt == 0:
        return bool(v.b32)
    if fmt == 1:
        return int(v.i64)
    if fmt == 2:
        return int(v.u64)
    if fmt == 3:
        return float(v.f64)
    return None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


# --- results -----------------------------------------------------------------------------------


@dataclass
class Job:
    """One compute pipeline to compile.

    ``spec``: uint32 values of spec constants 0..n-1; ``bindings``: storage buffers 0..n-1 in set 0
    (None: read from the SPIR-V's set-0 decorations); ``subgroup_size``: a required subgroup size
    (VK_EXT_subgroup_size_control; the feature is enabled for the call); ``full_subgroups``:
    REQUIRE_FULL_SUBGROUPS; ``push_constant_bytes``: a compute push-constant range of that size.
    """
    name: str
    spirv: bytes
    spec: Sequence[int] = ()
    bindings: Optional[int] = None
    entry: str = "main"
    subgroup_size: Optional[int] = None
    full_subgroups: bool = False
    push_constant_bytes: int = 0

    @classmethod
    def of(cls, job) -> "Job":
        if isinstance(job, Job):
            return job
        if isinstance(job, dict):
            return cls(**job)
        return cls(*job)


@dataclass
class Executable:
    """One pipeline executable: its name, chosen subgroup size and statistics (name -> value)."""
    name: str
    description: str
    subgroup_size: int
    stages: int
    stats: dict = field(default_factory=dict)
    descriptions: dict = field(default_factory=dict)
    ir: dict = field(default_factory=dict)          # internal representations, when asked for
    wave32_units: bool = False      # RADV gfx10+: "Subgroups per SIMD" counts wave32 slots

    def __getitem__(self, stat: str):
        return self.stats[stat]

    def as_dict(self) -> dict:
        """Statistics plus ``name`` and ``subgroupSize`` in one flat dict."""
        return {"name": self.name, "subgroupSize": self.subgroup_size, **self.stats}

    @property
    def subgroups_per_simd_wave64(self) -> Optional[float]:
        """RADV's "Subgroups per SIMD" in wave64 waves (RADV counts wave32 slots on gfx10+)."""
        value = self.stats.get("Subgroups per SIMD")
        if value is None:
            return None
        return value / 2 if self.wave32_units else value


@dataclass
class JobResult:
    """The outcome of one job. ``result``: VK_SUCCESS, the failing VkResult's name, "not compiled"
    (refused before the driver saw it: bad SPIR-V size, a subgroup size the device lacks) or
    "process failed" (the family_stats child died on it: a driver crash); ``error`` says more."""
    name: str
    result: str = "VK_SUCCESS"
    error: str = ""
    executables: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result == "VK_SUCCESS" and not self.error

    @property
    def stats(self) -> dict:
        """The first executable's statistics (a compute pipeline has one executable)."""
        return self.executables[0].stats if self.executables else {}


@dataclass
class DeviceSupport:
    """What a physical device offers: extensions and the optional features of :data:`FEATURES`."""
    name: str
    api_version: str
    driver_version: int
    vendor_id: int
    device_id: int
    extensions: list
    features: dict                      # feature name -> supported
    subgroup_size_range: tuple = (0, 0)
    statistics: bool = False            # VK_KHR_pipeline_executable_properties usable


@dataclass
class CompileResult:
    """One :func:`compile_stats` call (one device): support, features enabled, job results."""
    device: Optional[DeviceSupport] = None
    enabled: list = field(default_factory=list)
    not_supported: list = field(default_factory=list)
    jobs: list = field(default_factory=list)
    available: bool = True
    reason: str = ""

    def __iter__(self):
        return iter(self.jobs)

    def __getitem__(self, name: str) -> JobResult:
        for job in self.jobs:
            if job.name == name:
                return job
        raise KeyError(name)


def _result_from_dict(d: dict) -> CompileResult:
    dev = d.get("device")
    jobs = [JobResult(**{**j, "executables": [Executable(**e) for e in j["executables"]]})
            for j in d.get("jobs", [])]
    return CompileResult(device=DeviceSupport(**{**dev, "subgroup_size_range": tuple(
        dev["subgroup_size_range"])}) if dev else None, enabled=d.get("enabled", []),
        not_supported=d.get("not_supported", []), jobs=jobs,
        available=d.get("available", True), reason=d.get("reason", ""))


# --- the Vulkan side ---------------------------------------------------------------------------


def _bind_device_api(lib: ctypes.CDLL) -> None:
    """argtypes for the instance/device-level core commands this module calls."""
    sigs = {
        "vkEnumerateDeviceExtensionProperties": (VkResult, [VkPhysicalDevice, c_char_p,
                                                            POINTER(c_uint32), c_void_p]),
        "vkGetPhysicalDeviceQueueFamilyProperties": (None, [VkPhysicalDevice, POINTER(c_uint32),
                                                            c_void_p]),
        "vkGetPhysicalDeviceFeatures2": (None, [VkPhysicalDevice, c_void_p]),
        "vkGetPhysicalDeviceProperties2": (None, [VkPhysicalDevice, c_void_p]),
        "vkCreateDevice": (VkResult, [VkPhysicalDevice, POINTER(VkDeviceCreateInfo), c_void_p,
                                      POINTER(VkDevice)]),
        "vkDestroyDevice": (None, [VkDevice, c_void_p]),
        "vkGetDeviceProcAddr": (c_void_p, [VkDevice, c_char_p]),
        "vkCreateShaderModule": (VkResult, [VkDevice, POINTER(VkShaderModuleCreateInfo), c_void_p,
                                            POINTER(VkHandle)]),
        "vkDestroyShaderModule": (None, [VkDevice, VkHandle, c_void_p]),
        "vkCreateDescriptorSetLayout": (VkResult, [VkDevice,
                                                   POINTER(VkDescriptorSetLayoutCreateInfo),
                                                   c_void_p, POINTER(VkHandle)]),
        "vkDestroyDescriptorSetLayout": (None, [VkDevice, VkHandle, c_void_p]),
        "vkCreatePipelineLayout": (VkResult, [VkDevice, POINTER(VkPipelineLayoutCreateInfo),
                                              c_void_p, POINTER(VkHandle)]),
        "vkDestroyPipelineLayout": (None, [VkDevice, VkHandle, c_void_p]),
        "vkCreateComputePipelines": (VkResult, [VkDevice, VkHandle, c_uint32,
                                                POINTER(VkComputePipelineCreateInfo), c_void_p,
                                                POINTER(VkHandle)]),
        "vkDestroyPipeline": (None, [VkDevice, VkHandle, c_void_p]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


_PFN_GetExecutableProperties = CFUNCTYPE(VkResult, VkDevice, POINTER(VkPipelineInfoKHR),
                                         POINTER(c_uint32), c_void_p)
_PFN_GetExecutableStatistics = CFUNCTYPE(VkResult, VkDevice, POINTER(VkPipelineExecutableInfoKHR),
                                         POINTER(c_uint32), c_void_p)
_PFN_GetExecutableInternalRepresentations = CFUNCTYPE(
    VkResult, VkDevice, POINTER(VkPipelineExecutableInfoKHR), POINTER(c_uint32), c_void_p)


def _enumerate(call, ctype, stype: Optional[int] = None) -> list:
    """The Vulkan two-call idiom: ``call(count_ptr, array_or_None)`` -> list of ``ctype``."""
    count = c_uint32(0)
    result = call(byref(count), None)
    if result not in (_VK_SUCCESS, _VK_INCOMPLETE):
        raise _VkError(result, "count query")
    items = (ctype * count.value)()
    for item in items if stype is not None else ():
        item.sType = stype
    if count.value:
        result = call(byref(count), items)
        if result not in (_VK_SUCCESS, _VK_INCOMPLETE):
            raise _VkError(result, "query")
    return list(items[: count.value])


class _VkError(Exception):
    def __init__(self, result: int, what: str):
        super().__init__(f"{what} failed with {_result_name(result)}")
        self.result = result


def _version_tuple(version: int) -> tuple[int, int]:
    return ((version >> 22) & 0x7F, (version >> 12) & 0x3FF)


class _Physical:
    """A physical device: properties, extensions and the feature chain it answers."""

    def __init__(self, lib: ctypes.CDLL, handle: c_void_p):
        self.lib, self.handle = lib, handle
        self.subgroup_control = VkPhysicalDeviceSubgroupSizeControlProperties(
            sType=_STYPE_SUBGROUP_SIZE_CONTROL_PROPERTIES)
        props2 = VkPhysicalDeviceProperties2(sType=_STYPE_PHYSICAL_DEVICE_PROPERTIES_2)
        lib.vkGetPhysicalDeviceProperties(handle, byref(props2.properties))
        self.props = props2.properties
        self.name = _text(self.props.deviceName)
        self.version = _version_tuple(self.props.apiVersion)
        self.extensions = sorted(_text(e.extensionName) for e in _enumerate(
            lambda n, arr: lib.vkEnumerateDeviceExtensionProperties(handle, None, n, arr),
            VkExtensionProperties))
        if self.version >= (1, 1):
            if self.version >= (1, 3) or "VK_EXT_subgroup_size_control" in self.extensions:
                props2.pNext = ctypes.cast(byref(self.subgroup_control), c_void_p)
            lib.vkGetPhysicalDeviceProperties2(handle, byref(props2))
        self.blocks = [b for b in _BLOCKS if b.extension in self.extensions
                       or (b.core is not None and self.version >= b.core)]
        self.supported = self._query_features()

    def feature_chain(self, blocks: Sequence[_Block], values: Optional[dict] = None):
        """(Features2, structs) with ``blocks`` chained behind it; fields set from ``values``."""
        structs = [b.struct(sType=b.stype) for b in blocks]
        head = VkPhysicalDeviceFeatures2(sType=_STYPE_PHYSICAL_DEVICE_FEATURES_2)
        prev = head
        for s in structs:
            prev.pNext = ctypes.cast(byref(s), c_void_p)
            prev = s
        if values is not None:
            for name, on in values.items():
                for s in [head.features] + structs:
                    if hasattr(s, name) and name not in ("sType", "pNext"):
                        setattr(s, name, int(bool(on)))
        return head, structs

    def _query_features(self) -> dict:
        if self.version < (1, 1):
            return {f: False for f in FEATURES + ("pipelineExecutableInfo",)}
        head, structs = self.feature_chain(self.blocks)
        self.lib.vkGetPhysicalDeviceFeatures2(self.handle, byref(head))
        found = {f: bool(getattr(head.features, f)) for f in _CORE_OPTIONAL}
        for s in structs:
            found.update((f, bool(getattr(s, f))) for f, _ in s._fields_[2:])
        return {f: found.get(f, False) for f in FEATURES + ("pipelineExecutableInfo",)}

    def support(self) -> DeviceSupport:
        features = {f: self.supported[f] for f in FEATURES}
        sg = self.subgroup_control
        return DeviceSupport(
            name=self.name, api_version=_format_version(self.props.apiVersion),
            driver_version=self.props.driverVersion, vendor_id=self.props.vendorID,
            device_id=self.props.deviceID, extensions=list(self.extensions), features=features,
            subgroup_size_range=(sg.minSubgroupSize, sg.maxSubgroupSize),
            statistics=self.supported["pipelineExecutableInfo"])

    def compute_queue_family(self) -> int:
        families = _enumerate(lambda n, arr: self.lib.vkGetPhysicalDeviceQueueFamilyProperties(
            self.handle, n, arr) or _VK_SUCCESS, VkQueueFamilyProperties)
        for i, fam in enumerate(families):
            if fam.queueFlags & _QUEUE_COMPUTE_BIT and fam.queueCount:
                return i
        return 0


class _Session:
    """One VkInstance + the matching physical device (+ a VkDevice once :meth:`open` ran)."""

    def __init__(self, device: str):
        self.stack = ExitStack()
        self.lib = _load_loader()
        try:
            _bind(self.lib)
            _bind_device_api(self.lib)
        except AttributeError as exc:
            raise VulkanUnavailableError(f"The Vulkan loader is incomplete ({exc})") from exc
        self.instance = _create_instance(self.lib, _API_1_3)
        self.stack.callback(self.lib.vkDestroyInstance, self.instance, None)
        try:
            names = []
            for handle in _enumerate_physical_devices(self.lib, self.instance):
                phys = _Physical(self.lib, handle)
                names.append(phys.name)
                if device.lower() in phys.name.lower():
                    self.phys = phys
                    break
            else:
                raise VulkanUnavailableError(
                    f"no Vulkan device whose name contains {device!r} (found: "
                    f"{', '.join(names) or 'none'}); for RADV without its GPU set RADV_FORCE_FAMILY "
                    "(Mesa < 26) or LD_PRELOAD=libamdgpu_noop_drm_shim.so AMDGPU_GPU_ID (Mesa "
                    "26) before Vulkan loads, or use family_stats()")
        except BaseException:
            self.stack.close()
            raise
        self.dev = VkDevice()
        self.enabled: list = []
        self.not_supported: list = []

    def open(self, features: Iterable[str], need_subgroup_control: bool) -> None:
        phys = self.phys
        wanted = _check_features(features)
        if need_subgroup_control and "subgroupSizeControl" not in wanted:
            wanted += ["subgroupSizeControl", "computeFullSubgroups"]
        self.enabled = [f for f in wanted if phys.supported[f]]
        self.not_supported = [f for f in wanted if not phys.supported[f]]
        on = set(self.enabled) | ({"pipelineExecutableInfo"}
                                  if phys.supported["pipelineExecutableInfo"] else set())
        # chain (and enable the extension of) only the blocks with a feature turned on
        blocks = [b for b in phys.blocks if on & {f for f, _ in b.struct._fields_[2:]}]
        head, structs = phys.feature_chain(blocks, {f: True for f in on})
        exts = [b.extension for b in blocks if b.extension in phys.extensions]
        ext_array = (c_char_p * max(1, len(exts)))(*[e.encode() for e in exts])
        priority = c_float(1.0)
        queue = VkDeviceQueueCreateInfo(sType=_STYPE_DEVICE_QUEUE_CREATE_INFO,
                                        queueFamilyIndex=phys.compute_queue_family(),
                                        queueCount=1, pQueuePriorities=ctypes.pointer(priority))
        info = VkDeviceCreateInfo(sType=_STYPE_DEVICE_CREATE_INFO,
                                  pNext=ctypes.cast(byref(head), c_void_p) if phys.version >= (1, 1)
                                  else None, queueCreateInfoCount=1,
                                  pQueueCreateInfos=ctypes.pointer(queue),
                                  enabledExtensionCount=len(exts), ppEnabledExtensionNames=ext_array)
        result = self.lib.vkCreateDevice(phys.handle, byref(info), None, byref(self.dev))
        if result != _VK_SUCCESS:
            raise VulkanUnavailableError(f"vkCreateDevice on {phys.name} failed with "
                                         f"{_result_name(result)} (extensions {exts})")
        self.stack.callback(self.lib.vkDestroyDevice, self.dev, None)
        self.statistics = phys.supported["pipelineExecutableInfo"]
        if self.statistics:
            self.get_props = self._device_fn("vkGetPipelineExecutablePropertiesKHR",
                                             _PFN_GetExecutableProperties)
            self.get_stats = self._device_fn("vkGetPipelineExecutableStatisticsKHR",
                                             _PFN_GetExecutableStatistics)
            self.get_ir = self._device_fn("vkGetPipelineExecutableInternalRepresentationsKHR",
                                          _PFN_GetExecutableInternalRepresentations)

    def _device_fn(self, name: str, proto):
        address = self.lib.vkGetDeviceProcAddr(self.dev, name.encode())
        if not address:
            raise VulkanUnavailableError(f"{self.phys.name} has no {name}")
        return proto(address)

    def close(self) -> None:
        self.stack.close()

    def compile(self, job: Job, ir: bool) -> JobResult:
        out = JobResult(name=job.name)
        try:
            with ExitStack() as objects:
                pipeline = self._pipeline(job, ir, objects)
                if self.statistics:
                    out.executables = self._executables(pipeline, ir)
                else:
                    out.error = (f"{self.phys.name} does not offer {_EXT_PIPELINE_EXECUTABLE}: "
                                 "compiled, but no statistics")
        except _VkError as exc:
            out.result, out.error = _result_name(exc.result), str(exc)
        except ValueError as exc:
            out.result, out.error = "not compiled", str(exc)
        return out

    def _create(self, fn, info) -> int:
        handle = VkHandle(0)
        result = fn(self.dev, byref(info), None, byref(handle))
        if result != _VK_SUCCESS:
            raise _VkError(result, fn.__name__)
        return handle.value

    def _pipeline(self, job: Job, ir: bool, objects: ExitStack) -> int:
        lib, dev = self.lib, self.dev
        if job.subgroup_size or job.full_subgroups:
            self._check_subgroup_request(job)
        code = bytes(job.spirv)
        if len(code) % 4 or len(code) < 20:
            raise ValueError(f"SPIR-V of {len(code)} bytes is not a whole number of words")
        words = (c_uint32 * (len(code) // 4)).from_buffer_copy(code)
        module = self._create(lib.vkCreateShaderModule, VkShaderModuleCreateInfo(
            sType=_STYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code),
            pCode=ctypes.cast(words, POINTER(c_uint32))))
        objects.callback(lib.vkDestroyShaderModule, dev, module, None)

        n = spirv_bindings(code) if job.bindings is None else int(job.bindings)
        binds = (VkDescriptorSetLayoutBinding * max(1, n))(*[
            VkDescriptorSetLayoutBinding(binding=i, descriptorType=_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                         descriptorCount=1, stageFlags=_SHADER_STAGE_COMPUTE_BIT)
            for i in range(n)])
        set_layout = self._create(lib.vkCreateDescriptorSetLayout,
                                  VkDescriptorSetLayoutCreateInfo(
                                      sType=_STYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                                      bindingCount=n, pBindings=binds))
        objects.callback(lib.vkDestroyDescriptorSetLayout, dev, set_layout, None)

        set_layouts = (VkHandle * 1)(set_layout)
        push = VkPushConstantRange(stageFlags=_SHADER_STAGE_COMPUTE_BIT,
                                   size=int(job.push_constant_bytes))
        layout = self._create(lib.vkCreatePipelineLayout, VkPipelineLayoutCreateInfo(
            sType=_STYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=set_layouts,
            pushConstantRangeCount=1 if job.push_constant_bytes else 0,
            pPushConstantRanges=ctypes.pointer(push)))
        objects.callback(lib.vkDestroyPipelineLayout, dev, layout, None)

        spec = [int(v) for v in job.spec]
        if any(not 0 <= v < 2 ** 32 for v in spec):
            raise ValueError(f"spec constants must be uint32: {spec}")
        data = (c_uint32 * max(1, len(spec)))(*spec)
        entries = (VkSpecializationMapEntry * max(1, len(spec)))(*[
            VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(spec))])
        spec_info = VkSpecializationInfo(mapEntryCount=len(spec), pMapEntries=entries,
                                         dataSize=4 * len(spec),
                                         pData=ctypes.cast(data, c_void_p))
        required = VkPipelineShaderStageRequiredSubgroupSizeCreateInfo(
            sType=_STYPE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO,
            requiredSubgroupSize=int(job.subgroup_size or 0))
        entry = job.entry.encode()
        stage = VkPipelineShaderStageCreateInfo(
            sType=_STYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
            pNext=ctypes.cast(byref(required), c_void_p) if job.subgroup_size else None,
            flags=_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS if job.full_subgroups else 0,
            stage=_SHADER_STAGE_COMPUTE_BIT, module=module, pName=entry,
            pSpecializationInfo=ctypes.pointer(spec_info) if spec else None)
        flags = _PIPELINE_CREATE_CAPTURE_STATISTICS if self.statistics else 0
        if ir and self.statistics:
            flags |= _PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS
        info = VkComputePipelineCreateInfo(sType=_STYPE_COMPUTE_PIPELINE_CREATE_INFO, flags=flags,
                                           stage=stage, layout=layout, basePipelineIndex=-1)
        pipeline = VkHandle(0)
        result = lib.vkCreateComputePipelines(dev, 0, 1, byref(info), None, byref(pipeline))
        if pipeline.value:
            objects.callback(lib.vkDestroyPipeline, dev, pipeline.value, None)
        if result != _VK_SUCCESS:
            raise _VkError(result, "vkCreateComputePipelines")
        return pipeline.value

    def _check_subgroup_request(self, job: Job) -> None:
        """Refuse (as invalid usage) what would reach the compiler unchecked: ACO aborts on a
        wave32 request on gfx9, for one."""
        control = self.phys.subgroup_control
        feature = "subgroupSizeControl" if job.subgroup_size else "computeFullSubgroups"
        if feature not in self.enabled:
            raise ValueError(f"{self.phys.name} does not support {feature}")
        size = job.subgroup_size
        if size and not (control.requiredSubgroupSizeStages & _SHADER_STAGE_COMPUTE_BIT
                         and control.minSubgroupSize <= size <= control.maxSubgroupSize
                         and size & (size - 1) == 0):
            raise ValueError(f"required subgroup size {size} is not offered for compute by "
                             f"{self.phys.name} ({control.minSubgroupSize}.."
                             f"{control.maxSubgroupSize})")

    def _executables(self, pipeline: int, ir: bool) -> list:
        dev = self.dev
        pinfo = VkPipelineInfoKHR(sType=_STYPE_PIPELINE_INFO, pipeline=pipeline)
        wave32_units = self._radv_gfx10_plus()
        found = []
        for index, prop in enumerate(_enumerate(
                lambda n, arr: self.get_props(dev, byref(pinfo), n, arr),
                VkPipelineExecutablePropertiesKHR, _STYPE_PIPELINE_EXECUTABLE_PROPERTIES)):
            einfo = VkPipelineExecutableInfoKHR(sType=_STYPE_PIPELINE_EXECUTABLE_INFO,
                                                pipeline=pipeline, executableIndex=index)
            exe = Executable(name=_text(prop.name), description=_text(prop.description),
                             subgroup_size=prop.subgroupSize, stages=prop.stages,
                             wave32_units=wave32_units)
            for stat in _enumerate(lambda n, arr: self.get_stats(dev, byref(einfo), n, arr),
                                   VkPipelineExecutableStatisticKHR,
                                   _STYPE_PIPELINE_EXECUTABLE_STATISTIC):
                exe.stats[_text(stat.name)] = _stat_value(stat)
                exe.descriptions[_text(stat.name)] = _text(stat.description)
            if ir:
                exe.ir = self._representations(einfo)
            found.append(exe)
        return found

    def _representations(self, einfo) -> dict:
        call = lambda n, arr: self.get_ir(self.dev, byref(einfo), n, arr)  # noqa: E731
        reps = _enumerate(call, VkPipelineExecutableInternalRepresentationKHR,
                          _STYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION)
        buffers = [ctypes.create_string_buffer(r.dataSize) for r in reps]
        for rep, buf in zip(reps, buffers):
            rep.pData = ctypes.cast(buf, c_void_p)
        array = (VkPipelineExecutableInternalRepresentationKHR * len(reps))(*reps)
        count = c_uint32(len(reps))
        if reps:
            call(byref(count), array)
        return {_text(r.name): (_text(buf.raw.rstrip(b"\0")) if r.isText else
                                base64.b64encode(buf.raw).decode())
                for r, buf in zip(array, buffers)}

    def _radv_gfx10_plus(self) -> bool:
        """True where RADV reports "Subgroups per SIMD" in wave32 slots (gfx10 and later)."""
        if self.phys.props.vendorID != 0x1002 or "RADV" not in self.phys.name.upper():
            return False
        # gfx10+ is where RADV offers wave32 (gfx8/9: wave64 only), whatever the product name
        # (the null hardware's "NAVI21", the drm-shim's "RX 7900 XTX (RADV NAVI31)", "PHOENIX")
        return self.phys.subgroup_control.minSubgroupSize == 32


def _check_features(features: Iterable[str]) -> list:
    wanted = list(dict.fromkeys(features))
    unknown = [f for f in wanted if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; known: {', '.join(FEATURES)}")
    return wanted


def _iter_compile(jobs, device: str, features: Iterable[str], ir: bool) -> Iterator[tuple]:
    """("device", CompileResult-without-jobs) then ("job", JobResult) per job, in order."""
    jobs = [Job.of(j) for j in jobs]
    session = _Session(device)
    try:
        session.open(features, any(j.subgroup_size or j.full_subgroups for j in jobs))
        yield "device", CompileResult(device=session.phys.support(), enabled=session.enabled,
                                      not_supported=session.not_supported)
        for job in jobs:
            yield "job", session.compile(job, ir)
    finally:
        session.close()


def compile_stats(jobs, device: str = NULL_DEVICE, features: Iterable[str] = (),
                  ir: bool = False) -> CompileResult:
    """Compile ``jobs`` on the first Vulkan device whose name contains ``device`` (any case).

    One VkInstance and VkDevice serve all jobs; each job's shader module, layouts and pipeline are
    destroyed after its statistics are read. Returns a :class:`CompileResult`: ``.jobs`` holds one
    :class:`JobResult` per job, in order (a job that fails to compile carries its VkResult),
    ``.enabled`` / ``.not_supported`` the requested features. ``ir=True`` also captures each
    executable's internal representations (RADV: NIR, ACO IR, disassembly). Raises
    VulkanUnavailableError when no such device exists -- in this process, RADV's null device only
    appears if RADV_FORCE_FAMILY was set before Vulkan loaded (see :func:`family_stats`).
    """
    run = None
    for kind, item in _iter_compile(jobs, device, features, ir):
        if kind == "device":
            run = item
        else:
            run.jobs.append(item)
    return run


def device_support(device: str = NULL_DEVICE) -> DeviceSupport:
    """Extensions and optional-feature support of the first device whose name contains ``device``."""
    session = _Session(device)
    try:
        return session.phys.support()
    finally:
        session.close()


# --- one process per family --------------------------------------------------------------------

_MARK = "@vkattn-stats "
# inherited variables that would change what the child loads or how RADV compiles
_DROPPED_ENV = ("VK_INSTANCE_LAYERS", "VK_LOADER_LAYERS_ENABLE", "VK_ICD_FILENAMES",
                "VK_DRIVER_FILES", "VK_ADD_DRIVER_FILES", "VK_LOADER_DRIVERS_SELECT",
                "VK_LOADER_DRIVERS_DISABLE", "RADV_FORCE_FAMILY", "AMDGPU_GPU_ID", "RADV_DEBUG",
                "RADV_PERFTEST", "ACO_DEBUG", "MESA_VK_DEVICE_SELECT", "NOUVEAU_CHIPSET",
                "MESA_LOADER_DRIVER_OVERRIDE", "NAK_DEBUG", "NVK_DEBUG")

FORCE_FAMILY, DRM_SHIM, NOUVEAU_SHIM = "force-family", "drm-shim", "nouveau-shim"
#: nouveau's drm-shim (Debian 13: mesa-drm-shim): NVK compiling with NAK for an NVIDIA chip that
#: is not there (``MESA_LOADER_DRIVER_OVERRIDE=nouveau NOUVEAU_CHIPSET=<hex id>``), :func:`nvk_mechanism`
NOUVEAU_SHIM_LIBRARY = "libnouveau_noop_drm_shim.so"
#: NVIDIA chips by name -> NOUVEAU_CHIPSET (hex, as the shim reads it). Mesa 26.1's shim gives an
#: NVK device for Turing (TU1xx) and Ampere (GA10x) only: Ada (19x), Hopper (180) and Blackwell
#: (1a0+) give none (measured: NOUVEAU_CHIPSET=180, 192, 194, 1a2 enumerate no NVK device)
NVK_CHIPSETS = {"tu102": "162", "tu104": "164", "tu106": "166", "ga100": "170", "ga102": "172",
                "ga104": "174", "ga106": "176", "ga107": "177"}
#: what ``perf nvk`` compiles for: the datacenter Ampere (A100, the H100's predecessor: 164 KiB of
#: shared memory per SM, 64 warps) and the consumer one (RTX 3090: 100 KiB, 48 warps), and Turing
NVK_FAMILIES = ("ga100", "ga102", "tu102")
#: AMDGPU's drm-shim library (Debian: mesa-drm-shim): RADV on a fake amdgpu device
DRM_SHIM_LIBRARY = "libamdgpu_noop_drm_shim.so"
#: the first Mesa without RADV_FORCE_FAMILY ("removed. Please use AMDGPU drm-shim now.")
_MESA_WITHOUT_FORCE_FAMILY = (26, 0)
#: RDNA3 chips have two names: Mesa 22.3's RADV_FORCE_FAMILY takes the gfx name (gfx1100), Mesa
#: 25's the code name (navi31), as does the drm-shim's AMDGPU_GPU_ID; either spelling is accepted
#: and the one the installed Mesa knows is used (NullMechanism.spellings)
_GFX_NAME = {"navi31": "gfx1100", "navi32": "gfx1101", "navi33": "gfx1102"}
_CODE_NAME = {v: k for k, v in _GFX_NAME.items()}


def canonical_family(family: str) -> str:
    """One spelling per chip (RDNA3's gfx names: navi31 -> gfx1100), to compare family names."""
    family = family.lower()
    return _GFX_NAME.get(family, family)


def radeon_icd(prefix: str = "radeon_icd") -> Optional[str]:
    """Path of RADV's ICD manifest (radeon_icd.<arch>.json, or radeon_icd.json as in Mesa 26),
    or None where RADV is not installed. A RADV manifest named in VK_DRIVER_FILES /
    VK_ICD_FILENAMES comes first (a private Mesa, e.g. scripts/mesa25.sh's). ``prefix``: another
    driver's manifest the same way (``"nouveau_icd"``: NVK's)."""
    for var in ("VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        named = [p for p in os.environ.get(var, "").split(os.pathsep)
                 if os.path.basename(p).startswith(prefix) and os.path.isfile(p)]
        if named:
            return named[0]
    dirs = [d for d in os.environ.get("XDG_DATA_DIRS", "/usr/local/share:/usr/share").split(":")
            if d] + ["/usr/share", "/usr/local/share"]
    found = []
    for base in [os.path.join(d, "vulkan", "icd.d") for d in dirs] + ["/etc/vulkan/icd.d"]:
        found += sorted(glob.glob(os.path.join(base, prefix + "*.json")))
    machine = platform.machine()
    found.sort(key=lambda p: machine not in os.path.basename(p))
    return found[0] if found else None


def _library_dirs() -> list:
    """Where the dynamic loader looks for a bare library name (LD_LIBRARY_PATH, then the system's
    multiarch and plain lib directories)."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += sorted(glob.glob("/usr/lib/*-linux-gnu")) + sorted(glob.glob("/lib/*-linux-gnu"))
    dirs += ["/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib64", "/lib"]
    machine = platform.machine()
    return sorted(dict.fromkeys(dirs), key=lambda d: "-linux-gnu" in d and machine not in d)


def radv_library(icd: Optional[str] = None) -> Optional[str]:
    """The RADV driver library the manifest ``icd`` (default :func:`radeon_icd`) names, resolved
    as the loader would; None where it cannot be found."""
    icd = icd or radeon_icd()
    if icd is None:
        return None
    try:
        with open(icd) as f:
            lib = json.load(f)["ICD"]["library_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if os.path.isabs(lib):
        cands = [lib]
    elif "/" in lib:
        cands = [os.path.join(os.path.dirname(icd), lib)]
    else:
        cands = [os.path.join(d, lib) for d in _library_dirs()]
    return next((c for c in cands if os.path.isfile(c)), None)


_MESA_VERSION = re.compile(rb"Mesa (\d+)\.(\d+)\.(\d+)")
_version_cache: dict = {}


def mesa_version(library: Optional[str]) -> Optional[tuple]:
    """(major, minor, patch) of the Mesa a driver library was built from: the version string every
    Mesa driver carries (its ``driverInfo``, e.g. "Mesa 26.1.6-1~bpo13+1"), read from the file
    without loading it. None where the file has none."""
    if not library:
        return None
    try:
        st = os.stat(library)
    except OSError:
        return None
    key = (os.path.realpath(library), st.st_size, st.st_mtime_ns)
    if key not in _version_cache:
        found = None
        try:
            with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                m = _MESA_VERSION.search(mm)
                found = tuple(int(g) for g in m.groups()) if m else None
        except (OSError, ValueError):
            pass
        _version_cache[key] = found
    return _version_cache[key]


def drm_shim_library(near: Optional[str] = None, name: str = DRM_SHIM_LIBRARY) -> Optional[str]:
    """AMDGPU's drm-shim (:data:`DRM_SHIM_LIBRARY`; ``name``: another shim, e.g.
    :data:`NOUVEAU_SHIM_LIBRARY`): ``$VKATTN_DRM_SHIM`` if set (AMDGPU's only), else beside the
    driver library ``near``, else in the system's library directories; None where absent."""
    env = os.environ.get("VKATTN_DRM_SHIM") if name == DRM_SHIM_LIBRARY else None
    if env:
        return env if os.path.isfile(env) else None
    dirs = ([os.path.dirname(near)] if near else []) + _library_dirs()
    return next((os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))), None)


@dataclass(frozen=True)
class NullMechanism:
    """How a child process gets RADV compiling for a family without its GPU.

    ``kind``: :data:`FORCE_FAMILY` (``RADV_FORCE_FAMILY=<gfx name>``: Mesa up to 25, a device named
    "Null hardware (RADV ...)"), :data:`DRM_SHIM` (``LD_PRELOAD=<shim> AMDGPU_GPU_ID=<code name>``:
    Mesa 26, which removed RADV_FORCE_FAMILY; the device is named as the product, e.g. "AMD Radeon
    RX 7900 XTX (RADV NAVI31)") or None (no AMD compiler reachable: ``reason`` says why).
    ``mesa``: RADV's version read from its library; ``icd``: its manifest; ``shim``: the library.
    """
    kind: Optional[str]
    icd: Optional[str] = None
    mesa: Optional[tuple] = None
    shim: Optional[str] = None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.kind is not None

    @property
    def device_match(self) -> str:
        """What the child's device name contains (the loader sees the driver's manifest alone)."""
        return NULL_DEVICE if self.kind == FORCE_FAMILY else "NVK" if self.kind == NOUVEAU_SHIM else "RADV"

    def spellings(self, family: str) -> list:
        """The names to try for ``family``, in order: as given, then its other spelling (RADV_FORCE_FAMILY:
        22.3 knows gfx1100, 25 navi31); the drm-shim knows code names only, so those first."""
        family = family.lower()
        if self.kind == NOUVEAU_SHIM:
            return [family]
        other = _GFX_NAME.get(family) or _CODE_NAME.get(family)
        names = [family] + ([other] if other else [])
        if self.kind == DRM_SHIM:
            names.sort(key=lambda n: n not in _GFX_NAME)
        return names

    def family_id(self, family: str) -> str:
        """``family`` as this mechanism spells it (the spelling the installed Mesa accepted where
        :func:`family_stats` has tried, else the first of :meth:`spellings`)."""
        return _spelled.get((self, family.lower())) or self.spellings(family)[0]

    def env(self, family: str) -> dict:
        """The variables that make RADV's device ``family`` (set before the loader loads)."""
        if self.kind == FORCE_FAMILY:
            return {"RADV_FORCE_FAMILY": self.family_id(family)}
        if self.kind == DRM_SHIM:
            pre = [p for p in os.environ.get("LD_PRELOAD", "").split() if p != self.shim]
            return {"LD_PRELOAD": " ".join([self.shim] + pre), "AMDGPU_GPU_ID": self.family_id(family)}
        if self.kind == NOUVEAU_SHIM:
            chip = NVK_CHIPSETS.get(family.lower(), family.lower())
            if not re.fullmatch(r"[0-9a-f]{3}", chip):
                raise ValueError(f"NVIDIA chip {family!r}: name one of {', '.join(NVK_CHIPSETS)} or a "
                                 "3-digit hex NOUVEAU_CHIPSET")
            pre = [p for p in os.environ.get("LD_PRELOAD", "").split() if p != self.shim]
            return {"LD_PRELOAD": " ".join([self.shim] + pre), "MESA_LOADER_DRIVER_OVERRIDE": "nouveau",
                    "NOUVEAU_CHIPSET": chip}
        raise RuntimeError(f"no GPU compiler is reachable: {self.reason}")

    def describe(self) -> str:
        mesa = "Mesa " + ".".join(map(str, self.mesa)) if self.mesa else "Mesa (version unknown)"
        if self.kind == FORCE_FAMILY:
            return f"RADV/ACO of {mesa}, RADV_FORCE_FAMILY (null hardware)"
        if self.kind == DRM_SHIM:
            return f"RADV/ACO of {mesa}, AMDGPU drm-shim ({self.shim})"
        if self.kind == NOUVEAU_SHIM:
            return f"NVK/NAK of {mesa}, nouveau drm-shim ({self.shim})"
        return f"no GPU compiler: {self.reason}"


_MECHANISMS = (FORCE_FAMILY, DRM_SHIM)
_spelled: dict = {}     # (mechanism, family) -> the spelling the installed Mesa accepted


def _spell(mechanism: "NullMechanism", family: str, works) -> bool:
    """Try :meth:`NullMechanism.spellings` of ``family`` with ``works(spelling)`` (True: a device
    appeared) and remember the first that works; False where none does."""
    key = (mechanism, family.lower())
    if key in _spelled:
        return True
    for name in mechanism.spellings(family):
        _spelled[key] = name
        if works(name):
            return True
        del _spelled[key]
    return False


def null_mechanism(icd: Optional[str] = None) -> NullMechanism:
    """Which mechanism gives RADV devices here: RADV_FORCE_FAMILY on a Mesa before 26,
    AMDGPU's drm-shim on Mesa 26 (or where the version cannot be read and the shim is installed).
    ``VKATTN_RADV_NULL=force-family|drm-shim`` chooses instead (to compare them on Mesa 25)."""
    icd = icd or radeon_icd()
    if icd is None:
        return NullMechanism(None, reason="RADV is not installed (no radeon_icd*.json under "
                             "*/vulkan/icd.d; Debian: apt-get install mesa-vulkan-drivers)")
    lib = radv_library(icd)
    mesa = mesa_version(lib)
    shim = drm_shim_library(lib)
    want = os.environ.get("VKATTN_RADV_NULL", "").strip()
    if want and want not in _MECHANISMS:
        raise ValueError(f"VKATTN_RADV_NULL={want!r}: choose one of {', '.join(_MECHANISMS)}")
    no_shim = (f"AMDGPU's drm-shim ({DRM_SHIM_LIBRARY}) is not installed (Debian: apt-get install "
               "mesa-drm-shim; or point VKATTN_DRM_SHIM at it)")
    if want == DRM_SHIM or (not want and (mesa is None or mesa >= _MESA_WITHOUT_FORCE_FAMILY)
                            and shim):
        if shim is None:
            return NullMechanism(None, icd, mesa, None, no_shim)
        return NullMechanism(DRM_SHIM, icd, mesa, shim)
    if want != FORCE_FAMILY and mesa is not None and mesa >= _MESA_WITHOUT_FORCE_FAMILY:
        return NullMechanism(None, icd, mesa, None, f"Mesa {mesa[0]}.{mesa[1]} removed "
                             f"RADV_FORCE_FAMILY and {no_shim}")
    return NullMechanism(FORCE_FAMILY, icd, mesa, shim)


def nvk_mechanism() -> NullMechanism:
    """NVK (Mesa's NVIDIA driver, compiler NAK) on nouveau's drm-shim, where both are installed
    (Debian 13 with trixie-backports' Mesa 26: mesa-vulkan-drivers and mesa-drm-shim): a child
    process with :meth:`NullMechanism.env` sees a device named "NVK" that compiles for the chip
    ``NOUVEAU_CHIPSET`` names and answers VK_KHR_pipeline_executable_properties (NAK's GPRs,
    warps per SM, spills, instruction and static cycle counts). Families: :data:`NVK_CHIPSETS`."""
    icd = radeon_icd("nouveau_icd")
    if icd is None:
        return NullMechanism(None, reason="NVK is not installed (no nouveau_icd*.json under "
                             "*/vulkan/icd.d; Debian 13: apt-get install mesa-vulkan-drivers)")
    lib = radv_library(icd)
    shim = drm_shim_library(lib, NOUVEAU_SHIM_LIBRARY)
    if shim is None:
        return NullMechanism(None, icd, mesa_version(lib), None,
                             f"nouveau's drm-shim ({NOUVEAU_SHIM_LIBRARY}) is not installed "
                             "(Debian 13: apt-get install mesa-drm-shim)")
    return NullMechanism(NOUVEAU_SHIM, icd, mesa_version(lib), shim)


def default_families(mechanism: Optional[NullMechanism] = None) -> tuple:
    """:data:`DEFAULT_FAMILIES` for RADV_FORCE_FAMILY; :data:`SHIM_FAMILIES` for the drm-shim;
    :data:`NVK_FAMILIES` for nouveau's."""
    mechanism = mechanism or null_mechanism()
    if mechanism.kind == NOUVEAU_SHIM:
        return NVK_FAMILIES
    return SHIM_FAMILIES if mechanism.kind == DRM_SHIM else DEFAULT_FAMILIES


def _child_env(family: str, mechanism: NullMechanism, env: Optional[dict]) -> dict:
    child = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    child.update({
        "VK_DRIVER_FILES": mechanism.icd,              # loader >= 1.3.207
        "VK_ICD_FILENAMES": mechanism.icd,             # older loaders
        "VK_LOADER_LAYERS_DISABLE": "~all~",  # no implicit layers (device-select, overlays)
        "NODEVICE_SELECT": "1",              # Mesa's device-select layer, on loaders without ^
    })
    child.update(mechanism.env(family))
    child.update(env or {})
    return child


def _job_payload(job: Job) -> dict:
    d = asdict(job)
    d["spirv"] = base64.b64encode(bytes(job.spirv)).decode()
    d["spec"] = [int(v) for v in job.spec]
    return d


def _child_main() -> int:
    """Subprocess side of :func:`family_stats`: request on stdin, marked JSON lines on stdout."""
    request = json.load(sys.stdin)
    jobs = [Job(**{**j, "spirv": base64.b64decode(j["spirv"])}) for j in request["jobs"]]
    out = sys.stdout

    def emit(kind, payload) -> None:
        out.write(_MARK + json.dumps({kind: payload}) + "\n")
        out.flush()

    try:
        for kind, item in _iter_compile(jobs, request["device"], request["features"],
                                        request["ir"]):
            emit(kind, asdict(item))
    except VulkanUnavailableError as exc:
        emit("unavailable", str(exc))
    return 0


def _run_child(family: str, jobs: list, features, ir: bool, mechanism: NullMechanism, env,
               timeout: float):
    """One subprocess; returns (header CompileResult or None, [JobResult], failure text)."""
    request = json.dumps({"jobs": [_job_payload(j) for j in jobs], "device": mechanism.device_match,
                          "features": list(features), "ir": ir})
    # -I -S: no user site, no site-packages: the child runs this file as a script and needs the
    # stdlib and _vkinfo only (the package __init__, which imports kp and numpy, is bypassed)
    cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--child"]
    try:
        proc = subprocess.run(cmd, input=request, capture_output=True, text=True,
                              env=_child_env(family, mechanism, env), timeout=timeout)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, code = f"timed out after {timeout:g} s", None
    header, results, unavailable = None, [], None
    for line in stdout.splitlines():
        if not line.startswith(_MARK):
            continue
        (kind, payload), = json.loads(line[len(_MARK):]).items()
        if kind == "device":
            header = _result_from_dict(payload)
        elif kind == "job":
            results.append(_result_from_dict({"jobs": [payload]}).jobs[0])
        else:
            unavailable = payload
    failure = ""
    if code != 0:
        how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit status {code}" if code is not None else "timeout")
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        failure = f"child process ended with {how}" + (f": {tail}" if tail else "")
    elif unavailable:
        failure = unavailable
    return header, results, failure


def family_stats(families: Iterable[str], jobs, features: Iterable[str] = (), ir: bool = False,
                 env: Optional[dict] = None, timeout: float = 300.0,
                 mechanism: Optional[NullMechanism] = None) -> dict:
    """{family: CompileResult}: ``jobs`` compiled on RADV's null device for each family.

    Each family runs in a fresh ``python -I -S`` process with ``RADV_FORCE_FAMILY=<family>``, the
    loader pointed at RADV's ICD alone (VK_DRIVER_FILES / VK_ICD_FILENAMES: faster, and no
    lavapipe), and all layers off (VK_INSTANCE_LAYERS / VK_LOADER_LAYERS_ENABLE are not inherited,
    VK_LOADER_LAYERS_DISABLE=~all~), so a validation layer switched on for the test suite does
    not ride along. No RADV_DEBUG is needed; inherited RADV_DEBUG / RADV_PERFTEST / ACO_DEBUG are
    dropped so that results do not depend on the caller's shell (RADV_DEBUG=llvm would swap ACO
    for LLVM, RADV_PERFTEST=cswave32 the wave size): pass them in ``env`` to study them, e.g.
    ``env={"RADV_PERFTEST": "cswave32"}``. The driver's on-disk shader cache is left as it is
    (entries are keyed by the driver build, family and the statistics flag).

    A family the installed Mesa does not know (22.3 aborts while enumerating) or a missing RADV
    gives ``CompileResult(available=False, reason=...)``. A job that crashes the driver is
    reported as failed and the remaining jobs are compiled in a new process.
    """
    jobs = [Job.of(j) for j in jobs]
    features = _check_features(features)
    mechanism = mechanism or null_mechanism()
    out = {}
    for family in families:
        if not mechanism.available:
            out[family] = CompileResult(available=False, reason=mechanism.reason)
            continue
        run, todo = None, list(jobs)
        tried = []

        def attempt(_name):       # the first child, under each spelling until a device appears
            tried.append(_run_child(family, todo, features, ir, mechanism, env, timeout))
            return tried[-1][0] is not None

        if not _spell(mechanism, family, attempt):
            failure = tried[-1][2] if tried else ""
            out[family] = CompileResult(available=False, reason=failure or "no device appeared")
            continue
        pending = tried[-1] if tried else None
        while True:
            header, results, failure = pending or _run_child(family, todo, features, ir, mechanism,
                                                             env, timeout)
            pending = None
            if header is None:      # no device: unknown family, no RADV, or a broken driver
                out[family] = run or CompileResult(available=False, reason=failure or
                                                   "no null device appeared")
                if run is not None:     # a restart after a crash found no device: give up
                    run.jobs += [JobResult(name=j.name, result="not compiled", error=failure)
                                 for j in todo]
                break
            if run is None:
                run = header
            run.jobs += results
            todo = todo[len(results):]
            if not todo:
                out[family] = run
                break
            crashed = todo.pop(0)
            run.jobs.append(JobResult(name=crashed.name, result="process failed",
                                      error=failure or "the child process stopped"))
            if not todo:
                out[family] = run
                break
    return out


_family_cache: dict = {}


def family_device_info(family: str, env: Optional[dict] = None, timeout: float = 60.0,
                       mechanism: Optional[NullMechanism] = None):
    """The DeviceInfo (vkattn._vkinfo) of RADV's device for ``family`` without its GPU, read in a
    child process with the environment of :func:`family_stats`; None where RADV or the family is
    absent. What ``perf gpu`` plans pipelines against (limits, subgroup size and operations)."""
    mechanism = mechanism or null_mechanism()
    if not mechanism.available:
        return None
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_vkinfo.py")
    found = []

    def probe(_name) -> bool:
        try:
            proc = subprocess.run([sys.executable, "-I", "-S", script, "--json"], capture_output=True,
                                  text=True, timeout=timeout, env=_child_env(family, mechanism, env))
            devices = json.loads(proc.stdout or "null")
        except (subprocess.TimeoutExpired, ValueError):
            return False
        found[:] = [d for d in devices if mechanism.device_match.lower() in d["name"].lower()] \
            if isinstance(devices, list) else []
        return bool(found)

    if not _spell(mechanism, family, probe) or (not found and not probe(None)):
        return None
    d = found[0]
    return DeviceInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def available_families(candidates: Optional[Iterable[str]] = None, refresh: bool = False,
                       mechanism: Optional[NullMechanism] = None) -> list:
    """The candidate families (default :func:`default_families`) for which the installed RADV
    creates a device without the GPU (probed once per family, manifest and mechanism)."""
    mechanism = mechanism or null_mechanism()
    found = []
    for family in default_families(mechanism) if candidates is None else candidates:
        key = (family.lower(), mechanism)
        if refresh or key not in _family_cache:
            _family_cache[key] = family_stats([family], [], mechanism=mechanism)[family].available
        if _family_cache[key]:
            found.append(family)
    return found


# --- SPIR-V and presentation -------------------------------------------------------------------

_OP_DECORATE, _DECORATION_BINDING, _DECORATION_SET = 71, 33, 34


def spirv_bindings(spirv: bytes, descriptor_set: int = 0) -> int:
    """1 + the highest binding decorated in ``descriptor_set`` (0 if none)."""
    words = memoryview(bytes(spirv)).cast("I")
    if len(words) < 5 or words[0] != 0x07230203:
        raise ValueError("not SPIR-V (bad magic number)")
    sets, binds = {}, {}
    i = 5
    while i < len(words):
        count, opcode = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise ValueError("malformed SPIR-V (zero-length instruction)")
        if opcode == _OP_DECORATE and count >= 4:
            target, decoration, value = words[i + 1], words[i + 2], words[i + 3]
            if decoration == _DECORATION_BINDING:
                binds[target] = value
            elif decoration == _DECORATION_SET:
                sets[target] = value
        i += count
    used = [b for t, b in binds.items() if sets.get(t, 0) == descriptor_set]
    return max(used) + 1 if used else 0


# --- RADV 22.3's occupancy rule, for budgeting kernels --------------------------------------------

_GFX_LEVELS = {
    (8, 0): "tonga iceland carrizo fiji stoney polaris10 polaris11 polaris12 vegam",
    (9, 0): "vega10 vega12 vega20 raven raven2 renoir arcturus aldebaran",
    (10, 1): "navi10 navi12 navi14",
    (10, 3): "navi21 navi22 vangogh navi23 navi24 rembrandt gfx1036",
    (11, 0): "gfx1100 gfx1101 gfx1102 gfx1103_r1 gfx1103_r2",
    (12, 0): "gfx1201",
}
_FAMILY_GFX = {fam: gfx for gfx, names in _GFX_LEVELS.items() for fam in names.split()}


def _align(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def radv_waves_per_simd(family: str, vgprs: int, lds_bytes: int = 0, workgroup_size: int = 64,
                        wave_size: int = 64, sgprs: int = 0,
                        mesa: tuple = (22, 3)) -> tuple[int, dict]:
    """RADV's "Subgroups per SIMD" of a compute shader, computed (see the module docstring).

    ``vgprs``/``sgprs`` as allocated (the statistics), ``lds_bytes`` per workgroup. Returns (the
    value in RADV's units -- wave32 slots on gfx10+, wave64 before -- and {limit: waves of the
    pipeline's size per SIMD} for slots, sgprs, vgprs and lds), so a kernel can be sized to a budget
    before it is written. Families of gfx8..gfx11, and gfx1201 on Mesa 26. The rule is 22.3's;
    with ``mesa`` 26 or later one difference, measured (tests/test_gpu_compile.py): a wave32
    pipeline gets the same number of wave slots per SIMD as a wave64 one (16 on gfx10.3+, 20 on
    gfx10), not twice as many; gfx1201 allocates VGPRs as gfx1100 does.
    """
    family = canonical_family(family)
    if family not in _FAMILY_GFX:
        raise ValueError(f"radv_waves_per_simd knows gfx8..gfx11 and gfx1201, not {family!r}")
    gfx = _FAMILY_GFX[family]
    per64 = 64 // wave_size
    slots = 16 if gfx >= (10, 3) else 20 if gfx == (10, 1) else (
        8 if family.lower() in ("polaris10", "polaris11", "polaris12", "vegam") else 10)
    limits = {"slots": slots * (1 if tuple(mesa) >= _MESA_WITHOUT_FORCE_FAMILY else per64)}
    if sgprs and gfx < (10, 0):
        limits["sgprs"] = 800 // _align(sgprs, 16)
    if vgprs:
        big = family in ("gfx1100", "gfx1101", "gfx1201")
        physical = (768 if big else 512 if gfx >= (10, 0) else 256) * per64
        v = _align(vgprs, 8 if wave_size == 32 else 4)
        if big:
            v = _align(v, 24 if wave_size == 32 else 12)
        elif gfx == (10, 3):
            v = _align(v, 16 if wave_size == 32 else 8)
        limits["vgprs"] = physical // v
    if lds_bytes:
        per_wave = _align(lds_bytes, 1024 if gfx >= (10, 3) else 512) // -(-workgroup_size //
                                                                           wave_size)
        per_simd = (128 if gfx >= (10, 0) else 64) * 1024 // 4
        limits["lds"] = -(-per_simd // per_wave)
    waves = min(limits.values())
    return (waves * wave_size // 32 if gfx >= (10, 0) else waves), limits


#: statistics shown first (in this order) by :func:`format_table`
KEY_STATS = ("VGPRs", "SGPRs", "Spilled VGPRs", "Spilled SGPRs", "Scratch size", "LDS size",
             "Subgroups per SIMD", "Instructions", "Code size")


def format_table(columns: dict, all_stats: bool = True) -> str:
    """A text table: one column per ``{label: JobResult | CompileResult-with-one-job}``."""
    cells = {}
    for label, res in columns.items():
        if isinstance(res, CompileResult):
            res = res.jobs[0] if res.jobs else JobResult(name="", result="unavailable",
                                                         error=res.reason)
        col = {}
        if not res.ok or not res.executables:
            col["status"] = res.result if res.result != "VK_SUCCESS" else "no statistics"
        for exe in res.executables:
            col.update({"executable": exe.name, "subgroupSize": exe.subgroup_size})
            col.update(exe.stats)
            w64 = exe.subgroups_per_simd_wave64
            if w64 is not None and exe.wave32_units:
                col["Subgroups per SIMD"] = f"{exe.stats['Subgroups per SIMD']} (w64: {w64:g})"
        cells[label] = col
    order = ["status", "executable", "subgroupSize"] + list(KEY_STATS)
    rest = sorted({k for c in cells.values() for k in c} - set(order))
    rows = [k for k in order + (rest if all_stats else []) if any(k in c for c in cells.values())]
    width = max([len(r) for r in rows] + [4])
    widths = {lab: max([len(str(lab))] + [len(str(c.get(r, ""))) for r in rows])
              for lab, c in cells.items()}
    lines = [" " * width + "  " + "  ".join(str(lab).rjust(widths[lab]) for lab in cells)]
    for r in rows:
        lines.append(r.ljust(width) + "  " + "  ".join(
            str(cells[lab].get(r, "")).rjust(widths[lab]) for lab in cells))
    return "\n".join(lines)


def _load_spirv(shader: str, defines: dict) -> tuple[str, bytes]:
    if shader.endswith(".spv"):
        with open(shader, "rb") as f:
            return os.path.basename(shader)[:-4], f.read()
    if shader.endswith(".comp") or os.sep in shader:
        path = os.path.abspath(shader if shader.endswith(".comp") else shader + ".comp")
        name = os.path.basename(path)[:-5]
        return name, compile_shader(name, defines, src_dir=os.path.dirname(path))
    try:
        return shader, compile_shader(shader, defines)
    except ModuleNotFoundError:     # run as a file outside an install: the checkout's shaders/
        src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shaders")
        return shader, compile_shader(shader, defines, src_dir=src)


def _uints(text: str) -> list:
    return [int(v, 0) for v in text.replace(" ", "").split(",") if v]


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        return _child_main()
    ap = argparse.ArgumentParser(
        prog="python -m vkattn.tools.vkpipeline",
        description="Compiler statistics of a compute shader on RADV's null device (per AMD "
                    "family) or on any Vulkan device with VK_KHR_pipeline_executable_properties.")
    ap.add_argument("shader", nargs="?", help="a .comp file, a .spv file, or a package shader "
                    "name (attn, reduce, ...)")
    ap.add_argument("--spec", default="", help="spec constants 0..n-1, e.g. 64,4,1")
    ap.add_argument("--bindings", type=int, default=None,
                    help="storage buffers 0..n-1 in set 0 (default: from the SPIR-V)")
    ap.add_argument("--define", "-D", action="append", default=[], help="NAME=VALUE for glslang")
    ap.add_argument("--family", action="append", default=[],
                    help="AMD family (comma-separated or repeated; 'all': the available ones of "
                         f"{','.join(DEFAULT_FAMILIES)}); default navi21")
    ap.add_argument("--device", help="compile in this process on the device whose name contains "
                    "this (e.g. llvmpipe) instead of a null device")
    ap.add_argument("--feature", action="append", default=[],
                    help=f"enable an optional feature where supported: {', '.join(FEATURES)}")
    ap.add_argument("--subgroup-size", type=int, default=None, help="required subgroup size")
    ap.add_argument("--perftest", default=None, help="RADV_PERFTEST for the null device, e.g. "
                    "cswave32")
    ap.add_argument("--ir", action="store_true", help="print the internal representations")
    ap.add_argument("--support", action="store_true",
                    help="print extensions and optional-feature support instead")
    ap.add_argument("--json", action="store_true", help="JSON output")
    args = ap.parse_args(argv)
    families = [f for spec in args.family for f in spec.split(",") if f] or ["navi21"]
    if "all" in families:
        families = available_families()
    features = [f for spec in args.feature for f in spec.split(",") if f]
    env = {"RADV_PERFTEST": args.perftest} if args.perftest else None

    if args.support or not args.shader:
        if args.device:
            report = {args.device: asdict(device_support(args.device))}
        else:
            report = {fam: (asdict(r.device) if r.available else {"unavailable": r.reason})
                      for fam, r in family_stats(families, [], env=env).items()}
        if args.json:
            print(json.dumps(report, indent=1))
            return 0
        if not args.device:
            print(f"compiler: {null_mechanism().describe()}")
        for label, sup in report.items():
            if "unavailable" in sup:
                print(f"{label}: unavailable ({sup['unavailable']})")
                continue
            feats = " ".join(f"{f}={'yes' if on else 'no'}" for f, on in sup["features"].items())
            print(f"{label}: {sup['name']} Vulkan {sup['api_version']} subgroup sizes "
                  f"{sup['subgroup_size_range'][0]}..{sup['subgroup_size_range'][1]} "
                  f"statistics={'yes' if sup['statistics'] else 'no'}\n  {feats}\n  "
                  f"{len(sup['extensions'])} extensions: {' '.join(sup['extensions'])}")
        return 0

    defines = dict(d.split("=", 1) if "=" in d else (d, "1") for d in args.define)
    name, spirv = _load_spirv(args.shader, defines)
    job = Job(name=name, spirv=spirv, spec=_uints(args.spec), bindings=args.bindings,
              subgroup_size=args.subgroup_size)
    if args.device:
        results = {args.device: compile_stats([job], args.device, features, ir=args.ir)}
    else:
        results = family_stats(families, [job], features, ir=args.ir, env=env)
    if args.json:
        print(json.dumps({k: asdict(v) for k, v in results.items()}, indent=1))
        return 0
    print(f"{name}: spec {list(job.spec)}, "
          f"{job.bindings if job.bindings is not None else spirv_bindings(spirv)} bindings"
          + (f", defines {defines}" if defines else ""))
    for label, res in results.items():
        if res.available and (res.enabled or res.not_supported):
            print(f"  {label}: enabled {res.enabled or '-'}; not supported "
                  f"{res.not_supported or '-'}")
    print(format_table(results))
    for label, res in results.items():
        for job_result in res.jobs if res.available else [JobResult(name, "unavailable",
                                                                      res.reason)]:
            if job_result.error:
                print(f"{label}: {job_result.result}: {job_result.error}")
    if args.ir:
        for label, res in results.items():
            for exe in (res.jobs[0].executables if res.jobs else []):
                for rep, text in exe.ir.items():
                    print(f"\n===== {label}: {exe.name}: {rep} =====\n{text}")
    failed = [r for r in results.values() if r.available and not all(j.ok for j in r.jobs)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
