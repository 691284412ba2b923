"""Golden vectors and cross-vendor parity reports.

``python -m dsv4_rocm parity --write-golden`` writes, for every op, small seeded inputs and the
reference outputs under ``tests/golden/`` (one ``.pt`` per case). ``parity --report R.json`` runs every
case on this device with the default backend and records, per output, whether it matches the golden
values (bytes and integers exactly; floats within the case's tolerance), the error, and a SHA-256 of
integer/byte outputs. ``parity --compare A.json B.json ...`` checks that every device (say an MI300, an
MI355 and an H100) passed, that they produced the same bytes, and that they ran the same golden vectors
(a report records each case's golden file by its SHA-256). ``.github/workflows/parity.yml`` runs the
reports on one runner per target and the compare over all of them (docs/cluster.md#parity).
"""
import hashlib
import json
import os
from types import SimpleNamespace

import torch

from . import layout as L
from . import ops
from .config import LayerType, tiny_config
from .reference import cache as rc
from .reference import compressor as rcomp
from .reference import output as ro
from .reference.rope import build_cos_sin_cache

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _k(n, g):
    blk = torch.exp2(torch.randint(-6, 6, (n, 8), generator=g).float()).repeat_interleave(64, 1)
    return (torch.randn(n, 512, generator=g) * blk).bfloat16()


# Each case: (inputs dict, run(inputs) -> outputs dict, float tolerance): (rtol, atol) per element, or
# ("norm", max relative Frobenius error) for whole-layer outputs.
def case_quantize_and_insert_k_cache():
    g = _g(1)
    inp = dict(k=_k(9, g), k_cache=torch.randint(0, 256, (3, 37440), generator=g, dtype=torch.uint8),
               slot_mapping=torch.tensor([5, -1, 130, 64, 0, 191, -3, 7, 100]))

    def run(i):
        c = i["k_cache"].clone()
        ops.quantize_and_insert_k_cache(i["k"], c, i["slot_mapping"], 64)
        return dict(k_cache=c)
    return inp, run, (0, 0)


def case_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert():
    g = _g(2)
    inp = dict(q=torch.randn(6, 8, 512, generator=g).bfloat16(), kv=_k(6, g),
               k_cache=torch.zeros(2, 64, 584, dtype=torch.uint8), slot_mapping=torch.tensor([3, 70, -1, 0, 127]),
               positions=torch.tensor([0, 1, 77, 300, 511, 64], dtype=torch.int32),
               cos_sin=build_cos_sin_cache(10000.0, 512).bfloat16())

    def run(i):
        c = i["k_cache"].clone()
        qp = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(i["q"], i["kv"], c.view(c.shape[0], -1),
                                                                   i["slot_mapping"], i["positions"], i["cos_sin"],
                                                                   64, 1e-6, 64)
        return dict(q_padded=qp, k_cache=c)
    return inp, run, (0, 2 ** -8)


def case_qnorm_rope_and_insert_full_k_cache():
    g = _g(13)
    inp = dict(q=torch.randn(5, 4, 512, generator=g).bfloat16(), kv=_k(5, g), slot_mapping=torch.tensor([9, -1, 0, 31]),
               positions=torch.tensor([3, 0, 200, 511, 17]), cos_sin=build_cos_sin_cache(10000.0, 512),
               kv_scale=torch.tensor([0.25]), q_scale_inv=torch.tensor([16.0]))

    def run(i):
        c = torch.zeros(2, 16, 512, dtype=torch.float8_e4m3fn, device=i["q"].device)
        q8 = torch.empty(5, 4, 512, dtype=torch.float8_e4m3fn, device=i["q"].device)
        ops.qnorm_rope_and_insert_full_k_cache(i["q"], i["kv"], c, i["slot_mapping"], i["positions"], i["cos_sin"],
                                               1e-6, 16, i["kv_scale"], q8, i["q_scale_inv"])
        return dict(k_cache=c.view(torch.uint8), q_fp8=q8.float())
    # q_fp8: an RMSNorm sum order that differs from the reference's moves a value by at most one e4m3 step
    return inp, run, (2 ** -3, 2 ** -9)


