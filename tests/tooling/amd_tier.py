"""The AMD execution tier (docs/platforms.md#amd-tier): each Triton kernel with a branch, constexpr or tile
configuration that depends on the target, run on CPU tensors under the Triton interpreter as that target
launches it (``_launch.emulate_target``), against ``dsv4_rocm.reference``.

gfx942 runs its fnuz branches (x / 2 encoded as fnuz, bytes read as fnuz with the scale exponent + 1, the
fp8 GEMMs on fnuz operands with each block's scale product x 4, 0x80 mapped to 0x00), gfx950 its OCP
branches with AMD's tiles; sm_100 where its constexprs differ from sm_90 (which runs on the H100 in the
GPU suite). The fp8 instructions run as the bit-exact models of ``dsv4_rocm/triton/_fp8.py``, and bf16 as the
GPUs compute it (``helpers.patch_interpreter_bf16``). Bytes and integers must match exactly, floats within
the tolerances of docs/numerics.md. Each case also checks that the launches it made carried the target's
constexprs (``EXPECT``), so a case cannot pass on the CPU's configuration.

Run as a script, ``python tests/tooling/amd_tier.py TARGET [CASE ...]`` sets TRITON_INTERPRET=1 before Triton is
imported, runs the cases of TARGET and prints one JSON line per case; ``tests/tooling/test_amd_tier.py`` runs one such
process per target and asserts each line. Imported, the module gives the case table (``CASES``) only.
"""
import json
import os
import sys
import time
import traceback

if __name__ == "__main__":        # the interpreter is chosen when Triton is imported: before anything imports it
    os.environ["TRITON_INTERPRET"] = "1"
    _tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # this checkout's dsv4_rocm, then tests/ (helpers) and the stage folders whose inputs and checks the cases use
    sys.path[:0] = [os.path.dirname(_tests), _tests] + [os.path.join(_tests, s) for s in
                                                         ("compressor", "indexer", "attention", "output", "qkv")]

import torch                                                    # noqa: E402
import triton                                                   # noqa: E402
import triton.language as tl                                    # noqa: E402

from dsv4_rocm import layout as L                               # noqa: E402
from helpers import float_mismatch                               # noqa: E402
from dsv4_rocm.triton import _fp8                               # noqa: E402
from dsv4_rocm.triton._records import _e4m3                     # noqa: E402
from dsv4_rocm.triton.attention.sparse_mla_decode import _e2m1_to_scaled_bf16, _e4m3_to_scaled_bf16  # noqa: E402

# case -> the targets whose branches it runs (sm_90: the H100 runs the GPU suite; the rest as the text says)
CASES = {
    "compress_norm_rope_store": ("gfx942", "gfx950"),
    "compress_norm_rope_store_v41": ("gfx942", "gfx950"),
    "indexer_k_quant_and_cache": ("gfx942", "gfx950"),
    "indexer_k_norm_rope_store": ("gfx942", "gfx950"),
    "rope_quant_insert": ("gfx942", "gfx950"),
    "fused_deepseek_v4_kv_rope_insert": ("gfx942", "gfx950"),
    "decode_front": ("gfx942", "gfx950"),
    "fused_indexer_q_rope_quant": ("gfx942", "gfx950"),
    "fused_indexer_q_rope_quant_fnuz": ("gfx942", "gfx950"),
    "fused_inv_rope_fp8_quant": ("gfx942", "gfx950"),
    "merge_attn_states": ("gfx942", "gfx950"),
    "fp8_einsum": ("gfx942", "gfx950"),
    "fp8_linear": ("gfx942", "gfx950"),
    "fp8_mqa_logits": ("gfx942", "gfx950"),
    "fp8_paged_mqa_logits": ("gfx942", "gfx950"),
    "indexer_logits_fnuz_query": ("gfx942", "gfx950"),
    "merge_attn_states_fp8_flavours": ("gfx942", "gfx950"),
    "sparse_mla_decode": ("gfx942", "gfx950", "sm_100"),
    "sparse_mla_decode_v41": ("gfx942", "gfx950", "sm_100"),
    "sparse_mla_decode_fnuz_window": ("gfx942", "gfx950", "sm_100"),
    "sparse_mla_prefill": ("gfx942", "gfx950", "sm_100"),
    "top_k_per_row": ("gfx942", "sm_100"),
}
TARGETS = ("gfx942", "gfx950", "sm_100")
# case -> (kernel module, the record-format constexprs of its launches, one dict a variant): every record-format
# variant a module's compile specs build has a case (tests/tooling/test_amd_tier.py checks it); the cases check that
# their launches carried these values
_V40, _V41, _FP4 = L.V40_584, L.V41_528, L.V41_FP4_288
CASE_FORMATS = {
    "compress_norm_rope_store": ("compress_norm_rope_store", [dict(FMT=_V40)]),
    "compress_norm_rope_store_v41": ("compress_norm_rope_store", [dict(FMT=_V41), dict(FMT=_FP4)]),
    "sparse_mla_decode": ("sparse_mla_decode", [dict(MAIN_FMT=_V40, EXTRA_FMT=_V40)]),
    "sparse_mla_decode_v41": ("sparse_mla_decode", [dict(MAIN_FMT=_V41, EXTRA_FMT=_V41),
                                                    dict(MAIN_FMT=_V41, EXTRA_FMT=_FP4)]),
    "sparse_mla_decode_fnuz_window": ("sparse_mla_decode", [dict(MAIN_FMT=L.with_fnuz(_V40), EXTRA_FMT=_V40)]),
    "fused_deepseek_v4_kv_rope_insert": ("fused_deepseek_v4_kv_rope_insert", [dict(FMT=_V40),
                                                                              dict(FMT=L.with_layout(_V41))]),
    "decode_front": ("decode_front", [dict(FMT=_V40), dict(FMT=L.with_layout(_V41))]),
    "rope_quant_insert": ("rope_quant_insert", [dict(FMT=_V40), dict(FMT=L.with_layout(_V41)),
                                                dict(FMT=L.with_layout(_FP4))]),
}
# launch options: Triton's interpreter takes none of them; the compile matrix compiles each target's
OPTIONS = ("num_warps", "num_stages", "num_ctas", "kpack", "matrix_instr_nonkdim", "waves_per_eu", "maxnreg",
           "enable_fp_fusion")


def _bytes_equal(got, ref, name):
    g, r = got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
    bad = int((g != r).sum())
    assert bad == 0, f"{name}: {bad} of {r.numel()} bytes differ"
    return f"{name}: {r.numel()} bytes equal"


# ---- the cases: each returns lines to print and the constexprs its launches must carry ------------------
# compressor steps: (ratio, target, request lengths, steps) for C4 (one [8, D] tile an entry) and C128 (AMD:
# 16 column slices, then a finishing launch): a prefill-sized step with padding, then a decode-sized one.
# Windows reach back into state rows no step wrote (random values, read alike by kernel and oracle), which
# keeps the C128 steps short
_C4_STEPS = ({0: (0, 13), 1: (0, 9)}, {0: (13, 14)})
_C4_FP8_STEPS = ({0: (0, 12), 1: (0, 6)}, {0: (12, 13)})
_C128_STEPS = ({0: (118, 127), 1: (120, 128)}, {0: (127, 128)})


