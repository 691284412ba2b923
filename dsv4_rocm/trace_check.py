"""``python -m dsv4_rocm run``: a serving-shaped synthetic trace over attention layers on the best backend
present, request 0's outputs checked against the reference, and the rates and stage times reported.

The trace is serving-shaped: requests arrive one step apart with prompt lengths spread around
``--prompt-len``; every step holds up to ``--chunk`` tokens, the decode tokens of running requests first,
then chunks of waiting prompts (chunked prefill), so most steps mix decode and prefill; each request
decodes ``--decode-steps`` tokens. The trace runs once to warm up (kernel compilation), then again timed
on fresh caches. A DeepSeek-V4.0 config serves one layer of each type ``--layers`` (swa, c4a, c128a), one
server each; a DeepSeek-V4.1 config (``--config v4.1-flash``) serves one stack of the layers ``--layers``
(layer ids; by default one layer of each kind with the sources they read, ``serving.FLASH_LAYERS``) sharing
their caches and top-k as the model does, in layer order, over the records ``--record`` names
(``kv_cache.V41_RECORDS``; default V40_584). Request 0's output of every layer is checked against an
independent evaluation (``_check``), and the decode step of all requests is timed replayed from a CUDA/HIP
graph. The report: prefill and decode rates, the check, and the time of each stage of every layer.
"""
import time
from collections import defaultdict

import torch

from . import ops
from .config import LayerType, get_config
from .platform import detect
from .reference.layer_spec import from_scratch_layer
from .serving import SyntheticServer, check_stack

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


def _name(srv, layer: int) -> str:
    """A layer as the report names it: its type for a V4.0 server of one layer, else its id and kind."""
    return srv.layer_type.value if srv.layer_type is not None else f"{layer:5d} {srv.plans[layer].label}"


def _run_trace(srv, xs, steps, device, timers=None):
    """Run every step through the server's layers: (request 0's outputs {layer: fp32 [T, hidden]}, per-step
    (seconds, prefill tokens, decode tokens)). ``timers``: {layer: StageTimer} attached to the layers."""
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
                    raise RuntimeError(f"layer {_name(srv, layer).strip()}: non-finite output for request {b}")
            if 0 in ys:
                out0[layer].append(ys[0].float().cpu())
    return {x: torch.cat(v) for x, v in out0.items()}, times


def _check_what(device, v41: bool = False):
    """What ``_check`` compares request 0's served output with, in words for the report."""
    if ops.backend_for("sparse_mla_decode", device) != "reference":
        return "the served trace (the kernels) vs a CPU copy of the layers on the reference backend, all at once"
    if v41:
        return ("the served stack (reference ops, chunked) vs the same stack all at once on the reference backend: "
                "the same ops, so this checks chunked serving and the shared caches, not the ops")
    return ("the served trace (reference ops, chunked steps through the paged caches) vs the layer evaluated "
            "from scratch (reference.layer_spec: key sets built by hand, dense attention, no caches); both "
            "compose the same fp32 reference functions, so a correct serving path gives exactly 0")


def _check(srv, xs, total0, y0, device):
    """Request 0's output of every layer against an independent evaluation of the same layers (same
    weights); returns ({layer: relative error}, tolerance). On the kernels: a CPU copy of the server on the
    reference backend, all at once (the layers are chunk invariant). On the reference backend that copy
    would run the very ops that served the trace (an error of exactly 0 that checks nothing), so a V4.0
    layer is evaluated from scratch instead (``reference.layer_spec``, the oracle of tests/layer/test_layer.py),
    within that test's bound; a V4.1 stack is compared with itself all at once (``_check_what``)."""
    cfg = srv.cfg
    ref_srv = SyntheticServer(cfg, srv.layer_type, 1, srv.max_model_len, device="cpu", layers=srv.layers,
                              max_step_tokens=total0, record_format=srv.record_format,
                              layer_weights={x: w.to("cpu") for x, w in srv.layer_weights.items()})
    x = xs[0][:total0].cpu()
    on_reference = ops.backend_for("sparse_mla_decode", device) == "reference"
    if on_reference and srv.layer_type is not None:
        ref = {srv.layers[0]: from_scratch_layer(ref_srv, x)}
    else:
        with ops.use_backend("reference"):
            ref = {layer: ys[0] for layer, ys in ref_srv.step_all({0: x}).items()}
    errs = {layer: float((y0[layer] - ref[layer].float()).norm() / ref[layer].float().norm().clamp_min(1e-30))
            for layer in srv.layers}
    return errs, CHECK_TOL["cpu" if on_reference else "gpu"]


