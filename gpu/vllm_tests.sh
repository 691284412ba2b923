#!/usr/bin/env bash
# vLLM 0.33.0's own DeepSeek-V4 and V4.1 kernel and metadata tests on a GPU machine, against dsv4_rocm's ops:
# the engine tier's plugin (tests/engines/with_vllm/vllm_suite.py) run over vLLM's Python files carried in
# .carry/vllm_py.tar.xz (gpu/vllm_carry.sh builds it on a machine with network; the GPU machine needs none and
# nothing is installed). The test files are vllm_sdist.FILES. Prints the plugin's table: cases run, passed,
# failed, skipped by reason, failures by cause. Stage `vllm` of gpu/suite.sh.
#
# Usage: bash gpu/vllm_tests.sh          (results under $OUT, default ./gpu_out: vllm_tests.log, vllm_table.txt)
# Environment: PYTEST_WORKERS (default 8, with pytest-xdist), VLLM_CARRY (default .carry/vllm_py.tar.xz),
# VLLM_CARRY_DIR (where it is unpacked, default /tmp/dsv4_vllm), PYTEST_ARGS (extra pytest arguments, e.g. -k).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}; mkdir -p "$OUT"
say() { echo "gpu/vllm_tests.sh: $*"; }
T0=$(date +%s)
CARRY=${VLLM_CARRY:-.carry/vllm_py.tar.xz}
DEST=${VLLM_CARRY_DIR:-/tmp/dsv4_vllm}
if [ ! -f "$CARRY" ]; then
  say "SKIPPED: no $CARRY (bash gpu/vllm_carry.sh builds it where there is network; carry .carry to this machine)"
  exit 3
fi
rm -rf "$DEST"; mkdir -p "$DEST"
tar -xJf "$CARRY" -C "$DEST" || exit 2
SITE=$DEST/vllm_py/site
TESTS=$DEST/vllm_py/tests
HOOKS=$ROOT/tests/engines/with_vllm

# dsv4_rocm's vLLM plugin is found through its entry point: where dsv4_rocm is not installed, a dist-info with
# the entry point of pyproject.toml stands for the install
EP=$DEST/entry_point
mkdir -p "$EP/dsv4_rocm-0+checkout.dist-info"
printf 'Metadata-Version: 2.1\nName: dsv4_rocm\nVersion: 0+checkout\n' > "$EP/dsv4_rocm-0+checkout.dist-info/METADATA"
python3 - "$ROOT/pyproject.toml" > "$EP/dsv4_rocm-0+checkout.dist-info/entry_points.txt" <<'EOF'
import sys, tomllib
eps = tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"]
for group, entries in eps.items():
    print(f"[{group}]")
    for name, target in entries.items():
        print(f"{name} = {target}")
EOF
if python3 -c "import importlib.metadata as m, sys
sys.exit(not any(e.name == 'dsv4_rocm' for e in m.entry_points(group='vllm.general_plugins')))"; then
  rm -rf "$EP/dsv4_rocm-0+checkout.dist-info"      # installed (pip install -e .): that entry point serves
fi
export PYTHONPATH="$SITE:$EP:$ROOT:$HOOKS" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# dsv4_rocm._C once, before the workers start (each would otherwise build it on first use)
python3 -c "
from dsv4_rocm.ops._dispatch import machine_backends
if 'hip' in machine_backends('cuda'):
    from dsv4_rocm._build import load; load(); print('dsv4_rocm._C ready')
else:
    print('dsv4_rocm._C not buildable here: the Triton and reference backends run')" 2>&1 | tail -3
say "unpacked and ready in $(( $(date +%s) - T0 )) s"

files=$(python3 -c "import vllm_sdist; print(' '.join(vllm_sdist.FILES))")
workers=${PYTEST_WORKERS:-8}
xdist=""; python3 -c "import xdist" 2>/dev/null && [ "$workers" -gt 1 ] && xdist="-n $workers"
say "pytest $xdist over vLLM's tests (log: $OUT/vllm_tests.log)"
(cd "$TESTS" && python3 -m pytest -q -p no:cacheprovider -p vllm_suite -c pyproject.toml $xdist ${PYTEST_ARGS:-} \
  $files) > "$OUT/vllm_tests.log" 2>&1
rc=$?
sed -n "/vLLM 0.33.0's DeepSeek-V4 tests against dsv4_rocm/,\$p" "$OUT/vllm_tests.log" > "$OUT/vllm_table.txt"
if [ -s "$OUT/vllm_table.txt" ]; then cat "$OUT/vllm_table.txt"; else tail -40 "$OUT/vllm_tests.log"; fi
say "pytest rc=$rc in $(( $(date +%s) - T0 )) s"
exit $rc
