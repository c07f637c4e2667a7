"""Tools beside the runtime: nothing in vkattn's runtime imports this package.

- ``vkattn.tools.vkpipeline``: GPU-compiler statistics without the GPU (RADV's null hardware or
  drm-shim), what ``python -m perf gpu`` and the GPU report read.
- ``vkattn.tools.spirv_audit``: every shader variant vkattn plans, compiled by each given glslang
  and validated by spirv-val (``python -m vkattn.tools.spirv_audit --help``).
"""
