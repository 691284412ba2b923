#!/usr/bin/env bash
# The compatibility tier: the CPU suite's kernel, interpreter and compile-matrix tests under vLLM 0.33.0's
# pair, torch 2.14.0 + triton 3.8.0, in a venv of its own (./.venv-compat), so that the pinned pair of
# ci/test.sh (torch 2.13 + triton 3.6, the GPU machines' compiler) and this one are both tested.
#   - torch 2.14.0 is a CUDA build on PyPI (there is no CPU wheel of it there); it runs on the CPU, and
#     setup.py is not run (the package is used from the source tree through PYTHONPATH), so no extension
#     build starts;
#   - the tests: COMPAT_TESTS below (every op's kernel and interpreter tests, the AMD execution tier, the
#     launch module and the interpreter fixes, the compile matrix), or the paths given as arguments;
#   - the compilers of the compile matrix come from ci/test.sh, which CI runs first.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "ci/compat_tier.sh: $*"; }
start=$(date +%s)
VENV=.venv-compat
[ -x "$VENV/bin/python3" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
. "$VENV/bin/activate"
say "installing torch==2.14.0 triton==3.8.0 and the test packages into $VENV"
python3 -m pip install -q --disable-pip-version-check torch==2.14.0 triton==3.8.0 numpy tqdm pytest pytest-xdist \
  hypothesis matplotlib
say "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
say "installed in $(( $(date +%s) - start )) s"

COMPAT_TESTS=(
  tests/tooling/test_compile_matrix.py tests/tooling/test_amd_tier.py tests/tooling/test_fast_launch.py tests/test_helpers.py
  tests/cache/test_cache_fnuz.py tests/cache/test_cache_fnuz_padding.py
  tests/cache/test_dequantize_and_gather_k_cache.py tests/cache/test_dequantize_global_slots_k_cache.py
  tests/cache/test_quant.py tests/cache/test_quantize_and_insert_k_cache.py
  tests/qkv/test_fused_deepseek_v4_kv_rope_insert.py
  tests/qkv/test_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert.py tests/qkv/test_fused_q_kv_rmsnorm.py
  tests/qkv/test_qnorm_rope_and_insert_full_bf16_k_cache.py tests/qkv/test_qnorm_rope_and_insert_full_k_cache.py
  tests/qkv/test_rope.py
  tests/compressor/test_compressor.py tests/compressor/test_fused_save_compress_norm.py
  tests/compressor/test_rope_quant_insert.py
  tests/indexer/test_indexer.py tests/indexer/test_indexer_k_cache.py tests/indexer/test_indexer_k_norm_rope_store.py
  tests/indexer/test_mask_candidate_logits.py tests/indexer/test_select_candidate_blocks.py
  tests/indexer/test_top_k_per_row.py
  tests/metadata/test_step_index_sets_v41.py
  tests/attention/test_ragged_indices_to_dense.py tests/attention/test_rocm_inverse_rope_rows.py
  tests/attention/test_vllm_rocm_sparse_attn.py tests/attention/test_sparse_mla.py
  tests/output/test_fp8_einsum.py tests/output/test_fused_inv_rope_fp8_quant.py tests/output/test_merge_attn_states.py
  tests/output/test_output.py
)
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
set +e
python3 -m pytest -q -n auto -p no:cacheprovider --durations=10 "${@:-${COMPAT_TESTS[@]}}"
rc=$?
set -e
say "torch 2.14.0 + triton 3.8.0: pytest exit $rc, $(( $(date +%s) - start )) s in all (install included)"
exit $rc
