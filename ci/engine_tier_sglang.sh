#!/usr/bin/env bash
# The SGLang engine tier: tests/engines/test_sglang.py against the real sglang==0.5.23 package.
#
# SGLang pins its own CUDA torch and about a hundred serving packages; none of that is needed to import the
# modules the dsv4_rocm plugin hooks. So this builds a virtual environment of its own (DSV4_SGLANG_VENV,
# default build/venvs/sglang), apart from the test venv of ci/setup.sh:
#   - torch==2.13.0 (the CPU build where pip's index serves one) with torchvision==0.28.0, which
#     sglang.srt.configs imports, from PyTorch's CPU index. PyPI's torchvision is a CUDA build that a CPU
#     torch cannot load: where the CPU index cannot be reached, SGLang's own pins torch==2.14.1 and
#     torchvision==0.29.1 are installed instead (CUDA builds; they run on the CPU);
#   - sglang==0.5.23 with --no-deps, plus the packages its DeepSeek-V4 attention, memory-pool and plugin
#     modules import (SGLang's own pins where it pins them; compressed-tensors without its dependencies,
#     which would replace torch);
#   - dsv4_rocm editable, so SGLang's plugin loader finds its `sglang.srt.plugins` entry point.
# A venv that already has all of it is reused. Then pytest over tests/engines/test_sglang.py (or the
# paths given). If the package index refuses sglang, the script says so and exits 0: the tests then
# skip in the main suite with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "ci/$(basename "$0"): $*"; }
VENV=${DSV4_SGLANG_VENV:-build/venvs/sglang}
PY="$VENV/bin/python"
PIP="$PY -m pip install -q --disable-pip-version-check"

[ -x "$PY" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
if ! "$PY" -c "import torch, torchvision, triton, pytest, hypothesis" 2>/dev/null; then
  say "installing torch==2.13.0 triton==3.6.0 torchvision and the test tools into $VENV"
  $PIP torch==2.13.0 triton==3.6.0 numpy pytest hypothesis
  $PIP --no-deps --timeout 20 --retries 0 --index-url https://download.pytorch.org/whl/cpu torchvision==0.28.0 ||
    $PIP --no-deps torchvision==0.28.0
  if ! "$PY" -c "import torchvision" 2>/dev/null; then
    say "torchvision 0.28.0 does not load with this torch: installing SGLang's pins torch==2.14.1 torchvision==0.29.1"
    $PIP torch==2.14.1 torchvision==0.29.1
  fi
fi
if ! $PIP --no-deps sglang==0.5.23; then
  say "the package index refuses sglang==0.5.23: the SGLang tier is not run"
  exit 0
fi
say "installing what sglang's DeepSeek-V4 modules import"
$PIP --no-deps compressed-tensors==0.18.0
$PIP transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 openai==2.8.0 apache-tvm-ffi==0.1.11 \
  orjson pyyaml pillow pyzmq psutil requests msgspec pybase64 pydantic ipython aiohttp dill gguf einops \
  partial_json_parser setproctitle starlette loguru
$PIP --no-deps -e .
"$PY" -c "import torch, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__)"
exec "$PY" -m pytest -q -p no:cacheprovider "${@:-tests/engines/test_sglang.py}"
