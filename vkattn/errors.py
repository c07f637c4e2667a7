"""Every exception the public API raises (docs/errors.md)."""


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


class CacheFileError(ValueError):
    """A saved cache file (``save``/``load``, vkattn.persist) cannot be loaded into this cache.
    Raised before anything is written: the cache is unchanged."""


class CacheFileCorruptError(CacheFileError):
    """The file is damaged: not a readable safetensors file (truncated, cut or garbled header),
    no vkattn metadata, a checksum that does not match its contents, or tensors that disagree
    with its own metadata."""


class CacheFileMismatchError(CacheFileError):
    """The file is intact but was written for other settings than this cache's: format kind or
    version, dtype, head counts, head dims, rotary settings (vkattn.hf: layers, windows, batch).
    ``field`` names the setting."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field