def _compressed_pages(ratio, kind, lens, steps, seed, fmt=_V40):
    """(kernel's, oracle's) output pages of a compressor store over ``steps`` (a poisoned row in a window)."""
    from compressor_batches import compress_kwargs, make_setup, step_inputs
    from dsv4_rocm import ops
    from dsv4_rocm.reference import compressor as rc
    from dsv4_rocm.triton.compressor import compress_norm_rope_store as K
    S = make_setup(ratio, kind, lens, "cpu", seed=seed, scale=4.0)
    S.kv_score[0][2, :64] = float("nan")                             # a poisoned row inside a window
    ref = S.clone()
    c, sbs = rc.coff(ratio), rc.state_block_size(ratio)
    for ranges in steps:
        kv_score, pos, req, sslots, kslots = step_inputs(S, ranges, pad=2)
        kv, score = kv_score.split([c * S.D, c * S.D], dim=-1)
        for s in (S, ref):
            ops.save_partial_states(kv, score, s.ape, pos, s.state, sslots, sbs, c * S.D, ratio)
        K.compress_norm_rope_store(**compress_kwargs(S, sslots.shape[0], req, pos, sslots, kslots), fmt=fmt)
        rc.compress_norm_rope_store(**compress_kwargs(ref, sslots.shape[0], req, pos, sslots, kslots), fmt=fmt)
    return S.pages, ref.pages


def case_compress_norm_rope_store(target):
    """C4 main and indexer fp8, C128 main (V40_584 records)."""
    lines = []
    for ratio, kind, lens, steps in ((4, "main", [21, 9], _C4_STEPS), (4, "fp8", [17, 6], _C4_FP8_STEPS),
                                     (128, "main", [128, 128], _C128_STEPS)):
        got, want = _compressed_pages(ratio, kind, lens, steps, ratio)
        lines.append(_bytes_equal(got, want, f"C{ratio} {kind} cache pages"))
    amd = target.startswith("gfx")
    return lines, {"_compress_norm_rope_store_kernel": dict(FNUZ=target == "gfx942", STAGE=1 if amd else 0,
                                                           NSPLIT=16 if amd else 1, FMT=_V40)}


def case_compress_norm_rope_store_v41(target):
    """The DeepSeek-V4.1 records of the compressor store (the cache's last dim names them): all 512 dims of
    RoPE(bf16 latent) as V41_528 (e4m3, UE8M0 per 32) or V41_FP4_288 (e2m1, e4m3 scale per 16, its scale
    encoded and read back through the target's fp8 convert), page-split and interleaved; C4 and C128."""
    lines = []
    for ratio, kind, lens, steps in ((4, "v41", [21, 9], _C4_STEPS), (4, "fp4", [17, 6], _C4_FP8_STEPS),
                                     (128, "fp4", [128, 128], _C128_STEPS)):
        for layout in ("page_split", "interleaved"):
            fmt = L.with_layout({"v41": _V41, "fp4": _FP4}[kind], layout)
            got, want = _compressed_pages(ratio, kind, lens, steps, ratio + len(layout), fmt)
            lines.append(_bytes_equal(got, want, f"C{ratio} {fmt.name} {layout} cache pages"))
    amd = target.startswith("gfx")
    return lines, {"_compress_norm_rope_store_kernel": dict(FNUZ=target == "gfx942", STAGE=1 if amd else 0,
                                                           FMT=L.interleaved(_FP4))}


def case_indexer_k_quant_and_cache(target):
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.indexer import indexer_k_quant_and_cache as K
    from indexer_inputs import new_pages
    g = torch.Generator().manual_seed(1)
    n, bs = 21, 16
    k = (torch.randn(n, 128, generator=g) * torch.exp2(torch.randint(-20, 12, (n, 1), generator=g).float()))
    k[3, :] = 0.0
    k[4, ::3] = -0.0
    k[5, 7] = float("nan")
    k[6, 9] = float("-inf")
    k[7] *= 2.0 ** -14                                            # values near the e4m3 subnormals after scaling
    k = k.bfloat16()
    slots = torch.randperm(4 * bs, generator=g)[:n]
    slots[[1, 8]] = -1
    slots[9] = 4 * bs + 5                                         # past the cache: skipped
    got, ref = new_pages(4, bs, fill=0x5A), new_pages(4, bs, fill=0x5A)
    view = lambda p: p.view(torch.uint8)[:, :bs * 132].view(4, bs, 132)       # noqa: E731
    K.indexer_k_quant_and_cache(k, view(got), slots, 128, "ue8m0")
    ri.indexer_k_quant_and_cache(k, view(ref), slots, 128, "ue8m0")
    return [_bytes_equal(got, ref, "indexer-K pages")], {"_indexer_k_quant_and_cache_kernel": dict(
        FNUZ=target == "gfx942")}


def _v41_writes(g, T, nb, ratio, width, cs_rows):
    """Random rows of ``width`` with a spread of magnitudes (a NaN-poisoned row, a zero row, -0s, a row near
    the e4m3 subnormals after scaling), positions of which about 1 / ratio close a group, distinct slots with
    padding, a slot past the cache and a position past the RoPE table (both skipped)."""
    x = torch.randn(T, width, generator=g) * torch.exp2(torch.randint(-14, 10, (T, 1), generator=g).float())
    x[1, 5] = float("nan")
    x[2] = 0.0
    x[3, ::4] = -0.0
    x[4] *= 2.0 ** -12
    pos = torch.randint(0, cs_rows - 1, (T,), generator=g)
    pos[:8] = (pos[:8] // ratio) * ratio + ratio - 1                    # rows 0..7 close a group
    slots = torch.randperm(nb * 64, generator=g)[:T]
    slots[[6, 9]] = -1
    slots[10] = nb * 64 + 3
    pos[11] = cs_rows + 2
    return x.bfloat16(), pos, slots


def case_indexer_k_norm_rope_store(target):
    from dsv4_rocm.reference import indexer_v41 as ri
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.indexer import indexer_k_norm_rope_store as K
    g = torch.Generator().manual_seed(10)
    cs = build_cos_sin_cache(160000.0, 300, factor=16.0, original_max=64)
    lines = []
    # the FP8 record (gfx942: fnuz encode of x / 2) and the MXFP4 one (integer code, no fp8 convert), both ratios
    for ratio, fp4 in ((1, False), (2, False), (2, True)):
        k_pre, pos, slots = _v41_writes(g, 24, 3, ratio, 128, cs.shape[0])
        w = (1 + 0.25 * torch.randn(128, generator=g)).bfloat16()
        caches = []
        for _ in range(2):
            c = ri.pages_bytes(3, 64, fp4)
            c.view(torch.uint8).fill_(0xA5)
            caches.append(c)
        K.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, caches[0], slots, ratio, fp4)
        ri.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, caches[1], slots, ratio, fp4)
        written = int((caches[1] != 0xA5).sum())
        assert written > 500, written
        lines.append(_bytes_equal(caches[0], caches[1], f"ratio {ratio} {'MXFP4' if fp4 else 'FP8'} indexer-K "
                                                        f"pages ({written} written)"))
    return lines, {"_indexer_k_norm_rope_store_kernel": dict(FNUZ=target == "gfx942", FP4=False)}


