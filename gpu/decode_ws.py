"""The warp-specialized Hopper kernel (dsv4_rocm/triton/hopper/sparse_mla_decode_ws.py) on an H100, decode and prefill
over bf16 rows: checked against the reference, then timed beside the Triton kernels and FlashMLA on identical
tensors.

    python gpu/decode_ws.py [--flashmla /path/to/FlashMLA] [--smoke] [--json out.json]

0. Every variant's kernels are compiled first, in parallel (one worker thread per CPU).
1. Correctness (tolerances of tests/attention/sparse_mla_inputs.py): the default configuration on the GPU cases of
   tests/attention/test_sparse_mla.py (block sizes 2 to 576, lengths [b] and [b, s_q], no extra set, sinks +-inf, h 64
   and 128, s_q 1 to 3, b up to 321), with the default persistent schedule and with 3 parts per query;
   strided inputs and an out buffer (same bits as the contiguous call, nothing else written); all-invalid and
   zero-length queries (out 0, lse +inf); the public op's default on this GPU. Every other variant on two
   cases (timing probes, whose outputs are wrong on purpose, on none); the default again on every timed case
   (the schedules of the large batches); the prefill kernel over bf16 rows on the prefill GPU cases with every
   kind of sink (out, lse, max logits, lonely queries).
2. Compile report of each variant (registers, spills, shared memory of the compiled kernels).
3. Timing, CUDA-graph replay (median) and eager: FlashMLA (when ``import flash_mla`` works, or from the
   ``--flashmla`` checkout built in place), the Triton kernel, the Hopper kernel, its variants and its timing
   probes (``PROBE``: no record loads, no matrix products, neither); prefill (eager, s_q 4096, s_kv 8K / 64K,
   h 64 / 128) for both kernels, the probes and FlashMLA.
4. Tables: per case the times and FlashMLA / ours, the probes, a verdict per case (which of ws and triton is
   faster) and overall: the value ``sparse_mla_decode.DEFAULT_SM90_KERNEL`` should hold; the prefill TFLOP/s.

A kernel that hangs ends the run (exit 3) with the case named, so the machine is not held. Exit 1 after the
timing of what passed when any check failed; 2 when the device is not Hopper (sm_90). ``--smoke`` compiles
and checks one shape only.
"""
import argparse
import json
import os
import sys
import threading
import time
import traceback

import torch

# this checkout's dsv4_rocm, then tests/ (helpers.py) and tests/attention/: the cases and checks are the sparse
# MLA tests' own (sparse_mla_inputs.py, test_sparse_mla.py's case lists), one copy beside those tests; so the
# tool runs as `python gpu/decode_ws.py`, without PYTHONPATH
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "tests", "attention")]

SMOKE_CASE = (4, 2, 64, 256, 128, 64, 512, "random", "b")

# (name, config, num_splits): the default first; the others change one thing each
VARIANTS = [
    ("ws", dict(kernel="ws"), None),
    ("ws noL2", dict(kernel="ws", L2_AHEAD=False), None),                  # no L2 requests ahead
    ("ws probe nogather", dict(kernel="ws", PROBE=1), None),               # timing probes: outputs wrong
    ("ws probe nomma", dict(kernel="ws", PROBE=2), None),
    ("ws probe neither", dict(kernel="ws", PROBE=3), None),
]
FULL = ("ws",)      # checked on every case (the default and the candidates for it)
PROBES = ("ws probe nogather", "ws probe nomma", "ws probe neither")     # timed, never checked
TRITON = ("triton", dict(kernel="triton"), None)
# --portable-sweep: tiles of the portable Triton kernel (the one AMD runs), each checked on the variant cases
# before it is timed: ids two tiles ahead (AMD's default), and the runner-up tile of the last sweep
# (BENCHMARKS.md section P: 32-key tiles, one stage, 16 warps and the in-kernel combine all lost on the H200;
# 128-head blocks of 16 warps do not compile there)
PORTABLE_SWEEP = [
    ("triton ahead2", dict(kernel="triton", IDX_AHEAD=2), None),
    ("triton ahead2 n64s3", dict(kernel="triton", IDX_AHEAD=2, num_stages=3), None),
    ("triton n64s3", dict(kernel="triton", num_stages=3), None),
]
PREFILL_SWEEP = [
    ("triton n32s3", dict(kernel="triton", BLOCK_N=32, num_stages=3)),
    ("triton n64s2", dict(kernel="triton", BLOCK_N=64, num_stages=2)),
    ("triton n64s4", dict(kernel="triton", BLOCK_N=64, num_stages=4)),
]
TRITONS = [TRITON]       # the portable variants timed: TRITON, plus PORTABLE_SWEEP with --portable-sweep
WS_TIMED = {}             # --ws-default-only: {"only": True}, the Hopper kernel's default alone is timed


