"""The main job: one DeepSeek-V4 attention layer of each type (SWA-only, C4, C128) serving a synthetic trace
on the best backend present.

The trace is serving-shaped: requests arrive one step apart with prompt lengths spread around
``--prompt-len``; every step holds up to ``--chunk`` tokens, the decode tokens of running requests first,
then chunks of waiting prompts (chunked prefill), so most steps mix decode and prefill; each request
decodes ``--decode-steps`` tokens. The trace runs once to warm up (kernel compilation), then again timed
on fresh caches. Request 0's outputs are checked against the float reference run on the CPU (on the
reference backend itself, against the layer evaluated from scratch, ``reference.layer_spec``), and the
decode step of all requests is timed replayed from a CUDA/HIP graph. The report: prefill and decode
rates, the check, and the time of each stage of the layer.

A DeepSeek-V4.1 config (``--config v4.1-flash``) runs a stack instead: the layers ``--layers`` (layer ids;
by default one layer of each kind with the sources they read, ``serving_v41.FLASH_LAYERS``) share their
caches and top-k as the model does, every step runs them in layer order, request 0's output of every
layer is checked, and the graph replays the decode step of the whole stack. ``--record`` picks the records
of its sliding-window and compressed caches (``kv_cache.V41_RECORDS``; default V40_584).
"""
import time
from collections import defaultdict

import torch

from . import ops
from .config import LayerType, get_config
from .platform import detect
from .reference.layer_spec import from_scratch_layer
from .serving import SyntheticServer

STAGES = ("projections", "q norm + kv insert", "compressor", "indexer", "attention", "output")
CHECK_TOL = {"cpu": 2e-3, "gpu": 5e-2}   # relative error of request 0's outputs (see docs/numerics.md)


class StageTimer:
    """End-of-stage marks of the layer (device events on a GPU, host clock on the CPU), summed per stage."""

    def __init__(self, device):
        self.gpu = torch.device(device).type == "cuda"
        self.marks, self.totals = [], defaultdict(float)

    def mark(self, stage):
        if self.gpu:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((stage, ev))
        else:
            self.marks.append((stage, time.perf_counter()))

    def collect(self):
        if self.gpu:
            torch.cuda.synchronize()
        for (_, a), (stage, b) in zip(self.marks, self.marks[1:]):
            if stage != "start":
                self.totals[stage] += a.elapsed_time(b) / 1e3 if self.gpu else b - a
        self.marks = []


def trace(num_requests, prompt_len, decode_steps, chunk, seed=0):
    """The steps of the trace: a list of {request: (first token, end token)}; and each request's length."""
    g = torch.Generator().manual_seed(seed)
    prompts = [max(1, int(prompt_len * (0.5 + float(torch.rand((), generator=g))))) for _ in range(num_requests)]
    total = [p + decode_steps for p in prompts]
    done, steps, t = [0] * num_requests, [], 0
    while any(d < n for d, n in zip(done, total)):
        arrived = [b for b in range(num_requests) if b <= t and done[b] < total[b]]
        step, budget = {}, chunk
        for b in arrived:                                   # decode tokens first
            if done[b] >= prompts[b] and budget:
                step[b] = (done[b], done[b] + 1)
                budget -= 1
        for b in arrived:                                   # then prefill chunks, first come first served
            if done[b] < prompts[b] and budget:
                n = min(prompts[b] - done[b], budget)
                step[b] = (done[b], done[b] + n)
                budget -= n
        for b, (a, e) in step.items():
            done[b] = e
        if step:
            steps.append(step)
        t += 1
    return steps, total


def _run_trace(srv, xs, steps, device, timer=None):
    """Run every step; returns (outputs of request 0, per-step (seconds, prefill tokens, decode tokens))."""
    srv.layer.timer = timer
    out0, times = [], []
    for step in steps:
        tokens = {b: xs[b][a:e] for b, (a, e) in step.items()}
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = srv.step(tokens)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if timer is not None:
            timer.collect()
        n_dec = sum(1 for (a, e) in step.values() if e - a == 1 and a > 0)
        times.append((dt, sum(e - a for a, e in step.values()) - n_dec, n_dec))
        for b, v in y.items():
            if not torch.isfinite(v.float()).all():
                raise RuntimeError(f"layer {srv.layer_type.value}: non-finite output for request {b}")
        if 0 in y:
            out0.append(y[0].float().cpu())
    return torch.cat(out0), times