def case_rope_quant_insert(target):
    from dsv4_rocm.reference import cache as rcache
    from dsv4_rocm.reference import compressor_v41 as rv
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.compressor import rope_quant_insert as K
    g = torch.Generator().manual_seed(11)
    cs = build_cos_sin_cache(160000.0, 300, factor=16.0, original_max=64)
    lines = []
    # the three records the cache's last dim names (V4.1's in vLLM 0.33's interleaved layout): the V4.1 fp8
    # record's e4m3 encode and the fp4 record's e4m3 scale, encoded and read back, through the target's convert
    for fmt in (_V40, L.with_layout(_V41), L.with_layout(_FP4)):
        for ratio in (1, 2):
            latent, pos, slots = _v41_writes(g, 20, 3, ratio, 512, cs.shape[0])
            pages = [rcache.new_cache(3, 64, fmt=fmt).fill_(0xA5) for _ in range(2)]
            r = fmt.token_bytes
            views = [torch.as_strided(p, (3, 64, r), (p.stride(0), r, 1)) for p in pages]
            K.rope_quant_insert(latent, pos, cs, views[0].unsqueeze(-2), slots, ratio, fmt=fmt)   # FlashMLA's 4-D view
            rv.rope_quant_insert(latent, pos, cs, views[1], slots, ratio, fmt=fmt)
            written = int((pages[1] != 0xA5).sum())
            assert written > 1000, written
            lines.append(_bytes_equal(pages[0], pages[1], f"{fmt.name} ratio {ratio} compressed pages ({written} "
                                                          "written)"))
    # vLLM's plain-row caches (FlashInfer): bf16 rows and per-tensor e4m3 rows (the target's convert)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        latent, pos, slots = _v41_writes(g, 20, 3, 2, 512, cs.shape[0])
        latent = latent.nan_to_num(0.0)                                    # rows: no NaN payloads
        backing = [torch.full((3, 65 * 512 * (2 if dtype == torch.bfloat16 else 1)), 0xA5, dtype=torch.uint8)
                   for _ in range(2)]
        rows = [b.view(dtype).as_strided((3, 64, 512), (65 * 512, 512, 1)) for b in backing]   # padded pages
        scale = torch.tensor([0.37])
        K.rope_quant_insert(latent, pos, cs, rows[0], slots, 2, scale)
        rv.rope_quant_insert(latent, pos, cs, rows[1], slots, 2, scale)
        written = int((backing[1] != 0xA5).sum())
        assert written > 1000, written
        lines.append(_bytes_equal(backing[0], backing[1], f"{dtype} rows ({written} bytes written)"))
    return lines, {"_rope_quant_insert_kernel": dict(FNUZ=target == "gfx942", RATIO=2, FMT=L.with_layout(_FP4),
                                                     MODE=2)}


def case_fused_deepseek_v4_kv_rope_insert(target):
    """vLLM 0.33's kv-only insert on the three caches: V40_584 and V41_528 records (their e4m3 encode through
    the target's convert), bf16 rows, and per-tensor e4m3 rows (the same convert)."""
    from dsv4_rocm.reference import cache as rcache
    from dsv4_rocm.reference import qkv as rq
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.qkv import fused_deepseek_v4_kv_rope_insert as K
    g = torch.Generator().manual_seed(12)
    cs = build_cos_sin_cache(160000.0, 300, factor=16.0, original_max=64)
    lines = []
    for form in (_V40, L.with_layout(_V41), torch.bfloat16, torch.float8_e4m3fn):
        x, pos, slots = _v41_writes(g, 20, 3, 1, 512, cs.shape[0])
        kv = (x if isinstance(form, L.RecordFormat) else x.nan_to_num(0.0)).bfloat16()   # rows: no NaN payloads
        if isinstance(form, L.RecordFormat):
            caches = [rcache.new_cache(3, 64, fmt=form).fill_(0xA5) for _ in range(2)]
            backing, fmt, scale, name = caches, form, None, form.name
        else:
            backing = [torch.full((3, 64 * 512 * (2 if form == torch.bfloat16 else 1)), 0xA5, dtype=torch.uint8)
                       for _ in range(2)]
            caches = [b.view(form).view(3, 64, 512) for b in backing]
            fmt, scale, name = None, torch.tensor([0.37]), f"{form} rows"
        K.fused_deepseek_v4_kv_rope_insert(kv, caches[0], slots, pos, cs, 64, scale, False, fmt=fmt)
        rq.fused_deepseek_v4_kv_rope_insert(kv, caches[1], slots, pos, cs, 64, scale, False, fmt=fmt)
        written = int((backing[1] != 0xA5).sum())
        assert written > 1000, written
        lines.append(_bytes_equal(backing[0], backing[1], f"{name} ({written} bytes written)"))
    return lines, {"_kv_rope_insert_kernel": dict(FNUZ=target == "gfx942", MODE=2, FMT=L.with_layout(_V41))}


def case_decode_front(target):
    """The decode step's front in one launch: q norm + RoPE (vLLM's fma rounding), the kv norm + RoPE + record
    (V40_584 with the FP8 indexer query, V41_528 with the MXFP4 one; the e4m3 encodes through the target's
    convert), the indexer query; against the unfused math (the HIP-order norms of tests/qkv/test_decode_front.py
    and the references) bit for bit."""
    import test_decode_front as F
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.qkv import decode_front as K
    lines = []
    for fmt, fp4 in ((_V40, False), (L.with_layout(_V41), True)):
        T, H, Hp, n, nb, bs, nh = 7, 4, 8, 6, 2, 16, 32
        q, kv, w, pos, slots, iq, iw = F.inputs(T, H, n, nb, bs, nh, seed=5 + fp4)
        caches = [torch.full((nb, L.page_bytes(bs, fmt)), 0xA5, dtype=torch.uint8) for _ in range(2)]
        q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16)
        w_out = torch.full((T, nh), float("nan"))
        out = torch.full((T, nh, 64 if fp4 else 128), 0xAB, dtype=torch.uint8)
        scales = torch.full((T, nh, 4), 0xAB, dtype=torch.uint8) if fp4 else out
        K.decode_front(q, kv, w, q_out, caches[0], slots, pos, F.CS, F.EPS, bs, True, fmt,
                       (iq, F.CS, iw, 0.125, 0.1, fp4, False, out, scales, w_out))
        want_q = F.model_front(q, kv, w, caches[1], slots, pos, F.CS, Hp, bs, True, fmt)
        rq8, rw = ri.fused_indexer_q_rope_quant(pos, iq, F.CS, iw, 0.125, 0.1, fp4)
        assert not bool(float_mismatch(w_out, rw).any()), "folded weights differ"
        assert int((caches[1] != 0xA5).sum()) > 1000
        lines += [_bytes_equal(q_out, want_q, f"{fmt.name} q_out"),
                  _bytes_equal(caches[0], caches[1], f"{fmt.name} cache"),
                  _bytes_equal(out, rq8[0] if fp4 else rq8, "index q bytes")]
        if fp4:
            lines.append(_bytes_equal(scales, rq8[1].contiguous().view(torch.uint8).view(T, nh, 4), "index q scales"))
    return lines, {"_decode_front_kernel": dict(FNUZ=target == "gfx942", FMT=L.with_layout(_V41), FP4=True)}


def case_fused_indexer_q_rope_quant(target):
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.indexer import fused_indexer_q_rope_quant as K
    from indexer_inputs import query
    g = torch.Generator().manual_seed(2)
    pos, qi, w = query(5, 20, g, pos_max=60)
    qi[1, 3, 70] = float("nan")
    qi[2, 5] *= 2.0 ** -12
    cs = build_cos_sin_cache(160000.0, 64)
    q8, wk = K.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1)
    r8, wr = ri.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1)
    return [_bytes_equal(q8, r8, "q bytes"), _bytes_equal(wk, wr, "folded weights")], {
        "_fused_indexer_q_rope_quant_kernel": dict(FNUZ=target == "gfx942", FP4=False)}


