"""The main job: one DeepSeek-V4 attention layer of each type (SWA-only, C4, C128) serving a synthetic
batch (every request prefilled, then decoded step by step) on the best backend present."""
import time

import torch

from . import ops
from .config import LayerType, get_config
from .platform import detect
from .serving import SyntheticServer


def main_job(a) -> int:
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = get_config(a.config)
    heads = a.heads or (8 if device == "cpu" else cfg.local_heads)
    if cfg.num_heads % heads or cfg.o_groups % (cfg.num_heads // heads):
        raise ValueError(f"--heads {heads} must be num_heads / tp for a tp that divides o_groups {cfg.o_groups}")
    cfg = cfg.with_tp(cfg.num_heads // heads)
    types = [LayerType(t) for t in a.layers.split(",")]
    if a.backend:
        ops.use_backend(a.backend)
    try:
        from tqdm import tqdm
    except ImportError:                                   # progress bar is cosmetic
        def tqdm(it, **_):
            return it
    plat = detect(device)
    print(f"dsv4_rocm run: {cfg.name}, {cfg.local_heads} local heads (tp {cfg.tp_size}), device {device} "
          f"({plat.arch}), sparse attention backend {ops.backend_for('sparse_mla_decode', device)}")
    print(f"batch: {a.requests} requests x {a.prompt_len} prompt tokens, then {a.decode_steps} decode steps")
    max_len = a.prompt_len + a.decode_steps + 1
    g = torch.Generator().manual_seed(0)
    rows = []
    for lt in types:
        srv = SyntheticServer(cfg, lt, a.requests, max_len, device=device, impl=ops)
        xs = {b: torch.randn(max_len, cfg.hidden_size, generator=g).bfloat16().to(device) for b in range(a.requests)}
        steps = [("prefill", {b: xs[b][:a.prompt_len] for b in xs})]
        steps += [(f"decode {i}", {b: xs[b][a.prompt_len + i:a.prompt_len + i + 1] for b in xs})
                  for i in range(a.decode_steps)]
        times = []
        for name, batch in tqdm(steps, desc=f"layer {lt.value}", leave=False):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = srv.step(batch)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append((name, time.perf_counter() - t0, sum(v.shape[0] for v in batch.values())))
            for y in out.values():
                if not torch.isfinite(y.float()).all():
                    raise RuntimeError(f"layer {lt.value}, step {name}: non-finite output")
        pre = times[0]
        dec = times[1:]
        dec_t = sum(t for _, t, _ in dec)
        rows.append((lt.value, pre[1], pre[2] / pre[1], dec_t / max(len(dec), 1),
                     sum(n for _, _, n in dec) / dec_t if dec_t else 0.0))
    print(f"{'layer':7s} {'prefill ms':>11s} {'prefill tok/s':>14s} {'decode ms/step':>15s} {'decode tok/s':>13s}")
    for lt, pt, ptok, dt, dtok in rows:
        print(f"{lt:7s} {pt * 1e3:11.1f} {ptok:14.0f} {dt * 1e3:15.1f} {dtok:13.0f}")
    return 0
