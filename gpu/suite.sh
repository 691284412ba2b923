#!/usr/bin/env bash
# What a GPU machine runs: environment, the install with the HIP extension (the README's GPU command), GPU
# tests, a compute-sanitizer pass (memcheck, racecheck, initcheck: gpu/sanitize.sh), the parity
# report, the main job, FlashMLA's own cases through our API, the benchmarks; a short summary last.
#
# Usage: bash gpu/suite.sh [STAGE ...]      (results under $OUT, default ./gpu_out)
#   stages: build tests memcheck parity main flashmla host bench perf vllm   (default: all but perf and vllm, in
#   that order)
#   perf: the speed report of the sparse attention kernels beside FlashMLA (gpu/decode_ws.py: every decode
#   and prefill row with the Hopper kernel's variants and timing probes; gpu/flashmla_cases.py --timing-only:
#   the comparison table on FlashMLA's own tensors) and the layer step, einsum, top-k and start-up rows of
#   `python -m dsv4_rocm bench`; it builds FlashMLA first when it is not built.
#   vllm: vLLM 0.33.0's own DeepSeek-V4 and V4.1 kernel and metadata tests against dsv4_rocm's ops
#   (gpu/vllm_tests.sh, 8 xdist workers); needs .carry/vllm_py.tar.xz from gpu/vllm_carry.sh, carried along.
#   e.g. `bash gpu/suite.sh build tests` then `bash gpu/suite.sh build flashmla bench` fit two calls
#   of ten minutes each on an H100; `bash gpu/suite.sh build memcheck` (the sanitizer pass: about 9.5
#   minutes on an H200, its table in $OUT/sanitize/summary.txt) fits one call by itself.
# Environment: PYTEST_WORKERS (default 4, with pytest-xdist), FLASHMLA_DIR (default .peers/FlashMLA, see
# gpu/flashmla_peer.sh: built here in the background when it is not built yet), FLASHMLA_EVERY (every n-th
# FlashMLA case, default 8), BENCH_ARGS (extra arguments of `python -m dsv4_rocm bench`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAGES=${*:-build tests memcheck parity main flashmla host bench}
want() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
declare -A RC
status=0
record() { RC[$1]=$2; [ "$2" = 0 ] || [ "$2" = skipped ] || status=1; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || rocm-smi --showproductname 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

FLASHMLA_DIR=${FLASHMLA_DIR:-$PWD/.peers/FlashMLA}
fm_built() { python3 -c "import sys; sys.path.insert(0, '$FLASHMLA_DIR'); import flash_mla.cuda" 2>/dev/null; }
if { want flashmla || want perf; } && [ -f "$FLASHMLA_DIR/setup.py" ] && ! fm_built; then
  stamp "building FlashMLA in the background (log: $OUT/flashmla_build.log)"
  ( FLASHMLA_DIR=$FLASHMLA_DIR bash gpu/flashmla_peer.sh build > "$OUT/flashmla_build.log" 2>&1 ) &
  FM_BUILD=$!
fi

if want build; then
  # the README's GPU install, as a user types it, for the GPU this machine has; then the extension imports
  arch=$(python3 -m build_tools.extension --arch-env)
  stamp "dsv4_rocm._C: $arch pip install --no-deps --no-build-isolation -e . (log: $OUT/install.log)"
  env "$arch" python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
  rc=$?
  tail -3 "$OUT/install.log"
  if [ "$rc" = 0 ]; then
    python3 -c "import dsv4_rocm._C as c; print('dsv4_rocm._C imported:', c.__file__)"
    rc=$?
  fi
  python3 -m dsv4_rocm info | grep "HIP extension"
  record build "$rc"
fi

if want tests; then
  stamp "pytest -m gpu"
  workers=${PYTEST_WORKERS:-4}
  xdist=""; python3 -c "import xdist" 2>/dev/null && [ "$workers" -gt 1 ] && xdist="-n $workers"
  python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark $xdist tests 2>&1 | tee "$OUT/pytest_gpu.log" |
    grep -vE "^\s*$|^SKIPPED|^[.sxF]+( +\[ *[0-9]+%\])?$" | tail -30
  record tests "${PIPESTATUS[0]}"
fi

if want memcheck; then
  stamp "compute-sanitizer memcheck, racecheck, initcheck over every gpu test function (gpu/sanitize.sh)"
  bash gpu/sanitize.sh "$OUT/sanitize"
  record memcheck $?
  command -v compute-sanitizer >/dev/null || RC[memcheck]=skipped
fi

if want parity; then
  stamp "parity report"
  arch=$(python3 -c 'from dsv4_rocm.platform import detect; print(detect("cuda").arch)')
  python3 -m dsv4_rocm parity --report "$OUT/parity_$arch.json" | tail -3
  record parity "${PIPESTATUS[0]}"
fi

if want main; then
  stamp "main job"
  python3 -m dsv4_rocm run --device cuda 2>&1 | tail -8
  rc=${PIPESTATUS[0]}
  python3 -m dsv4_rocm run --device cuda --config v4.1-flash 2>&1 | tail -12   # a V4.1 stack sharing caches
  v41=${PIPESTATUS[0]}
  record main "$(( rc != 0 ? rc : v41 ))"
fi

if want flashmla; then
  if [ -n "${FM_BUILD:-}" ]; then stamp "waiting for the FlashMLA build"; wait "$FM_BUILD"; tail -2 "$OUT/flashmla_build.log"; fi
  if [ -f "$FLASHMLA_DIR/tests/lib.py" ]; then
    stamp "FlashMLA's sparse cases through dsv4_rocm.flash_mla (every ${FLASHMLA_EVERY:-8}-th), FlashMLA timed beside"
    python3 gpu/flashmla_cases.py --flashmla "$FLASHMLA_DIR" --every "${FLASHMLA_EVERY:-8}" --timing \
      --json "$OUT/flashmla_cases.json" > "$OUT/flashmla_cases.log" 2>&1
    record flashmla $?
    sed -n '/^case  /,/^ratio = /p; /^timing skipped/p; /== FlashMLA cases/,$p' "$OUT/flashmla_cases.log"
  else
    record flashmla skipped
    echo "FlashMLA cases skipped: no checkout in $FLASHMLA_DIR (bash gpu/flashmla_peer.sh fetch)"
  fi
fi

if want host; then
  stamp "host time of the eager path (FlashMLA beside it when built)"
  fm_arg=""; [ -d "$FLASHMLA_DIR/flash_mla" ] && fm_arg="--flashmla $FLASHMLA_DIR"
  python3 gpu/host_overhead.py $fm_arg --json "$OUT/host_overhead.json" > "$OUT/host_overhead.log" 2>&1
  record host $?
  sed -n '/== host overhead ==/,$p' "$OUT/host_overhead.log"
fi

if want bench; then
  stamp "benchmarks"
  fm_path=""; [ -d "$FLASHMLA_DIR/flash_mla" ] && fm_path="$FLASHMLA_DIR"
  PYTHONPATH="$PYTHONPATH${fm_path:+:$fm_path}" python3 -m dsv4_rocm bench --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | tail -90
  record bench "${PIPESTATUS[0]}"
fi

if want perf; then
  if [ -n "${FM_BUILD:-}" ]; then stamp "waiting for the FlashMLA build"; wait "$FM_BUILD"; FM_BUILD=""; fi
  stamp "speed report: decode and prefill beside FlashMLA, layer step, einsum, top-k, start-up"
  fm_arg=""; [ -d "$FLASHMLA_DIR/flash_mla" ] && fm_arg="--flashmla $FLASHMLA_DIR"
  python3 gpu/decode_ws.py $fm_arg --json "$OUT/decode_ws.json" > "$OUT/decode_ws.log" 2>&1
  rc=$?
  sed -n '/== decode, us/,/^VERDICT/p; /^prefill case/,/^$/p' "$OUT/decode_ws.log"
  if [ -n "$fm_arg" ]; then
    python3 gpu/flashmla_cases.py $fm_arg --timing-only --json "$OUT/flashmla_timing.json" > "$OUT/flashmla_timing.log" 2>&1
    rc=$(( rc | $? ))
    sed -n '/^case  /,/^ratio = /p' "$OUT/flashmla_timing.log"
  fi
  for only in "C4 decode step" fp8_einsum "topk k=512 n=256K" "start-up"; do
    PYTHONPATH="$PYTHONPATH${fm_arg:+:$FLASHMLA_DIR}" python3 -m dsv4_rocm bench --only "$only" 2>&1 | tail -12
  done
  record perf "$rc"
fi

if want vllm; then
  stamp "vLLM 0.33.0's DeepSeek-V4 tests against dsv4_rocm (gpu/vllm_tests.sh)"
  PYTEST_WORKERS=${VLLM_PYTEST_WORKERS:-8} bash gpu/vllm_tests.sh
  rc=$?
  [ "$rc" = 3 ] && rc=skipped
  record vllm "$rc"
fi

echo
stamp "gpu_suite summary"
for s in build tests memcheck parity main flashmla host bench perf vllm; do
  want "$s" || continue
  extra=""
  [ "$s" = tests ] && extra=" ($(grep -Eo '[0-9]+ (passed|failed|error)' "$OUT/pytest_gpu.log" 2>/dev/null | tr '\n' ' '))"
  [ "$s" = vllm ] && extra=" ($(tail -1 "$OUT/vllm_tests.log" 2>/dev/null))"
  printf '%-9s rc=%s%s\n' "$s" "${RC[$s]:-?}" "$extra"
  # the sanitizer pass: one line per tool
  if [ "$s" = memcheck ]; then grep "^TOTAL" "$OUT/sanitize/summary.txt" 2>/dev/null | sed 's/^/  /'; fi
done
exit $status