def fits(cfg, h):
    """A variant's head block must divide the case's heads."""
    return h % cfg.get("BLOCK_H", 64) == 0


# (label, b, s_q, h, main topk, main bs, extra topk, extra bs, random extra lengths, time the variants)
TIMED = [
    ("h64 128(bs256)+512(bs64) s_q2 b2", 2, 2, 64, 128, 256, 512, 64, False, True),
    ("V4-Flash h64 128(bs256)+512(bs64) s_q2 b64", 64, 2, 64, 128, 256, 512, 64, False, True),
    ("V4-Flash h64 128(bs256)+512(bs64) s_q2 b148", 148, 2, 64, 128, 256, 512, 64, False, True),
    ("V4-Pro h128 128+1024(bs64) s_q2 b64", 64, 2, 128, 128, 256, 1024, 64, False, True),
    ("V4-Pro h128 128+1024(bs64) s_q2 b148", 148, 2, 128, 128, 256, 1024, 64, False, True),
    ("h64 s_q1 128+512 b128", 128, 1, 64, 128, 256, 512, 64, False, True),
    ("h64 s_q1 128+512 b256", 256, 1, 64, 128, 256, 512, 64, False, True),
    ("h64 128+1024(bs2, extra lengths) s_q2 b148", 148, 2, 64, 128, 256, 1024, 2, True, True),
    ("h128 128+1024(bs2, extra lengths) s_q2 b148", 148, 2, 128, 128, 256, 1024, 2, True, True),
]

FAILURES = []


def log(msg=""):
    print(msg, flush=True)


class watchdog:
    """Ends the process (exit 3) if the block takes longer than ``seconds``: a kernel that deadlocks on an
    mbarrier never returns, and only the end of the process frees the GPU."""

    def __init__(self, seconds, what):
        self.seconds, self.what = seconds, what

    def _fire(self):
        sys.stdout.write(f"\nHANG: {self.what} did not finish in {self.seconds} s; ending the run\n")
        sys.stdout.flush()
        os._exit(3)

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def check(name, fn):
    """Run a check; record its failure (with the message) and go on."""
    try:
        with watchdog(180, name):
            fn()
            torch.cuda.synchronize()
        log(f"  ok    {name}")
        return True
    except Exception as e:  # noqa: BLE001  (an assertion, a compile error, a launch error: all are failures)
        FAILURES.append((name, f"{type(e).__name__}: {e}"))
        log(f"  FAIL  {name}: {type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc(limit=3)
        return False


# ---- correctness ----------------------------------------------------------------------------------------------
def check_case(case, cfg, splits, label):
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from sparse_mla_inputs import check_lse, check_out, decode_args, decode_case, decode_key_amax
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    a = decode_case(b, s_q, h, bs, topk, ebs, etopk, "cuda", 11 + b, sink, lshape)
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    out = torch.full_like(ref_out, float("nan"))                 # poisoned: every element must be written
    res, lse = sparse_mla_decode(*decode_args(a), out, config=cfg, num_splits=splits)
    assert res is out
    check_out(out, ref_out, label, decode_key_amax(a))
    if sink != "+inf":
        check_lse(lse, ref_lse)


def check_call_forms(cfg, splits):
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from sparse_mla_inputs import decode_args, decode_case, padded_out, strided
    a = decode_case(6, 2, 64, 64, 128, 2, 256, "cuda", 7)
    base, base_lse = sparse_mla_decode(*decode_args(a), config=cfg, num_splits=splits)
    s = dict(a, q=strided(a["q"]), indices=strided(a["indices"]), k_cache=a["k_cache"].view(torch.float8_e4m3fn),
             extra_k_cache=a["extra_k_cache"].view(torch.int8).view(torch.uint8),
             topk_length=a["topk_length"].unsqueeze(1).expand(6, 2),
             extra_indices_in_kvcache=strided(a["extra_indices_in_kvcache"]))
    out, back = padded_out((6, 2, 64, 512), "cuda")
    before = back.clone()
    res, lse = sparse_mla_decode(*decode_args(s), out, config=cfg, num_splits=splits)
    torch.cuda.synchronize()
    assert res is out and torch.equal(out, base) and torch.equal(lse, base_lse), "strided call differs"
    written = torch.zeros_like(back, dtype=torch.bool)
    written[:6, :, :64] = True
    assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16)), "wrote outside out"


