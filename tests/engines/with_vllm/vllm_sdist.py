"""Unpack the vLLM 0.33.0 test files the engine tier runs (vllm_suite.py) from vLLM's source distribution.

``python vllm_sdist.py DIR`` downloads vLLM's sdist into DIR once (its PyPI file, checked against the
sha256 PyPI lists for it; ``pip download`` of an sdist would first build its metadata, which needs vLLM's
CUDA build requirements), writes ``FILES`` and ``HELPERS`` under DIR afresh and prints the test files'
paths. Nothing else of the archive is unpacked: vLLM's tests/conftest.py imports the whole engine.
Exit status 3: the archive could not be fetched (no network or the index refused it).
"""
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.request

VERSION = "0.33.0"
URL = ("https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
       f"vllm-{VERSION}.tar.gz")
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

# vLLM's DeepSeek-V4 kernel and metadata tests (paths inside the sdist)
FILES = (
    "tests/kernels/test_deepseek_v4_cpu_kernels.py",
    "tests/kernels/test_fused_deepseek_v4_qnorm_rope_kv_insert.py",
    "tests/v1/attention/test_deepseek_v4_swa_visible.py",
    "tests/v1/attention/test_deepseek_v4_rocm_adaptive.py",
    "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py",
    "tests/kernels/test_fused_inv_rope_fp8_quant.py",
    "tests/kernels/test_fused_indexer_q_rope_quant.py",
    "tests/kernels/test_compressor_kv_cache.py",
    "tests/kernels/test_top_k_per_row.py",
    "tests/kernels/attention/test_flashmla_sparse.py",
)
# what they import or need beside them (pytest markers: vLLM's pyproject.toml)
HELPERS = ("pyproject.toml", "tests/__init__.py", "tests/kernels/__init__.py", "tests/kernels/conftest.py",
           "tests/kernels/utils.py", "tests/kernels/quant_utils.py", "tests/v1/__init__.py",
           "tests/v1/attention/utils.py")


def _fetch(archive: str) -> None:
    part = archive + ".part"
    with urllib.request.urlopen(URL, timeout=120) as r, open(part, "wb") as f:
        shutil.copyfileobj(r, f)
    os.replace(part, archive)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack(target: str) -> list:
    os.makedirs(target, exist_ok=True)
    archive = os.path.join(target, f"vllm-{VERSION}.tar.gz")
    if not os.path.exists(archive) or _sha256(archive) != SHA256:
        _fetch(archive)
        if _sha256(archive) != SHA256:
            os.remove(archive)
            raise RuntimeError(f"{URL}: sha256 differs from {SHA256}")
    shutil.rmtree(os.path.join(target, "tests"), ignore_errors=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(archive) as tar:
        for name in FILES + HELPERS:
            member = tar.getmember(prefix + name)
            member.name = name
            tar.extract(member, target, filter="data")
    return list(FILES)


if __name__ == "__main__":
    try:
        print(" ".join(unpack(sys.argv[1])))
    except OSError as e:            # URLError and socket errors included
        print(f"vllm_sdist: cannot fetch {URL}: {e}", file=sys.stderr)
        sys.exit(3)