def case_fused_indexer_q_rope_quant_fnuz(target):
    """vLLM's gfx942 query (use_fnuz: e4m3fnuz, maximum 224): the oracle's bytes and weights bit for bit, a
    poisoned head (0x80, NaN weight) and a tiny head included."""
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.indexer import fused_indexer_q_rope_quant as K
    from indexer_inputs import query
    g = torch.Generator().manual_seed(12)
    pos, qi, w = query(5, 20, g, pos_max=60)
    qi[3, 7, 100] = float("-inf")
    qi[0, 2] *= 2.0 ** -14
    cs = build_cos_sin_cache(160000.0, 64)
    q8, wk = K.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1, use_fnuz=True)
    r8, wr = ri.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1, use_fnuz=True)
    assert q8.dtype == r8.dtype == torch.float8_e4m3fnuz, (q8.dtype, r8.dtype)
    assert (r8.view(torch.uint8)[3, 7] == 0x80).all() and torch.isnan(wr[3, 7])
    return [_bytes_equal(q8, r8, "fnuz q bytes"), _bytes_equal(wk, wr, "fnuz folded weights")], {
        "_fused_indexer_q_rope_quant_kernel": dict(FNUZ=target == "gfx942", FP4=False, Q_FNUZ=True)}


def case_fused_inv_rope_fp8_quant(target):
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.output import fused_inv_rope_fp8_quant as K
    g = torch.Generator().manual_seed(3)
    T, H = 5, 8
    o = (torch.randn(T, H, 512, generator=g) * torch.exp2(torch.randint(-12, 8, (T, H, 1), generator=g).float()))
    o[1, 2, 450] = float("inf")
    o[2, 3, :128] = 0.0
    o = o.bfloat16()
    pos = torch.randint(0, 60, (T,), generator=g)
    cs = build_cos_sin_cache(10000.0, 64)
    lines = []
    for packed, qg in ((False, 128), (True, 128), (True, 32)):          # vLLM also runs blocks of 32
        d, s = K.fused_inv_rope_fp8_quant(o, pos, cs, 2, 4, quant_group_size=qg, tma_aligned_scales=packed)
        rd, rs = O.fused_inv_rope_fp8_quant(o, pos, cs, 2, 4, quant_group_size=qg, tma_aligned_scales=packed)
        lines += [_bytes_equal(d, rd, f"fp8 data (packed={packed}, blocks of {qg})"),
                  _bytes_equal(s.transpose(0, 1).contiguous(), rs.transpose(0, 1).contiguous(),
                               f"scales (packed={packed}, blocks of {qg})")]
    return lines, {"_inv_rope_fp8_quant_kernel": dict(FNUZ=target == "gfx942", BH=K.default_config(target)["BH"],
                                                      QG=32)}


