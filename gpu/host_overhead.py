"""Host overhead of the eager path: what each public op of a C4 decode step costs the CPU, the GPU span of
an eager ``flash_mla_with_kvcache`` call, and the main job's eager decode step. Every Triton launch goes
through Triton's own launcher (``dsv4_rocm/triton/_launch.py`` says why); a captured graph replays without
host time (``graph us``).

    python gpu/host_overhead.py [--flashmla PATH] [--json out.json]
    python gpu/host_overhead.py --cpu [--target cuda|hip]

On a GPU (correctness first, then timing):
1. the decode ops (``dsv4_rocm.bench.host.c4_decode_calls``: V4-Flash dims, b = 128) and
   ``flash_mla_with_kvcache`` at b 2 s_q 2 (topk 128 + 512, h 64) give the same bytes when repeated; the
   b = 2 call matches the reference with the split combine in the kernel and in its own launch;
2. per op: host us per eager call (median of 5 rounds of 200 back-to-back calls, the GPU synchronized
   only around a round) and the GPU span of one eager call (torch.profiler: first kernel start to last
   kernel end);
3. the b = 2 call: the same, for every split count with the combine in the kernel and in a second
   launch, beside FlashMLA's call on the same tensors when its package imports (``--flashmla`` adds a
   built checkout to the path); a cProfile top-15 of 200 eager calls;
4. the main job's eager decode step per layer (``python -m dsv4_rocm run``'s default trace: 4 requests,
   V4-Flash, 64 heads), and a cProfile of the C4 layer's decode steps.
A short table is printed last.

``--cpu`` (no GPU): the same op calls (b = 4 by default) on CPU tensors taking the GPU path
(``bench.host.ops_as_on_gpu``), with the launches simulated (``bench.host.simulated_gpu``): our Python alone
(every launch a no-op) and plus Triton's launcher (the minimum of 5 rounds: the CPU may be shared); ops
that are torch compute are left out (a CPU computes them for real); a cProfile of the b = 2 call; the main
job's decode step of a tiny C4 layer on that path (its kernels launching nothing, its torch ops on the CPU).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_rocm.bench import host as H  # noqa: E402

ROWS = []
CPU_COMPUTE = ("compressor_kv_score", "torch.matmul")


def row(section, name, **values):
    ROWS.append(dict(section=section, name=name, **values))
    vals = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
    print(f"[{section}] {name}: {vals}", flush=True)


# ---- GPU -----------------------------------------------------------------------------------------------
def _sync():
    torch.cuda.synchronize()


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_snapshot(v) for v in x)
    return x


def _same(a, b):
    if isinstance(a, torch.Tensor):
        raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731  (bits, NaN included)
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_decode_ops(calls, outputs):
    """Every op's results and the caches they write are the same bytes when the calls repeat."""
    passes = []
    for _ in range(2):
        for _, fn in calls:
            fn()
        _sync()
        passes.append({k: _snapshot(v) for k, v in outputs().items()})
    for name, v in passes[0].items():
        if not _same(v, passes[1][name]):
            raise SystemExit(f"host_overhead: {name} differs between two passes")
    print(f"decode ops: {len(passes[0])} results and caches identical over 2 passes")


def check_flash_mla(fn, args):
    """The b = 2 call: the same bytes when repeated, for the combine in the kernel and in its own launch;
    those two within fp32 summation order of each other; the reference agrees."""
    from dsv4_rocm.reference.attention import flash_mla_with_kvcache_sparse
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    q, kc, idx, lens, sink, ekc, eidx, elens, sm = args
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    ref, ref_lse = flash_mla_with_kvcache_sparse(*cpu[:2], cpu[2], cpu[3], cpu[4], cpu[5], cpu[6], cpu[7], sm)
    res = {}
    for fused in (True, False):
        cfg = dict(kernel="triton", split_combine="kernel" if fused else "launch")
        for ns in (None, 1, 2, 4, 10):
            for _ in range(2):
                out, lse = D.sparse_mla_decode(q, kc, idx, lens, sink, ekc, eidx, elens, sm, config=cfg,
                                               num_splits=ns)
                _sync()
                got = (out.clone(), lse.clone())
                key = (fused, ns)
                if key in res and not _same(res[key], got):
                    raise SystemExit(f"host_overhead: b=2 decode (fused={fused}, splits={ns}) differs between launches")
                res[key] = got
            out, lse = res[(fused, ns)]
            err = (out.float().cpu() - ref.float()).abs().max().item()
            if not err <= 2e-2 * max(1.0, ref.float().abs().max().item()):
                raise SystemExit(f"host_overhead: b=2 decode (fused={fused}, splits={ns}) off the reference by {err}")
    for ns in (None, 2, 4, 10):
        if not _same(res[(True, ns)], res[(False, ns)]):
            raise SystemExit(f"host_overhead: in-kernel and two-launch combine differ (splits {ns})")
    print("flash_mla b=2: identical when repeated, and with the combine in the kernel or in a second launch; "
          "reference ok")


