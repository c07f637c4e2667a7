"""What vkattn checks in a SPIR-V module itself, without SPIRV-Tools.

glslang 13.1 to 15.0 drop the matrix use of every declarator but the first in a statement that
declares two cooperative matrices (``coopmat<..., gl_MatrixUseA> ph, pl;``): ``pl`` gets an
``OpTypeCooperativeMatrixKHR`` whose use is not A, B or Accumulator, and every multiply-add that
reads it is invalid SPIR-V (``spirv-val``: "Cooperative matrix type must be A Type"), undefined
behaviour on a driver. vkattn's shaders declare one matrix a statement; :func:`matrix_problem`
refuses any module, whatever its compiler, whose cooperative-matrix types are not well formed, so
a compiler with this or a similar defect is refused by the compiler probe and never reaches a
driver. The whole-module check is ``spirv-val`` (``VKATTN_SPIRV_VAL``, vkattn.compiler).
"""
from __future__ import annotations

import struct

MAGIC = 0x07230203
OP_CONSTANT = 43
OP_SPEC_CONSTANT = 50
OP_TYPE_COOPMAT_KHR = 4456
USES = {0: "A", 1: "B", 2: "Accumulator"}     # SPIR-V's CooperativeMatrixUse


def words(spirv: bytes) -> tuple:
    """The module as 32-bit words (little- or big-endian, from its magic number); ValueError if
    it is not SPIR-V."""
    if len(spirv) < 20 or len(spirv) % 4:
        raise ValueError(f"not a SPIR-V module: {len(spirv)} bytes")
    for order in "<>":
        w = struct.unpack(f"{order}{len(spirv) // 4}I", spirv)
        if w[0] == MAGIC:
            return w
    raise ValueError("not a SPIR-V module: wrong magic number")


def instructions(spirv: bytes):
    """(opcode, operand words) of every instruction after the 5-word header."""
    w = words(spirv)
    i = 5
    while i < len(w):
        count, op = w[i] >> 16, w[i] & 0xFFFF
        if count == 0 or i + count > len(w):
            raise ValueError(f"malformed SPIR-V: instruction at word {i} has length {count}")
        yield op, w[i + 1:i + count]
        i += count


def matrix_uses(spirv: bytes) -> list:
    """The use of every OpTypeCooperativeMatrixKHR in the module, in order: "A", "B",
    "Accumulator", or "invalid (N)" for a use constant outside SPIR-V's three (None where the use
    is not a plain or specialisation constant)."""
    consts, found = {}, []
    for op, ops in instructions(spirv):
        if op in (OP_CONSTANT, OP_SPEC_CONSTANT) and len(ops) >= 3:
            consts[ops[1]] = ops[2]
        elif op == OP_TYPE_COOPMAT_KHR and len(ops) >= 6:
            use = consts.get(ops[5])
            found.append(None if use is None else USES.get(use, f"invalid ({use:#x})"))
    return found


def matrix_problem(spirv: bytes) -> str:
    """Why the module's cooperative-matrix types are not well formed ("" when they are, or the
    module declares none)."""
    try:
        uses = matrix_uses(spirv)
    except ValueError as e:
        return str(e)
    bad = [u for u in uses if u is None or u.startswith("invalid")]
    if bad:
        return (f"{len(bad)} of its {len(uses)} cooperative-matrix types have no valid use ({bad[0]}): "
                "the compiler dropped a matrix's use (glslang 13.1-15.0 do for the second declarator "
                "of one statement)")
    return ""
