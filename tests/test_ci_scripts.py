"""The CI scripts that run on a GPU machine, checked where they can be on a CPU: the compute-sanitizer pass
(ci/gpu_sanitize.sh, the memcheck stage of ci/gpu_suite.sh) and the one-case-per-test selection it uses."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [l for l in r.stdout.splitlines() if "::" in l]


def test_one_case_keeps_the_first_parameter_set_of_every_test_function():
    files = ["tests/test_cache_views.py", "tests/test_quantize_and_insert_k_cache.py"]
    every, one = _collect(*files), _collect("--one-case", *files)
    functions = list(dict.fromkeys(re.sub(r"\[.*\]$", "", i) for i in every))
    assert len(every) > len(one) == len(functions)
    assert one == [next(i for i in every if re.sub(r"\[.*\]$", "", i) == f) for f in functions]


def test_sanitizer_pass_is_one_stage_of_the_gpu_suite(tmp_path):
    for script in ("ci/gpu_sanitize.sh", "ci/gpu_suite.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, script)]).returncode == 0
    suite = open(os.path.join(ROOT, "ci", "gpu_suite.sh")).read()
    assert 'bash ci/gpu_sanitize.sh "$OUT/sanitize"' in suite
    text = open(os.path.join(ROOT, "ci", "gpu_sanitize.sh")).read()
    assert "--one-case" in text and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in text
    assert re.search(r"TOOLS=\$\{\*:-memcheck racecheck initcheck\}", text)
    if shutil.which("compute-sanitizer") is None:        # a CPU machine: one line per tool says why it skipped
        r = subprocess.run(["bash", os.path.join(ROOT, "ci", "gpu_sanitize.sh"), str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and [l.split(":")[0] for l in r.stdout.splitlines()] == \
            ["memcheck", "racecheck", "initcheck"] and "compute-sanitizer is not on PATH" in r.stdout


def test_part_splits_the_selection_into_disjoint_interleaved_parts():
    files = ["tests/test_quantize_and_insert_k_cache.py"]
    every = _collect("--one-case", *files)
    parts = [_collect("--one-case", "--part", f"{i}/3", *files) for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(every) and all(parts)
    assert parts[0] == every[0::3]


def test_sanitizer_skips_are_listed_by_name_with_a_reason():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import sanitizer_skips as S
    every = set(_collect(*sorted({k.split("::")[0] for k in S.SKIPS})))
    for name, tools in S.SKIPS.items():
        assert any(i.split("[")[0] == name for i in every), f"{name}: no such test"
        assert set(tools) <= {"*", "memcheck", "racecheck", "initcheck"} and all(len(r) > 40 for r in tools.values())
        assert S.reason(name + "[x]", "racecheck") == (tools.get("racecheck") or tools.get("*"))
    assert S.reason("tests/test_sparse_mla.py::test_smoke_small_decode_and_prefill", "memcheck") is None
