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


def _setup_line(tmp_path, info):
    """The line ci/setup.sh says about the HIP extension, sourced under ci/test.sh's shell options, with a
    python3 on PATH that is a stand-in: in a venv, pip a no-op, ``-m dsv4_rocm info`` the bash given as info."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text('#!/usr/bin/env bash\ncase "$1 $2" in\n'
                                  '  "-c "*print*) echo /venv;;\n  "-c "*) exit 0;;\n  "-m pip") exit 0;;\n'
                                  f'  "-m dsv4_rocm") {info};;\n  *) exit 3;;\nesac\n')
    (fake / "python3").chmod(0o755)
    r = subprocess.run(["bash", "-c", "set -euo pipefail; . ci/setup.sh", "ci/test.sh"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[1:]


def test_setup_reports_infos_hip_line_every_time(tmp_path):
    """info's HIP line is said once, also when info goes on writing long after it (200 kB: more than a pipe
    holds, so a grep that stops reading at its match would leave info writing into a closed pipe); a failing
    info, or one without the line, is said as such."""
    hip = "HIP extension dsv4_rocm._C: not built (stand-in)"
    long_info = f'echo "{hip}"; for i in $(seq 4000); do echo "more info, line $i: ........................"; done'
    assert _setup_line(tmp_path, long_info) == [f"ci/test.sh: {hip}"]
    assert _setup_line(tmp_path, f'echo "{hip}"; exit 1') == ["ci/test.sh: python -m dsv4_rocm info failed"]
    assert _setup_line(tmp_path, "echo torch 2.13") == \
        ["ci/test.sh: python -m dsv4_rocm info printed no 'HIP extension' line"]