def case_fused_q_kv_rmsnorm():
    g = _g(3)
    inp = dict(qr=torch.randn(5, 256, generator=g).bfloat16(), kv=torch.randn(5, 512, generator=g).bfloat16(),
               qw=torch.rand(256, generator=g).bfloat16(), kw=torch.rand(512, generator=g).bfloat16())

    def run(i):
        a, b = ops.fused_q_kv_rmsnorm(i["qr"], i["kv"], i["qw"], i["kw"], 1e-6)
        return dict(qr=a, kv=b)
    return inp, run, (0, 2 ** -8)


def case_dequantize_and_gather_k_cache():
    g = _g(4)
    c = torch.zeros(3, 2, 584, dtype=torch.uint8)
    rc.quantize_and_insert_k_cache(_k(6, g), c, torch.arange(6), 2)
    inp = dict(k_cache=c, seq_lens=torch.tensor([5, 3], dtype=torch.int32), gather_lens=torch.tensor([4, 3]),
               block_table=torch.tensor([[2, 0, 1], [1, 2, -1]], dtype=torch.int32))

    def run(i):
        out = torch.zeros(2, 6, 512, dtype=torch.bfloat16, device=i["k_cache"].device)
        ops.dequantize_and_gather_k_cache(out, i["k_cache"], i["seq_lens"], i["gather_lens"], i["block_table"], 2, 1)
        return dict(rows=out)
    return inp, run, (0, 0)


def case_dequantize_global_slots_k_cache():
    g = _g(14)
    c = torch.zeros(3, 37440, dtype=torch.uint8)
    rc.quantize_and_insert_k_cache(_k(9, g), c, torch.tensor([0, 5, 64, 70, 128, 190, 191, 3, 100]), 64)
    inp = dict(k_cache=c, slot_ids=torch.tensor([[0, 5, -1, 190], [191, 100, 64, 3]], dtype=torch.int32))

    def run(i):
        out = torch.zeros(2, 4, 512, dtype=torch.bfloat16, device=i["k_cache"].device)
        ops.dequantize_global_slots_k_cache(out, rc.flash_mla_view(i["k_cache"], 64), i["slot_ids"], 64)
        return dict(rows=out)
    return inp, run, (0, 0)


