"""Every exception the public API raises (see README, "Errors")."""


class CacheFullError(ValueError):
    """A batch does not fit: ``length + n > capacity``. Raised before anything is written."""


class DeviceLimitError(ValueError):
    """A requested size exceeds a limit of the Vulkan device (buffer range, shared memory...)."""


class CacheClosedError(RuntimeError):
    """The cache (or its device) was closed; it holds no device memory any more."""


class VerificationError(AssertionError):
    """Verify mode: a device result differs from the numpy reference beyond tolerance."""


class ShaderCompileError(RuntimeError):
    """glslangValidator is missing or rejected a shader; the message carries its output."""


class SyncHazardError(RuntimeError):
    """Internal: a recording would let two dispatches touch one buffer without a barrier."""
