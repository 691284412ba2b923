"""Run the benchmarks and print one table: time, TFLOP/s, TB/s, fraction of the measured floor and the
FlashMLA reference point. Results go to a JSON file (and a PNG plot when matplotlib is present)."""
import json
import time

import torch

from ..platform import detect
from . import sparse_mla as S
from .timing import bf16_matmul_rate, copy_bandwidth, time_graph_ms, time_ms


SWEEP_DECODE = {          # tile sweeps of 2026-11-22 are in BENCHMARKS.md; this one tunes the split count
    "default": None,
    "waves2": dict(split_waves=2),
    "waves4": dict(split_waves=4),
}
SWEEP_PREFILL = {
    "default": None,
    "n32s2": dict(BLOCK_N=32, num_stages=2),
    "n64s3": dict(BLOCK_N=64, num_stages=3),
    "n64w16": dict(BLOCK_N=64, num_warps=16, num_stages=2),
}


def run(device="cuda", out_json=None, only=None, configs=None, prefill_configs=None):
    plat = detect(device)
    bw = copy_bandwidth(device)
    mm = bf16_matmul_rate(device)
    rows = []
    from ..triton.sparse_mla_decode import sparse_mla_decode
    from ..triton.sparse_mla_prefill import sparse_mla_prefill
    for name, c in S.decode_cases():
        if only and only not in name:
            continue
        args, T = S.make_decode_inputs(c, device)
        flop, nbytes = S.count_decode(c)
        for cfg_name, cfg in (configs or {"default": None}).items():
            ms = time_graph_ms(lambda: sparse_mla_decode(*args, config=cfg))
            rows.append(_row(name, cfg_name, ms, flop, nbytes, bw, mm))
            if cfg_name == "default" and c["b"] <= 64:   # what a caller without graphs pays
                rows.append(_row(name, "eager", time_ms(lambda: sparse_mla_decode(*args)), flop, nbytes, bw, mm))
        del args
    for name, c in S.prefill_cases():
        if only and only not in name:
            continue
        q, kv, idx = S.make_prefill_inputs(c, device)
        flop, nbytes = S.count_prefill(c)
        for cfg_name, cfg in (prefill_configs or {"default": None}).items():
            ms = time_ms(lambda: sparse_mla_prefill(q, kv, idx, 512 ** -0.5, config=cfg))
            rows.append(_row(name, cfg_name, ms, flop, nbytes, bw, mm))
    if not only or "cache" in only:
        from . import cache_ops
        for T in (16384, 65536):
            for name, fn, nbytes in cache_ops.cases(device, T):
                rows.append(_row(name, "hip", time_graph_ms(fn), 0, nbytes, bw, mm))
    report = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(device), arch=plat.arch,
                  copy_TBps=bw / 1e12, bf16_TFLOPs=mm / 1e12, rows=rows)
    print_table(report)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _row(name, cfg, ms, flop, nbytes, bw, mm):
    floor_ms = max(nbytes / bw, flop / mm) * 1e3
    peer = S.FLASHMLA_H100.get(name)
    return dict(case=name, config=cfg, us=ms * 1e3, tflops=flop / ms / 1e9, tbps=nbytes / ms / 1e9,
                floor_us=floor_ms * 1e3, frac_floor=floor_ms / ms,
                flashmla_us=peer[0] if peer else None, flashmla_tflops=peer[1] if peer else None)


def print_table(rep):
    print(f"\n{rep['device']} ({rep['arch']}), copy {rep['copy_TBps']:.2f} TB/s, bf16 mm {rep['bf16_TFLOPs']:.0f} TFLOP/s")
    print(f"{'case':30s} {'config':10s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} {'floor':>6s} {'FlashMLA':>14s}")
    for r in rep["rows"]:
        peer = ""
        if r["flashmla_tflops"]:
            peer = f"{r['tflops'] / r['flashmla_tflops']:.2f}x" + (f" ({r['flashmla_us']:.0f}us)" if r["flashmla_us"] else "")
        print(f"{r['case']:30s} {r['config']:10s} {r['us']:9.1f} {r['tflops']:8.1f} {r['tbps']:6.2f} "
              f"{r['frac_floor']:6.0%} {peer:>14s}")
