"""Top-k per row on a GPU: every variant of ``dsv4_rocm.bench.top_k.SWEEP`` checked, then timed, on the
benchmark shapes; a table last.

    python gpu/topk.py [--variants default,fused] [--jobs 8] [--rep-ms 100]

1. Compile: one process per CPU (--jobs) runs each (variant, shape) once, so Triton's disk cache holds
   every kernel before this process needs it.
2. Correctness, every variant x shape x data, through ``top_k_per_row_decode`` (1-D seq_lens): "normal"
   N(0, 1); "clustered" 1 + U[0, 1e-3) (one exponent, the top mantissa bits shared); "padded" per-row
   lengths in [n/2, n] with -inf past them; "ties" N(0, 1) on a grid of 1/8. Checked by
   tests/indexer/test_top_k_per_row.py's ``check_topk`` against the oracle's order keys: n <= k rows exact, k
   distinct in-range columns whose keys are, as a multiset, the k largest, the lowest columns among the
   ties at the k-th place. Then a CUDA graph captured on "normal" is replayed on "padded" and on
   "clustered" and checked again (the split kernels' counters and coarse maxima must return to zero).
3. Timing: CUDA graph replay median and eager median (``dsv4_rocm/bench/timing.py``) of every variant,
   torch.topk on the same tensors beside it.
Exit status 1 if any check failed.
"""
import argparse
import contextlib
import io
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

# this checkout's dsv4_rocm, then tests/ (helpers.py) and tests/indexer/: the check is the top-k tests' own
# (test_top_k_per_row.py's check_topk), one copy beside those tests; so the tool runs as `python gpu/topk.py`,
# without PYTHONPATH
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "tests", "indexer")]

from dsv4_rocm.bench.top_k import CASES as SHAPES  # noqa: E402  (name, rows, candidates per row, k)

DATA = ("normal", "clustered", "padded", "ties")
DEVICE = "cuda"


def configs(names):
    from dsv4_rocm.bench.top_k import SWEEP
    from dsv4_rocm.triton.indexer.top_k_per_row import _facts, default_config
    arch = _facts(torch.device(DEVICE))[0]
    return {(v, k): SWEEP[v](default_config(arch, k)) for v in names for k in sorted({s[3] for s in SHAPES})}


def inputs(rows, n, data, seed):
    """(logits fp32 [rows, n], seq_lens int32 [rows]) on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    lens = torch.full((rows,), n, dtype=torch.int32, device=DEVICE)
    if data == "clustered":
        x = 1 + torch.rand(rows, n, device=DEVICE, generator=g) * 1e-3
    else:
        x = torch.randn(rows, n, device=DEVICE, generator=g)
    if data == "ties":
        x = (x * 8).round() / 8
    if data == "padded":
        lens = torch.randint(n // 2, n + 1, (rows,), device=DEVICE, generator=g, dtype=torch.int32)
        x.masked_fill_(torch.arange(n, device=DEVICE)[None] >= lens[:, None], float("-inf"))
    return x, lens


def call(x, lens, out, k, cfg):
    from dsv4_rocm.triton.indexer.top_k_per_row import top_k_per_row_decode
    top_k_per_row_decode(x, 1, lens, out, x.shape[0], x.stride(0), x.stride(1), k, config=cfg)


def _compile_one(task):
    """Worker: run (variant, shape) once so that its kernels land in Triton's cache; the error, if any."""
    variant, si = task
    name, rows, n, k = SHAPES[si]
    try:
        x, lens = inputs(rows, n, "normal", 0)
        call(x, lens, torch.empty(rows, k, dtype=torch.int32, device=DEVICE), k, configs([variant])[(variant, k)])
        torch.cuda.synchronize()
        return ""
    except Exception as e:          # reported, and the variant left out of what follows
        return f"{type(e).__name__}: {str(e)[-300:]}"


def check(x, lens, out, k):
    """(ok, message) of check_topk on one output."""
    from test_top_k_per_row import check_topk
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            check_topk(x, out, torch.zeros_like(lens), lens, k, lowest_ties=True, label="")
        return True, ""
    except AssertionError:
        return False, buf.getvalue().strip()