def _compressor_case(ratio, target, seed):
    """kv_score is an input (computed once on the CPU: the projection GEMM's summation order is
    device-specific); the state save, pooling, norm, RoPE, quant and insert after it must match bit for bit
    on every device. Two chunks, so the second reads windows back from the state cache."""
    g = _g(seed)
    D = 512 if target == "main" else 128
    c, sbs = rcomp.coff(ratio), rcomp.state_block_size(ratio)
    n = 20 if ratio == 4 else 260
    ns = -(-n // sbs) + 4
    inp = dict(kv_score=torch.randn(n, 2 * c * D, generator=g), ape=torch.randn(ratio, c * D, generator=g),
               norm_w=(1 + 0.1 * torch.randn(D, generator=g)).bfloat16(), cos_sin=build_cos_sin_cache(160000.0, 512),
               state_bt=torch.randperm(ns, generator=g)[:ns - 4].view(1, -1).to(torch.int32),
               comp_bt=torch.tensor([[1, 0, 2]], dtype=torch.int32))
    bs = 256 // ratio if target == "main" else 64
    (ts, sd), qb = {"main": ((576, 8), 64), "indexer": ((128, 4), 128), "indexer_mxfp4": ((64, 4), 32)}[target]

    def run(i):
        dev = i["kv_score"].device
        state = rcomp.new_state_cache(ns, ratio, D, device=dev)
        pages = torch.zeros(3, L.round_up(bs * (ts + sd), L.PAGE_ALIGN), dtype=torch.uint8, device=dev)
        half = n // 2 + 1
        for a, e in ((0, half), (half, n)):
            pos = torch.arange(a, e, device=dev)
            sslots = i["state_bt"][0, pos // sbs].long() * sbs + pos % sbs
            j = pos // ratio
            kslots = torch.where((pos + 1) % ratio == 0, i["comp_bt"][0, j // bs].long() * bs + j % bs, -1)
            kv, score = i["kv_score"][a:e].split([c * D, c * D], dim=-1)
            ops.save_partial_states(kv, score, i["ape"], pos, state, sslots, sbs, c * D, ratio)
            ops.compress_norm_rope_store(
                state_cache=state, num_actual=e - a, token_to_req_indices=torch.zeros_like(pos), positions=pos,
                slot_mapping=sslots, block_table=i["state_bt"], block_size=sbs, state_width=c * D,
                cos_sin_cache=i["cos_sin"], kv_cache=rcomp.kv_cache_view(pages, bs, ts + sd),
                k_cache_metadata=SimpleNamespace(slot_mapping=kslots), pdl_kwargs={}, head_dim=D, rope_head_dim=64,
                compress_ratio=ratio, overlap=ratio == 4, use_fp4_cache=target == "indexer_mxfp4",
                rms_norm_weight=i["norm_w"], rms_norm_eps=1e-6, quant_block=qb, token_stride=ts, scale_dim=sd)
        return dict(cache=pages, state=state.contiguous().view(torch.int32))
    return inp, run, (0, 0)


def case_compressor_c4_main():
    return _compressor_case(4, "main", 5)


def case_compressor_c128_main():
    return _compressor_case(128, "main", 6)


def case_compressor_c4_indexer():
    return _compressor_case(4, "indexer", 7)


def case_compressor_c4_indexer_mxfp4():
    return _compressor_case(4, "indexer_mxfp4", 13)


def case_indexer():
    g = _g(8)
    bt = torch.tensor([[1, 0], [1, 0]], dtype=torch.int32)
    j = torch.arange(100)
    ternary = lambda *shape: torch.randint(-1, 2, shape, generator=g).float()             # noqa: E731
    # logits inputs whose dot products every fp8 matrix unit sums exactly (values 0, +-1 against 0, +-256
    # with power-of-two scales: partial sums stay within 13 mantissa bits) and positive weights, so the
    # fp32 head sums, the only order-dependent part, have no cancellation
    inp = dict(qi=torch.randn(4, 64, 128, generator=g).bfloat16(), w=torch.randn(4, 64, generator=g).bfloat16(),
               pos=torch.tensor([3, 40, 41, 200]), cos_sin=build_cos_sin_cache(160000.0, 256),
               k=(ternary(100, 128) * torch.exp2(torch.randint(-4, 4, (100, 1), generator=g))).bfloat16(),
               slots=bt[0, j // 64].long() * 64 + j % 64, bt=bt,
               cl=torch.tensor([[30, 31], [100, 99]], dtype=torch.int32),
               lq=ternary(4, 64, 128).to(torch.float8_e4m3fn).view(torch.uint8), lw=torch.rand(4, 64, generator=g) + 0.1)

    def run(i):
        dev = i["qi"].device
        q8, wq = ops.fused_indexer_q_rope_quant(i["pos"], i["qi"], i["cos_sin"], i["w"], 128 ** -0.5, 64 ** -0.5)
        (q4, q4s), w4 = ops.fused_indexer_q_rope_quant(i["pos"], i["qi"], i["cos_sin"], i["w"], 128 ** -0.5,
                                                       64 ** -0.5, use_fp4=True)
        cache = torch.zeros(2, 64, 132, dtype=torch.uint8, device=dev)
        ops.indexer_k_quant_and_cache(i["k"], cache, i["slots"], 128, "ue8m0")
        k8 = torch.empty(100, 128, dtype=torch.float8_e4m3fn, device=dev)
        ks = torch.empty(100, 4, dtype=torch.uint8, device=dev)
        ops.cp_gather_indexer_k_quant_cache(cache, k8, ks, i["bt"][:1], torch.tensor([0, 100], dtype=torch.int32,
                                                                                        device=dev))
        ke = ((i["pos"] + 1) // 4).clamp(max=100).to(torch.int32)
        lq = i["lq"].view(torch.float8_e4m3fn)
        lg = ops.fp8_mqa_logits(lq, (k8, ks.view(torch.float32).squeeze(-1)), i["lw"], torch.zeros_like(ke), ke)
        top = torch.empty(lg.shape[0], 8, dtype=torch.int32, device=dev)
        ops.top_k_per_row_prefill(lg, torch.zeros_like(ke), ke, top, lg.shape[0], lg.stride(0), lg.stride(1), 8)
        plg = ops.fp8_paged_mqa_logits(lq.view(2, 2, 64, 128), cache.unsqueeze(-2), i["lw"], i["cl"], i["bt"],
                                       ops.get_paged_mqa_logits_metadata(i["cl"], 64, 4), 100)
        return dict(q8=q8.view(torch.uint8), weights=wq, q4=q4, q4_scale=q4s, w4=w4, cache=cache,
                    k8=k8.view(torch.uint8), k_scale=ks, logits=lg, topk_sorted=top.sort(dim=1).values,
                    paged_logits=plg)
    # weights are bit-exact; logits: sums of 64 positive fp32 terms in any order agree within 64 * 2^-24
    return inp, run, (1e-5, 1e-6)


def case_metadata():
    """A mixed step: request 0 decodes one token (position 299), request 1 prefills three (127..129), one
    token is padding (slot -1); every metadata op in vLLM's form on it."""
    g = _g(9)
    i32 = dict(dtype=torch.int32)
    inp = dict(bt=torch.randperm(12, generator=g).view(2, 6).to(torch.int32), qsl=torch.tensor([0, 1, 4], **i32),
               seq=torch.tensor([300, 130], **i32), pos=torch.tensor([299, 127, 128, 129]),
               t2r=torch.tensor([0, 1, 1, 1], **i32), sm=torch.tensor([1, 1, -1, 1]),
               loc=torch.randint(-1, 70, (4, 8), generator=g).to(torch.int32))

    def run(i):
        dev, out = i["bt"].device, {}
        buf = torch.empty(6, dtype=torch.int64, device=dev)
        out["c4_slots"] = ops.get_compressed_slot_mapping(4, i["qsl"], i["seq"], i["bt"], 64, 4, out=buf).clone()
        out["c4_slots_buffer"] = buf
        out["c128_slots"] = ops.get_compressed_slot_mapping(4, i["qsl"], i["seq"], i["bt"], 2, 128)
        out["swa_idx"], out["swa_len"] = ops.compute_swa_indices_and_lens(
            torch.empty(4, 1, 128, **i32, device=dev), torch.empty(4, **i32, device=dev), 128, i["qsl"], i["seq"],
            i["t2r"], i["sm"] >= 0, i["bt"], 64)
        out["gather_lens"] = ops.compute_prefill_gather_lens(torch.empty(2, **i32, device=dev), i["seq"], i["qsl"], 1,
                                                             1, 128)
        out["g_idx"], out["g_len"] = ops.compute_global_topk_indices_and_lens(i["loc"], i["t2r"], i["bt"], 64,
                                                                              i["sm"] >= 0)
        out["c128_idx"], out["c128_len"], out["c128_prefill"] = ops.build_c128a_topk_metadata(
            i["pos"], 128, 1, i["t2r"], i["bt"], 2, i["sm"], torch.empty(4, 128, **i32, device=dev),
            torch.empty(4, **i32, device=dev), torch.empty(4, 128, **i32, device=dev), 128)
        out["comb_idx"], out["comb_len"] = ops.combine_topk_swa_indices(
            i["loc"][1:], i["qsl"][1:], i["seq"][1:], out["gather_lens"][:1], 128, 4, 8, 211, 80)
        return out
    return inp, run, (0, 0)


def case_sparse_mla():
    g = _g(10)
    pages = torch.zeros(4, 37440, dtype=torch.uint8)
    rc.quantize_and_insert_k_cache(torch.randn(256, 512, generator=g).bfloat16(), pages, torch.arange(256), 64)
    epages = torch.zeros(8, 1728, dtype=torch.uint8)
    rc.quantize_and_insert_k_cache(torch.randn(16, 512, generator=g).bfloat16(), epages, torch.arange(16), 2)
    inp = dict(q=torch.randn(3, 1, 64, 512, generator=g).bfloat16(), pages=pages, epages=epages,
               idx=torch.randint(-20, 270, (3, 1, 64), generator=g).int(), lens=torch.tensor([64, 10, 0]).int(),
               eidx=torch.randint(-1, 16, (3, 1, 16), generator=g).int(), elens=torch.tensor([16, 16, 3]).int(),
               sink=torch.randn(64, generator=g), kv=torch.randn(100, 1, 512, generator=g).bfloat16(),
               pidx=torch.randint(-5, 110, (5, 1, 96), generator=g).int())

    def run(i):
        o, l = ops.sparse_mla_decode(i["q"], rc.flash_mla_view(i["pages"], 64), i["idx"], i["lens"], i["sink"],
                                     rc.flash_mla_view(i["epages"], 2), i["eidx"], i["elens"], 512 ** -0.5)
        po, pm, pl = ops.sparse_mla_prefill(i["q"][:, 0][:5], i["kv"], i["pidx"][:3], 512 ** -0.5, 512, i["sink"])
        return dict(decode_out=o, decode_lse=l, prefill_out=po, prefill_max_logits=pm, prefill_lse=pl)
    return inp, run, (2 / 128, 3e-2)   # |K| < 6: P in bf16 costs up to 2^-8 * 6 absolute


def case_output_path():
    g = _g(11)
    inp = dict(o=torch.randn(3, 8, 512, generator=g).bfloat16(), pos=torch.tensor([0, 9, 300]),
               cos_sin=build_cos_sin_cache(10000.0, 512))
    w8, ws = ro.quantize_weight(torch.randn(2, 128, 4 * 512, generator=g) * 0.05)
    inp.update(w8=w8, ws=ws)

    def run(i):
        a8, sa = ops.fused_inv_rope_fp8_quant(i["o"], i["pos"], i["cos_sin"], 2, 4)
        _, packed = ops.fused_inv_rope_fp8_quant(i["o"], i["pos"], i["cos_sin"], 2, 4, tma_aligned_scales=True)
        z = torch.empty(3, 2, 128, dtype=torch.bfloat16, device=a8.device)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (i["w8"], i["ws"]), z)
        return dict(a8=a8.view(torch.uint8).contiguous(), a_scale=sa.contiguous(), a_scale_packed=packed.contiguous(),
                    z=z)
    # z: fp32 sums in another order, then one bf16 rounding (2^-8 relative)
    return inp, run, (1e-2, 1e-3)


def case_layer_c4():
    from .serving import SyntheticServer
    g = _g(12)
    cfg = tiny_config()
    inp = dict(x=torch.randn(70, cfg.hidden_size, generator=g).bfloat16())

    def run(i):
        s = SyntheticServer(cfg, LayerType.C4, 1, 256, device=str(i["x"].device))
        y = torch.cat([s.step({0: i["x"][:60]})[0]] + [s.step({0: i["x"][t:t + 1]})[0] for t in range(60, 70)])
        return dict(y=y)     # cache bytes depend on the device's GEMM summation order: op cases cover them
    # a whole layer re-quantizes to fp8 twice and selects top-k: compare the relative error of the tensor
    return inp, run, ("norm", 5e-2)   # H100: 2.1e-2; a wrong index or slot gives O(1)


def _v41_compressor_case(ratio, seed):
    """DeepSeek-V4.1's compressor and indexer-K store: kv_score and k_pre are inputs (their GEMMs' summation
    order is device-specific); the ring save, pooling, norm, RoPE, records and index keys (FP8 and MXFP4)
    after them must match bit for bit on every device. Two requests over two steps, so the second step's
    first tokens pair with ring rows the first step saved (ratio 2)."""
    from .reference.indexer_v41 import pages_bytes
    g = _g(seed)
    n = 37
    inp = dict(kv_score=torch.randn(2 * n, 512 * ratio, generator=g) * 2, k_pre=(torch.randn(2 * n, 128, generator=g)
                                                                               * 3).bfloat16(),
               norm_w=(1 + 0.1 * torch.randn(512, generator=g)).bfloat16(),
               k_norm=(1 + 0.1 * torch.randn(128, generator=g)).bfloat16(),
               cos_sin=build_cos_sin_cache(160000.0, 64), comp_bt=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))

    def run(i):
        dev = i["kv_score"].device
        ring = torch.zeros(3, 8, 1024, device=dev)
        comp = torch.zeros(4, 64, 584, dtype=torch.uint8, device=dev)
        idx = {fp4: pages_bytes(4, 64, fp4, dev) for fp4 in (False, True)}
        latent = torch.zeros(2 * n, 512, dtype=torch.bfloat16, device=dev)
        for lo, hi in ((0, 20), (20, n)):                      # request b's tokens at rows b * n + (lo..hi)
            pos = torch.cat([torch.arange(lo, hi)] * 2).to(dev)
            rows = torch.cat([torch.arange(lo, hi), n + torch.arange(lo, hi)]).to(dev)
            t2r = torch.repeat_interleave(torch.arange(2, device=dev), hi - lo).to(torch.int32)
            qsl = torch.tensor([0, hi - lo, 2 * (hi - lo)], dtype=torch.int32, device=dev)
            j = pos // ratio
            slots = torch.where((pos + 1) % ratio == 0, i["comp_bt"][t2r.long(), j // 64].long() * 64 + j % 64, -1)
            out = torch.zeros(2 * (hi - lo), 512, dtype=torch.bfloat16, device=dev)
            ks = i["kv_score"][rows].contiguous()
            if ratio == 2:
                ops.fused_save_compress_norm(ks, pos, ring, (t2r.long() + 1) * 8 + pos % 8, qsl, t2r, i["norm_w"],
                                             1e-6, 2, out)
            else:
                ops.fused_save_compress_norm(ks, pos, None, slots, None, None, i["norm_w"], 1e-6, 1, out)
            ops.rope_quant_insert(out, pos, i["cos_sin"], comp, slots, ratio)
            for fp4, c in idx.items():
                ops.indexer_k_norm_rope_store(i["k_pre"][rows].contiguous(), pos, i["cos_sin"], i["k_norm"], 1e-6, c,
                                              slots, ratio, fp4)
            closes = (pos + 1) % ratio == 0
            latent[rows[closes]] = out[closes]
        return dict(latent=latent.view(torch.int16), ring=ring.view(torch.int32), comp=comp, idx_fp8=idx[False],
                    idx_mxfp4=idx[True])
    return inp, run, (0, 0)


def case_v41_compressor_ratio1():
    return _v41_compressor_case(1, 15)


def case_v41_compressor_ratio2():
    return _v41_compressor_case(2, 16)


def case_v41_candidates_and_step_sets():
    """DeepSeek-V4.1's candidate blocks, the candidate mask and the step's index sets: integers and exact
    floats."""
    g = _g(17)
    i32 = dict(dtype=torch.int32)
    inp = dict(logits=torch.randn(5, 300, generator=g), lens=torch.tensor([300, 150, 0, 9, 400], **i32),
               pos=torch.randint(-1, 300, (40,), generator=g),
               t2r=torch.randint(-1, 4, (40,), generator=g).to(torch.int32),
               valid=torch.rand(40, generator=g) < 0.8, cbt=torch.randint(-1, 9, (3, 5), generator=g).to(torch.int32),
               sbt=torch.randint(-1, 9, (3, 1), generator=g).to(torch.int32))
    inp["logits"][:, ::7] = 0.0                                     # ties between blocks

    def run(i):
        dev = i["logits"].device
        cand = torch.empty(5, 6, **i32, device=dev)
        ops.select_candidate_blocks(i["logits"], i["lens"], cand, 4)
        masked = i["logits"].clone()
        ops.mask_candidate_logits(masked, i["lens"], cand, 4)
        e64 = lambda: torch.empty(40, dtype=torch.int64, device=dev)           # noqa: E731
        e32 = lambda: torch.empty(40, **i32, device=dev)                       # noqa: E731
        r1, r2 = (e64(), e32()), (e64(), e32(), e64())
        ops.step_index_sets_v41(i["pos"], i["t2r"], i["valid"], i["cbt"], i["sbt"], 64, 8, r1, r2)
        return dict(candidates=cand, masked_bits=masked.view(torch.int32), slots1=r1[0], lens1=r1[1], slots2=r2[0],
                    lens2=r2[1], ring=r2[2])
    return inp, run, (0, 0)


def case_layer_v41_stack():
    """A DeepSeek-V4.1 stack sharing caches: a ratio-2 kv source and its reader, the ratio-1 kv and candidate
    source and an index source scoring inside its candidates; prefill, then decode."""
    from .config import tiny_v41_config
    from .serving import SyntheticServer
    g = _g(18)
    cfg = tiny_v41_config()
    inp = dict(x=torch.randn(44, cfg.hidden_size, generator=g).bfloat16())

    def run(i):
        s = SyntheticServer(cfg, None, 1, 128, device=str(i["x"].device), layers=(1, 2, 3, 5))
        steps = [s.step({0: i["x"][:40]})[0]] + [s.step({0: i["x"][t:t + 1]})[0] for t in range(40, 44)]
        return dict(y=torch.cat(steps))
    # as case_layer_c4, and a top-k taken among near-equal logits may pick another entry on another device
    return inp, run, ("norm", 1.5e-1)


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def _exact(t):
    return not t.dtype.is_floating_point


def write_golden(directory=GOLDEN_DIR, only=None):
    """Write the golden file of every case (or of the cases whose name contains ``only``)."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(n for n in CASES if not only or only in n)
    for name in names:
        inp, run, _ = CASES[name]()
        torch.save(dict(inputs=inp, outputs=run(inp)), os.path.join(directory, f"{name}.pt"))
    return names


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def check_case(name, device="cpu", directory=GOLDEN_DIR):
    """Run one golden case on device; returns {output: (ok, error, sha256 or None)}."""
    blob = torch.load(os.path.join(directory, f"{name}.pt"))
    _, run, (rtol, atol) = CASES[name]()
    got = run({k: _to(v, device) for k, v in blob["inputs"].items()})
    res = {}
    for k, exp in blob["outputs"].items():
        a = got[k].cpu()
        if _exact(exp):
            ok = a.dtype == exp.dtype and a.shape == exp.shape and torch.equal(a, exp)
            err = 0.0 if ok else float((a.long() != exp.long()).float().mean()) if a.shape == exp.shape else 1.0
            sha = hashlib.sha256(a.contiguous().numpy().tobytes()).hexdigest()
        elif rtol == "norm":
            err = float((a.double() - exp.double()).norm() / exp.double().norm().clamp_min(1e-30))
            ok, sha = bool(torch.isfinite(a).all() and err <= atol), None
        else:
            fin = torch.isfinite(exp)
            same_inf = torch.equal(torch.isfinite(a), fin) and torch.equal(a[~fin].nan_to_num(), exp[~fin].nan_to_num())
            d = (a.float()[fin] - exp.float()[fin]).abs()
            ok = bool(same_inf and bool((d <= atol + rtol * exp.float()[fin].abs()).all()))
            err, sha = (float(d.max()) if d.numel() else 0.0), None
        res[k] = (bool(ok), err, sha)
    return res


def golden_sha256(name, directory=GOLDEN_DIR):
    with open(os.path.join(directory, f"{name}.pt"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def report(device="cpu", directory=GOLDEN_DIR):
    from .platform import detect
    out = dict(device=str(detect(device)), backends={n: ops.backend_for(n, device) for n in
                                                      ("sparse_mla_decode", "sparse_mla_prefill")}, cases={},
               golden={name: golden_sha256(name, directory) for name in sorted(CASES)})
    for name in sorted(CASES):
        out["cases"][name] = {k: dict(ok=v[0], err=v[1], sha256=v[2]) for k, v in check_case(name, device,
                                                                                            directory).items()}
    out["all_ok"] = all(v["ok"] for c in out["cases"].values() for v in c.values())
    return out


def compare(*reports, labels=None):
    """Lines describing where parity reports (two or more) differ; empty when every output passed on every
    device with the same bytes, from the same golden vectors. A float output passed when it lay within its
    case's tolerance of the golden value; bytes and integers when they equal it, and they must then hash
    alike everywhere. ``labels`` (the reports' file names) make the lines say which report is which."""
    if len(reports) < 2:
        raise ValueError("compare needs two or more parity reports")
    who = list(labels) if labels else [f"report {i + 1}" for i in range(len(reports))]
    lines = []
    goldens = [r.get("golden") for r in reports]
    for name in sorted(set().union(*(g for g in goldens if g))):
        shas = [g.get(name) if g else None for g in goldens]
        if len({x for x in shas if x is not None}) > 1:
            lines.append(f"{name}: the reports ran different golden vectors ("
                         + ", ".join(f"{w}: {x[:12] if x else '?'}" for w, x in zip(who, shas)) + ")")
    for name in sorted(set().union(*(r["cases"] for r in reports))):
        cs = [r["cases"].get(name, {}) for r in reports]
        for k in sorted(set().union(*cs)):
            xs = [c.get(k) for c in cs]
            if any(x is None for x in xs):
                lines.append(f"{name}.{k}: missing in " + (
                    "one report" if len(xs) == 2 and not labels else ", ".join(w for w, x in zip(who, xs) if x is None)))
            elif not all(x["ok"] for x in xs):
                oks = "/".join(str(x["ok"]) for x in xs)
                errs = "/".join(format(x["err"], ".3g") for x in xs)
                lines.append(f"{name}.{k}: ok={oks} err={errs}")
            elif len({x["sha256"] for x in xs}) > 1:
                groups = {}
                for w, x in zip(who, xs):
                    groups.setdefault(x["sha256"], []).append(w)
                lines.append(f"{name}.{k}: bytes differ" + (
                    ": " + " | ".join(", ".join(g) for g in groups.values()) if labels else ""))
    return lines


class ReportError(Exception):
    """A parity command asked for a file that is missing or is not what it should be (one-line message)."""


def _load_report(path):
    try:
        with open(path) as f:
            rep = json.load(f)
    except OSError as e:
        raise ReportError(f"--compare: cannot read {path} ({e.strerror}); write a report with "
                          "python -m dsv4_rocm parity --report FILE")
    except ValueError as e:
        raise ReportError(f"--compare: {path} is not JSON ({e}); give a file written by parity --report")
    if not isinstance(rep, dict) or not isinstance(rep.get("cases"), dict):
        raise ReportError(f"--compare: {path} is not a parity report (no 'cases'); give a file written by "
                          "parity --report")
    return rep


def cli(a):
    d = a.golden_dir or GOLDEN_DIR
    if a.only and not a.write_golden:
        raise ReportError("--only selects the cases to regenerate and needs --write-golden")
    if a.write_golden:
        names = write_golden(d, a.only)
        if not names:
            raise ReportError(f"--only {a.only!r} matches no golden case; choose from {', '.join(sorted(CASES))}")
        print(f"wrote {len(names)} golden cases to {d}")
        return 0
    if a.compare:
        if len(a.compare) < 2:
            raise ReportError("--compare needs two or more reports written by parity --report")
        reps = [_load_report(p) for p in a.compare]
        diff = compare(*reps, labels=[os.path.basename(p) for p in a.compare])
        for p, r in zip(a.compare, reps):
            n = sum(len(c) for c in r["cases"].values())
            print(f"{os.path.basename(p)}: {r.get('device', '?')}, {n} outputs, "
                  f"{'all ok' if r.get('all_ok') else 'NOT all ok'}")
        print("\n".join(diff) if diff else f"parity: the {len(reps)} reports agree (every output passed on every "
                                           f"device, bytes and integers identical)")
        return 1 if diff else 0
    missing = [n for n in sorted(CASES) if not os.path.exists(os.path.join(d, f"{n}.pt"))]
    if missing:
        raise ReportError(f"golden vectors missing in {d} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                          "write them with python -m dsv4_rocm parity --write-golden")
    if a.report and not os.path.isdir(os.path.dirname(os.path.abspath(a.report))):
        raise ReportError(f"--report {a.report}: its directory does not exist; create it or choose another path")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rep = report(device, d)
    for name, c in rep["cases"].items():
        bad = [k for k, v in c.items() if not v["ok"]]
        print(f"{name:45s} {'ok' if not bad else 'FAIL ' + ','.join(bad)}")
    if a.report:
        with open(a.report, "w") as f:
            json.dump(rep, f, indent=1)
    print("parity:", "all outputs match the golden vectors" if rep["all_ok"] else "MISMATCH")
    return 0 if rep["all_ok"] else 1
