#!/usr/bin/env bash
# The SGLang engine tier: tests/engines/test_sglang.py against the real sglang==0.5.23 package.
#
# SGLang pins its own CUDA torch and about a hundred serving packages; none of that is needed to import the
# modules the dsv4_rocm plugin hooks. So this builds a virtual environment of its own (DSV4_SGLANG_VENV,
# default build/venvs/sglang), apart from the test venv of ci/setup.sh:
#   - torch==2.13.0 (the CPU build where pip's index serves one) with torchvision==0.28.0, which
#     sglang.srt.configs imports, from PyTorch's CPU index (download.pytorch.org/whl/cpu): the only place a
#     CPU build of torchvision exists. PyPI's torchvision 0.28.0 is built against a CUDA torch: its
#     torchvision/_C.so needs libtorch_cuda.so, libc10_cuda.so and libcudart.so.13, which a CPU torch does not
#     have, so `import torchvision` fails beside it. Where PyTorch's index cannot be reached (no answer in
#     20 s), the tier cannot have a CPU torch and installs SGLang's own pins torch==2.14.1 and
#     torchvision==0.29.1 instead: CUDA builds with their NVIDIA libraries, about 5 GB more, that run on the
#     CPU. It says which torch it got;
#   - sglang==0.5.23 with --no-deps, plus the packages its DeepSeek-V4 attention, memory-pool and plugin
#     modules import, also with --no-deps, pinned with everything they need in ci/engine_requirements_sglang.txt
#     (SGLang's own pins where it pins them; compressed-tensors without its dependencies, which would replace
#     torch). pip then never resolves against sglang's ~100 serving requirements, so it has nothing to report;
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
    say "no CPU torchvision 0.28.0 (PyTorch's CPU index unreachable; PyPI's build needs a CUDA torch):" \
      "installing SGLang's pins torch==2.14.1 torchvision==0.29.1, CUDA builds"
    $PIP torch==2.14.1 torchvision==0.29.1
  fi
fi
if ! $PIP --no-deps sglang==0.5.23; then
  say "the package index refuses sglang==0.5.23: the SGLang tier is not run"
  exit 0
fi
say "installing what sglang's DeepSeek-V4 modules import (ci/engine_requirements_sglang.txt, --no-deps)"
$PIP --no-deps -r ci/engine_requirements_sglang.txt
$PIP --no-deps -e .
"$PY" -c "import torch, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__,
      '(a CPU build)' if torch.version.cuda is None else '(a CUDA build: no CPU torchvision could be installed)')"
# SGLang's imports print warnings that are expected here: ci/engine_warnings.py drops those it knows and says
# in one line what it dropped
"$PY" -m pytest -q -p no:cacheprovider "${@:-tests/engines/test_sglang.py}" 2>&1 |
  python3 ci/engine_warnings.py sglang "ci/$(basename "$0")"
