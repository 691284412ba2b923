"""Output-path benchmarks: ``fused_inv_rope_fp8_quant`` and the grouped ``fp8_einsum`` with wo_a at V4-Flash
(64 local heads in G = 8 groups, TP1) and V4-Pro (128 heads, G = 16) dims, o_lora 1024, r = 8 * 512 = 4096,
for a decode step of T = 128 tokens, a batch of T = 512 (both graph-timed: an eager call's host time would
exceed the kernel's) and a prefill chunk of T = 4096 (eager).

Bytes, each counted once:
  inverse RoPE + quant: o (T H 512 bf16) + positions (8 B) and a cos/sin row (256 B) a token in; fp8
  (T H 512) and fp32 scales (T H 4 x 4 B) out. Floor: bytes / copy bandwidth.
  einsum: a (T G r fp8) and its scales (T G r/128 x 4 B), w (G d r fp8) and its scales, out (T G d bf16);
  FLOP 2 T G d r. Floor: max(bytes / bandwidth, FLOP / fp8 rate), the fp8 rate being an 8192^3 e4m3
  ``torch._scaled_mm`` timed in the same run. Peer: ``torch.einsum`` of the same shapes in bf16 (what
  engines run on MI300 for lack of an fp8 path), timed in the same run.
"""
import torch

from . import timing

MODELS = {"flash": dict(G=8, hpg=8, d=1024), "pro": dict(G=16, hpg=8, d=1024)}
TOKENS = (128, 512, 4096)


def _inputs(m, T, device, seed=0):
    from ..reference.output import quantize_weight
    from ..reference.rope import build_cos_sin_cache
    g = torch.Generator(device=device).manual_seed(seed)
    H, G, d = m["G"] * m["hpg"], m["G"], m["d"]
    r = m["hpg"] * 512
    o = torch.randn(T, H, 512, device=device, generator=g).bfloat16()
    pos = torch.randint(0, 65536, (T,), device=device, generator=g)
    cs = build_cos_sin_cache(10000.0, 65536, device=device)
    w8, ws = quantize_weight(torch.randn(G, d, r, device=device, generator=g) * r ** -0.5)
    return o, pos, cs, w8.view(torch.float8_e4m3fn), ws


def _packed_weight_scales(ws, d):
    """fp32 [G, d/128, r/128] powers of two -> DeepGEMM's per-row UE8M0 int32 words [G, d, r/512]."""
    e = (ws.view(torch.int32) >> 23) & 0xFF
    rows = e.repeat_interleave(128, 1)[:, :d].to(torch.uint8).contiguous()
    return rows.view(torch.int32)


