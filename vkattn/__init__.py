"""vkattn: persistent-cache flash attention on Vulkan, from Python.

    cache = vkattn.KVCache(capacity, num_kv_heads, head_dim, dtype="float16")
    out = cache.forward(q, k, v)          # append k/v at the live length, then attend q
"""
from . import _driverfix
_driverfix.apply()          # before any Vulkan driver loads: llvmpipe of Mesa 25 with AVX-512 (see there)
from . import reference
from ._vkinfo import VulkanUnavailableError
from ._attn import RoPE
from .cache import KVCache
from .paged import PagedKVCache
from .paging import UnknownSequenceError
from .device import Device, default_device, list_devices
from .reference import merge_states
from .errors import (CacheClosedError, CacheFileCorruptError, CacheFileError, CacheFileMismatchError,
                     CacheFullError, DeviceLimitError, ShaderCompileError, SyncHazardError, VerificationError)
from .persist import file_info as cache_file_info
from .array import DeviceArray, empty, to_device, zeros
from .graph import Graph, algorithm
from . import measure        # registers the per-device measurements (the self-test, the speed probe)
from ._version import __version__

__all__ = ["KVCache", "RoPE", "PagedKVCache", "UnknownSequenceError", "Device", "default_device", "list_devices", "reference", "CacheFullError",
           "CacheClosedError", "DeviceLimitError", "ShaderCompileError", "SyncHazardError",
           "VerificationError", "VulkanUnavailableError", "merge_states", "__version__",
           "CacheFileError", "CacheFileCorruptError", "CacheFileMismatchError", "cache_file_info",
           "DeviceArray", "empty", "zeros", "to_device", "Graph", "algorithm"]
