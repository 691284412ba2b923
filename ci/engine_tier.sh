#!/usr/bin/env bash
# The engine tier: dsv4_rocm's vLLM plugin tested against the real vLLM 0.33.0 on a CPU machine, in its own
# virtual environment .venv-engines (apart from the test venv: vLLM's modules need packages the main suite
# does not). vLLM is installed with --no-deps beside torch 2.13 CPU and the packages its imports need
# (ci/engine_requirements.txt); its wheel's own dependencies would bring a CUDA torch and ~7.7 GB. Then
# pytest over tests/engines (or the paths given) with vLLM on its CPU platform and Triton kernels, vLLM's
# and ours, under the interpreter, and, with no paths given, vLLM's own DeepSeek-V4 tests from its sdist
# (unpacked into .vllm-tests/) against dsv4_rocm's ops (tests/engines/with_vllm/vllm_suite.py). Where the
# package index refuses vLLM, or its sdist cannot be fetched, the tier says so and skips that part.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "ci/engine_tier.sh: $*"; }
start=$(date +%s)
V=.venv-engines
[ -x "$V/bin/python" ] || { say "creating $V"; python3 -m venv "$V"; }
pip="$V/bin/python -m pip install -q --disable-pip-version-check"
say "installing torch==2.13.0 triton==3.6.0 pytest, vllm==0.33.0 (--no-deps) and its imports into $V"
$pip torch==2.13.0 triton==3.6.0 numpy tqdm pytest
if ! $pip --no-deps vllm==0.33.0; then
  say "SKIPPED: the package index refused vllm==0.33.0, so the engine tier cannot run here"
  exit 0
fi
$pip --no-deps -r ci/engine_requirements.txt
$pip --no-deps --no-build-isolation -e .       # the plugin's entry point, as pip install dsv4_rocm[vllm] gives it
say "installed in $(( $(date +%s) - start )) s"
run_tests() {
  local status=0
  TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= "$V/bin/python" -m pytest -q -p no:cacheprovider \
    "${@:-tests/engines}" || status=$?
  if [ $# -eq 0 ]; then
    hooks="$PWD/tests/engines/with_vllm"
    if files=$("$V/bin/python" "$hooks/vllm_sdist.py" .vllm-tests); then
      say "vLLM 0.33.0's DeepSeek-V4 tests against dsv4_rocm's ops"
      (cd .vllm-tests && TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 \
        PYTHONPATH="$PWD:$hooks" "../$V/bin/python" -m pytest -q -p no:cacheprovider -p vllm_suite -c pyproject.toml \
        $files) || status=$?
    else
      say "SKIPPED vLLM's own tests: its sdist could not be fetched"
    fi
  fi
  return $status
}
# vLLM's modules print warnings that are expected on a CPU machine (its compiled extensions missing, torch
# deprecations): ci/engine_warnings.py drops those it knows and says in one line what it dropped
status=0
run_tests "$@" 2>&1 | python3 ci/engine_warnings.py vllm ci/engine_tier.sh || status=$?
say "done in $(( $(date +%s) - start )) s"
exit $status