def case_merge_attn_states(target):
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.triton.output import merge_attn_states as M
    from test_merge_attn_states import ordinal, states
    T, H, D, n_ctx = 12, 4, 128, 9
    po, pl, so, sl = states(T, H, D, seed=12, empty_frac=0.3)
    so[10, 0, :4] = torch.tensor([1e-9, -1e-9, 1e4, -1e4])             # past the context: 0x00 for -0, +-448
    scale = torch.tensor([0.03])
    out, ref = (torch.zeros(T, H, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    M.merge_attn_states(out, po, pl, so, sl, None, n_ctx, scale)
    O.merge_attn_states(ref, po, pl, so, sl, None, n_ctx, scale)
    a, b = out.view(torch.uint8), ref.view(torch.uint8)
    # rows whose merge weights are exact (an empty part: exp(0) = 1 and exp(-inf) = 0; tokens past the context
    # copy the suffix) give the oracle's bytes; elsewhere the fp32 values differ by ulps of exp and log
    p, q = (torch.where(torch.isposinf(x), float("-inf"), x).t() for x in (pl, sl))
    exact = (torch.isneginf(p) | torch.isneginf(q) | (torch.arange(T) >= n_ctx)[:, None]).unsqueeze(-1)
    exact = exact.expand(T, H, D)
    assert int(exact.sum()) > 1000 and int((~exact).sum()) > 1000
    line = _bytes_equal(a[exact], b[exact], "fp8 output, exact merge weights")
    step = int((ordinal(a[~exact]) - ordinal(b[~exact])).abs().max())
    assert step <= 1, f"fp8 output: {step} e4m3 steps from the oracle"
    assert int(a[10, 0, 1]) == 0 and int(a[10, 0, 2]) == 0x7E and int(a[10, 0, 3]) == 0xFE
    return [line, f"fp8 output, other rows: within one e4m3 step of the oracle ({int((a != b).sum())} differ)"], {
        "_merge_attn_states_kernel": dict(FNUZ=target == "gfx942", FP8_OUT=True)}


def _einsum_bound(out, ref, S, name):
    """docs/numerics.md#fp8-einsum: |z - z_ref| <= 2^-8 |z_ref| + 2^-9 S; NaN where the oracle has NaN."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{name}: NaN entries differ"
    fin = ~torch.isnan(ref)
    err = (out.float() - ref.float()).abs()[fin]
    tol = ref.float().abs()[fin] * 2 ** -8 + S[fin] * 2 ** -9
    assert bool((err <= tol).all()), f"{name}: {int((err > tol).sum())} outside the bound"
    return f"{name}: {int(fin.sum())} values within 2^-8 |z| + 2^-9 S (max err / S {float((err / S[fin]).max()):.2e})"


def case_fp8_einsum(target):
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.triton.output import fp8_einsum as E
    from test_fp8_einsum import _abs_sum, _operands, _packed
    lines = []
    # 40 tokens: AMD's 64 x 64 tile; 70 tokens: AMD's 128 x 64 tile (NVIDIA keeps 64 x 64 up to 256)
    for T, packed in ((40, False), (70, True)):
        a8, sa, w8, ws = _operands(T, 2, 96, 256, T)
        w8[0, 3, 5] = 0x80                                        # -0 in a weight: read as 0 on gfx942 too
        w8[1, 7, 130] = 0x80
        sa[4, 1, 1] = float("nan")
        S = _abs_sum(a8, sa.nan_to_num(), w8, ws).float()
        ref = torch.empty(T, 2, 96)
        O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
        if packed:                                                # UE8M0 words, weight scales per row
            a, b, gran, label = (a8, _packed(sa)), (w8, _packed(ws.repeat_interleave(128, 1)[:, :96])), 1, "packed"
        else:
            a, b, gran, label = (a8, sa), (w8, ws), 128, "fp32"
        out = torch.full((T, 2, 96), float("nan"), dtype=torch.bfloat16)
        E.fp8_einsum("bhr,hdr->bhd", a, b, out, recipe=(1, gran, 128))
        lines.append(_einsum_bound(out, ref, S, f"T={T}, {label} scales"))
    cfg = E.default_config(target, 70)
    return lines, {"_fp8_einsum_kernel": dict(FNUZ=target == "gfx942", BLOCK_M=cfg["BLOCK_M"],
                                              BLOCK_N=cfg["BLOCK_N"])}


def case_fp8_linear(target):
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.triton.output import fp8_einsum as E
    g = torch.Generator().manual_seed(4)
    T, K, N = 6, 384, 128
    x = (torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-16, 16, (T, 3), generator=g).float())
         .repeat_interleave(128, 1)).bfloat16()
    x[2, :128] = 0.0
    x[3, 200] = float("nan")
    q, s = torch.empty(T, K, dtype=torch.uint8), torch.full((T, K // 128), 7.0)
    E._quantizer(x.device)[(T, 1)](x, x.stride(0), x.stride(1), q, s, K // 128)
    rq, rs = O.quantize_activation(x)
    rs = rs.masked_fill(torch.isinf(rs), float("nan"))            # the kernel writes a poisoned scale as NaN
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s[~s.isnan()], rs[~rs.isnan()])
    lines = [_bytes_equal(q, rq, "activation bytes"), "activation scales equal"]
    w8, ws = O.quantize_weight(torch.randn(N, K, generator=g))
    y = E.fp8_linear(x, w8, ws)
    ref = O.fp8_linear(x, w8, ws)
    xq = O.e4m3_decode(rq) * rs.nan_to_num(0.0).repeat_interleave(128, -1)
    S = (xq.abs().double() @ O.dequantize_weight(w8, ws).abs().double().t()).float()
    lines.append(_einsum_bound(y, ref, S, "fp8_linear output"))
    return lines, {"_quantize_activation_kernel": dict(FNUZ=target == "gfx942"),
                   "_fp8_einsum_kernel": dict(FNUZ=target == "gfx942")}


def _logit_inputs(g, M, H):
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from indexer_inputs import query
    pos, qi, w = query(M, H, g, pos_max=60)
    q8, wq = ri.fused_indexer_q_rope_quant(pos, qi, build_cos_sin_cache(160000.0, 64), w, 0.125, 0.5)
    q8 = q8.view(torch.uint8).clone()
    q8[0, 1, 5] = 0x80                                            # -0 bytes: gfx942 reads them as 0x00
    q8[1, 0, :8] = 0x80
    return q8.view(torch.float8_e4m3fn), wq


def case_fp8_mqa_logits(target):
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.indexer import fp8_mqa_logits as Q
    from indexer_inputs import abs_bytes, assert_logits_close
    g = torch.Generator().manual_seed(5)
    M, H, N = 5, 16, 150
    q8, w = _logit_inputs(g, M, H)
    keys = (torch.randn(N, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (N, 1), generator=g).float()))
    from dsv4_rocm.reference.quant import quantize_blocks
    kq, e = quantize_blocks(keys, 128, 1e-4)
    kq[3, :4] = 0x80
    k8, ks = kq.view(torch.float8_e4m3fn), ri.pow2_or_nan(e[:, 0])
    starts = torch.tensor([0, 10, 70, 0, 149], dtype=torch.int32)
    ends = torch.tensor([150, 100, 71, 0, 150], dtype=torch.int32)
    out = Q.fp8_mqa_logits(q8, (k8, ks), w, starts, ends)
    ref = ri.fp8_mqa_logits(q8, (k8, ks), w, starts, ends)
    mag = ri.fp8_mqa_logits(abs_bytes(q8).view(torch.float8_e4m3fn), (abs_bytes(k8).view(torch.float8_e4m3fn),
                            ks.abs()), w.abs(), starts, ends)
    assert_logits_close(out, ref, mag, "fp8_mqa_logits")
    cfg = Q.default_config(target)
    return [f"fp8_mqa_logits: {M} x {N} logits within 2^-6 mag, -inf and NaN exact"], {
        "_fp8_mqa_logits_kernel": dict(FNUZ=target == "gfx942", BN=cfg["BN"], BQ=cfg["BQ"])}


def case_fp8_paged_mqa_logits(target):
    from dsv4_rocm import layout as L
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.indexer import fp8_paged_mqa_logits as P
    from indexer_inputs import assert_logits_close, filled_cache, paged_magnitude
    g = torch.Generator().manual_seed(6)
    B, nn, H, bs, max_len = 2, 2, 16, 32, 160
    q8, w = _logit_inputs(g, B * nn, H)
    q8 = q8.view(B, nn, H, 128)
    pages, kv, bt, _ = filled_cache([150, 70], bs, g)
    pages.view(torch.uint8)[bt[0, 1], 5 * 128:5 * 128 + 4] = 0x80          # -0 key bytes in a used slot
    lens = torch.tensor([150, 70], dtype=torch.int32)
    meta = torch.zeros(2, 2, dtype=torch.int32)
    out = P.fp8_paged_mqa_logits(q8, kv, w, lens, bt, meta, max_len)
    ref = ri.fp8_paged_mqa_logits(q8, kv, w, lens, bt, meta, max_len)
    mag = paged_magnitude(q8, pages, bs, w, lens, bt, max_len)
    assert_logits_close(out, ref, mag, "fp8_paged_mqa_logits")
    assert L.INDEXER_DIM == 128
    return [f"fp8_paged_mqa_logits: {B * nn} x {max_len} logits within 2^-6 mag, -inf and NaN exact"], {
        "_fp8_paged_mqa_logits_kernel": dict(FNUZ=target == "gfx942", BN=P.default_config(target)["BN"])}


def _equal_logits(a, b, name):
    """Bit for bit, -inf included; NaN in the same places (any NaN: its payload is the platform's choice)."""
    bad = int(float_mismatch(a, b).sum())
    assert bad == 0, f"{name}: {bad} logits differ"
    return f"{name}: {a.numel()} logits equal bit for bit (NaN: in the same places)"


def case_indexer_logits_fnuz_query(target):
    """vLLM's gfx942 query (float8_e4m3fnuz bytes, weights folded with the 224-maximum scale) through both
    logits kernels, with OCP keys and (prefill) float8_e4m3fnuz keys with their doubled scales: within the
    tolerance of the oracle, which reads the bytes as fnuz, and bit for bit the logits of the OCP query and
    keys of the same values (halving s_k per fnuz operand is exact)."""
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.quant import quantize_blocks
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.indexer import fp8_mqa_logits as Q, fp8_paged_mqa_logits as P
    from indexer_inputs import abs_bytes, assert_logits_close, filled_cache, paged_magnitude, query
    g = torch.Generator().manual_seed(13)
    M, H, N = 5, 16, 150
    pos, qi, wi = query(M, H, g, pos_max=60)
    qi[4, 9, 3] = float("nan")
    cs = build_cos_sin_cache(160000.0, 64)
    q8, w = ri.fused_indexer_q_rope_quant(pos, qi, cs, wi, 0.125, 0.5)
    z8, wz = ri.fused_indexer_q_rope_quant(pos, qi, cs, wi, 0.125, 0.5, use_fnuz=True)
    keys = torch.randn(N, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (N, 1), generator=g).float())
    keys[11, 5] = float("inf")
    kq, e = quantize_blocks(keys, 128, 1e-4)
    kz, ez = quantize_blocks(keys, 128, 1e-4, fnuz=True)
    k8, ks = kq.view(torch.float8_e4m3fn), ri.pow2_or_nan(e[:, 0])
    k8z, ksz = kz.view(torch.float8_e4m3fnuz), ri.pow2_or_nan(ez[:, 0])
    starts = torch.tensor([0, 10, 70, 0, 149], dtype=torch.int32)
    ends = torch.tensor([150, 100, 71, 0, 150], dtype=torch.int32)
    ocp = Q.fp8_mqa_logits(q8, (k8, ks), w, starts, ends)
    lines = []
    for kv, name in (((k8, ks), "fnuz q, OCP k"), ((k8z, ksz), "fnuz q and k")):
        out = Q.fp8_mqa_logits(z8, kv, wz, starts, ends)
        ref = ri.fp8_mqa_logits(z8, kv, wz, starts, ends)
        mag = ri.fp8_mqa_logits(abs_bytes(z8).view(torch.float8_e4m3fnuz),
                                (abs_bytes(kv[0]).view(kv[0].dtype), kv[1].abs()), wz.abs(), starts, ends)
        assert_logits_close(out, ref, mag, f"fp8_mqa_logits {name}")
        lines.append(_equal_logits(out, ocp, f"fp8_mqa_logits {name} vs the OCP query"))
    B, nn, bs, max_len = 2, 2, 32, 160
    pages, kv, bt, _ = filled_cache([150, 70], bs, g)
    lens = torch.tensor([150, 70], dtype=torch.int32)
    meta = torch.zeros(2, 2, dtype=torch.int32)
    zq = z8[:B * nn].reshape(B, nn, H, 128)
    out = P.fp8_paged_mqa_logits(zq, kv, wz[:B * nn], lens, bt, meta, max_len)
    ref = ri.fp8_paged_mqa_logits(zq, kv, wz[:B * nn], lens, bt, meta, max_len)
    assert_logits_close(out, ref, paged_magnitude(zq, pages, bs, wz[:B * nn], lens, bt, max_len),
                        "fp8_paged_mqa_logits fnuz q")
    ocp = P.fp8_paged_mqa_logits(q8[:B * nn].reshape(B, nn, H, 128), kv, w[:B * nn], lens, bt, meta, max_len)
    lines.append(_equal_logits(out, ocp, "fp8_paged_mqa_logits fnuz q vs the OCP query"))
    return lines, {"_fp8_mqa_logits_kernel": dict(FNUZ=target == "gfx942", Q_FNUZ=True, K_FNUZ=True),
                   "_fp8_paged_mqa_logits_kernel": dict(FNUZ=target == "gfx942", Q_FNUZ=True)}


def case_sparse_mla_decode(target):
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    from sparse_mla_inputs import check_lse, check_out, decode_args, decode_case, decode_key_amax
    a = decode_case(2, 1, 64, 64, 40, 3, 24, "cpu", 7, num_blocks=6)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    lines = []
    # the target's own split count (its SM count), its default second-launch combine, and the in-kernel
    # combine (its release slots are the target's threads a program: warps x wave size)
    for label, cfg in (("default", None), ("combine in the kernel", dict(split_combine="kernel"))):
        out, lse = D.sparse_mla_decode(*decode_args(a), config=cfg)
        check_out(out, ref, f"{target} decode, {label}", decode_key_amax(a))
        check_lse(lse, ref_lse)
        lines.append(f"decode ({label}): out within 2/128 |r| + 2^-8 max|K|, cos-diff < 5e-6; lse within "
                     "1e-6 + 2^-13")
    c = D.default_config(target, 64, "triton")
    wave = 64 if target.startswith("gfx") else 32
    return lines, {"_sparse_mla_paged_kernel": dict(FNUZ=target == "gfx942", BLOCK_N=c["BLOCK_N"],
                                                    DEQ_INT=c["DEQ_INT"], SPLIT=True,
                                                    THREADS=c["num_warps"] * wave, MAIN_FMT=_V40, EXTRA_FMT=_V40)}


def _decode_formats(target, formats, label, seed, layout="page_split", h=64):
    """One decode over caches of ``formats`` (main, extra) against the oracle: split as the target splits,
    the default combine."""
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    from sparse_mla_inputs import check_lse, check_out, decode_args, decode_case, decode_key_amax
    fmts = tuple(L.with_layout(f, layout) for f in formats)
    a = decode_case(2, 1, h, 64, 40, 3, 24, "cpu", seed, num_blocks=6, formats=fmts)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=fmts)
    out, lse = D.sparse_mla_decode(*decode_args(a), formats=fmts)
    check_out(out, ref, f"{target} decode, {label}", decode_key_amax(a, fmts))
    check_lse(lse, ref_lse)
    return f"decode over {label} ({layout}): out within 2/128 |r| + 2^-8 max|K|, cos-diff < 5e-6; lse within " \
           "1e-6 + 2^-13"


def _poisoned_key_decode(target, formats, seed):
    """A key whose first quant block held a NaN (its record poisoned: scale byte 0xFF, NaN bytes) in the main
    set of one query: that query's output is NaN on every head, as in the oracle (the scale exponent moved
    for the target's or the record's flavour must keep 0xFF a NaN); the other query's is finite."""
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.reference import cache as rc
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    from sparse_mla_inputs import decode_args, decode_case
    fmts = tuple(L.with_layout(f) for f in formats)
    a = decode_case(2, 1, 64, 64, 16, 3, 8, "cpu", seed, num_blocks=4, formats=fmts)
    a["indices"][:, :, :4] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    a["topk_length"][:] = 16
    k = torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)).bfloat16()
    k[0, 3] = float("nan")
    rc.insert_k_records(rc.encode_k_records(k, fmts[0]), a["k_cache"], torch.tensor([5]), 64, fmts[0])
    a["indices"][1, 0, 0] = 9                                      # the second query does not read slot 5
    out, _ = D.sparse_mla_decode(*decode_args(a), formats=fmts)
    ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=fmts)
    assert bool(ref[0].isnan().all()) and bool(out[0].isnan().all()), f"{target}: the poisoned key is not NaN"
    assert bool(out[1].isfinite().all()), f"{target}: NaN outside the query reading the poisoned key"
    return f"a poisoned {fmts[0].name}{' (FNUZ)' if fmts[0].fnuz else ''} key: NaN output for its query only"


