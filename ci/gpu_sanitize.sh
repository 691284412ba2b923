#!/usr/bin/env bash
# compute-sanitizer over the GPU tests of every kernel: memcheck (out-of-bounds and misaligned accesses),
# racecheck (shared-memory hazards) and initcheck (reads of global memory nothing wrote). Every `gpu` test
# function runs once, with its first parameter set (pytest --one-case): every kernel's tests at the cost
# of one case each. The tools run at once on the one GPU, each within a time budget, with torch's
# caching allocator off so that every tensor is an allocation of its own (an access past a tensor is
# then past an allocation, and a read of an unwritten tensor is a read of unwritten memory); graph
# capture, which needs that allocator, is left out. One summary line per tool.
#
# Usage: bash ci/gpu_sanitize.sh OUT_DIR [TOOL ...]      (tools: memcheck racecheck initcheck; default all)
# Environment: SANITIZER_SECONDS (each tool's budget, default 420: the three fit one ten-minute call),
# SANITIZE_TESTS (pytest paths, default tests), SANITIZE_K (pytest -k, default "not graph and not capture").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift; mkdir -p "$OUT"
TOOLS=${*:-memcheck racecheck initcheck}
budget=${SANITIZER_SECONDS:-420}
if ! command -v compute-sanitizer >/dev/null; then
  for t in $TOOLS; do echo "$t: skipped (compute-sanitizer is not on PATH; it ships with the CUDA toolkit)"; done
  exit 0
fi
for t in $TOOLS; do
  ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s INT -k 60 "$budget" \
      compute-sanitizer --tool "$t" --target-processes all --error-exitcode 9 --print-limit 20 \
      python3 -m pytest -m gpu -v -p no:cacheprovider -p no:benchmark --one-case \
        -k "${SANITIZE_K:-not graph and not capture}" ${SANITIZE_TESTS:-tests} > "$OUT/$t.log" 2>&1
    echo $? > "$OUT/$t.rc" ) &
done
wait
status=0
for t in $TOOLS; do
  rc=$(cat "$OUT/$t.rc")
  summary=$(grep -E "(ERROR|RACECHECK|INITCHECK) SUMMARY" "$OUT/$t.log" | tail -1 | sed -E 's/^=+ *//')
  ran=$(grep -cE "::.* (PASSED|FAILED|ERROR)" "$OUT/$t.log")
  failed=$(grep -cE "::.* (FAILED|ERROR)" "$OUT/$t.log")
  note=""
  case $rc in
    0) ;;
    9) note=", the tool found errors (see $OUT/$t.log)"; status=1 ;;
    124|130) note=", stopped at its ${budget} s budget"; status=1 ;;
    *) note=", pytest failed (see $OUT/$t.log)"; status=1 ;;
  esac
  printf '%-9s rc=%s  %s; %s tests ran, %s failed%s\n' "$t" "$rc" "${summary:-no summary printed}" "$ran" "$failed" \
    "$note" | tee "$OUT/$t.summary"
done
exit $status