def _check_what(device):
    """What ``_check`` compares request 0's served output with, in words for the report."""
    if ops.backend_for("sparse_mla_decode", device) == "reference":
        return ("the served trace (reference ops, chunked steps through the paged caches) vs the layer evaluated "
                "from scratch (reference.layer_spec: key sets built by hand, dense attention, no caches); both "
                "compose the same fp32 reference functions, so a correct serving path gives exactly 0")
    return "the served trace (the kernels) vs a CPU copy of the layer on the reference backend, all at once"


def _check(cfg, lt, srv, xs, total0, y0, device):
    """Request 0's output against an independent evaluation of the same layer (same weights); returns
    (relative error, tolerance). On the kernels: a CPU copy of the layer on the reference backend, all at
    once (the layer is chunk invariant). On the reference backend that copy would run the very ops that
    served the trace (an error of exactly 0 that checks nothing), so the layer is evaluated from scratch
    instead (``reference.layer_spec``, the oracle of tests/layer/test_layer.py), within that test's bound."""
    ref_srv = SyntheticServer(cfg, lt, 1, srv.max_model_len, device="cpu", weights=srv.weights.to("cpu"))
    x = xs[0][:total0].cpu()
    on_reference = ops.backend_for("sparse_mla_decode", device) == "reference"
    if on_reference:
        ref = from_scratch_layer(ref_srv, x).float()
    else:
        with ops.use_backend("reference"):
            ref = ref_srv.step({0: x})[0].float()
    err = float((y0 - ref).norm() / ref.norm().clamp_min(1e-30))
    return err, CHECK_TOL["cpu" if on_reference else "gpu"]


