"""perf/lpjit.py's reading of llvmpipe's machine code (``python -m perf lpjit``), on a hand-written
disassembly in objdump's layout: the hottest loop and its instruction kinds, the functions by
samples, the per-lane load loops; and its typed refusals. The sampling itself needs Linux perf and
runs in the perf script, not here."""
import pytest

from perf import lpjit

# offsets as objdump prints them for a raw binary; a main loop 0x10-0x60 with a per-lane load
# loop 0x30-0x40 inside it, then a texel-fetch-like callee after the ret
ASM = """
jit.bin:     file format binary

Disassembly of section .data:

0000000000000000 <.data>:
   0:\t31 c0                \txor    %eax,%eax
  10:\tc5 fc 59 04 24       \tvmulps (%rsp),%ymm0,%ymm0
  14:\tc5 fc 58 c1          \tvaddps %ymm1,%ymm0,%ymm0
  18:\tc5 fc 29 44 24 20    \tvmovaps %ymm0,0x20(%rsp)
  1e:\tc4 e3 7d 4a c1 20    \tvblendvps %ymm2,%ymm1,%ymm0,%ymm0
  24:\t41 ff d5             \tcall   *%r13
  30:\t89 c1                \tmov    %eax,%ecx
  32:\t89 8c 94 60 2a 00 00 \tmov    %ecx,0x2a60(%rsp,%rdx,4)
  39:\tff c0                \tinc    %eax
  3b:\t83 f8 08             \tcmp    $0x8,%eax
  3e:\t72 f0                \tjb     0x30
  40:\tc5 fc 59 c9          \tvmulps %ymm1,%ymm1,%ymm1
  44:\tc4 e2 75 b8 c2       \tvfmadd231ps %ymm2,%ymm1,%ymm0
  60:\t0f 82 aa ff ff ff    \tjb     0x10
  66:\tc3                   \tret
  70:\tc5 fa 6f 00          \tvmovdqu (%rax),%xmm0
  74:\tc3                   \tret
"""


def test_the_hottest_loop_its_kinds_and_the_per_lane_loads():
    samples = {0x10: 10, 0x14: 10, 0x32: 20, 0x3e: 10, 0x40: 10, 0x70: 40}
    r = lpjit.analyse(ASM, samples)
    loop = r["loop"]
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0x60, 13)
    assert loop["kinds"] == {"arith": 3, "fma": 1, "stack move": 1, "blend": 1, "call": 1, "other": 6}
    assert loop["samples_share"] == pytest.approx(0.6)
    assert r["lane_loads"] == {"loops": 1, "samples_share": pytest.approx(0.3)}
    assert r["lane_loads_in_loop"] == 1
    # two functions: the main one (0x0-0x66, 15 instructions) and the callee, by samples
    assert [(f[0], f[1], f[2]) for f in r["functions"]] == [(0x0, 0x66, 15), (0x70, 0x74, 2)]
    assert [f[3] for f in r["functions"]] == [pytest.approx(0.6), pytest.approx(0.4)]


def test_a_loop_without_a_lane_insert_is_not_a_per_lane_load():
    r = lpjit.analyse(ASM.replace("0x2a60(%rsp,%rdx,4)", "0x2a60(%rsp)"), {0x10: 1})
    assert r["lane_loads"]["loops"] == 0 and r["lane_loads_in_loop"] == 0


def test_what_it_cannot_read_is_a_typed_error():
    with pytest.raises(lpjit.LpjitError, match="no instruction"):
        lpjit.analyse("nothing here", {})
    with pytest.raises(lpjit.LpjitError, match="no loop"):
        lpjit.analyse("   0:\t31 c0 \txor    %eax,%eax\n   2:\tc3 \tret\n", {0: 1})


def test_a_missing_tool_or_an_unknown_case_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("VKATTN_PERF_JIT_CASE", "decode,prefil")
    assert lpjit.main([]) == 2
    assert "prefil" in capsys.readouterr().err
    monkeypatch.setenv("VKATTN_PERF_JIT_CASE", "decode")
    monkeypatch.setattr(lpjit.shutil, "which", lambda tool: None if tool == "perf" else "/usr/bin/" + tool)
    assert lpjit.main([]) == 2
    assert "perf (package linux-perf)" in capsys.readouterr().err


def test_the_report_names_fused_multiply_adds_even_where_there_are_none():
    """llvmpipe 22.3 splits a shader's fma() into a multiply and an add: the report says so."""
    r = lpjit.analyse(ASM.replace("vfmadd231ps %ymm2,%ymm1,%ymm0", "vaddps %ymm2,%ymm1,%ymm0"), {0x10: 1})
    assert r["loop"]["kinds"]["arith"] == 4 and "fma" not in r["loop"]["kinds"]
    assert "fma 0" in lpjit.report_lines("prompt", r)[0]
    assert "fma 1" in lpjit.report_lines("prompt", lpjit.analyse(ASM, {0x10: 1}))[0]
