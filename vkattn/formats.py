"""The K/V storage formats: one table the layers above read (the caches' word layout, range
checks and accepted dtypes, the shader defines, the planner's kernel choice, the file tensors,
the SPIR-V audit's variants, perf). A new format is a row here, its exact definition in
vkattn.reference (and ``round_to``), its load and store in shaders/common.glsl (selected by its
define), its host readback (``_attn.unpack_rows``), its adversarial rows in ``check`` and its
tests.

A K or V row is stored in 16-byte words (uvec4): ``per_word`` values per word, so the kernels
handle ``ch = per_word // 4`` float vec4 per word. ``row_scale``: one float32 scale per stored
row (position and kv head) beside the words (int8). ``matrices``: attn_coopmat.comp may take the
format -- its float16 matrices hold every stored value exactly (float16: the values themselves;
int8: the integers -127 .. 127, the scale applied after the product; fp8: e5m2's values, e4m3's
times 2^-8, the kv head's scale applied after the product); bfloat16's exponent range does not
fit in float16, so it stays on attn.comp / attn_lane.comp, and so does q4 (its blocks' scales
would need a rescale per 16 values inside the matrix product). ``block_scale``: q4's blocks of 16 values, each with a parameter word (scale and zero
point) stored in the row itself (after the data words; ``row_words``). ``head_scale``: one float32 scale per kv head for K and one for V, fixed at
cache creation (the fp8 formats: value = decode(byte) * scale, vkattn.reference.fp8_bits).
``max_abs``: the largest
|x| a cache accepts from numpy (a larger value would be stored as Inf: float16 refuses what
passes its largest value, 65504, as it always has; bfloat16 exactly what rounds to Inf, from
0x7f7f8000 on; q4 above 2^126, where a level could pass float32's range; int8 float32's largest
value itself, whose row scale (max / 127, rounded to nearest) rounds up so that 127 times it is
Inf -- every smaller value reads back finite); None: any finite value (the fp8 formats saturate
finite overflow). A cache with a RoPE also refuses keys whose rotated pairs could pass the
format's limit (float32's largest value where it has none): vkattn.checks.check_rotated; not q4,
whose limit leaves room for that growth (``rotation_room``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .checks import FP16_MAX
from .reference import BF16_FINITE_INPUT, Q4_MAX_ABS

# the largest |x| an int8 row takes: one float32 below float32's largest value (that value's scale
# max / 127 rounds up, and 127 times the scale overflows: the row would read back Inf)
INT8_MAX_ABS = float(np.nextafter(np.float32(np.finfo(np.float32).max), np.float32(0)))


@dataclass(frozen=True)
class KVFormat:
    name: str
    per_word: int                 # values per 16-byte storage word
    defines: dict = field(hash=False)   # preprocessor defines of the kernels that load and store it
    bits: type = np.uint32        # an integer view of one stored element (file tensors, readback)
    file_dtype: np.dtype = field(default=np.dtype(np.float32), hash=False)  # its tensors' dtype in a file
    row_scale: bool = False       # a float32 scale per row and kv head
    matrices: bool = True         # attn_coopmat.comp can hold it exactly (see the module docstring)
    max_abs: float | None = None  # numpy inputs above this magnitude are refused
    head_scale: bool = False      # a float32 scale per kv head (K and V), set at creation (fp8)
    block_scale: bool = False     # a parameter word per 16-value block, after the row's data words (q4)
    rotation_room: bool = False   # max_abs leaves room for RoPE's growth of a key (q4: Q4_MAX_ABS)

    @property
    def ch(self) -> int:
        return self.per_word // 4

    def row_words(self, data_words: int) -> int:
        """16-byte words of a stored row of ``data_words`` data words (q4: plus its parameter words)."""
        return data_words + (data_words + 1) // 2 if self.block_scale else data_words


FORMATS = {
    "float32": KVFormat("float32", 4, {"KV_F16": 0, "KV_I8": 0}, np.uint32, np.dtype(np.float32),
                        matrices=False),
    "float16": KVFormat("float16", 8, {"KV_F16": 1, "KV_I8": 0}, np.uint16, np.dtype(np.float16),
                        max_abs=FP16_MAX),
    "int8": KVFormat("int8", 16, {"KV_F16": 0, "KV_I8": 1}, np.uint8, np.dtype(np.int8), row_scale=True,
                     max_abs=INT8_MAX_ABS),
    # numpy has no bfloat16: files hold its bits as uint16, the metadata's dtype says "bfloat16"
    "bfloat16": KVFormat("bfloat16", 8, {"KV_F16": 0, "KV_I8": 0, "KV_BF16": 1}, np.uint16,
                         np.dtype(np.uint16), matrices=False, max_abs=BF16_FINITE_INPUT),
    # 16 per word (four per uint32, low byte first) like int8, read by the kernels in 8-byte units
    # like int8; files hold the bits as uint8, the metadata's dtype names the format. On
    # attn_coopmat.comp every fp8 value is a float16 (e4m3's times 2^-8), staged by bit operations
    # (common.glsl fp8x4_halves), the kv head's scale applied after the product
    "fp8_e4m3": KVFormat("fp8_e4m3", 16, {"KV_F16": 0, "KV_I8": 0, "KV_FP8": 1}, np.uint8, np.dtype(np.uint8),
                         head_scale=True),
    "fp8_e5m2": KVFormat("fp8_e5m2", 16, {"KV_F16": 0, "KV_I8": 0, "KV_FP8": 2}, np.uint8, np.dtype(np.uint8),
                         head_scale=True),
    # q4: two 16-value blocks per word (8 nibbles per uint32, low first), each block's parameter word
    # (scale and zero point) in (words + 1) // 2 words after the row's data words (common.glsl;
    # reference.quantize_q4). Files hold the stored row words as uint32 (format "q4z"). Not on
    # attn_coopmat.comp (as bfloat16)
    "q4": KVFormat("q4", 32, {"KV_F16": 0, "KV_I8": 0, "KV_Q4": 1}, np.uint32, np.dtype(np.uint32),
                   matrices=False, block_scale=True, max_abs=Q4_MAX_ABS, rotation_room=True),
}
DTYPES = tuple(FORMATS)


def dtype_list() -> str:
    """'float16', 'float32', ... for error messages."""
    names = [f"{n!r}" for n in DTYPES]
    return ", ".join(names[:-1]) + " or " + names[-1]
