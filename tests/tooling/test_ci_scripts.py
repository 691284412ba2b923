"""The scripts a GPU machine runs (gpu/), checked where they can be on a CPU: the compute-sanitizer pass
(gpu/sanitize.sh, the memcheck stage of gpu/suite.sh) and the one-case-per-test selection it uses."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _collect(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [l for l in r.stdout.splitlines() if "::" in l]


def test_one_case_keeps_the_first_parameter_set_of_every_test_function():
    files = ["tests/cache/test_cache_views.py", "tests/cache/test_quantize_and_insert_k_cache.py"]
    every, one = _collect(*files), _collect("--one-case", *files)
    functions = list(dict.fromkeys(re.sub(r"\[.*\]$", "", i) for i in every))
    assert len(every) > len(one) == len(functions)
    assert one == [next(i for i in every if re.sub(r"\[.*\]$", "", i) == f) for f in functions]


def test_sanitizer_pass_is_one_stage_of_the_gpu_suite(tmp_path):
    for script in ("gpu/sanitize.sh", "gpu/suite.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, script)]).returncode == 0
    suite = open(os.path.join(ROOT, "gpu", "suite.sh")).read()
    assert 'bash gpu/sanitize.sh "$OUT/sanitize"' in suite
    text = open(os.path.join(ROOT, "gpu", "sanitize.sh")).read()
    assert "--one-case" in text and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in text
    assert re.search(r"TOOLS=\$\{\*:-memcheck racecheck initcheck\}", text)
    if shutil.which("compute-sanitizer") is None:        # a CPU machine: one line per tool says why it skipped
        r = subprocess.run(["bash", os.path.join(ROOT, "gpu", "sanitize.sh"), str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and [l.split(":")[0] for l in r.stdout.splitlines()] == \
            ["memcheck", "racecheck", "initcheck"] and "compute-sanitizer is not on PATH" in r.stdout


def test_part_splits_the_selection_into_disjoint_interleaved_parts():
    files = ["tests/cache/test_quantize_and_insert_k_cache.py"]
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
    assert S.reason("tests/attention/test_sparse_mla.py::test_smoke_small_decode_and_prefill", "memcheck") is None


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


def _pip_installs(script):
    """The pip install commands of an engine tier script, in order, continuation lines joined."""
    text = open(os.path.join(ROOT, "ci", script)).read().replace("\\\n", " ")
    return [l.strip() for l in text.splitlines() if re.search(r"(\$PIP|\$pip) ", l) and not l.lstrip().startswith("#")]


def test_engine_tiers_install_the_engine_and_its_imports_without_resolving_against_it():
    """Once the engine is installed with --no-deps, every later install is --no-deps too (pip otherwise checks
    the environment against the engine's own CUDA and serving requirements and prints an ERROR with dozens of
    missing packages on a passing run), from a list that pins every package."""
    for script, engine, reqs in (("engine_tier.sh", "vllm==0.33.0", "engine_requirements.txt"),
                                 ("engine_tier_sglang.sh", "sglang==0.5.23", "engine_requirements_sglang.txt")):
        cmds = _pip_installs(script)
        i = next(i for i, c in enumerate(cmds) if engine in c)
        assert "--no-deps" in cmds[i] and cmds[i + 1:], script
        assert all("--no-deps" in c for c in cmds[i + 1:]), (script, [c for c in cmds[i + 1:] if "--no-deps" not in c])
        assert any(f"-r ci/{reqs}" in c for c in cmds[i + 1:]), script
        pins = [l for l in open(os.path.join(ROOT, "ci", reqs)).read().splitlines() if l and not l.startswith("#")]
        assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", p) for p in pins), (reqs, pins)
    sglang = open(os.path.join(ROOT, "ci", "engine_tier_sglang.sh")).read()
    assert "libtorch_cuda.so" in sglang and "download.pytorch.org/whl/cpu" in sglang     # why a CUDA torch, if one


def test_engine_tier_output_drops_known_warnings_and_says_so_in_one_line():
    """vLLM's warnings on a CPU machine (its compiled extensions missing, libcuda.so.1 among them, and torch
    deprecations) are dropped with the line after each that belongs to it; everything else passes, pytest's
    indented summaries included; one last line says what was dropped. Both tiers pipe their tests through it."""
    out_in = ["....ss..  [100%]\n",
              "Failed to import from vllm._C with ModuleNotFoundError(\"No module named 'vllm._C'\")\n",
              "Failed to import from vllm._C_stable_libtorch with ImportError('libcuda.so.1: cannot open shared object "
              "file: No such file or directory')\n",
              "Failed to import from amdsmi with ModuleNotFoundError(\"No module named 'amdsmi'\")\n",
              "/v/lib/python3.11/site-packages/torch/jit/_script.py:365: DeprecationWarning: `torch.jit.script_method` is "
              "deprecated. Please switch to `torch.compile` or `torch.export`.\n",
              "  warnings.warn(\n",
              "  /v/lib/python3.11/site-packages/torch/jit/_script.py:365: DeprecationWarning: `torch.jit.script_method` "
              "is deprecated.\n",
              "Failed to import from dsv4_rocm._C with ImportError('x')\n",
              "81 passed, 1342 skipped in 89.59s\n"]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ci", "engine_warnings.py"), "vllm", "ci/engine_tier.sh"],
                       input="".join(out_in), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines(keepends=True)
    assert lines[:-1] == [out_in[0], out_in[6], out_in[7], out_in[8]]
    assert re.match(r"ci/engine_tier\.sh: filtered 5 lines of known harmless vllm warnings: 3 x vLLM's compiled "
                    r".*libcuda\.so\.1.*; 1 x torch's deprecation of torch\.jit\.script_method", lines[-1]), lines[-1]
    for script, engine in (("engine_tier.sh", "vllm"), ("engine_tier_sglang.sh", "sglang")):
        text = open(os.path.join(ROOT, "ci", script)).read()
        assert re.search(rf"2>&1 \|\s+python3 ci/engine_warnings\.py {engine} ", text), script