def _graph_decode_ms(srv, xs, device, reps=20, layers=None):
    """Median time of a decode step of every request replayed from a captured graph (of ``layers``, by
    default the server's layer)."""
    from .graph import DecodeGraph
    B = srv.num_requests
    dg = DecodeGraph(layers or [srv.layer], B, 1, srv.swa_bt.shape[1], srv.comp_bt.shape[1], srv.state_bt.shape[1],
                     srv.max_model_len, ratios=srv.ratios())
    st = srv.make_step({b: 1 for b in range(B)})
    x = torch.cat([xs[b][srv.done[b]:srv.done[b] + 1] for b in st.order])
    args = (x, st.positions, st.query_start_loc, st.seq_lens, st.slot_mapping, st.swa_block_table,
            st.compressed_block_table, st.state_block_table)
    dg.replay(*args)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dg.replay(*args)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main_job(a) -> int:
    if getattr(a, "long", False):           # the long-context preset (dsv4_rocm/long_context.py)
        from .long_context import long_job
        return long_job(a)
    device = a.device
    cfg = get_config(a.config)
    cfg = cfg.with_tp(cfg.num_heads // a.heads)
    if cfg.is_v41:
        return main_job_v41(a, cfg, [int(t) for t in a.layers.split(",")])
    types = [LayerType(t) for t in a.layers.split(",")]
    if a.backend:
        ops.use_backend(a.backend)
    plat = detect(device)
    steps, total = trace(a.requests, a.prompt_len, a.decode_steps, a.chunk)
    max_len = max(total) + 2
    print(f"dsv4_rocm run: {cfg.name}, {cfg.local_heads} local heads (tp {cfg.tp_size}), device {device} "
          f"({plat.arch}), sparse attention on {ops.backend_for('sparse_mla_decode', device)}")
    print(f"trace: {a.requests} requests, prompts of {min(t - a.decode_steps for t in total)}.."
          f"{max(t - a.decode_steps for t in total)} tokens, {a.decode_steps} decode steps each, up to {a.chunk} "
          f"tokens a step: {len(steps)} steps, {sum(1 for s in steps if len(set(e - x > 1 for x, e in s.values())) > 1)}"
          " of them mixing decode and prefill")
    g = torch.Generator().manual_seed(0)
    rows, stage_rows = [], []
    for lt in types:
        xs = [torch.randn(max_len, cfg.hidden_size, generator=g).bfloat16().to(device) for _ in range(a.requests)]
        _run_trace(SyntheticServer(cfg, lt, a.requests, max_len, device=device), xs, steps, device)   # warm-up
        srv = SyntheticServer(cfg, lt, a.requests, max_len, device=device)
        timer = StageTimer(device)
        y0, times = _run_trace(srv, xs, steps, device, timer)
        err, tol = _check(cfg, lt, srv, xs, total[0], y0, device)
        t_all = sum(t for t, _, _ in times)
        pre_tok = sum(p for _, p, _ in times)
        dec_steps = [(t, d) for t, p, d in times if p == 0 and d > 0]
        dec_ms = 1e3 * sum(t for t, _ in dec_steps) / max(len(dec_steps), 1)
        graph_ms = _graph_decode_ms(srv, xs, device) if device != "cpu" else float("nan")
        rows.append((lt.value, len(times), 1e3 * t_all, pre_tok / t_all if t_all else 0.0, dec_ms, graph_ms,
                     a.requests / (graph_ms / 1e3) if graph_ms == graph_ms else a.requests / (dec_ms / 1e3),
                     err, tol))
        stage_rows.append((lt.value, {s: timer.totals.get(s, 0.0) for s in STAGES}))
        if err > tol:
            raise RuntimeError(f"layer {lt.value}: request 0 differs by {err:.2e} (tolerance {tol:.0e}) in the "
                               f"check of {_check_what(device)}")
    print(f"\ncheck of request 0: {_check_what(device)}")
    print(f"{'layer':7s} {'steps':>5s} {'total ms':>9s} {'prefill tok/s':>14s} {'decode ms/step':>15s} "
          f"{'graph ms/step':>14s} {'decode tok/s':>13s}  check (request 0)")
    for lt, n, tot, ptok, dms, gms, dtok, err, tol in rows:
        graph = f"{gms:14.3f}" if gms == gms else f"{'- (no GPU)':>14s}"      # NaN: no graph on a CPU
        print(f"{lt:7s} {n:5d} {tot:9.1f} {ptok:14.0f} {dms:15.2f} {graph} {dtok:13.0f}  "
              f"rel err {err:.1e} <= {tol:.0e} ok")
    print("\ntime per stage over the timed trace (ms, share of the layer):")
    print(f"{'layer':7s} " + " ".join(f"{s:>20s}" for s in STAGES))
    for lt, st in stage_rows:
        tot = sum(st.values()) or 1.0
        print(f"{lt:7s} " + " ".join(f"{1e3 * st[s]:13.1f} ({st[s] / tot:4.0%})" for s in STAGES))
    return 0


def _run_stack(srv, xs, steps, device, timers=None):
    """The V4.1 stack over every step: (request 0's outputs per layer, per-step (seconds, prefill, decode))."""
    for layer, mod in srv.modules.items():
        mod.timer = timers[layer] if timers else None
    out0, times = {x: [] for x in srv.layers}, []
    for step in steps:
        tokens = {b: xs[b][a:e] for b, (a, e) in step.items()}
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = srv.step_all(tokens)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        for t in (timers or {}).values():
            t.collect()
        n_dec = sum(1 for (a, e) in step.values() if e - a == 1 and a > 0)
        times.append((dt, sum(e - a for a, e in step.values()) - n_dec, n_dec))
        for layer, ys in y.items():
            for b, v in ys.items():
                if not torch.isfinite(v.float()).all():
                    raise RuntimeError(f"layer {layer}: non-finite output for request {b}")
            if 0 in ys:
                out0[layer].append(ys[0].float().cpu())
    return {x: torch.cat(v) for x, v in out0.items()}, times


def _mixed(steps) -> int:
    """Steps holding both decode and prefill tokens."""
    return sum(1 for s in steps if len(set(e - x > 1 for x, e in s.values())) > 1)


def main_job_v41(a, cfg, layers) -> int:
    """The main job of a DeepSeek-V4.1 config: a stack of ``layers`` sharing caches (module docstring)."""
    from .serving_v41 import V41Stack, check_stack
    device = a.device
    layers = check_stack(cfg, layers)
    record = getattr(a, "record", None) or "V40_584"
    plat = detect(device)
    steps, total = trace(a.requests, a.prompt_len, a.decode_steps, a.chunk)
    max_len = max(total) + 2
    print(f"dsv4_rocm run: {cfg.name}, {cfg.local_heads} local heads (tp {cfg.tp_size}), device {device} "
          f"({plat.arch}), sparse attention on {ops.backend_for('sparse_mla_decode', device)}")
    print("stack: " + ", ".join(f"{x} {cfg.v41_layer(x).label}" for x in layers) + f"; records {record}")
    print(f"trace: {a.requests} requests, prompts of {min(t - a.decode_steps for t in total)}.."
          f"{max(t - a.decode_steps for t in total)} tokens, {a.decode_steps} decode steps each, up to {a.chunk} "
          f"tokens a step: {len(steps)} steps, {_mixed(steps)} of them mixing decode and prefill")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(max_len, cfg.hidden_size, generator=g).bfloat16().to(device) for _ in range(a.requests)]

    def stack(**kw):
        return V41Stack(cfg, None, a.requests, max_len, device=device, layers=layers, max_step_tokens=a.chunk,
                        record_format=record, **kw)
    warm = stack()
    _run_stack(warm, xs, steps, device)                                 # warm-up: kernel compilation
    srv = stack(layer_weights=warm.layer_weights)
    timers = {x: StageTimer(device) for x in layers}
    y0, times = _run_stack(srv, xs, steps, device, timers)
    ref_srv = V41Stack(cfg, None, 1, max_len, device="cpu", layers=layers, max_step_tokens=total[0],
                       layer_weights={x: w.to("cpu") for x, w in srv.layer_weights.items()}, record_format=record)
    with ops.use_backend("reference"):
        ref = ref_srv.step_all({0: xs[0][:total[0]].cpu()})
    tol = CHECK_TOL["cpu" if ops.backend_for("sparse_mla_decode", device) == "reference" else "gpu"]
    errs = {x: float((y0[x] - ref[x][0].float()).norm() / ref[x][0].float().norm().clamp_min(1e-30)) for x in layers}
    t_all = sum(t for t, _, _ in times)
    pre_tok = sum(p for _, p, _ in times)
    dec_steps = [(t, d) for t, p, d in times if p == 0 and d > 0]
    dec_ms = 1e3 * sum(t for t, _ in dec_steps) / max(len(dec_steps), 1)
    graph_ms = _graph_decode_ms(srv, xs, device, layers=[srv.modules[x] for x in layers]) if device != "cpu" \
        else float("nan")
    graph = f"{graph_ms:.3f}" if graph_ms == graph_ms else "- (no GPU)"
    rate = a.requests / ((graph_ms if graph_ms == graph_ms else dec_ms) / 1e3)
    print(f"\nstack of {len(layers)} layers: {len(times)} steps, {1e3 * t_all:.1f} ms, {pre_tok / t_all:.0f} prefill "
          f"tok/s, decode {dec_ms:.2f} ms/step, graph {graph} ms/step, {rate:.0f} decode tok/s")
    if ops.backend_for("sparse_mla_decode", device) == "reference":
        what = ("the served stack (reference ops, chunked) vs the same stack all at once on the reference backend: "
                "the same ops, so this checks chunked serving and the shared caches, not the ops")
    else:
        what = "the served stack (the kernels) vs a CPU copy of the stack on the reference backend, all at once"
    print(f"\ncheck of request 0: {what}")
    print(f"{'layer':>5s} {'kind':32s} {'check (request 0)':>32s}   "
          + " ".join(f"{s:>18s}" for s in STAGES))
    bad = []
    for x in layers:
        st = {s: timers[x].totals.get(s, 0.0) for s in STAGES}
        verdict = "ok" if errs[x] <= tol else "FAILED"
        if errs[x] > tol:
            bad.append(x)
        print(f"{x:5d} {cfg.v41_layer(x).label:32s} {'rel err ' + f'{errs[x]:.1e} <= {tol:.0e} ' + verdict:>32s}   "
              + " ".join(f"{1e3 * st[s]:15.1f} ms" for s in STAGES))
    if bad:
        raise RuntimeError(f"layers {bad}: request 0 differs from the reference beyond {tol:.0e}")
    return 0