def case_sparse_mla_decode_v41(target):
    """V41_528 in both sets (one loop over their tiles, [BN, 16, 32] chunks), and V41_528 with a V41_FP4_288
    extra set (a loop per set; the e2m1 tile: on AMD each code's e4m3 byte through the target's convert,
    its e4m3 scale read back the same way (fnuz on gfx942, times 2), on sm_100 the integer byte-permute
    decode), page-split and interleaved; split as the target splits."""
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    lines = [_decode_formats(target, (_V41, _V41), "V41_528 + V41_528", 11),
             _decode_formats(target, (_V41, _FP4), "V41_528 + V41_FP4_288", 12),
             _decode_formats(target, (_V41, _FP4), "V41_528 + V41_FP4_288", 13, "interleaved"),
             _poisoned_key_decode(target, (_V41, _FP4), 16)]
    c = D.default_config(target, 64, "triton")
    return lines, {"_sparse_mla_paged_kernel": dict(FNUZ=target == "gfx942", BLOCK_N=c["BLOCK_N"],
                                                    DEQ_INT=c["DEQ_INT"], MAIN_FMT=_V41,
                                                    EXTRA_FMT=_FP4)}


def case_sparse_mla_decode_fnuz_window(target):
    """vLLM's gfx942 caches: a sliding-window set of FNUZ-flavour V40_584 records (e4m3fnuz bytes, scale bytes
    one higher) and an OCP compressed set, in the one loop over both sets with the tile's flavour a run-time
    flag: gfx942 reads the window's bytes natively (fnuz, the scale as written) and the compressed ones with
    the scale exponent + 1; OCP targets read the window with the scale exponent - 1."""
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    fz = L.with_fnuz(_V40)
    lines = [_decode_formats(target, (fz, _V40), "V40_584 FNUZ window + V40_584", 14),
             _decode_formats(target, (fz, _V40), "V40_584 FNUZ window + V40_584, 128 heads", 15, h=128),
             _poisoned_key_decode(target, (fz, _V40), 17), _poisoned_key_decode(target, (_V40, _V40), 18)]
    c = D.default_config(target, 64, "triton")
    return lines, {"_sparse_mla_paged_kernel": dict(FNUZ=target == "gfx942", DEQ_INT=c["DEQ_INT"], MAIN_FMT=fz,
                                                    EXTRA_FMT=_V40)}


