#!/usr/bin/env bash
# The whole pytest suite under the Khronos validation layer with synchronization validation on.
# Fails if the layer is not active (a deliberately racy probe must be reported), if any test
# fails, or if the layer prints any validation or synchronization message during the suite.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/vk_layer_settings.txt" <<'SETTINGS'
khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT
khronos_validation.debug_action = VK_DBG_LAYER_ACTION_LOG_MSG
khronos_validation.report_flags = error,warn
khronos_validation.log_filename = stdout
SETTINGS
export VK_LAYER_SETTINGS_PATH="$work/vk_layer_settings.txt" VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation
pattern='Validation (Error|Warning)|VUID-|SYNC-HAZARD'

"$PY" tests/sync_probe.py > "$work/probe.log" 2>&1
if ! grep -q "SYNC-HAZARD-READ-AFTER-WRITE" "$work/probe.log"; then
  echo "validation: the layer did not report the probe's hazard; is vulkan-validationlayers installed?" >&2
  cat "$work/probe.log" >&2
  exit 1
fi
echo "validation: layer active (probe hazard reported); running the suite under it"

"$PY" -m pytest -q -s -p no:cacheprovider "$@" 2>&1 | tee "$work/suite.log"
status=${PIPESTATUS[0]}
count=$(grep -cE "$pattern" "$work/suite.log")
echo "validation: $count validation/synchronization messages during the suite"
if [ "$count" -ne 0 ]; then
  grep -E "$pattern" "$work/suite.log" | sort | uniq -c | head -20 >&2
  exit 1
fi
exit "$status"
