#!/usr/bin/env bash
# compute-sanitizer over every GPU test file: memcheck (out-of-bounds and misaligned accesses), racecheck
# (shared-memory hazards) and initcheck (reads of global memory nothing wrote).
#
# What is covered: every test_*.py of tests/ and its stage folders holding a `gpu` test, each file under each
# tool as a job of its own (`compute-sanitizer --tool T python -m pytest -m gpu --one-case --sanitizer T FILE`),
# several jobs at once (SANITIZER_JOBS, default one per CPU core but one), all within one wall-clock budget. --one-case: every
# test function runs once, with its first parameter set (every kernel's tests at the cost of one case each;
# SANITIZE_ALL_CASES=1 runs every parameter set, which does not fit a ten-minute call). torch's caching
# allocator is off under the tools (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so every tensor is an allocation of
# its own: an access past a tensor is past an allocation, and a read of an unwritten tensor a read of
# unwritten memory. What does not run under a tool is skipped by name with its reason, listed in one place,
# tests/sanitizer_skips.py; any CUDA graph capture skips its test (a capture needs the caching allocator).
# Before the tools, a plain pass (no tool, allocator on; SANITIZE_PLAIN=0 leaves it out) runs the same files
# to compile every kernel into the shared caches and to show each file's result without a tool.
#
# Results in OUT_DIR: logs/TOOL__FILE.log (and .xml) per job, findings_TOOL.txt (each distinct finding: kind,
# places, count), summary.txt / summary.json: per file and tool, tests ran/passed/failed/skipped, the
# tool's finding count and seconds; printed last. Exit 1 when a tool found something, a test failed under
# a tool, or a job was cut at the budget.
#
# dsv4_rocm._C (the HIP ops, built for this GPU) is built first when it is not importable (the build stage
# of gpu/suite.sh), so no test builds it under a tool.
#
# Controls: beside the tests, racecheck runs gpu/racecheck_control.py and initcheck gpu/initcheck_control.py,
# programs that are right by construction; what a tool reports there is what it cannot see (the summary's
# last lines), which is how its reports on the Hopper decode kernel's hand-offs are to be read.
#
# Cost on an H200 (16 cores): with the build, `bash gpu/suite.sh build memcheck` takes about 9.5 minutes,
# one ten-minute call (build 1 min, then this script's budget).
#
# Usage: bash gpu/sanitize.sh OUT_DIR [TOOL ...]      (tools: memcheck racecheck initcheck; default all)
# Environment: SANITIZER_SECONDS (the budget of the plain pass and the tool jobs together, default 470),
# SANITIZER_JOBS, SANITIZE_TESTS (test files, default every file with gpu tests), SANITIZE_ALL_CASES,
# SANITIZE_PLAIN.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift; mkdir -p "$OUT"
TOOLS=${*:-memcheck racecheck initcheck}
if ! command -v compute-sanitizer >/dev/null; then
  for t in $TOOLS; do echo "$t: skipped (compute-sanitizer is not on PATH; it ships with the CUDA toolkit)"; done
  exit 0
fi
if ! python3 -c "import dsv4_rocm._C" 2>/dev/null; then
  echo "dsv4_rocm._C is not importable: building it first (gpu/suite.sh build, log in $OUT/build)"
  OUT="$OUT/build" bash gpu/suite.sh build 2>&1 | tail -6
fi
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 and --one-case are set per job by the driver
exec python3 gpu/sanitize.py "$OUT" $TOOLS