def case_sparse_mla_prefill(target):
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention import sparse_mla_prefill as P
    from sparse_mla_inputs import SM, check_lse, check_out, prefill_case, prefill_key_amax
    q, kv, idx, lens, s = prefill_case(4, 64, 40, 50, "cpu", 9)
    out, mx, lse = P.sparse_mla_prefill(q, kv, idx, SM, 512, s, lens)
    ref = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
    check_out(out, ref[0], f"{target} prefill", prefill_key_amax(kv, idx, lens))
    check_lse(lse, ref[2])
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(mx), torch.isneginf(ref[1]))
    torch.testing.assert_close(mx[fin], ref[1][fin], atol=1e-5, rtol=1e-5)
    return ["prefill: out within 2/128 |r| + 2^-8 max|K|; lse and max_logits close, lonely queries exact"], {
        "_sparse_mla_prefill_kernel": dict(BLOCK_N=P.default_config(target)["BLOCK_N"])}


def case_merge_attn_states_fp8_flavours(target):
    """merge_attn_states' fp8 outputs, float8_e4m3fn and vLLM's gfx942 float8_e4m3fnuz, on merges whose
    values are exact in fp32: every byte the oracle's, NaN included (gfx942's route for the OCP byte maps
    its fnuz NaN back to 0x7F)."""
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.triton.output import merge_attn_states as M
    g = torch.Generator().manual_seed(9)
    T, H, D = 6, 4, 128
    # equal lse (weights 1/2 each), one part empty, both empty, tokens past the context: the merged values
    # are exact in fp32, so the fp8 bytes are the oracle's exactly; values span both formats' subnormals and
    # their saturation, with -0, +-inf and NaN
    po, so = (torch.randn(T, H, D, generator=g) * torch.exp2(torch.randint(-14, 12, (T, H, D), generator=g).float())
              for _ in range(2))
    po[0, 0, :5] = torch.tensor([-0.0, float("inf"), float("-inf"), 1e6, float("inf")])
    so[0, 0, :5] = torch.tensor([-0.0, 1.0, 1.0, 1e6, float("-inf")])            # the last: NaN
    po, so = po.bfloat16(), so.bfloat16()
    lse = torch.randn(H, T, generator=g)
    pl, sl = lse.clone(), lse.clone()
    pl[1, 2], sl[2, 3] = float("inf"), float("-inf")
    pl[3, 1], sl[3, 1] = float("inf"), float("inf")
    scale = torch.tensor([0.5])
    lines = []
    for odt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        out, ref = (torch.zeros(T, H, D, dtype=odt) for _ in range(2))
        olse, rlse = (torch.full((H, T), float("nan")) for _ in range(2))
        M.merge_attn_states(out, po, pl, so, sl, olse, 5, scale)
        O.merge_attn_states(ref, po, pl, so, sl, rlse, 5, scale)
        lines.append(_bytes_equal(out, ref, f"{odt} output"))
        assert torch.equal(olse.isnan(), rlse.isnan()) and torch.allclose(olse, rlse, rtol=1e-6, equal_nan=True)
    return lines, {"_merge_attn_states_kernel": dict(FNUZ=target == "gfx942", OUT_FNUZ=True)}


def case_top_k_per_row(target):
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    from test_top_k_per_row import POISON, check_topk, hard_rows
    g = torch.Generator().manual_seed(8)
    k = 512
    # long rows (past raw_max = 4096 columns): split over CTAs by the target's CU count (two launches), coarse
    # maxima and a radix select with the target's digits; short rows (the C4 decode step's width): one register pass
    lg = hard_rows(4200, g)[:2]
    starts, ends = torch.tensor([0, 90], dtype=torch.int32), torch.tensor([4200, 4150], dtype=torch.int32)
    out = torch.full((2, k), POISON, dtype=torch.int32)
    T.top_k_per_row_prefill(lg, starts, ends, out, 2, lg.stride(0), lg.stride(1), k)
    s, n = ri.prefill_rows(starts, ends, 2, 4200)
    check_topk(lg, out, s, n, k, lowest_ties=True, label=f"{target} long rows")
    lines = ["long rows: the k largest of each row (order keys), indices distinct and in range"]
    expect = {"_coarse_kernel": dict(D=T.default_config(target, k)["digit"])}
    if target == "sm_100":                # 8-bit digits in the short-rows kernel too (6 spill there)
        dec = hard_rows(2048, g)[:2]
        seq = torch.tensor([2048, 700], dtype=torch.int32)
        out = torch.full((2, k), POISON, dtype=torch.int32)
        T.top_k_per_row_decode(dec, 1, seq, out, 2, dec.stride(0), 1, k)
        check_topk(dec, out, torch.zeros(2), ri.decode_rows(seq, 1, 2, 2048), k, lowest_ties=True,
                   label=f"{target} short rows")
        lines.append("short rows: the k largest of each row")
        expect["_fused_kernel"] = dict(D=8, LONG=False)
    return lines, expect


# ---- the fp8 instruction models themselves ------------------------------------------------------------------
# The probes run the helpers of dsv4_rocm/triton/_fp8.py (and the kernels' own encoder, _e4m3) on a vector:
# under the interpreter that is the model, compiled on a GPU the hardware instruction (test_amd_tier.py
# compares the two on the GPU).
ENCODERS = ("ocp", "fnuz", "kernel_ocp", "kernel_fnuz")       # FORM 0..3 of _encode_probe
DECODERS = ("ocp", "fnuz", "ptx_scaled_bf16", "ptx_e2m1_scaled_bf16")   # FORM 0..3 of _decode_probe


@triton.jit
def _encode_probe(x_ptr, out_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """x fp32 -> bytes: FORM 0 / 1 encode OCP / fnuz, 2 / 3 the kernels' _e4m3 with FNUZ False / True."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if FORM == 0:
        b = _fp8.encode(x, False)
    elif FORM == 1:
        b = _fp8.encode(x, True)
    else:
        b = _e4m3(x, FORM == 3).to(tl.uint8)
    tl.store(out_ptr + i, b, mask=i < n)


@triton.jit
def _decode_probe(b_ptr, out_ptr, FORM: tl.constexpr):
    """Every byte -> fp32: FORM 0 decode OCP, 1 decode fnuz, 2 the sm_90 / sm_100 decode kernel's integer
    e4m3 -> bf16 (value * 2^-120), 3 its integer e2m1 -> bf16 of the byte's low nibble (value * 2^-112)."""
    i = tl.arange(0, 256)
    b = tl.load(b_ptr + i)
    if FORM == 2:
        v = _e4m3_to_scaled_bf16(b).to(tl.float32)
    elif FORM == 3:
        v = _e2m1_to_scaled_bf16(b & 0xF).to(tl.float32)
    else:
        v = _fp8.decode(b, FORM == 1)
    tl.store(out_ptr + i, v)


def probe_values(seed=0, n_random=1 << 20):
    """fp32 values for the encoders: every e4m3 value of both formats, the midpoints between neighbours (ties)
    and the floats next to them, the subnormal range, the saturation and overflow edges, zeros, infinities,
    NaN, fp32 subnormals; then random bit patterns (every exponent) and random values of e4m3's range."""
    g = torch.Generator().manual_seed(seed)
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = torch.cat([b.view(torch.float8_e4m3fn).float(), b.view(torch.float8_e4m3fnuz).float()])
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor([float("inf")])
    near = torch.cat([mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])
    edges = torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 479.9, 480.0, 512.0, 240.0, 247.9, 248.0, 256.0,
                          2.0 ** -9, 2.0 ** -10, 2.0 ** -11, 2.0 ** -12, 3 * 2.0 ** -12, 2.0 ** -126, 1e-45, 1e38,
                          float("inf"), float("nan")])
    special = torch.cat([grid, near, edges, torch.nextafter(grid, inf), torch.nextafter(grid, -inf)])
    bits = torch.randint(-2 ** 31, 2 ** 31, (n_random,), generator=g, dtype=torch.int64).to(torch.int32)
    spread = torch.randn(n_random, generator=g) * torch.exp2(torch.randint(-16, 10, (n_random,), generator=g).float())
    return torch.cat([special, -special, bits.view(torch.float32), spread])