def _graph_decode_ms(srv, xs, device, reps=20, layers=None):
    """Median time of a decode step of every request replayed from a captured graph (of ``layers``, by
    default every layer of the server)."""
    from .graph import DecodeGraph
    B = srv.num_requests
    layers = layers or [srv.modules[x] for x in srv.layers]
    dg = DecodeGraph(layers, B, 1, srv.swa_bt.shape[1], srv.comp_bt.shape[1], srv.state_bt.shape[1],
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


def _mixed(steps) -> int:
    """Steps holding both decode and prefill tokens."""
    return sum(1 for s in steps if len(set(e - x > 1 for x, e in s.values())) > 1)


def run_trace_check(a) -> int:
    """The ``run`` command (module docstring); ``a``: its parsed arguments. Returns 0, or raises naming the
    layer whose request 0 differs from the reference."""
    if getattr(a, "long", False):           # the long-context preset (dsv4_rocm/long_context.py)
        from .long_context import long_job
        return long_job(a)
    device = a.device
    cfg = get_config(a.config)
    cfg = cfg.with_tp(cfg.num_heads // a.heads)
    record = getattr(a, "record", None) or "V40_584"
    if a.backend:
        ops.use_backend(a.backend)
    steps, total = trace(a.requests, a.prompt_len, a.decode_steps, a.chunk)
    max_len = max(total) + 2
    # one server per V4.0 layer type; one stack of V4.1 layers
    if cfg.is_v41:
        groups = [dict(layer_type=None, layers=check_stack(cfg, [int(t) for t in a.layers.split(",")]))]
    else:
        groups = [dict(layer_type=LayerType(t)) for t in a.layers.split(",")]
    print(f"dsv4_rocm run: {cfg.name}, {cfg.local_heads} local heads (tp {cfg.tp_size}), device {device} "
          f"({detect(device).arch}), sparse attention on {ops.backend_for('sparse_mla_decode', device)}")
    if cfg.is_v41:
        print("stack: " + ", ".join(f"{x} {cfg.v41_layer(x).label}" for x in groups[0]["layers"])
              + f"; records {record}")
    print(f"trace: {a.requests} requests, prompts of {min(t - a.decode_steps for t in total)}.."
          f"{max(t - a.decode_steps for t in total)} tokens, {a.decode_steps} decode steps each, up to {a.chunk} "
          f"tokens a step: {len(steps)} steps, {_mixed(steps)} of them mixing decode and prefill")
    g = torch.Generator().manual_seed(0)
    rows, layer_rows = [], []
    for grp in groups:
        xs = [torch.randn(max_len, cfg.hidden_size, generator=g).bfloat16().to(device) for _ in range(a.requests)]

        def server(**kw):
            return SyntheticServer(cfg, grp["layer_type"], a.requests, max_len, device=device,
                                   layers=grp.get("layers"), max_step_tokens=a.chunk, record_format=record, **kw)
        warm = server()
        _run_trace(warm, xs, steps, device)                              # warm-up: kernel compilation
        srv = server(layer_weights=warm.layer_weights)
        timers = {x: StageTimer(device) for x in srv.layers}
        y0, times = _run_trace(srv, xs, steps, device, timers)
        errs, tol = _check(srv, xs, total[0], y0, device)
        t_all = sum(t for t, _, _ in times)
        pre_tok = sum(p for _, p, _ in times)
        dec_steps = [(t, d) for t, p, d in times if p == 0 and d > 0]
        dec_ms = 1e3 * sum(t for t, _ in dec_steps) / max(len(dec_steps), 1)
        graph_ms = _graph_decode_ms(srv, xs, device) if device != "cpu" else float("nan")
        served = f"layer {srv.layer_type.value}" if srv.layer_type is not None else f"stack of {len(srv.layers)}"
        rows.append((served, len(times), 1e3 * t_all, pre_tok / t_all if t_all else 0.0, dec_ms, graph_ms,
                     a.requests / ((graph_ms if graph_ms == graph_ms else dec_ms) / 1e3)))
        layer_rows += [(_name(srv, x), {s: timers[x].totals.get(s, 0.0) for s in STAGES}, errs[x], tol)
                       for x in srv.layers]
    print(f"\n{'served':12s} {'steps':>5s} {'total ms':>9s} {'prefill tok/s':>14s} {'decode ms/step':>15s} "
          f"{'graph ms/step':>14s} {'decode tok/s':>13s}")
    for served, n, tot, ptok, dms, gms, dtok in rows:
        graph = f"{gms:14.3f}" if gms == gms else f"{'- (no GPU)':>14s}"      # NaN: no graph on a CPU
        print(f"{served:12s} {n:5d} {tot:9.1f} {ptok:14.0f} {dms:15.2f} {graph} {dtok:13.0f}")
    what = _check_what(device, cfg.is_v41)
    print(f"\ncheck of request 0: {what}")
    print("time per stage over the timed trace (ms, share of the layer), and the check:")
    print(f"{'layer':38s} " + " ".join(f"{s:>20s}" for s in STAGES) + "  check (request 0)")
    bad = []
    for name, st, err, tol in layer_rows:
        tot = sum(st.values()) or 1.0
        verdict = "ok" if err <= tol else "FAILED"
        print(f"{name:38s} " + " ".join(f"{1e3 * st[s]:13.1f} ({st[s] / tot:4.0%})" for s in STAGES)
              + f"  rel err {err:.1e} <= {tol:.0e} {verdict}")
        if err > tol:
            bad.append((name.strip(), err, tol))
    if bad:
        name, err, tol = bad[0]
        raise RuntimeError(f"layer {name}: request 0 differs by {err:.2e} (tolerance {tol:.0e}) in the check of "
                           f"{what}")
    return 0
