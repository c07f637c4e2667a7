"""vkattn: persistent-cache flash attention on Vulkan, from Python.

    cache = vkattn.KVCache(capacity, num_kv_heads, head_dim, dtype="float16")
    out = cache.forward(q, k, v)          # append k/v at the live length, then attend q
"""
from . import reference
from ._vkinfo import VulkanUnavailableError
from .cache import KVCache
from .device import Device, default_device, list_devices
from .errors import (CacheClosedError, CacheFullError, DeviceLimitError, ShaderCompileError,
                     SyncHazardError, VerificationError)

__version__ = "0.1.0"

__all__ = ["KVCache", "Device", "default_device", "list_devices", "reference", "CacheFullError",
           "CacheClosedError", "DeviceLimitError", "ShaderCompileError", "SyncHazardError",
           "VerificationError", "VulkanUnavailableError", "__version__"]
