#!/usr/bin/env bash
# Two passes under the Khronos validation layer; fails on any message, on any failed test, or if
# the layer is not really doing what the pass relies on (a deliberately wrong probe must be
# reported first):
#   sync   the whole pytest suite with synchronization validation on (probe: tests/sync_probe.py,
#          a racy sequence that must give SYNC-HAZARD-READ-AFTER-WRITE)
#   gpuav  tests/test_bounds.py's GPU-AV sweep (`-m gpuav`: each buffer-access pattern once, odd
#          shapes, every storage layout, the variants, paged batches, every kernel; GPUAV_SWEEP there
#          says which cases and why) with GPU-assisted validation's buffer bounds checks on (probe:
#          tests/gpuav_probe.py, an out-of-bounds read that must give VUID-vkCmdDispatch-None-02706):
#          every kernel stays inside its buffers. GPU-AV instruments every buffer access, so lavapipe
#          compiles slowly there: one pytest process per shard of VKATTN_GPUAV_KERNELS (pytest -k
#          expressions separated by ';', one process each; default the lane kernel's cases in three
#          -- on Mesa 22.3 its int8, q4 and float16 odd-shape compiles take about 200 s each on a
#          2-core machine without AVX-512 -- and the tile kernel's in two (464 s cold in one process
#          in session 21), so that the processes keep both cores busy to the end; then coopmat,
#          whose cases skip where the device has no cooperative matrices). CI runs this pass on
#          Debian 13's Mesa 26 (its LLVM 19 lavapipe compiled the sweep cold 3x faster than the
#          host's Mesa 22.3, and its layer validates the cooperative-matrix kernel too;
#          docs/testing.md). VKATTN_GPUAV_MARK (default gpuav; "" for every case of
#          tests/test_bounds.py) picks the cases: VKATTN_GPUAV_MARK= runs the whole module by hand
#          (Mesa 22.3: about 30 CPU-minutes cold on a 2-core machine without AVX-512; Mesa 26: 189 s
#          on the 2-core AVX-512 machine, session 23).
# VKATTN_VALIDATION=sync or =gpuav runs one pass (default: both). Arguments go to the sync pass's
# pytest (e.g. a test selection) -- or, after `--`, name a command the sync pass runs under the layer
# instead (CI: `VKATTN_VALIDATION=sync scripts/validation.sh -- make test`, the README's test
# command itself under sync validation, so the suite runs once, not twice): its pytest runs with -s
# (PYTEST_ADDOPTS) and tests/conftest.py points each xdist worker's stdout, which the layer logs to
# and xdist would drop, at a file in VKATTN_LAYER_LOG_DIR that is counted with the command's output.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
passes=${VKATTN_VALIDATION:-sync gpuav}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pattern='Validation (Error|Warning)|VUID-|SYNC-HAZARD'

# The layer's notices about its own set-up, not findings: Debian 13's layer (1.4.309) prints them
# at every GPU-assisted instance and device creation (its advice to turn core validation off, and
# the features GPU-AV turns on for itself). Dropped, whole messages, before counting; every other
# message counts. (Debian 12's layer prints none of them.)
drop_notices() {
  awk 'function out() { if (m != "" && m !~ /Both GPU Assisted Validation and Normal Core Check Validation are enabled/ &&
                            m !~ /vkCreateDevice\(\): Internal Warning: (Forcing |Adding a |Ray Query validation option)/) print m; m = "" }
       /^Validation (Error|Warning|Information)/ { out(); m = $0; next }
       /^$/ { out(); print; next }
       m != "" { m = m "\n" $0; next }
       { print }
       END { out() }'
}

settings() {   # $1: the khronos_validation.enables line and any further settings
  cat > "$work/vk_layer_settings.txt" <<SETTINGS
$1
khronos_validation.debug_action = VK_DBG_LAYER_ACTION_LOG_MSG
khronos_validation.report_flags = error,warn
khronos_validation.log_filename = stdout
SETTINGS
}
export VK_LAYER_SETTINGS_PATH="$work/vk_layer_settings.txt" VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation

# run_pass NAME PROBE EXPECTED SHARDS PYTEST-ARGS...: the probe must be reported, then the tests
# give 0 messages. SHARDS: "" (one pytest) or -k expressions run as parallel pytest processes (the
# layer logs to each process's stdout, which pytest-xdist workers would not pass on), or "--": the
# arguments are a command (make test), its workers' stdout kept in files (tests/conftest.py)
run_pass() {
  local name=$1 probe=$2 expect=$3 shards=$4
  shift 4
  # up to 3 tries, a guard: Debian 13's layer (1.4.309) reports a submission's GPU-AV finding when
  # the queue next submits, and reported the probe's read in about 3 runs of 4 until the probe
  # submitted once more after it (since: 12 of 12, docs/platforms.md); Debian 12's every time
  local try
  for try in 1 2 3; do
    "$PY" "$probe" > "$work/probe.log" 2>&1
    ! grep -qE -- "$expect" "$work/probe.log" || break
  done
  if ! grep -qE -- "$expect" "$work/probe.log"; then
    echo "validation ($name): the layer did not report the probe's $expect; is vulkan-validationlayers installed?" >&2
    cat "$work/probe.log" >&2
    return 1
  fi
  echo "validation ($name): layer active (probe reported $(grep -oE -- "$expect" "$work/probe.log" | head -1)); running the tests under it"
  local start=$SECONDS status=0
  if [ "$shards" = -- ]; then
    # first the probe again, in an xdist worker, through the same files: it must be counted
    mkdir -p "$work/probe-workers"
    PYTEST_ADDOPTS="-s" VKATTN_LAYER_LOG_DIR="$work/probe-workers" \
      "$PY" -m pytest -q -n 1 -p no:cacheprovider tests/sync_probe.py > "$work/probe-worker.log" 2>&1
    if ! cat "$work/probe-workers"/*.log 2>/dev/null | grep -qE -- "$expect"; then
      echo "validation ($name): the probe run in an xdist worker was not reported through VKATTN_LAYER_LOG_DIR" >&2
      cat "$work/probe-worker.log" >&2
      return 1
    fi
    echo "validation ($name): an xdist worker's messages reach the count (the probe in a worker reported)"
    mkdir -p "$work/workers"
    PYTEST_ADDOPTS="-s ${PYTEST_ADDOPTS:-}" VKATTN_LAYER_LOG_DIR="$work/workers" "$@" 2>&1 | tee "$work/$name.log"
    status=${PIPESTATUS[0]}
    # each xdist worker creates its file as it starts (tests/conftest.py): workers without one
    # would mean their layer messages went nowhere
    local files=("$work/workers"/*.log)
    if [ -e "${files[0]}" ]; then
      cat "${files[@]}" >> "$work/$name.log"
    elif grep -q "bringing up nodes" "$work/$name.log"; then
      echo "validation ($name): xdist workers ran but none wrote a log under VKATTN_LAYER_LOG_DIR" >&2
      status=1
    fi
  elif [ -z "$shards" ]; then
    "$PY" -m pytest -q -s -p no:cacheprovider "$@" 2>&1 | tee "$work/$name.log"
    status=${PIPESTATUS[0]}
  else
    local i=0 pids=() k list
    IFS=';' read -ra list <<< "$shards"
    for k in "${list[@]}"; do
      "$PY" -m pytest -q -s -p no:cacheprovider -k "$k" "$@" > "$work/$name.$i.log" 2>&1 &
      pids+=($!)
      i=$((i + 1))
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    cat "$work/$name".*.log | tee "$work/$name.log"
  fi
  local count
  drop_notices < "$work/$name.log" > "$work/$name.findings"
  count=$(grep -cE "$pattern" "$work/$name.findings")
  echo "validation ($name): $count validation messages, $((SECONDS - start)) s"
  if [ "$count" -ne 0 ]; then
    grep -E "$pattern" "$work/$name.findings" | sort | uniq -c | head -20 >&2
    return 1
  fi
  return "$status"
}

# the rule vkattn/_kp.py takes for a write after a read (the cascade's append after its shared
# pass): a download of any buffer between them orders the pair. The layer must report the pair
# without the download and say nothing with it
war_check() {
  "$PY" tests/sync_probe.py war > "$work/war.log" 2>&1
  if ! grep -q SYNC-HAZARD-WRITE-AFTER-READ "$work/war.log"; then
    echo "validation (sync): the layer did not report tests/sync_probe.py war's SYNC-HAZARD-WRITE-AFTER-READ" >&2
    return 1
  fi
  "$PY" tests/sync_probe.py war-download > "$work/war.log" 2>&1 || { cat "$work/war.log" >&2; return 1; }
  if grep -qE "$pattern" "$work/war.log"; then
    echo "validation (sync): a download between a read and a write did not order them:" >&2
    grep -E "$pattern" "$work/war.log" | head -5 >&2
    return 1
  fi
  echo "validation (sync): write-after-read ordered by a download (0 messages; reported without it)"
}

rc=0
for pass in $passes; do
  case $pass in
    sync)
      # enables: the layer of Debian 12 (1.3.239); validate_sync and the shader-access heuristic: the
      # layer of Debian 13 (1.4.309), whose syncval tracks no descriptor access without the heuristic
      # (the probe's hazard goes unreported); each layer ignores the other's keys
      settings "khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT
khronos_validation.validate_sync = true
khronos_validation.syncval_shader_accesses_heuristic = true"
      war_check || rc=1
      # `-- COMMAND`: that command under the layer; no arguments: `make test` itself (the whole
      # suite on xdist, each worker's messages counted the same way); arguments: one pytest
      # process with them
      shards=""
      if [ "${1:-}" = -- ]; then
        shift; shards=--
      elif [ $# -eq 0 ]; then
        shards=--; set -- make test VENV="${VENV:-.venv}"
      fi
      run_pass sync tests/sync_probe.py SYNC-HAZARD-READ-AFTER-WRITE "$shards" "$@" || rc=1 ;;
    gpuav)
      # enables + gpuav_buffer_oob: Debian 12's layer; gpuav_enable + descriptor checks: Debian 13's,
      # which names an out-of-bounds storage-buffer access VUID-vkCmdDispatch-storageBuffers-06936
      settings "khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_GPU_ASSISTED_EXT
khronos_validation.gpuav_buffer_oob = true
khronos_validation.gpuav_enable = true
khronos_validation.gpuav_shader_instrumentation = true
khronos_validation.gpuav_descriptor_checks = true"
      run_pass gpuav tests/gpuav_probe.py 'VUID-vkCmdDispatch-None-02706|VUID-vkCmdDispatch-storageBuffers-06936' \
        "${VKATTN_GPUAV_KERNELS:-lane and (float16 or float32 or mask);lane and (int8 or fp8);lane and q4;tile and (float16 or float32 or mask);tile and not (float16 or float32 or mask);coopmat}" \
        -m "${VKATTN_GPUAV_MARK-gpuav}" tests/test_bounds.py --durations=5 || rc=1 ;;
    *) echo "validation: unknown pass '$pass' in VKATTN_VALIDATION (sync, gpuav)" >&2; exit 2 ;;
  esac
done
exit "$rc"
