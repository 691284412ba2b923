#!/usr/bin/env bash
# Build .carry/vllm_py.tar.xz: what a GPU machine without network needs to run vLLM 0.33.0's own DeepSeek-V4
# tests against dsv4_rocm's ops (gpu/vllm_tests.sh). Run on a CPU machine with network, from anywhere.
#
# The archive unpacks into vllm_py/:
#   site/   vLLM 0.33.0's Python files (from its wheel as installed in the engine tier's .venv-engines, each
#           file checked against the wheel's RECORD, or from a wheel named by VLLM_WHEEL) without the compiled
#           parts, which the tests do not need (vllm_suite.py answers the few that vLLM imports on CUDA), and
#           the CPython 3.12 manylinux or pure-Python wheels of the packages vLLM's imports need that the
#           device image lacks (PY312_WHEELS below; the image's list: the device notes), installed flat;
#   tests/  the test files and helpers of tests/engines/with_vllm/vllm_sdist.py, from vLLM's sdist.
# Left out of vLLM: shared objects (.so), the vllm-rs binary, C/C++/CUDA sources and headers (DeepGEMM,
# CUTLASS, FMHA, FlashMLA trees), the API server's JavaScript. About 20 MB as tar.xz.
#
# Usage: bash gpu/vllm_carry.sh        Environment: VLLM_SITE (a site-packages holding vllm 0.33.0; default
#        .venv-engines' or /work/main/.venv-engines'), VLLM_WHEEL (a vllm-0.33.0 wheel instead), VLLM_TESTS
#        (a directory vllm_sdist.py unpacked; default .vllm-tests, else fetched into a temporary one).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "gpu/vllm_carry.sh: $*"; }
VERSION=0.33.0
OUT_ARCHIVE=.carry/vllm_py.tar.xz
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/vllm_py; SITE=$ROOT/site; mkdir -p "$SITE" "$ROOT/tests" .carry
PY=${PYTHON:-python3}

# What vLLM's DeepSeek-V4 test modules import beyond the device image (found by importing them with the
# image's packages; versions as ci/engine_requirements.txt pins them for the CPU tier). typing_extensions and
# anyio are newer than the image's and pydantic / starlette need the newer ones.
PY312_WHEELS=(
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.165.0
  httpcore2==2.16.2 httpx2==2.16.2 importlib_metadata==10.2.0 lazy-importer==0.1.0 llguidance==1.9.1 msgspec==0.22.0 openai==3.57.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5
  typing_extensions==4.16.0 xgrammar==0.2.8
)
PLATFORM=(--python-version 3.12 --implementation cp)      # the image is glibc 2.39 (Ubuntu 24.04's Python 3.12.3)
for v in 31 28 27 26 24 17 5; do PLATFORM+=(--platform manylinux_2_${v}_x86_64); done
PLATFORM+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# 1. vLLM's Python files
keep='\.(py|json|jinja|txt|typed)$'
if [ -n "${VLLM_WHEEL:-}" ]; then
  say "vLLM from $VLLM_WHEEL"
  "$PY" - "$VLLM_WHEEL" "$SITE" "$keep" <<'EOF'
import re, sys, zipfile
wheel, site, keep = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if ".dist-info/" in n or n.startswith("vllm/") and (
        n.endswith(".py") or re.search(keep, n) and "/third_party/" not in n)]
    z.extractall(site, names)
EOF
else
  for s in "${VLLM_SITE:-}" .venv-engines/lib/python3*/site-packages /work/main/.venv-engines/lib/python3*/site-packages; do
    [ -n "$s" ] && [ -f "$s/vllm-$VERSION.dist-info/RECORD" ] && VLLM_SITE=$s && break
  done
  [ -n "${VLLM_SITE:-}" ] || { say "no vllm $VERSION install found: set VLLM_SITE or VLLM_WHEEL"; exit 2; }
  say "vLLM from $VLLM_SITE (checked against its RECORD)"
  "$PY" - "$VLLM_SITE" "$SITE" "$keep" "$VERSION" <<'EOF'
import base64, csv, hashlib, os, re, shutil, sys
src, site, keep, version = sys.argv[1:]
n = 0
with open(os.path.join(src, f"vllm-{version}.dist-info", "RECORD")) as f:
    for path, digest, _ in csv.reader(f):
        if path.startswith("..") or not (path.startswith("vllm/") or ".dist-info/" in path) or path.endswith("RECORD"):
            continue
        if path.startswith("vllm/") and not (path.endswith(".py") or re.search(keep, path) and "/third_party/" not in path):
            continue
        with open(os.path.join(src, path), "rb") as g:
            data = g.read()
        algo, want = digest.split("=", 1)
        got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
        if got != want:
            sys.exit(f"{path}: differs from the wheel's RECORD")
        os.makedirs(os.path.dirname(os.path.join(site, path)), exist_ok=True)
        with open(os.path.join(site, path), "wb") as g:
            g.write(data)
        n += 1
print(f"{n} files")
EOF
fi
rm -f "$SITE"/vllm-$VERSION.dist-info/RECORD

# 2. the CPython 3.12 wheels, installed flat into site/
say "downloading ${#PY312_WHEELS[@]} cp312 / pure-Python wheels"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${PLATFORM[@]}" \
  -d "$WORK/wheels" "${PY312_WHEELS[@]}"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --only-binary=:all: "${PLATFORM[@]}" \
  --target "$SITE" "$WORK"/wheels/*.whl
rm -rf "$SITE/bin"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +

# 3. vLLM's test files (vllm_sdist.py's FILES and HELPERS)
tests=${VLLM_TESTS:-.vllm-tests}
if [ ! -f "$tests/pyproject.toml" ]; then
  [ -f /work/main/.vllm-tests/pyproject.toml ] && tests=/work/main/.vllm-tests || {
    tests=$WORK/sdist; "$PY" tests/engines/with_vllm/vllm_sdist.py "$tests" >/dev/null; }
fi
say "vLLM's tests from $tests"
(cd "$tests" && cp --parents pyproject.toml $(cd "$tests" && find tests -type f -name '*.py' ! -path '*__pycache__*') \
  "$ROOT/tests/")

tar -C "$WORK" -cf - vllm_py | xz -T2 -9 > "$OUT_ARCHIVE.part"
mv "$OUT_ARCHIVE.part" "$OUT_ARCHIVE"
say "$OUT_ARCHIVE: $(du -m "$OUT_ARCHIVE" | cut -f1) MB ($(du -sm "$ROOT" | cut -f1) MB unpacked)"