def gpu_main(a):
    from dsv4_rocm.bench.timing import gpu_span_us, time_graph_ms
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    dev = torch.device("cuda")
    calls, outputs = H.c4_decode_calls(dev)
    check_decode_ops(calls, outputs)
    fn, args = H.flash_mla_b2_call(dev)
    check_flash_mla(fn, args)

    for name, f in calls:
        row("C4 decode op (b=128)", name, **{"host us": H.host_us(f, sync=_sync), "span us": gpu_span_us(f)})

    peer = load_peer(a.flashmla)
    q, kc, idx, lens, sink, ekc, eidx, elens, sm = args
    for fused in (True, False):
        for ns in (None, 1, 2, 3, 4, 6, 10):
            def call(ns=ns, cfg=dict(kernel="triton", split_combine="kernel" if fused else "launch")):  # noqa: E306
                return D.sparse_mla_decode(q, kc, idx, lens, sink, ekc, eidx, elens, sm, config=cfg, num_splits=ns)
            row("b=2 decode kernel", f"{'in-kernel' if fused else 'two-launch'} combine, splits {ns or 'auto'}",
                **{"span us": gpu_span_us(call), "graph us": 1e3 * time_graph_ms(call)})
    row("flash_mla_with_kvcache b=2 s_q=2", "dsv4_rocm",
        **{"host us": H.host_us(fn, sync=_sync), "span us": gpu_span_us(fn)})
    if peer is not None:
        from dsv4_rocm.bench.sparse_mla import decode_call
        pf = decode_call(peer, args)
        row("flash_mla_with_kvcache b=2 s_q=2", "FlashMLA", **{"host us": H.host_us(pf, sync=_sync),
                                                               "span us": gpu_span_us(pf)})
    print("\ncProfile, 200 eager flash_mla_with_kvcache calls (b=2):")
    print(H.profile_top(fn))
    for lt in ("swa", "c4a", "c128a"):
        row("main job eager decode step", lt, **{"ms/step": H.main_job_decode_step_ms("cuda", lt)})
    ms, prof = H.main_job_decode_step_ms("cuda", "c4a", profile=True)
    print(f"\ncProfile of the main job's eager decode steps, c4a ({ms:.2f} ms/step under the profiler):")
    print(prof)


def load_peer(path):
    path = path or os.environ.get("FLASHMLA_DIR")
    if path and path not in sys.path:
        sys.path.append(path)
    from dsv4_rocm.bench.sparse_mla import flashmla_peer
    return flashmla_peer()


# ---- CPU -----------------------------------------------------------------------------------------------
def cpu_main(a):
    import triton.runtime.jit as J
    torch.set_num_threads(1)
    with H.ops_as_on_gpu(), H.simulated_gpu(a.target):
        calls, _ = H.c4_decode_calls("cpu", b=a.b, ctx=a.ctx)
        fn, _ = H.flash_mla_b2_call("cpu", pool_tokens=1 << 12)
        # torch compute (a matmul, the reference compressor projection) runs for real on a CPU: left out
        all_calls = [(n, f) for n, f in calls if not any(c in n for c in CPU_COMPUTE)]
        all_calls.append(("flash_mla_with_kvcache b=2", fn))
        results = {}
        run = J.JITFunction.run
        try:                                   # our Python alone: every launch a no-op
            J.JITFunction.run = lambda self, *args, **kw: None
            for name, f in all_calls:
                results[name] = {"ours us": H.host_us(f, n=a.calls, best=True)}
        finally:
            J.JITFunction.run = run
        for name, f in all_calls:
            results[name]["triton"] = H.host_us(f, n=a.calls, best=True)
        for name, v in results.items():
            row("cpu host path", name, **{"ours us": v["ours us"], "+ triton launcher us": v["triton"]})
        tot = {k: sum(v[k] for n, v in results.items() if not n.startswith("flash_mla")) for k in ("ours us",
                                                                                                  "triton")}
        row("cpu host path", "C4 decode step, sum of ops", **{"ours us": tot["ours us"],
                                                              "+ triton launcher us": tot["triton"]})
        print("\ncProfile, 200 calls of flash_mla_with_kvcache b=2:")
        print(H.profile_top(fn))
        row("cpu main job eager decode step (tiny c4a, simulated)", "triton",
            **{"ms/step": H.main_job_decode_step_ms("cpu", "c4a", config="tiny")})


def print_table():
    print("\n== host overhead ==")
    for r in ROWS:
        vals = "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        print(f"{r['section'][:34]:34s} {r['name'][:52]:52s} {vals}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flashmla", default=None, help="a FlashMLA checkout built in place (the peer)")
    p.add_argument("--cpu", action="store_true", help="measure the host path on this CPU with simulated launches")
    p.add_argument("--target", default="cuda", choices=("cuda", "hip"), help="--cpu: the simulated target")
    p.add_argument("--ctx", type=int, default=1024, help="--cpu: context of the decode step's caches")
    p.add_argument("--b", type=int, default=4, help="--cpu: decode requests (host time hardly depends on it)")
    p.add_argument("--calls", type=int, default=100, help="--cpu: calls per timing round")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    t0 = time.time()
    if a.cpu:
        cpu_main(a)
    else:
        if not torch.cuda.is_available():
            print("host_overhead: no GPU here; use --cpu for the simulated host path", file=sys.stderr)
            return 2
        gpu_main(a)
    print_table()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