def check_all_invalid(cfg):
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from sparse_mla_inputs import decode_args, decode_case
    for sink in ("random", "-inf", "+inf", "none"):
        a = decode_case(6, 1, 64, 64, 128, 64, 512, "cuda", 2, sink)
        a["indices"][:3] = -1
        a["indices"][3:] = torch.tensor([-2 ** 31, 2 ** 31 - 1, 10 ** 9, -5], dtype=torch.int32,
                                        device="cuda").repeat(32)
        a["extra_topk_length"].zero_()
        for ns in (1, 4):
            out, lse = sparse_mla_decode(*decode_args(a), config=cfg, num_splits=ns)
            assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all(), (sink, ns)


def check_prefill(case, sink):
    """The Hopper kernel over bf16 rows (``sparse_mla_prefill`` config kernel="ws") against the reference."""
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    from sparse_mla_inputs import check_lonely, check_lse, check_out, prefill_case, prefill_key_amax
    s_q, h, topk, s_kv = case
    q, kv, idx, lens, sk = prefill_case(s_q, h, topk, s_kv, "cuda", s_q * 7 + topk, sink)
    ref = ra.flash_mla_sparse_fwd(q, kv, idx, 512 ** -0.5, 512, sk, lens)
    out = torch.full((s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    res = sparse_mla_prefill(q, kv, idx, 512 ** -0.5, 512, sk, lens, out, config=dict(kernel="ws"))
    check_out(out, ref[0], f"ws prefill {case} {sink}", prefill_key_amax(kv, idx, lens))
    check_lse(res[2], ref[2])
    check_lonely(out, res[2], [0, 1] if s_q > 1 else [0], res[1])
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(res[1]), torch.isneginf(ref[1]))
    torch.testing.assert_close(res[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)


def check_public_default():
    from dsv4_rocm import ops
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    from sparse_mla_inputs import check_out, decode_args, decode_case, decode_key_amax
    assert D.default_kernel("sm_90") == D.DEFAULT_SM90_KERNEL, "sm_90 does not run DEFAULT_SM90_KERNEL"
    a = decode_case(5, 2, 128, 256, 128, 64, 512, "cuda", 3)
    out, _ = ops.sparse_mla_decode(*decode_args(a))
    check_out(out, ra.flash_mla_with_kvcache_sparse(*decode_args(a))[0], "ops default", decode_key_amax(a))


def correctness(smoke):
    from test_sparse_mla import DECODE_CASES
    ok = {}
    log("== correctness")
    if smoke:
        ok["ws"] = all([check(f"ws {SMOKE_CASE} splits={ns}", lambda ns=ns: check_case(
            SMOKE_CASE, dict(kernel="ws"), ns, f"ws {SMOKE_CASE} splits={ns}")) for ns in (None, 3)])
        return ok
    precompile(DECODE_CASES)
    for name, cfg, _ in VARIANTS:
        if name not in FULL:
            continue
        good = True
        for case in DECODE_CASES:
            for ns in (None, 3):
                good &= check(f"{name} {case} splits={ns}", lambda case=case, ns=ns, cfg=cfg, name=name: check_case(
                    case, cfg, ns, f"{name} {case} splits={ns}"))
        for ns in (1, 4):
            good &= check(f"{name} call forms splits={ns}", lambda ns=ns, cfg=cfg: check_call_forms(cfg, ns))
        good &= check(f"{name} all-invalid and zero lengths", lambda cfg=cfg: check_all_invalid(cfg))
        ok[name] = good
    ok["ws"] &= check("ops default on this GPU is DEFAULT_SM90_KERNEL", check_public_default)
    from test_sparse_mla import PREFILL_CASES
    good = True
    for case in PREFILL_CASES:
        for sink in ("random", "none", "+inf", "-inf"):
            good &= check(f"ws prefill {case} {sink}", lambda case=case, sink=sink: check_prefill(case, sink))
    ok["ws prefill"] = good
    # each variant: the timed cases' kernel (V4-Flash pages; 600 units of 10 tiles, so the default schedule
    # puts four to five units in a CTA and cuts some) and the odd-page case of FlashMLA's tests (h 128,
    # [b, s_q] lengths, planned schedule)
    picks = [((300, 2, 64, 256, 128, 64, 512, "random", "b"), None), (DECODE_CASES[-1], None)]
    for name in PROBES:
        ok[name] = True
    for name, cfg, ns in [v for v in VARIANTS if v[0] not in FULL + PROBES] + TRITONS:
        ok[name] = all([check(f"{name} {case}", lambda case=case, cfg=cfg, n=ns or pns: check_case(
            case, cfg, n, f"{name} {case} splits={n}")) for case, pns in picks if fits(cfg, case[2])])
    return ok


def precompile(cases):
    """Compile every variant's kernels for the checked and timed configurations in parallel (one worker
    thread per CPU, Triton's asynchronous compiles), so the checks and timings that follow find them."""
    from dsv4_rocm.flash_mla import _compile_all
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from sparse_mla_inputs import decode_args, decode_case
    t0 = time.perf_counter()
    shapes = [(2, 1, h, bs, topk, ebs, etopk, sink, lshape) for b, s_q, h, bs, topk, ebs, etopk, sink, lshape in cases]
    shapes += [(2, 1, h, bs, topk, ebs, etopk, "random", "b") for _, b, s_q, h, topk, bs, etopk, ebs, _, _ in TIMED]
    jobs = []
    for case in shapes:
        args = decode_args(decode_case(*case[:7], "cuda", 1, *case[7:]))
        for _, cfg, _ in VARIANTS + TRITONS:
            if fits(cfg, case[2]):
                jobs += [(sparse_mla_decode, args, dict(config=cfg, num_splits=ns)) for ns in (1, 3)]
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    from sparse_mla_inputs import prefill_case
    for h in (64, 128):
        q, kv, idx, lens, sk = prefill_case(2, h, 64, 16, "cuda", 1)
        for cfg in [dict(kernel="ws")] + [c for _, c in PREFILL_VARIANTS if fits(c, h)]:
            for ln, sn in ((lens, sk), (lens, None), (None, None)):
                jobs.append((sparse_mla_prefill, (q, kv, idx, 512 ** -0.5, 512, sn, ln), dict(config=cfg)))
    try:
        _compile_all(jobs, None)
    except Exception as e:  # noqa: BLE001  (a variant that does not compile fails its own checks below)
        log(f"  precompile: {type(e).__name__}: {str(e)[:300]}")
    log(f"precompiled {len(jobs)} launches in {time.perf_counter() - t0:.0f} s")


# ---- compile report -------------------------------------------------------------------------------------------
def compiled_kernels(kern):
    cache = kern.device_caches.get(torch.cuda.current_device())
    return dict(cache[0]) if cache else {}


def compile_report(before, after):
    rows = []
    for key, ck in after.items():
        if key in before:
            continue
        try:
            ck._init_handles()
            rows.append(dict(regs=ck.n_regs, spills=ck.n_spills, shared=ck.metadata.shared))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(error=str(e)[:200]))
    return rows


# ---- timing ---------------------------------------------------------------------------------------------------
def timed_inputs(c, seed=0):
    from dsv4_rocm.bench.sparse_mla import make_decode_inputs
    label, b, s_q, h, topk, bs, etopk, ebs, elen, _ = c
    args, _ = make_decode_inputs(dict(b=b, s_q=s_q, h=h, topk=topk, bs=bs, etopk=etopk, ebs=ebs), "cuda", seed=seed)
    if elen:
        g = torch.Generator(device="cuda").manual_seed(seed + 5)
        args[7].copy_(torch.randint(etopk // 2, etopk + 1, (b,), device="cuda", generator=g, dtype=torch.int32))
    return args


def timing(ok, peer):
    from dsv4_rocm.bench.sparse_mla import decode_call
    from dsv4_rocm.bench.timing import time_graph_ms, time_ms
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    rows = []
    log("\n== timing (us; graph = CUDA-graph replay median, eager = launch by launch median)")
    for c in TIMED:
        label, variants = c[0], c[-1]
        args = timed_inputs(c)
        row = dict(case=label, graph={}, eager={}, compile={})
        runs = [TRITON] + [v for v in TRITONS[1:] + VARIANTS if (variants or v[0] == "ws") and ok.get(v[0])
                           and fits(v[1], c[3]) and not (WS_TIMED.get("only") and v[0].startswith("ws "))]
        for name, cfg, ns in runs:
            fn = (lambda cfg=cfg, ns=ns: D.sparse_mla_decode(*args, config=cfg, num_splits=ns))
            kern = D._ws._sparse_mla_ws_kernel if cfg["kernel"] == "ws" else D._sparse_mla_paged_kernel
            before = compiled_kernels(kern)
            try:
                with watchdog(240, f"{name} on {label}"):
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    row["compile"][name] = compile_report(before, compiled_kernels(kern))
                    row["graph"][name] = time_graph_ms(fn) * 1e3
                    if name in ("ws", "triton"):
                        row["eager"][name] = time_ms(fn) * 1e3
            except Exception as e:  # noqa: BLE001
                FAILURES.append((f"timing {name} {label}", f"{type(e).__name__}: {e}"))
                log(f"  FAIL timing {name} on {label}: {type(e).__name__}: {str(e)[:300]}")
                continue
            log(f"  {label:46s} {name:12s} graph {row['graph'][name]:8.1f}"
                + (f"  eager {row['eager'][name]:8.1f}" if name in row["eager"] else "")
                + (f"  first call {time.perf_counter() - t0:.1f} s" if row["compile"][name] else ""))
            if name == "ws":
                check(f"ws on the timed inputs of {label}", lambda: check_timed(args, label))
        if peer is not None:
            try:
                with watchdog(240, f"FlashMLA on {label}"):
                    fn = decode_call(peer, args)
                    row["graph"]["FlashMLA"] = time_graph_ms(fn) * 1e3
                    row["eager"]["FlashMLA"] = time_ms(fn) * 1e3
                log(f"  {label:46s} {'FlashMLA':12s} graph {row['graph']['FlashMLA']:8.1f}  "
                    f"eager {row['eager']['FlashMLA']:8.1f}")
            except Exception as e:  # noqa: BLE001
                log(f"  FlashMLA failed on {label}: {type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        del args
        torch.cuda.empty_cache()
    return rows


PREFILL_TIMED = [("prefill h64 topk512 s_q4096 s_kv8192", dict(s_q=4096, s_kv=8192, h=64, topk=512)),
                 ("prefill h64 topk512 s_q4096 s_kv65536", dict(s_q=4096, s_kv=65536, h=64, topk=512)),
                 ("prefill h128 topk1024 s_q4096 s_kv8192", dict(s_q=4096, s_kv=8192, h=128, topk=1024)),
                 ("prefill h128 topk1024 s_q4096 s_kv65536", dict(s_q=4096, s_kv=65536, h=128, topk=1024))]
PREFILL_VARIANTS = [("triton", dict(kernel="triton")), ("ws", dict(kernel="ws")),
                    ("ws probe nogather", dict(kernel="ws", PROBE=1)), ("ws probe nomma", dict(kernel="ws", PROBE=2))]


def prefill_timing(ok, peer):
    """Prefill over bf16 rows (eager, as engines call it): TFLOP/s of the Triton and the Hopper kernel (and
    FlashMLA's when built), the Hopper kernel's output checked against the Triton kernel's first."""
    from dsv4_rocm.bench.sparse_mla import count_prefill, make_prefill_inputs
    from dsv4_rocm.bench.timing import time_ms
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    log("\n== prefill (eager, TFLOP/s = 2 h topk 1024 s_q / time)")
    rows = []
    for label, c in PREFILL_TIMED:
        q, kv, idx = make_prefill_inputs(c, "cuda")
        flop = count_prefill(c)[0]
        row = dict(case=label, us={})
        base = None
        for name, cfg in PREFILL_VARIANTS:
            if (name.startswith("ws") and not ok.get("ws prefill") or not fits(cfg, c["h"])
                    or WS_TIMED.get("only") and name.startswith("ws ")):
                continue
            fn = (lambda cfg=cfg: sparse_mla_prefill(q, kv, idx, 512 ** -0.5, config=cfg))
            try:
                with watchdog(240, f"prefill {name} on {label}"):
                    res = fn()
                    torch.cuda.synchronize()
                    if name == "triton":
                        base = res
                    elif name != "triton" and not name.startswith("ws probe") and base is not None:
                        err = (res[0].float() - base[0].float()).abs().max().item()
                        assert err <= 2e-2 * base[0].float().abs().max().item(), f"{name} prefill differs by {err}"
                    row["us"][name] = time_ms(fn) * 1e3
            except Exception as e:  # noqa: BLE001
                FAILURES.append((f"prefill timing {name} {label}", f"{type(e).__name__}: {e}"))
                log(f"  FAIL prefill {name} on {label}: {type(e).__name__}: {str(e)[:300]}")
                continue
            log(f"  {label:44s} {name:18s} {row['us'][name]:9.1f} us  {flop / row['us'][name] / 1e6:6.1f} TFLOP/s")
        if peer is not None:
            try:
                with watchdog(240, f"FlashMLA prefill on {label}"):
                    row["us"]["FlashMLA"] = time_ms(lambda: peer.flash_mla_sparse_fwd(q, kv, idx, 512 ** -0.5)) * 1e3
                log(f"  {label:44s} {'FlashMLA':18s} {row['us']['FlashMLA']:9.1f} us  "
                    f"{flop / row['us']['FlashMLA'] / 1e6:6.1f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                log(f"  FlashMLA prefill failed on {label}: {type(e).__name__}: {str(e)[:300]}")
        row["flop"] = flop
        rows.append(row)
        del q, kv, idx, base
        torch.cuda.empty_cache()
    log(f"\n{'prefill case':44s} " + " ".join(f"{n[:12]:>12s}" for n in ["FlashMLA"] + [v[0] for v in PREFILL_VARIANTS])
        + "   (TFLOP/s)")
    for r in rows:
        log(f"{r['case']:44s} " + " ".join(
            f"{r['flop'] / r['us'][n] / 1e6:12.1f}" if n in r["us"] else f"{'-':>12s}"
            for n in ["FlashMLA"] + [v[0] for v in PREFILL_VARIANTS]))
    return rows


def check_timed(args, label):
    """The default Hopper kernel on a timed case (its persistent schedule at full size) against the
    reference."""
    from dsv4_rocm.reference import attention as ra
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from sparse_mla_inputs import check_lse, check_out, decode_key_amax
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*args)
    out = torch.full_like(ref_out, float("nan"))
    sparse_mla_decode(*args, out, config=dict(kernel="ws"))
    a = dict(q=args[0], k_cache=args[1], indices=args[2], topk_length=args[3], extra_k_cache=args[5],
             extra_indices_in_kvcache=args[6], extra_topk_length=args[7])
    check_out(out, ref_out, f"ws timed {label}", decode_key_amax(a))
    lse = sparse_mla_decode(*args, config=dict(kernel="ws"))[1]
    check_lse(lse, ref_lse)


def table(rows):
    log("\n== compile report (kernels compiled for the timed cases: registers are the kernel cap; the "
        "partitions' setmaxnreg split it)")
    seen = set()
    for r in rows:
        for name, reps in r["compile"].items():
            for rep in reps:
                key = (name, tuple(sorted(rep.items())))
                if key not in seen:
                    seen.add(key)
                    log(f"  {name:12s} {rep}")
    log("\n== decode, us (ratio = FlashMLA / ours, > 1: ours faster)")
    log(f"{'case':46s} {'FlashMLA':>9s} {'triton':>8s} {'ws':>8s} {'ratio':>6s}  {'best ws variant':>24s} {'ratio':>6s}"
        f"   eager: {'FlashMLA':>9s} {'ws':>8s} {'ratio':>6s}")
    for r in rows:
        g, e = r["graph"], r["eager"]
        f = g.get("FlashMLA")
        wsv = {k: v for k, v in g.items() if k.startswith("ws") and k not in PROBES}
        best = min(wsv, key=wsv.get) if wsv else None
        trv = {k: v for k, v in g.items() if k.startswith("triton")}
        tbest = min(trv, key=trv.get) if trv else None

        def num(x, w=8):
            return f"{x:{w}.1f}" if x is not None else f"{'-':>{w}s}"

        def ratio(a, b):
            return f"{a / b:6.2f}" if a is not None and b is not None else f"{'-':>6s}"
        log(f"{r['case']:46s} {num(f, 9)} {num(g.get('triton'))} {num(g.get('ws'))} {ratio(f, g.get('ws'))}  "
            f"{(best or '-'):>15s} {num(wsv.get(best))} {ratio(f, wsv.get(best))}   "
            f"       {num(e.get('FlashMLA'), 9)} {num(e.get('ws'))} {ratio(e.get('FlashMLA'), e.get('ws'))}"
            + (f"   best portable: {tbest} {num(trv.get(tbest))} {ratio(f, trv.get(tbest))}" if len(trv) > 1 else ""))
    if any(p in r["graph"] for r in rows for p in PROBES):
        log("\n== timing probes of the Hopper kernel, graph us (nogather: no record loads; nomma: no matrix "
            "products; neither: both off; outputs wrong)")
        log(f"{'case':46s} {'ws':>8s} " + " ".join(f"{p[9:]:>9s}" for p in PROBES))
        for r in rows:
            g = r["graph"]
            log(f"{r['case']:46s} {g.get('ws', float('nan')):8.1f} "
                + " ".join(f"{g.get(p, float('nan')):9.1f}" for p in PROBES))
    return verdict(rows)


def verdict(rows):
    """Per case, the faster of the default Hopper kernel and the Triton kernel (CUDA-graph times), and the
    value of sparse_mla_decode.DEFAULT_SM90_KERNEL the run supports: "ws" when it wins every case it was
    timed on and passed every check, else "triton"."""
    log("\n== verdict (graph times; DEFAULT_SM90_KERNEL in dsv4_rocm/triton/attention/sparse_mla_decode.py)")
    wins = []
    for r in rows:
        g = r["graph"]
        if "ws" in g and "triton" in g:
            w = "ws" if g["ws"] < g["triton"] else "triton"
            wins.append(w)
            log(f"  {r['case']:46s} {w:6s} (ws / triton = {g['ws'] / g['triton']:.2f})")
        else:
            wins.append(None)
            log(f"  {r['case']:46s} -      (ws or triton not timed)")
    ws_failed = any(name.startswith("ws ") or name.startswith("timing ws") for name, _ in FAILURES)
    pick = "ws" if wins and all(w == "ws" for w in wins) and not ws_failed else "triton"
    log(f"VERDICT DEFAULT_SM90_KERNEL = {pick!r}  (ws faster on {sum(w == 'ws' for w in wins)} of {len(wins)} "
        f"cases{', a ws check failed' if ws_failed else ''})")
    return pick


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flashmla", default=os.environ.get("FLASHMLA_DIR"),
                    help="a FlashMLA checkout built in place (its flash_mla package is timed beside ours)")
    ap.add_argument("--smoke", action="store_true", help="compile and check one shape only")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--portable-sweep", action="store_true",
                    help="also check and time the portable kernel's PORTABLE_SWEEP and PREFILL_SWEEP tiles")
    ap.add_argument("--ws-default-only", action="store_true",
                    help="time the Hopper kernel's default only (not its variants and timing probes)")
    a = ap.parse_args(argv)
    WS_TIMED["only"] = a.ws_default_only
    if a.portable_sweep:
        TRITONS[1:] = PORTABLE_SWEEP
        PREFILL_VARIANTS[1:1] = PREFILL_SWEEP
    if not torch.cuda.is_available():
        log("gpu_decode_ws: no GPU")
        return 2
    cap = torch.cuda.get_device_capability()
    import triton
    log(f"{torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}")
    if cap != (9, 0):
        log("gpu_decode_ws: the warp-specialized decode kernel is written for Hopper (sm_90)")
        return 2
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    if D._ws is None:
        log("gpu_decode_ws: this Triton has no Gluon")
        return 2
    t0 = time.perf_counter()
    ok = correctness(a.smoke)
    log(f"correctness: {time.perf_counter() - t0:.0f} s, {len(FAILURES)} failures")
    rows, pick = [], None
    if not a.smoke:
        if a.flashmla and a.flashmla not in sys.path:
            sys.path.append(a.flashmla)
        from dsv4_rocm.bench.sparse_mla import flashmla_peer
        peer = flashmla_peer()
        log("FlashMLA: " + ("timed beside ours" if peer is not None else "not importable (timing without it)"))
        rows = timing(ok, peer)
        pick = table(rows)
        rows.append(dict(prefill=prefill_timing(ok, peer)))
    else:
        from dsv4_rocm.triton.hopper import sparse_mla_decode_ws as W
        log(f"compiled: {compile_report({}, compiled_kernels(W._sparse_mla_ws_kernel))}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(ok=ok, failures=FAILURES, rows=rows, default_sm90_kernel=pick), f, indent=1)
    log(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if FAILURES:
        log(f"FAILED: {len(FAILURES)} checks")
        for name, msg in FAILURES:
            log(f"  {name}: {msg[:300]}")
        return 1
    log("all checks passed" + (" (smoke)" if a.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
