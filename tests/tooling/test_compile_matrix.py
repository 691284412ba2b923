"""Every Triton kernel compiles for gfx942, gfx950, sm_90a and sm_100a on this CPU-only machine, with
the matrix instructions and hardware fp8 converts present, no spills and LDS/shared within limits.

The rows come from the compile-matrix run that tests/conftest.py starts in the background when these tests
are collected (they run last); the matrix's own machinery (its cost report, the ptxas log it reads, a
failed run) is tested here on small inputs."""
import json
import os
import sys

import pytest

from build_tools import compile_matrix as cm

KERNELS = {k.name: k for k in cm.triton_kernels()}


@pytest.mark.parametrize("target", sorted(cm.TARGETS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_triton_kernel_compiles_clean(kernel, target, compile_matrix):
    k = KERNELS[kernel]
    if not k.applies_to(target):
        pytest.skip(f"{kernel} is written for {', '.join(k.targets)} only")
    row = compile_matrix.row(kernel, target)
    print(row)
    assert row["problems"] == []
    assert row["cpu_s"] >= 0 and row["wall_s"] >= 0


def test_matrix_prints_each_compile_cost_and_the_costliest(capsys):
    rows = lambda t, spec: [dict(kernel=n, target=t, regs="1", smem=0, spills="0", problems=[], cpu_s=c, wall_s=c)
                            for n, c in spec]                                      # noqa: E731
    ks = list(KERNELS)[:2]
    results = [dict(task="triton-sm_90a", rows=rows("sm_90a", [(ks[0], 7.3), (ks[1], 0.5)]), cpu_s=9.0,
                    startup_cpu_s=1.5, wall_s=10.0, error=None),
               dict(task="hip-gfx942", rows=rows("gfx942", [("a.hip", 2.0)]), cpu_s=2.0, startup_cpu_s=0.0,
                    wall_s=2.0, error=None)]
    cm.print_matrix(results, top=2)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert next(l for l in lines if l.startswith(ks[0] + " ")).split()[-1] == "7.3"     # the kernel's own cost
    assert next(l for l in lines if l.startswith("triton-sm_90a")).split() == ["triton-sm_90a", "2", "9.0", "1.5",
                                                                               "10.0"]
    assert next(l for l in lines if l.startswith("all")).split() == ["all", "3", "11.0"]
    assert f"costliest compiles (CPU s): {ks[0]} sm_90a 7.3, a.hip gfx942 2.0" in out


def test_run_timed_counts_the_childs_cpu():
    r, cpu = cm._run_timed([sys.executable, "-c", "import time\nt = time.process_time()\n"
                            "while time.process_time() - t < 0.3: pass\nprint('done')"])
    assert r.returncode == 0 and r.stdout.strip() == "done"
    assert 0.25 <= cpu < 5


def test_ptxas_report_is_the_cubins_log_printed_cached_or_rerun(tmp_path, monkeypatch):
    """The NVIDIA report reads the log of Triton's own ptxas run, keeps it beside the kernel in the cache
    (a warm compile runs no ptxas), and a kernel cached without it gets the same report from a ptxas run
    with Triton's flags."""
    from triton import knobs
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    k = KERNELS["compute_swa_indices_and_lens"]
    cold = cm._compile_triton_here(k, "sm_90a")
    logs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == cm.PTXAS_LOG]
    assert len(logs) == 1 and "Used" in open(logs[0]).read()
    import subprocess
    real_run = subprocess.run

    def no_ptxas(cmd, *a, **kw):
        assert "ptxas" not in os.path.basename(str(cmd[0])), "a warm compile ran ptxas"
        return real_run(cmd, *a, **kw)
    with monkeypatch.context() as m:
        m.setattr(subprocess, "run", no_ptxas)
        warm = cm._compile_triton_here(k, "sm_90a")
    os.remove(logs[0])
    rerun = cm._compile_triton_here(k, "sm_90a")
    assert cold == warm == rerun and cold["regs"] != "-1" and cold["problems"] == []
    assert os.path.exists(logs[0])


def test_background_run_fails_by_task_name_when_its_process_dies(tmp_path):
    bg = cm.Background.start(str(tmp_path / "m"), names=["no such kernel"], targets=["sm_90a"], hip=False)
    other = cm.Background.attach(str(tmp_path / "m"))            # as a pytest-xdist worker sees it
    assert other.running() and other.tasks == ["triton-sm_90a"]
    bg.proc.wait(timeout=120)
    assert not other.running() and not bg.running()
    res = bg.result("triton-sm_90a")              # the worker ran and compiled nothing: an empty task
    assert res["rows"] == [] and json.load(open(tmp_path / "m" / "triton-sm_90a.json"))["error"] is None
    for b in (bg, other):
        with pytest.raises(RuntimeError, match="without hip-sm_90a"):
            b.result("hip-sm_90a")


def test_accepted_spills_may_name_targets():
    k = KERNELS["compute_swa_indices_and_lens"]
    assert k.accepted("why", "gfx942") == "why" and k.accepted("", "sm_90a") == ""
    assert k.accepted({"sm_100a": "why"}, "sm_100a") == "why" and k.accepted({"sm_100a": "why"}, "sm_90a") == ""
