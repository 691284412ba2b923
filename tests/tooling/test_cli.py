"""The command line: the main job runs end to end and reports; info and parity answer; every user error
is one line on stderr naming what is wrong and what to do, exit status 2, no traceback; bench's plot."""
import json
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch

from dsv4_rocm.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_trace_check_tiny(capsys, monkeypatch):
    """Each layer's trace runs once untimed (warm-up: compilation and first-touch costs) and then timed on a
    fresh server; the table says that request 0 was checked against the reference, with its error and
    tolerance."""
    from dsv4_rocm import trace_check
    runs, run_trace = [], trace_check._run_trace

    def recording(srv, xs, steps, device, timer=None):
        runs.append((srv.layer_type.value, srv, timer is not None))
        return run_trace(srv, xs, steps, device, timer)
    monkeypatch.setattr(trace_check, "_run_trace", recording)
    assert main(["run", "--config", "tiny", "--requests", "2", "--prompt-len", "40", "--decode-steps", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    layers = ("swa", "c4a", "c128a")
    assert [(lt, timed) for lt, _, timed in runs] == [(lt, t) for lt in layers for t in (False, True)]
    assert all(runs[i][1] is not runs[i + 1][1] for i in range(0, 6, 2))    # the timed run starts on fresh caches
    assert "decode tok/s" in out and "check (request 0)" in out
    assert "check of request 0: the served trace (reference ops, chunked steps through the paged caches) vs the " \
           "layer evaluated from scratch (reference.layer_spec" in out
    for layer in layers:
        row = next(line for line in out.splitlines() if line.startswith(f"{layer} "))
        err, tol = re.search(r"rel err (\S+) <= (\S+) ok$", row).groups()
        assert float(err) <= float(tol) == trace_check.CHECK_TOL["cpu"]


def test_run_check_on_cpu_catches_a_wrong_serving_path(monkeypatch):
    """On a CPU the check is not the reference backend against itself: an attention op that is 1% off (in the
    layer's serving path, which the same layer's reference copy would share) makes the run fail, naming what
    it compared."""
    from dsv4_rocm import ops
    real = ops.sparse_mla_decode

    def off_by_one_percent(*args, out=None, **kw):
        r = real(*args, out=out, **kw)
        out.mul_(1.01)
        return r
    monkeypatch.setattr(ops, "sparse_mla_decode", off_by_one_percent)
    with pytest.raises(RuntimeError, match=r"layer swa: request 0 differs by .* in the check of the served trace "
                                           r"\(reference ops.* vs the layer evaluated from scratch"):
        main(["run", "--config", "tiny", "--requests", "1", "--prompt-len", "24", "--decode-steps", "1",
              "--layers", "swa", "--device", "cpu"])


def user_error(capsys, argv):
    """Run the CLI on argv; assert it failed as a user error and return its one stderr line."""
    rc = main(argv)
    cap = capsys.readouterr()
    print(cap.err)
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m dsv4_rocm")
    assert "Traceback" not in cap.err
    return lines[0]


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as one without a GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


RUN = ["run", "--config", "tiny", "--device", "cpu"]


@pytest.mark.parametrize("argv, says", [
    (["run", "--requests", "0"], "argument --requests: must be at least 1, got 0"),
    (["run", "--requests", "-3"], "argument --requests: must be at least 1, got -3"),
    (["run", "--prompt-len", "-1"], "argument --prompt-len: must be at least 1"),
    (["run", "--decode-steps", "0"], "argument --decode-steps: must be at least 1"),
    (["run", "--heads", "0"], "argument --heads: must be at least 1"),
    (["run", "--requests", "two"], "argument --requests: must be a whole number"),
    (["run", "--layers", "swa,foo"], "unknown layer type 'foo'"),
    (["run", "--layers", "swa,"], "unknown layer type ''"),
    (["run", "--config", "v5"], "invalid choice: 'v5'"),
    (["run", "--backend", "cuda-magic"], "invalid choice: 'cuda-magic'"),
    (RUN + ["--backend", "triton"], "--backend triton is not available on cpu"),
    (RUN + ["--heads", "3"], "--heads 3 does not split tiny"),
    (["run", "--device", "mps"], "--device 'mps' is not supported"),
    (["run", "--device", "nonsense"], "is not a device"),
    (["parity", "--only", "metadata"], "--only selects the cases to regenerate and needs --write-golden"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_user_errors_are_one_line_exit_2(capsys, argv, says):
    assert says in user_error(capsys, argv)


def test_backend_from_environment_checked(capsys, monkeypatch):
    monkeypatch.setenv("DSV4_BACKEND", "hip")
    assert "DSV4_BACKEND hip is not available on cpu" in user_error(capsys, RUN)


def test_gpu_commands_without_a_gpu(capsys, no_gpu):
    line = user_error(capsys, ["bench"])
    assert "no GPU" in line and "--device cuda" in line
    line = user_error(capsys, ["bench", "--device", "cpu"])
    assert "cannot run on --device cpu" in line and "Triton has no CPU driver" in line
    line = user_error(capsys, ["run", "--device", "cuda", "--config", "tiny"])
    assert "no GPU" in line and "use --device cpu" in line
    assert "no GPU" in user_error(capsys, ["parity", "--device", "cuda:1"])


def test_parity_compare_bad_files(capsys, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cases": {}}))
    line = user_error(capsys, ["parity", "--compare", str(tmp_path / "missing.json"), str(good)])
    assert "cannot read" in line and "missing.json" in line and "parity --report" in line
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not JSON" in user_error(capsys, ["parity", "--compare", str(good), str(bad)])
    bad.write_text("[1, 2]")
    assert "is not a parity report" in user_error(capsys, ["parity", "--compare", str(good), str(bad)])
    assert main(["parity", "--compare", str(good), str(good)]) == 0
    assert "agree" in capsys.readouterr().out


def test_parity_missing_golden_dir(capsys, tmp_path):
    line = user_error(capsys, ["parity", "--golden-dir", str(tmp_path / "none")])
    assert "golden vectors missing" in line and "--write-golden" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_without_gpu_as_a_process():
    """What a user sees: the real process, its exit status and its whole stderr."""
    r = subprocess.run([sys.executable, "-m", "dsv4_rocm", "bench"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    print(r.stderr)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("python -m dsv4_rocm bench: error: --device cuda: this machine has no GPU")


def test_info_and_backend_errors(capsys, monkeypatch):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backends" in out and "HIP extension dsv4_rocm._C:" in out
    if torch.version.hip is None and torch.version.cuda is None:
        assert "CPU build" in out and "built on a GPU machine" in out
    from dsv4_rocm import ops
    from dsv4_rocm.ops import _dispatch
    monkeypatch.setattr(_dispatch, "_ENV_BACKEND", "triton")      # DSV4_BACKEND=triton when dsv4_rocm was imported
    with pytest.raises(ValueError, match="not available"):
        ops.backend_for("sparse_mla_decode", "cpu")
    monkeypatch.setattr(_dispatch, "_ENV_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.backend_for("sparse_mla_decode", "cpu")
    monkeypatch.setattr(_dispatch, "_ENV_BACKEND", None)
    with ops.use_backend("reference"):
        assert ops.backend_for("sparse_mla_decode", "cpu") == "reference"
    with pytest.raises(ValueError, match="unknown op"):
        ops.backend_for("flash_attn", "cpu")


def test_kernels_registered_by_import_and_a_device_a_kernel_cannot_run_on_takes_the_next_backend(monkeypatch):
    """Each op's kernels are the functions its stage module imports (a Triton kernel from
    dsv4_rocm/triton/<stage>/, a HIP one from hip_ops); a kernel whose ``runs_on`` refuses the device is
    passed over, forced or not, and the op runs its next implementation (the choice is dispatch's)."""
    from dsv4_rocm.ops import _dispatch
    stages = {"qkv", "compressor", "indexer", "metadata", "attention", "output"}
    kernels = _dispatch._KERNELS
    assert sum("triton" in k for k in kernels.values()) == 35 and sum("hip" in k for k in kernels.values()) == 6
    for op, k in kernels.items():
        if "triton" in k:
            pkg, stage = k["triton"].__module__.split(".")[1:3]
            assert pkg == "triton" and stage in stages, (op, k["triton"].__module__)
        if "hip" in k:
            assert k["hip"].__module__ == "dsv4_rocm.hip_ops", op
    assert set(_dispatch._RUNS_ON["fp8_mqa_logits"]) == {"triton"}
    monkeypatch.setattr(_dispatch, "_machine_backends", lambda device_type: ("reference", "triton"))
    _dispatch.forget_implementations()
    try:
        assert _dispatch.backend_for("fp8_paged_mqa_logits", "cpu") == "triton"      # CPU: the interpreter runs it
        assert _dispatch.implementation("fp8_paged_mqa_logits", torch.device("cpu")) is kernels[
            "fp8_paged_mqa_logits"]["triton"]
        monkeypatch.setitem(_dispatch._RUNS_ON["fp8_paged_mqa_logits"], "triton", lambda device: False)
        _dispatch.forget_implementations()
        assert _dispatch.backend_for("fp8_paged_mqa_logits", "cpu") == "reference"
        with _dispatch.use_backend("triton"):
            assert _dispatch.backend_for("fp8_paged_mqa_logits", "cpu") == "reference"
            assert _dispatch.implementation("fp8_paged_mqa_logits", torch.device("cpu")) is \
                _dispatch._REFERENCE["fp8_paged_mqa_logits"]
            assert _dispatch.backend_for("fp8_mqa_logits", "cpu") == "triton"
    finally:
        monkeypatch.undo()
        _dispatch.forget_implementations()
    with pytest.raises(ValueError, match="runs_on names backend 'hip'"):
        _dispatch.register("no_such_op", lambda: None, triton=lambda: None, runs_on={"hip": lambda d: True})
    assert "no_such_op" not in _dispatch.registered_ops()


def test_import_without_triton():
    """On a machine without Triton, ``import dsv4_rocm`` works, imports no Triton, registers no Triton kernel
    and the ops run (here on CPU, their oracles); HIP kernels stay registered."""
    script = """if True:
        import importlib.abc, importlib.util, sys
        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoTriton())
        find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "triton" else find_spec(name, *a)
        import torch
        import dsv4_rocm
        from dsv4_rocm import ops
        from dsv4_rocm.ops import _dispatch
        assert not _dispatch.HAVE_TRITON and not any(m.split(".")[0] == "triton" for m in sys.modules)
        assert not any("triton" in k for k in _dispatch._KERNELS.values())
        assert sum("hip" in k for k in _dispatch._KERNELS.values()) == 6
        assert "triton" not in ops.machine_backends("cuda")
        qsl, seq = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
        out = ops.compute_prefill_gather_lens(torch.full((1,), -7, dtype=torch.int32), seq, qsl, 1, 0, 4)
        assert out.tolist() == [6], out           # 3 query tokens + min(4 earlier tokens, window 4 - 1)
        print("ran")
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr[-3000:]


def test_info_into_a_closed_pipe_stops_quietly():
    """``info | head -1`` prints info's first line and nothing on stderr; a reader gone before info writes at all
    (both ends closed at once, so the failure is certain, not a race with head) ends info as ``cat`` would end:
    killed by SIGPIPE, no traceback, whether or not Python buffers stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(["bash", "-c", f'set -o pipefail; "{sys.executable}" -m dsv4_rocm info | head -1; '
                        'echo "status ${PIPESTATUS[*]}" >&2'], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.startswith("Platform(") and len(r.stdout.splitlines()) == 1
    assert re.fullmatch(r"status (0|141) 0\n", r.stderr), r.stderr
    for unbuffered in ("1", ""):
        rd, wr = os.pipe()
        p = subprocess.Popen([sys.executable, "-m", "dsv4_rocm", "info"], cwd=ROOT, stdout=wr, stderr=subprocess.PIPE,
                             env=dict(env, PYTHONUNBUFFERED=unbuffered), text=True)
        os.close(wr)
        os.close(rd)
        err = p.communicate(timeout=300)[1]
        assert err == "" and p.returncode == -signal.SIGPIPE, (unbuffered, p.returncode, err)


# ---- bench's plot ----------------------------------------------------------------------------------

def fabricated_report():
    return dict(date="2026-11-22", device="AMD Instinct MI300X", arch="gfx942", copy_TBps=4.1, bf16_TFLOPs=650.0,
                rows=[dict(case="sparse_mla_decode b=64", config="bh64", us=40.0, frac_floor=0.62,
                           peer="FlashMLA", peer_us=50.0, ratio=1.25),
                      dict(case="quantize_and_insert_k_cache", config="", us=8.0, frac_floor=0.81, peer=None,
                           peer_us=None, ratio=None),
                      dict(case="fp8_einsum", config="r4", us=20.0, frac_floor=0.30, peer="torch", peer_us=14.0,
                           ratio=0.7)])


def test_plot_series_from_report():
    from dsv4_rocm.bench.plot import series
    labels, fracs, ratios = series(fabricated_report())
    assert labels == ["sparse_mla_decode b=64 [bh64]", "quantize_and_insert_k_cache", "fp8_einsum [r4]"]
    assert fracs == [0.62, 0.81, 0.30] and ratios == [1.25, None, 0.7]


def test_plot_renders_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib); "
                        "the plot cannot be rendered")
    from matplotlib.image import imread
    from dsv4_rocm.bench.plot import write_plot
    path = str(tmp_path / "bench.png")
    assert write_plot(fabricated_report(), path) == path
    assert f"plot: {path}" in capsys.readouterr().out
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 800
    assert img[..., :3].std() > 0.05            # bars and text, not a blank canvas


def test_plot_skipped_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    from dsv4_rocm.bench.plot import write_plot
    path = tmp_path / "bench.png"
    assert write_plot(fabricated_report(), str(path)) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["plot skipped: matplotlib is not installed (pip install matplotlib (or the package's 'plot' "
                   "extra))"]
    assert not path.exists()


def test_bench_run_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    """bench.run wiring on a CPU: a stand-in suite adds rows; the report lands in the JSON and the PNG."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    from dsv4_rocm.bench import run as bench_run
    from dsv4_rocm.bench.context import BenchContext

    def measure(self):
        self.bw, self.mm = 4e12, 6e14

    def suite(ctx):
        ctx.add("case_a", "cfg", 0.010, flop=1e9, nbytes=1e7, peer="torch", peer_ms=0.020)
        ctx.add("case_b", "cfg", 0.005, nbytes=1e7)

    rep = fabricated_report()
    monkeypatch.setattr(BenchContext, "measure_ceilings", measure)
    monkeypatch.setattr(BenchContext, "report", lambda self: dict(rep, rows=self.rows))
    monkeypatch.setattr(bench_run, "suites", lambda: [types.SimpleNamespace(suite=suite)])
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    out = bench_run.run("cuda", str(js), plot=str(png))
    assert [r["case"] for r in json.loads(js.read_text())["rows"]] == ["case_a", "case_b"]
    assert out["rows"][0]["ratio"] == pytest.approx(2.0)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_decode_inputs_and_v41_rows(monkeypatch):
    """The decode bench's caches hold records of each format at every slot (V4.0 pages byte for byte as
    records placed by the layout's offsets; every V4.1 pair attends through the public API on a CPU); the
    V4.1 rows name their shapes and carry the targets: 528 / 584 of the V4.0 time, and 0.6 of a V41_528
    extra set's cost for the fp4 extra set's (time with it minus time without)."""
    from dsv4_rocm import flash_mla
    from dsv4_rocm import layout as L
    from dsv4_rocm.bench import sparse_mla as B
    from dsv4_rocm.bench.context import BenchContext
    from dsv4_rocm.reference import cache as rc
    c = dict(b=2, s_q=1, h=64, topk=8, bs=64, etopk=16, ebs=2)
    args, T = B.make_decode_inputs(c, "cpu", pool_tokens=128)
    g = torch.Generator().manual_seed(0)
    rec = rc.encode_k_records(torch.randn(128, 512, generator=g).bfloat16())
    pages = args[1].as_strided((2, L.page_bytes(64)), (args[1].stride(0), 1))
    for slot in (0, 63, 64, 127):
        d, sc = L.token_byte_offsets(slot, 64)
        assert torch.equal(pages.reshape(-1)[d:d + 576], rec[slot, :576])
        assert torch.equal(pages.reshape(-1)[sc:sc + 8], rec[slot, 576:])
    v41, fp4 = L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288)        # the layout the API reads by default
    for fmts in ((v41, v41), (v41, fp4), (v41, None)):
        args, T = B.make_decode_inputs(c, "cpu", pool_tokens=128, formats=fmts)
        assert args[1].shape[-1] == fmts[0].token_bytes
        out = B.decode_call(flash_mla, args)()[0]
        assert out.shape == (2, 1, 64, 512) and bool(out.isfinite().all()) and float(out.abs().max()) > 0
        flop, nbytes = B.count_decode(c, fmts)
        etopk = 16 if fmts[1] else 0
        assert nbytes == (8 * 528 + etopk * (fmts[1].token_bytes if fmts[1] else 0) + 64 * 512 * 4) * T
    times = {584: 1.0, 528: 0.8}

    def fake_time(fn):        # ms by the formats of the call's caches: V4.0 1.0; V41 0.8; main only 0.5
        kc, ekc = fn.args[1], fn.args[12]    # (0.45 on the Triton kernel named for the fp4 difference); fp4 0.6
        if ekc is None:
            return 0.45 if fn.kernel == "triton" else 0.5
        return 0.6 if ekc.shape[-1] == 288 else times[kc.shape[-1]]

    def fake_call(mod, args, kernel=None, formats=None):
        return types.SimpleNamespace(args=(None, args[1]) + (None,) * 10 + (args[5],), kernel=kernel)
    monkeypatch.setattr(B, "v41_cases", lambda: [("tiny", c)])
    monkeypatch.setattr(B, "decode_call", fake_call)
    ctx = BenchContext(device="cpu")
    B._v41_rows(ctx, flash_mla, fake_time, pool_tokens=128)
    rows = {r["case"]: r for r in ctx.rows}
    assert list(rows) == ["tiny V41_528", "tiny V41_528+FP4", "tiny FP4 extra"]
    assert rows["tiny V41_528"]["ratio"] == pytest.approx(1.0 * 528 / 584 / 0.8)
    assert rows["tiny FP4 extra"]["us"] == pytest.approx(150.0)      # 0.6 - 0.45: both times of one kernel
    assert rows["tiny FP4 extra"]["ratio"] == pytest.approx(0.6 * 0.3 / 0.15)


def test_ci_runs_the_readme_test_command():
    """CI must run what a new user runs: the README's test command, word for word, is .ci/run's first
    command; what follows it are the engine tiers, each a ci/ script the README names."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    after = readme.split("Set up and run the tests:", 1)[1]
    command = next(line.strip() for line in after.splitlines() if line.startswith("    "))
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")) if line.strip()
          and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci[0] == command
    for extra in ci[1:]:
        assert extra.startswith("bash ci/") and extra in readme, extra


def test_backend_environment_read_at_import():
    """DSV4_BACKEND counts as it was when dsv4_rocm was imported: a later change of the environment does not
    move the backend, ``use_backend`` does and takes precedence. (Backends for CUDA tensors are resolved
    from what is installed, so no GPU is needed: Triton's kernels are what "cuda" gets unforced.)"""
    script = (
        "import os\n"
        "from dsv4_rocm import ops\n"
        "assert ops.backend_for('sparse_mla_decode', 'cuda') == 'reference'\n"
        "os.environ['DSV4_BACKEND'] = 'cuda-magic'\n"
        "assert ops.backend_for('sparse_mla_decode', 'cuda') == 'reference'\n"
        "with ops.use_backend('triton'):\n"
        "    assert ops.backend_for('sparse_mla_decode', 'cuda') == 'triton'\n"
        "assert ops.backend_for('sparse_mla_decode', 'cuda') == 'reference'\n"
        "print('ok')\n")
    env = dict(os.environ, DSV4_BACKEND="reference", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    env["DSV4_BACKEND"] = "cuda-magic"
    script = ("from dsv4_rocm import ops\n"
              "try:\n    ops.backend_for('sparse_mla_decode', 'cpu')\n"
              "except ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "unknown backend 'cuda-magic'" in r.stdout, (r.stdout, r.stderr[-2000:])