def main(argv=None):
    from dsv4_rocm.bench.timing import time_graph_ms, time_ms
    from dsv4_rocm.bench.top_k import SWEEP
    from dsv4_rocm.triton.indexer.top_k_per_row import _facts, _plan, _resolve
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(SWEEP), help="comma-separated names of SWEEP")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--rep-ms", type=float, default=100)
    a = p.parse_args(argv)
    names = a.variants.split(",")
    cfgs = configs(names)
    arch, sms = _facts(torch.device(DEVICE))
    print(f"{torch.cuda.get_device_name()} ({arch}, {sms} SMs), torch {torch.__version__}", flush=True)

    t0 = time.time()
    tasks = [(v, si) for si in range(len(SHAPES)) for v in names]      # neighbours compile different kernels
    if a.jobs > 1:
        import multiprocessing as mp
        with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
            errors = list(pool.map(_compile_one, tasks))
    else:
        errors = [_compile_one(t) for t in tasks]
    failures = [f"{SHAPES[si][0]} / {v} / compile or first run: {e}" for (v, si), e in zip(tasks, errors) if e]
    names = [v for v in names if not any(e and tv == v for (tv, _), e in zip(tasks, errors))]
    print(f"compile: {len(tasks)} (variant, shape) runs in {time.time() - t0:.1f} s with {a.jobs} processes",
          flush=True)
    if not names:
        print("\n".join(["every variant failed to run:"] + failures))
        return 1

    t0 = time.time()
    for name, rows, n, k in SHAPES:
        out = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
        for di, data in enumerate(DATA):
            x, lens = inputs(rows, n, data, 100 + di)
            for v in names:
                out.fill_(-777)
                call(x, lens, out, k, cfgs[(v, k)])
                ok, msg = check(x, lens, out, k)
                if not ok:
                    failures.append(f"{name} / {v} / {data}: {msg}")
        # graph replay: captured on "normal", replayed on "padded" (other lengths), then on "clustered"
        for v in names:
            x, lens = inputs(rows, n, "normal", 7)
            call(x, lens, out, k, cfgs[(v, k)])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(x, lens, out, k, cfgs[(v, k)])
            for data in ("padded", "clustered"):
                x2, lens2 = inputs(rows, n, data, 8)
                x.copy_(x2)
                lens.copy_(lens2)
                out.fill_(-777)
                graph.replay()
                torch.cuda.synchronize()
                ok, msg = check(x, lens, out, k)
                if not ok:
                    failures.append(f"{name} / {v} / graph replay on {data}: {msg}")
            del graph
    print(f"correctness: {len(SHAPES)} shapes x {len(DATA)} data x {len(names)} variants + graph replays, "
          f"{len(failures)} failures, {time.time() - t0:.1f} s", flush=True)
    for f in failures:
        print("  FAIL", f)

    rows_out = []
    t0 = time.time()
    for name, rows, n, k in SHAPES:
        x, lens = inputs(rows, n, "normal", 1)
        out = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
        vals = torch.empty(rows, k, device=DEVICE)
        idx = torch.empty(rows, k, dtype=torch.int64, device=DEVICE)
        peer = time_graph_ms(lambda: torch.topk(x, k, dim=1, out=(vals, idx)), rep_ms=a.rep_ms) * 1e3
        for v in names:
            cfg = cfgs[(v, k)]
            plan = _plan(_resolve(arch, k, cfg), rows, n, sms)
            g_us = time_graph_ms(lambda: call(x, lens, out, k, cfg), rep_ms=a.rep_ms) * 1e3
            e_us = time_ms(lambda: call(x, lens, out, k, cfg), rep_ms=a.rep_ms) * 1e3
            rows_out.append((name, v, f"{plan[0]} S={plan[1]} S2={plan[2]}", g_us, e_us, peer))
        print(f"timed {name}", flush=True)
    print(f"timing: {time.time() - t0:.1f} s")

    print(f"\n{'shape':38s} {'variant':10s} {'plan':22s} {'graph us':>9s} {'eager us':>9s} {'torch.topk':>10s} "
          f"{'speedup':>8s}")
    for name, v, plan, g_us, e_us, peer in rows_out:
        print(f"{name:38s} {v:10s} {plan:22s} {g_us:9.1f} {e_us:9.1f} {peer:10.1f} {peer / g_us:7.2f}x")
    print("\nbest graph time per shape:")
    for name, *_ in SHAPES:
        best = min((r for r in rows_out if r[0] == name), key=lambda r: r[3])
        dflt = next(r for r in rows_out if r[0] == name and r[1] == names[0])
        print(f"  {name:38s} {best[1]:10s} {best[3]:7.1f} us ({names[0]}: {dflt[3]:.1f} us)")
    print(f"checks: {'all passed' if not failures else f'{len(failures)} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
