#!/usr/bin/env bash
# The device runs of a lent GPU machine, as one script: a machine with Python, numpy, torch and a
# Vulkan driver but no network and no `make setup` (issue 31: "leave the device runs ready as one
# script"). BUNDLE (default .gpu) holds what set-up would have fetched, made on a machine with a
# network (perf/gpu_bundle.sh): kp's wheel for the GPU machine's Python, glslangValidator and
# spirv-val with their libraries (glslang/bin, glslang/lib) and the .debs of the Vulkan loader and
# fmt. Every step has its own time limit, cut to what VKATTN_GPU_SESSION_S leaves, and the script
# goes on past a failed one; each step's output goes to OUT/run.log, its reports (each step's own
# folder: VKATTN_PERF_OUT, so a step that failed leaves none rather than another step's) into
# OUT/reports.tgz, packed again after every step (the device tool brings back 8 files at most, and
# what a killed call left):
# the steps, in the order they run (VKATTN_GPU_STEPS names them; default "check coopmat bench
# peak ablate trips model overhead merge vearly fp8prefill splits suite", the first the ones a GPU's
# figures and verdicts need most):
#   check: python -m vkattn check (every kernel path vkattn takes there; every SPIR-V module built
#      is checked by spirv-val: VKATTN_SPIRV_VAL)
#   coopmat: the same with the cooperative-matrix kernel forced (VKATTN_KERNEL=coopmat)
#   bench: python -m perf gpubench (make gpu-bench): device ms, and the kernels' own, beside torch
#      SDPA on the same GPU
#   peak: python -m perf peak: the device's float32 multiply-add rate from a shader of independent
#      chains (no loads) -> reports/peak/results.json, beside the datasheet's (issue 31: kernels near the limits)
#   ablate: python -m perf ablate: attn_coopmat.comp's prefill S=512 over 0 and 15872 cached with
#      one part of its key loop taken out at a time (the K/V loads, either product, the lo halves,
#      exp2, the rescale), and attn.comp's decode at L=16384 (the K loads, the V loads, exp2, the
#      split merge), beside the whole kernels, two alternated rounds -> reports/ablate/: where the
#      prefill's 12.5 us per 32-key block and the decode's 16% of the bandwidth (H100, session 21) go
#   trips: attn_coopmat.comp's prefill S=512 from empty and over 15872 cached, float16, in its
#      four builds of session 24, one round each -> reports/trips.txt: COOPMAT_FIXED_TRIPS (O in
#      registers: NVK's NAK 96 -> 224 GPRs, 20 -> 8 warps per SM, no more 256 bytes a thread of
#      local memory) x COOPMAT_STAGE_BATCH (a key block's K/V loads in flight together);
#      "0,0" is the kernel of session 21's H100 figures (perf/gpu_report_nvk.md)
#   model: python -m perf model --random, SmolLM2-135M's shape with random weights (no
#      transformers, no model package needed): wall, device and host time of a decode token, each
#      token one replay of the 30 layers' graph (issue 30); with linear.comp's GPU layout
#      (DeviceLlama.LAYOUTS, session 25) and each op kind's device time in the 37-token prompt and
#      a token (--ops, session 43), then with the CPU layout of the H100's session 21
#      figures (--layout 16,1,16) -> reports/model{,_cpu_layout}/model_random.json
#   overhead: python -m perf overhead: wall against device time per call, the device-array path,
#      a 30-layer graph replayed (issue 30); then again with VKATTN_SPIN_US=1000 (each wait polls
#      the fence for up to 1 ms before it blocks: is the H100's 0.6 ms bare round trip the
#      driver's wake-up?) -> reports/overhead{,_spin}/results.json
#   merge: attn.comp's decode at L=16384 (float16, bfloat16, int8) with the split merge reading 2
#      splits at once (the default since session 24), 1 at a time as before (0) and 4
#      -> reports/merge.txt (perf/RESULTS.md session 24: the merge's serial reads, not the K/V reads,
#      likely bound the H100's decode at 128 splits)
#   vearly: attn.comp's decode at L=16384 with a step's V words loaded with its K words
#      (VKATTN_TILE_V_EARLY=1) and after the scores (the default) -> reports/vearly.txt
#   fp8prefill: prefill S=512 from empty and over 15872 cached with a fp8_e4m3 cache, on
#      attn_coopmat.comp (fp8 staged into its float16 matrices since session 25) and on attn.comp
#      -> reports/fp8prefill.txt (perf prefill checks each result against the reference)
#   splits: attn.comp's decode at L=16384 float16 (beside bfloat16, int8 and q4) under
#      VKATTN_DECODE_SPLITS = the default, 32, 64 and 256: the split count after the merge was shared
#      between the last workgroup's columns (session 21) -> reports/splits.txt
#   suite: the whole test suite but the files that need transformers' model downloads, the
#      install, the soak and the fuzz runs, in the time left ("tests": the device-path and
#      cooperative-matrix parity tests only)
#   formats, sweep and coopsweep, only when named: python -m perf decode at L=16384 with the cache
#      in q4 and in fp8_e4m3 beside float16 and int8 (issue 32; session 21 measured them);
#      attn.comp's decode shape on this GPU at L=16384 (VKATTN_TILE_DECODE=RPT,KB,
#      VKATTN_DECODE_SPLITS from VKATTN_GPU_SWEEP_SPLITS) -> reports/sweep.txt; attn_coopmat.comp's
#      prefill S=512 over 0 and 15872 at the tiles of VKATTN_GPU_COOP_TILES (default "4,2 2,2 2,1
#      4,1 1,2": subgroups per workgroup, matrix sides of keys per block; VKATTN_COOPMAT_TILE)
#      -> reports/coopsweep.txt
#   VKATTN_GPU_EXTRA (a command, run last in the same environment where set): an experiment's
#      script, its output to the log
# Time: by session 21's step times on the H100 (check 58 s, coopmat 14, a perf decode 10-30, bench
# 94, model 31) the default steps take about 11 minutes before the suite, more than one call of
# the device tool (600 s): a step that would start with under 40 s of VKATTN_GPU_SESSION_S (520 s)
# left is logged as skipped, for a second call to name in VKATTN_GPU_STEPS; the suite takes what
# is left.
# Usage: bash perf/gpu_session.sh [BUNDLE] [OUT]   (OUT defaults to $OUT, then perf/out/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(cd "${1:-.gpu}" && pwd)
out=${2:-${OUT:-perf/out/gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/run.log"
rep=$(mktemp -d)/reports            # the reports, packed into OUT/reports.tgz after each step
mkdir -p "$rep"
pack() { tar -czf "$out/reports.tgz.tmp" -C "$rep/.." reports 2>/dev/null && mv "$out/reports.tgz.tmp" "$out/reports.tgz"; }
PY=${PYTHON:-python3}
start=$SECONDS
step() { pack; echo "== $1 ($((SECONDS - start)) s in)" | tee -a "$log"; }
# a step's limit, cut to what VKATTN_GPU_SESSION_S (520) leaves: the script ends inside one call
limit() { local left=$(( ${VKATTN_GPU_SESSION_S:-520} - (SECONDS - start) )); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
run() {   # run LIMIT CMD...: the command's output to the log, its status and time after it
  local lim t0=$SECONDS rc
  lim=$(limit "$1")
  shift
  timeout "$lim" "$@" >> "$log" 2>&1
  rc=$?
  echo "-- exit $rc after $((SECONDS - t0)) s (limit $lim s): $*" | tee -a "$log"
  return 0
}

step "set-up"
for f in "$bundle"/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
ldconfig 2>/dev/null
# the GPU driver's Vulkan ICD where the loader does not find one itself (NVIDIA's may sit under
# /usr/local/nvidia, a mount the loader's search path leaves out)
if [ -z "${VK_DRIVER_FILES:-}" ] && ! ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1; then
  icd=$(find /usr/local /opt -name '*_icd*.json' -path '*vulkan*' 2>/dev/null | head -1)
  [ -n "$icd" ] && export VK_DRIVER_FILES="$icd"
fi
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
site=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$bundle"/kp-*.whl >> "$log" 2>&1
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export VKATTN_GLSLANG="$bundle/glslang/bin/glslangValidator" VKATTN_SPIRV_VAL="$bundle/glslang/bin/spirv-val"
export LD_LIBRARY_PATH="$bundle/glslang/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export VKATTN_CACHE_DIR="$site/.vkattn-cache"     # shader and verdict caches: fresh, and not under OUT
{ echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-}"; ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1; find /usr/local/nvidia -name "*.json" 2>/dev/null; nvidia-smi -L 2>&1; "$PY" --version; "$PY" -c 'import numpy, torch; print("numpy", numpy.__version__, "torch", torch.__version__)';
  "$VKATTN_GLSLANG" --version | head -1; nproc; } >> "$log" 2>&1
if ! timeout 60 "$PY" -m vkattn devices >> "$log" 2>&1; then
  echo "no Vulkan device: the ICD files on this machine:" | tee -a "$log"
  find / -xdev \( -path /proc -o -path /sys \) -prune -o -name '*icd*.json' -print 2>/dev/null | head -20 | tee -a "$log"
  exit 1
fi

# variant FILE LABEL PATTERN [VAR=VALUE ...] -- CMD...: one build or setting of an A/B step, its
# result rows (the lines matching PATTERN, and any error) after LABEL in FILE, 90 s at most (less
# where the session's time is nearly spent)
variant() {
  local file=$1 label=$2 pattern=$3 envs=()
  shift 3
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "$label:" >> "$file"
  env "${envs[@]}" timeout "$(limit 90)" "$@" 2>&1 | grep -E "$pattern|Error" >> "$file" || echo "failed" >> "$file"
}
# the decode at L=16384 (perf decode: float16, bfloat16 and int8, torch on the GPU beside it);
# VKATTN_PERF_CASE= after it: every decode case at that length
DECODE_16K=(VKATTN_PERF_CONTEXT=16384 VKATTN_PERF_CAPACITY=16384 VKATTN_PERF_ITERS=20
            "VKATTN_PERF_CASE=decode L=16384 cap=16384" VKATTN_PERF_TORCH_DEVICE=cuda)

steps=" ${VKATTN_GPU_STEPS:-check coopmat bench peak ablate trips model overhead merge vearly fp8prefill splits suite} "
# a step named in $steps runs while VKATTN_GPU_SESSION_S (default 520) has 40 s or more left, so
# that the whole script stays inside one 600-second call of the device tool; the rest are logged as
# skipped (name them in VKATTN_GPU_STEPS for a second call)
want() {
  [[ "$steps" == *" $1 "* ]] || return 1
  local left=$(( ${VKATTN_GPU_SESSION_S:-520} - (SECONDS - start) ))
  if [ "$left" -lt 40 ]; then echo "== $1 skipped: $left s of VKATTN_GPU_SESSION_S left" | tee -a "$log"; return 1; fi
}
if want check; then
  step "python -m vkattn check"
  run "${VKATTN_GPU_CHECK_S:-150}" "$PY" -m vkattn check --json "$rep/check.json"
fi
if want coopmat; then
  step "python -m vkattn check, the cooperative-matrix kernel forced"
  VKATTN_KERNEL=coopmat run "${VKATTN_GPU_CHECK_S:-150}" "$PY" -m vkattn check --json "$rep/check_coopmat.json"
fi
if want bench; then
  step "python -m perf gpubench (make gpu-bench)"
  VKATTN_PERF_OUT="$rep/bench" run "${VKATTN_GPU_BENCH_S:-200}" "$PY" -m perf gpubench
fi
if want peak; then
  step "python -m perf peak (the shaders' multiply-add rate, 1 to 6 vec4 chains an invocation)"
  VKATTN_PERF_OUT="$rep/peak" VKATTN_PERF_ITERS=10 run "${VKATTN_GPU_PEAK_S:-60}" "$PY" -m perf peak
fi
if want ablate; then
  step "python -m perf ablate (attn_coopmat.comp's prefill, attn.comp's decode, parts taken out)"
  VKATTN_PERF_OUT="$rep/ablate" run "${VKATTN_GPU_ABLATE_S:-150}" "$PY" -m perf ablate
fi
if want trips; then
  step "coopmat prefill S=512, past 0 and 15872: COOPMAT_FIXED_TRIPS,COOPMAT_STAGE_BATCH 1,1 0,0 1,0 0,1"
  for tb in 1,1 0,0 1,0 0,1; do
    variant "$rep/trips.txt" "COOPMAT_FIXED_TRIPS,COOPMAT_STAGE_BATCH=$tb" "^prefill S=512" VKATTN_KERNEL=coopmat \
      VKATTN_COOPMAT_FIXED_TRIPS=${tb%,*} VKATTN_COOPMAT_STAGE_BATCH=${tb#*,} VKATTN_PERF_QLEN=512 \
      VKATTN_PERF_CONTEXT=512,16384 VKATTN_PERF_CAPACITY=16384 VKATTN_PERF_ITERS=8 VKATTN_PERF_TORCH_DEVICE=cuda \
      -- "$PY" -m perf prefill
  done
  cat "$rep/trips.txt" >> "$log"
fi
if want model; then
  step "python -m perf model --random (SmolLM2-135M's shape, random weights): the GPU layout with each op's device time, then the CPU layout"
  VKATTN_PERF_OUT="$rep/model" run "${VKATTN_GPU_MODEL_S:-150}" "$PY" -m perf model --random --new 32 --prompt 37 --ops
  VKATTN_PERF_OUT="$rep/model_cpu_layout" run "${VKATTN_GPU_MODEL_S:-150}" "$PY" -m perf model --random --new 32 \
    --layout 16,1,16
fi
if want overhead; then
  step "python -m perf overhead"
  VKATTN_PERF_OUT="$rep/overhead" run "${VKATTN_GPU_OVERHEAD_S:-90}" "$PY" -m perf overhead
  step "python -m perf overhead, waits polling the fence for up to 1 ms (VKATTN_SPIN_US=1000)"
  VKATTN_PERF_OUT="$rep/overhead_spin" VKATTN_SPIN_US=1000 run "${VKATTN_GPU_OVERHEAD_S:-90}" "$PY" -m perf overhead
fi
if want merge; then
  step "decode L=16384: VKATTN_TILE_MERGE_BATCH default (2), 0, 4"
  for mb in "" 0 4; do
    variant "$rep/merge.txt" "TILE_MERGE_BATCH=${mb:-default}" "^decode L=16384" VKATTN_TILE_MERGE_BATCH=$mb \
      "${DECODE_16K[@]}" -- "$PY" -m perf decode
  done
  cat "$rep/merge.txt" >> "$log"
fi
if want vearly; then
  step "decode L=16384: VKATTN_TILE_V_EARLY 1 / 0"
  for ve in 1 0; do
    variant "$rep/vearly.txt" "TILE_V_EARLY=$ve" "^decode L=16384" VKATTN_TILE_V_EARLY=$ve "${DECODE_16K[@]}" \
      -- "$PY" -m perf decode
  done
  cat "$rep/vearly.txt" >> "$log"
fi
if want fp8prefill; then
  step "prefill S=512, past 0 and 15872, fp8_e4m3: attn_coopmat.comp / attn.comp"
  for k in coopmat tile; do
    variant "$rep/fp8prefill.txt" "fp8_e4m3 on $k" "^prefill S=512" VKATTN_KERNEL=$k VKATTN_PERF_DTYPE=fp8_e4m3 \
      VKATTN_PERF_QLEN=512 VKATTN_PERF_CONTEXT=512,16384 VKATTN_PERF_CAPACITY=16384 VKATTN_PERF_ITERS=8 \
      VKATTN_PERF_TORCH_DEVICE=cuda -- "$PY" -m perf prefill
  done
  cat "$rep/fp8prefill.txt" >> "$log"
fi
if want sweep; then
  step "decode sweep: VKATTN_TILE_DECODE (rpt,kb) x VKATTN_DECODE_SPLITS, L=16384"
  for shape in "" 1,4 2,2 2,4 4,1 4,2 4,4 4,8 8,2; do      # perf decode times float16, bfloat16 and int8
    for splits in "" ${VKATTN_GPU_SWEEP_SPLITS:-}; do
      variant "$rep/sweep.txt" "sweep rpt,kb=${shape:-default} splits=${splits:-default}" "^decode L=16384 cap=16384" \
        VKATTN_TILE_DECODE=$shape VKATTN_DECODE_SPLITS=$splits "${DECODE_16K[@]}" VKATTN_PERF_ITERS=30 \
        -- "$PY" -m perf decode
    done
  done
  cat "$rep/sweep.txt" >> "$log"
fi
if want coopsweep; then
  step "coopmat prefill S=512, past 0 and 15872, at tiles ${VKATTN_GPU_COOP_TILES:-4,2 2,2 2,1 4,1 1,2}"
  for tile in ${VKATTN_GPU_COOP_TILES:-4,2 2,2 2,1 4,1 1,2}; do
    variant "$rep/coopsweep.txt" "VKATTN_COOPMAT_TILE=$tile" "^prefill S=512" VKATTN_KERNEL=coopmat \
      VKATTN_COOPMAT_TILE=$tile VKATTN_PERF_QLEN=512 VKATTN_PERF_CONTEXT=512,16384 VKATTN_PERF_CAPACITY=16384 \
      VKATTN_PERF_ITERS=8 VKATTN_PERF_TORCH_DEVICE=cuda -- "$PY" -m perf prefill
  done
  cat "$rep/coopsweep.txt" >> "$log"
fi
if want formats; then
  for dt in q4 fp8_e4m3; do
    step "decode L=16384, $dt beside float16 and int8 (alternated rounds)"
    VKATTN_PERF_OUT="$rep/formats_$dt" VKATTN_PERF_DTYPE=$dt VKATTN_PERF_CONTEXT=16384 VKATTN_PERF_CAPACITY=16384 \
      VKATTN_PERF_TORCH_DEVICE=cuda run "${VKATTN_GPU_FORMAT_S:-150}" "$PY" -m perf decode
  done
fi
if want splits; then
  step "decode L=16384 under VKATTN_DECODE_SPLITS (default, 32, 64, 256)"
  for splits in "" 32 64 256; do
    variant "$rep/splits.txt" "splits=${splits:-default}" "^decode L=16384" VKATTN_DECODE_SPLITS=$splits \
      "${DECODE_16K[@]}" VKATTN_PERF_CASE= -- "$PY" -m perf decode
  done
  cat "$rep/splits.txt" >> "$log"
fi
left=$(( ${VKATTN_GPU_SESSION_S:-520} - (SECONDS - start) ))
if want suite && [ "$left" -gt 30 ]; then
  step "pytest: the suite on this GPU ($left s left)"
  run "$left" "$PY" -m pytest -q -p no:cacheprovider -n "$(nproc)" tests --ignore=tests/test_hf.py \
      --ignore=tests/test_hf_prefix.py --ignore=tests/test_install.py --ignore=tests/test_model_device.py \
      --ignore=tests/test_gpu_compile.py --ignore=tests/test_soak.py --ignore=tests/test_fuzz.py
fi
left=$(( ${VKATTN_GPU_SESSION_S:-520} - (SECONDS - start) ))
if want tests && [ "$left" -gt 30 ]; then
  step "pytest: device path, fast path, cooperative matrices ($left s left)"
  run "$left" "$PY" -m pytest -q -x -p no:cacheprovider -n 8 tests/test_device_path.py tests/test_fast_path.py \
      tests/test_coopmat.py tests/test_coopmat_rounding.py
fi
if [ -n "${VKATTN_GPU_EXTRA:-}" ]; then
  step "extra: $VKATTN_GPU_EXTRA"
  run "${VKATTN_GPU_EXTRA_S:-120}" bash -c "$VKATTN_GPU_EXTRA"
fi
step "done"