def suite(ctx):
    from .. import ops
    from ..triton.output.fp8_einsum import SWEEP
    from ..triton.output.fp8_einsum import fp8_einsum as triton_einsum
    from .timing import time_graph_ms, time_ms
    names = [(f"{k} T={T}", k, T) for k in MODELS for T in TOKENS]
    if not any(ctx.wants(f"inv_rope_quant {n}") or ctx.wants(f"fp8_einsum {n}") for n, _, _ in names):
        return
    fp8_rate = timing.fp8_matmul_rate(str(ctx.device))
    for name, model, T in names:
        m = MODELS[model]
        timer = time_graph_ms if T <= 512 else time_ms
        o, pos, cs, w8, ws = _inputs(m, T, ctx.device)
        H, G, d, r = m["G"] * m["hpg"], m["G"], m["d"], m["hpg"] * 512
        with ops.use_backend("triton"):
            if ctx.wants(f"inv_rope_quant {name}"):
                ms = timer(lambda: ops.fused_inv_rope_fp8_quant(o, pos, cs, G, m["hpg"]))
                nbytes = T * (H * 512 * 2 + 8 + 256) + T * H * (512 + 16)
                ctx.add(f"inv_rope_quant {name}", "triton", ms, 0, nbytes)
                ms = timer(lambda: ops.fused_inv_rope_fp8_quant(o, pos, cs, G, m["hpg"], tma_aligned_scales=True))
                ctx.add(f"inv_rope_quant {name}", "packed", ms, 0, nbytes - T * H * 12)
            if not ctx.wants(f"fp8_einsum {name}"):
                continue
            a8, sa = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, m["hpg"])
            _, sa_packed = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, m["hpg"], tma_aligned_scales=True)
            z = torch.empty(T, G, d, dtype=torch.bfloat16, device=ctx.device)
            xb, wb = a8.to(torch.bfloat16).contiguous(), w8.to(torch.bfloat16)
            peer_ms = timer(lambda: torch.einsum("bhr,hdr->bhd", xb, wb))
            flop = 2 * T * G * d * r
            nbytes = T * G * r * (1 + 4 / 128) + G * d * r + ws.numel() * 4 + T * G * d * 2
            forms = {"fp32 scales": ((a8, sa), (w8, ws), (1, 128, 128)),
                     "packed per-row": ((a8, sa_packed), (w8, _packed_weight_scales(ws, d)), (1, 1, 128))}
            for form, (a, b, recipe) in forms.items():
                ms = timer(lambda: ops.fp8_einsum("bhr,hdr->bhd", a, b, z, recipe=recipe))
                ctx.add(f"fp8_einsum {name}", form, ms, flop, nbytes, peer="torch bf16 einsum", peer_ms=peer_ms,
                        rate=fp8_rate, fp8_TFLOPs=fp8_rate / 1e12)
            if ctx.sweep:       # both forms: vLLM's wo_a passes the packed per-row one
                for form, suffix in (("fp32 scales", ""), ("packed per-row", "/row")):
                    _sweep(ctx, name, forms[form], z, timer, flop, nbytes, peer_ms, fp8_rate, SWEEP, triton_einsum,
                           suffix)
            del a8, sa, sa_packed, xb, wb, z


def _sweep(ctx, name, operands, z, timer, flop, nbytes, peer_ms, fp8_rate, sweep, einsum, suffix=""):
    """Every tile of ``sweep`` on one scale form (rows named tile + ``suffix``): each output checked against
    the default tile's first (the same k-block order, so only the matrix unit's in-block order and a split's
    order of partial sums may differ: within 2^-7 of the output's largest magnitude), then timed; a tile that
    fails to compile or to match is printed and skipped. Then one line with the fastest tile and its ratio
    to the torch bf16 einsum."""
    a, b, recipe = operands
    einsum("bhr,hdr->bhd", a, b, z, recipe=recipe)
    want = z.float().clone()
    tol = 2 ** -7 * float(want.abs().max())
    timed = {}
    for tile, cfg in sweep.items():
        cfg_name = tile + suffix
        z.fill_(float("nan"))
        try:
            einsum("bhr,hdr->bhd", a, b, z, recipe=recipe, config=cfg)
            err = float((z.float() - want).abs().max())
        except Exception as e:          # e.g. out of shared memory on this device
            print(f"fp8_einsum {name} {cfg_name}: skipped, {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        if not err <= tol:
            print(f"fp8_einsum {name} {cfg_name}: skipped, max |z - default| {err:.3g} > {tol:.3g}")
            continue
        ms = timer(lambda: einsum("bhr,hdr->bhd", a, b, z, recipe=recipe, config=cfg))
        timed[tile] = ms
        ctx.add(f"fp8_einsum {name}", cfg_name, ms, flop, nbytes, peer="torch bf16 einsum", peer_ms=peer_ms,
                rate=fp8_rate)
    if timed:
        best = min(timed, key=timed.get)
        print(f"fp8_einsum {name}{suffix}: fastest tile {best} {timed[best] * 1e3:.1f} us = "
              f"{peer_ms / timed[best]:.2f}x torch bf16 ({peer_ms * 1e3:.1f} us); {sweep[best]}")
