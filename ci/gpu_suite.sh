#!/usr/bin/env bash
# What a GPU machine runs: environment, GPU tests, a memcheck pass, the benchmarks; a short table last.
# Usage: bash ci/gpu_suite.sh [quick]   (results under $OUT, default ./gpu_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || rocm-smi 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m dsv4_rocm info
start=$(date +%s)
python3 -c "from dsv4_rocm._build import load; load()" 2>&1 | tail -5
build_rc=${PIPESTATUS[0]}
echo "dsv4_rocm._C build: rc=$build_rc, $(( $(date +%s) - start )) s"
[ "$build_rc" = 0 ] || status=1

python3 -m pytest -m gpu -q tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | grep -v "^\s*$" | tail -40
gpu_rc=${PIPESTATUS[0]}
[ "$gpu_rc" = 0 ] || status=1

if command -v compute-sanitizer >/dev/null && [ "${1:-}" != "quick" ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 5 \
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sparse_mla.py tests/test_quantize_and_insert_k_cache.py \
      tests/test_dequantize_and_gather_k_cache.py tests/test_dequantize_global_slots_k_cache.py \
      tests/test_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert.py tests/test_qnorm_rope_and_insert_full_k_cache.py \
      -k "all_invalid or smoke or (reference_bytes and 3-100) or garbage or 2-5-400 or 2-37-2048 or 17-16-64-0 or 300-16-64" \
      > "$OUT/memcheck.log" 2>&1
  mc_rc=$?
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  [ "$mc_rc" = 0 ] || status=1
else
  mc_rc=skipped
fi

python3 -m dsv4_rocm parity --report "$OUT/parity_$(python3 -c 'from dsv4_rocm.platform import detect; print(detect("cuda").arch)').json" | tail -3
parity_rc=${PIPESTATUS[0]}
[ "$parity_rc" = 0 ] || status=1
python3 -m dsv4_rocm run --device cuda 2>&1 | tail -6
run_rc=${PIPESTATUS[0]}
[ "$run_rc" = 0 ] || status=1

# FlashMLA's own d_qk-512 test cases through dsv4_rocm.flash_mla (every FLASHMLA_EVERY-th), and FlashMLA
# timed beside it when its package is built here; needs a FlashMLA checkout in FLASHMLA_DIR
if [ -n "${FLASHMLA_DIR:-}" ]; then
  python3 ci/flashmla_cases.py --flashmla "$FLASHMLA_DIR" --every "${FLASHMLA_EVERY:-8}" --timing \
    --json "$OUT/flashmla_cases.json" > "$OUT/flashmla_cases.log" 2>&1
  fm_rc=$?
  sed -n '/^case  /,/^ratio = /p; /^timing skipped/p; /== FlashMLA cases/,$p' "$OUT/flashmla_cases.log"
  [ "$fm_rc" = 0 ] || status=1
else
  fm_rc="skipped (set FLASHMLA_DIR to a FlashMLA checkout)"
fi

# host time of the eager path, the direct launch on and off (FlashMLA beside it when FLASHMLA_DIR is built)
python3 ci/host_overhead.py ${FLASHMLA_DIR:+--flashmla "$FLASHMLA_DIR"} --json "$OUT/host_overhead.json" \
  > "$OUT/host_overhead.log" 2>&1
ho_rc=$?
sed -n '/== host overhead ==/,$p' "$OUT/host_overhead.log"
[ "$ho_rc" = 0 ] || status=1

python3 -m dsv4_rocm bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -90
bench_rc=${PIPESTATUS[0]}

echo
echo "== gpu_suite summary =="
echo "_C build:      rc=$build_rc"
echo "pytest -m gpu: rc=$gpu_rc ($(grep -Eo '[0-9]+ passed|[0-9]+ failed' "$OUT/pytest_gpu.log" | tr '\n' ' '))"
echo "memcheck:      rc=$mc_rc"
echo "parity:        rc=$parity_rc"
echo "main job:      rc=$run_rc"
echo "FlashMLA cases: rc=$fm_rc (log in $OUT/flashmla_cases.log)"
echo "host overhead: rc=$ho_rc (log in $OUT/host_overhead.log)"
echo "bench:         rc=$bench_rc (table above, JSON in $OUT/bench.json)"
exit $status