def run_probes(x):
    """{encoder: bytes} of fp32 x and {"decode_" + decoder: fp32 [256]} of every byte through the probes: the
    models under the interpreter; on a GPU (x on it) the hardware, the fnuz forms on gfx942 only (NVIDIA has
    no fnuz fp8) and the PTX decode on NVIDIA only."""
    gpu = x.device.type != "cpu"
    if gpu:
        from dsv4_rocm.platform import detect
        fnuz_ok, ptx_ok = detect(x.device).arch == "gfx942", torch.version.hip is None
    else:
        fnuz_ok = ptx_ok = True
    n = x.numel()
    block = 1024 if gpu else 65536                 # the interpreter runs one program at a time: few, large ones
    out = {}
    for form, name in enumerate(ENCODERS):
        if "fnuz" in name and not fnuz_ok:
            continue
        o = torch.empty(n, dtype=torch.uint8, device=x.device)
        _encode_probe[(-(-n // block),)](x, o, n, FORM=form, BLOCK=block)
        out[name] = o.cpu()
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(x.device)
    for form, name in enumerate(DECODERS):
        if (name == "fnuz" and not fnuz_ok) or (name.startswith("ptx") and not ptx_ok):
            continue
        o = torch.empty(256, dtype=torch.float32, device=x.device)
        _decode_probe[(1,)](b, o, FORM=form)
        out["decode_" + name] = o.cpu()
    return out


def model_checks():
    """The models against torch's CPU casts (one JSON line per check)."""
    x = probe_values()
    t0 = time.time()
    got = run_probes(x)
    nan = torch.isnan(x)
    # torch's e4m3fn cast rounds to nearest even and gives NaN from 480 on: with the kernels' clamp to
    # +-448 first it is the saturating convert. Its fnuz cast gives NaN (0x80) for |x| >= 248 as gfx942's
    # convert does without the clamp bit.
    ocp = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    fnuz = x.to(torch.float8_e4m3fnuz).view(torch.uint8)
    kernel = torch.where(ocp == 0x80, 0, ocp)                 # the cache's bytes: -0 written 0x00
    checks = [
        ("encode_ocp", int(((got["ocp"] != ocp) & ~nan).sum()) + int((got["ocp"][nan] != 0x7F).sum())),
        ("encode_fnuz", int((got["fnuz"] != fnuz).sum())),
        # the kernels' encoder, both routes (gfx942: fnuz of x / 2), give the OCP byte of every finite value
        ("kernel_encode_ocp_route", int(((got["kernel_ocp"] != kernel) & ~nan).sum())),
        ("kernel_encode_fnuz_route", int(((got["kernel_fnuz"] != kernel) & ~nan).sum())),
    ]
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    checks += [("decode_ocp", int((float_mismatch(got["decode_ocp"], b.view(torch.float8_e4m3fn).float())).sum())),
               ("decode_fnuz", int((float_mismatch(got["decode_fnuz"], b.view(torch.float8_e4m3fnuz).float())).sum()))]
    # the integer decode: the e4m3 value times 2^-120 (0x7F / 0xFF, OCP NaN, read as +-480)
    want = torch.where((b & 0x7F) == 0x7F, torch.where(b > 127, -480.0, 480.0), b.view(torch.float8_e4m3fn).float())
    checks.append(("decode_ptx_scaled_bf16", int((float_mismatch(got["decode_ptx_scaled_bf16"] * 2.0 ** 120,
                                                                want)).sum())))
    # the integer e2m1 decode of the low nibble: the e2m1 value (sign kept, -0 included) times 2^-112
    from dsv4_rocm.reference.quant import e2m1_decode
    e2m1 = e2m1_decode(b & 0xF)
    checks.append(("decode_ptx_e2m1_scaled_bf16", int((float_mismatch(got["decode_ptx_e2m1_scaled_bf16"] * 2.0 ** 112,
                                                                     e2m1)).sum())))
    for name, bad in checks:
        print("AMD-TIER " + json.dumps(dict(case=name, target="model", ok=bad == 0, values=x.numel() if "encode" in
                                            name else 256, mismatches=bad, seconds=round(time.time() - t0, 2))),
              flush=True)


# ---- the runner ------------------------------------------------------------------------------------------
def _summary(launches):
    """{kernel: {"constexprs": {name: sorted distinct values}, "compile_only": {option: values}}}."""
    out = {}
    for name, consts in launches:
        k = out.setdefault(name, {"constexprs": {}, "compile_only": {}})
        for key, v in consts.items():
            vals = k["compile_only" if key in OPTIONS else "constexprs"].setdefault(key, [])
            if repr(v) not in vals:
                vals.append(repr(v))
    return out


def _check_expect(summary, expect):
    """Every expected kernel was launched, at least once with every expected constexpr value."""
    missing = []
    for kernel, want in expect.items():
        got = summary.get(kernel, {}).get("constexprs", {})
        for key, v in want.items():
            if repr(v) not in got.get(key, []):
                missing.append(f"{kernel}.{key}={v!r} (launched with {got.get(key)})")
    return missing


def run(target, names):
    from dsv4_rocm.triton import _launch
    for name in names:
        t0 = time.time()
        res = dict(case=name, target=target)
        try:
            with _launch.emulate_target(target), _launch.record_launches() as launches:
                lines, expect = globals()[f"case_{name}"](target)
            summary = _summary(launches)
            missing = _check_expect(summary, expect)
            res.update(ok=not missing, lines=lines, launches=summary, expect={k: {a: repr(b) for a, b in v.items()}
                                                                               for k, v in expect.items()},
                       error="constexprs not launched: " + "; ".join(missing) if missing else "")
        except Exception:                          # noqa: BLE001  (reported per case; the other cases still run)
            res.update(ok=False, lines=[], launches={}, expect={}, error=traceback.format_exc()[-3000:])
        res["seconds"] = round(time.time() - t0, 2)
        print("AMD-TIER " + json.dumps(res), flush=True)


if __name__ == "__main__":
    from helpers import patch_interpreter_bf16, patch_interpreter_fma, patch_interpreter_scalars
    patch_interpreter_scalars()
    patch_interpreter_bf16()
    patch_interpreter_fma()
    tgt = sys.argv[1]
    if tgt == "model":
        model_checks()
    elif tgt == "probe":                          # probe IN OUT: the models' results on IN's values (GPU test)
        torch.save(run_probes(torch.load(sys.argv[2])), sys.argv[3])
    else:
        run(tgt, sys.argv[2:] or [c for c, ts in CASES.items() if tgt in ts])
