#!/usr/bin/env bash
# FlashMLA, the peer sparse attention is measured beside, in the git-ignored folder .peers/FlashMLA:
#   bash gpu/flashmla_peer.sh fetch   clone it at the commit BENCHMARKS.md names, with the CUTLASS headers it
#                                    pins (needs network; a copy placed there by other means works too)
#   bash gpu/flashmla_peer.sh build   build it in place on an NVIDIA GPU machine (sm_90a only, about 150 s on
#                                    16 cores); `import flash_mla` then works with .peers/FlashMLA on sys.path
# gpu/suite.sh builds it in the background when the folder is there, and runs FlashMLA's own sparse
# cases through dsv4_rocm.flash_mla (gpu/flashmla_cases.py), timing FlashMLA beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.peers/FlashMLA
COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0
case "${1:-}" in
  fetch)
    [ -d "$DIR" ] || git clone -q https://github.com/deepseek-ai/FlashMLA.git "$DIR"
    git -C "$DIR" checkout -q "$COMMIT"
    git -C "$DIR" submodule update --init -q csrc/cutlass ;;
  build)
    [ -f "$DIR/setup.py" ] || { echo "gpu/flashmla_peer.sh: no FlashMLA checkout in $DIR (run: bash gpu/flashmla_peer.sh fetch)" >&2; exit 2; }
    [ -d "$DIR/csrc/cutlass/include/cute" ] || { echo "gpu/flashmla_peer.sh: $DIR/csrc/cutlass lacks the CUTLASS headers" >&2; exit 2; }
    nvcc=$(command -v nvcc) || { echo "gpu/flashmla_peer.sh: nvcc not found" >&2; exit 2; }
    cuda_home=$(dirname "$(dirname "$nvcc")")
    # CUDA 13 moved the CCCL headers (cuda/std, nv/target) under include/cccl
    cd "$DIR" && FLASH_MLA_DISABLE_SM100=1 NVCC_THREADS=2 MAX_JOBS=$(nproc) \
      CPLUS_INCLUDE_PATH="$cuda_home/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
      python3 setup.py build_ext --inplace ;;
  *)
    echo "usage: bash gpu/flashmla_peer.sh fetch|build" >&2; exit 2 ;;
esac
