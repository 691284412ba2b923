"""Host time of the public ops: the Python a call runs before (and between) its kernel launches.

* ``c4_decode_calls(device)``: the public-op calls of a C4 layer's decode step at V4-Flash dims (b = 128),
  in ``dsv4_rocm.attention``'s order, and the step's index-set ops.
* ``flash_mla_b2_call(device)``: FlashMLA's API call of the host-path case (b 2, s_q 2, h 64, topk 128 +
  512), as ``bench/sparse_mla.py`` makes it.
* ``simulated_gpu()``: Triton launches without a GPU: a stand-in driver (an sm_90 or gfx942 target,
  device 0, stream 0) and compiled kernels that launch nothing, so Triton's launcher (binder, cache key,
  launch metadata) runs as it does on a GPU.
* ``ops_as_on_gpu()``: CPU tensors take the hip / triton implementations and skip value checks, as GPU
  tensors do; the HIP launchers are stubbed. Together with ``simulated_gpu`` a CPU machine measures the
  host path of every op (``gpu/host_overhead.py --cpu``).
"""
import contextlib
import sys
import time

import torch

from .. import ops


# ---- simulated launches --------------------------------------------------------------------------------
class _NullKernel:
    """Stands for a compiled kernel: what Triton's launcher reads, and a run that launches nothing."""

    def __init__(self, key):
        self.key = key
        self.function = 1
        self.packed_metadata = (4, 1, 0)
        self.launches = 0

    def run(self, *args):
        self.launches += 1

    def launch_metadata(self, grid, stream, *args):
        from triton import knobs
        from triton.compiler.compiler import LazyDict
        if knobs.runtime.launch_enter_hook is None:
            return None
        return LazyDict({"name": "null", "function": self.function, "stream": stream})


class _SimDriver:
    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def simulated_gpu(backend: str = "cuda"):
    """Triton launches on CPU tensors go through Triton's launcher to kernels that do nothing; nothing is
    compiled. Restores Triton's driver and forgets every simulated kernel on exit."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
    target = GPUTarget("cuda", 90, 32) if backend == "cuda" else GPUTarget("hip", "gfx942", 64)
    touched = set()
    compile_ = JITFunction._do_compile

    def null_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        touched.add(self)
        kernel = self.device_caches[device][0][key] = _NullKernel(key)
        return kernel

    sim = _SimDriver(target)
    driver.set_active(sim)
    JITFunction._do_compile = null_compile
    try:
        yield
    finally:
        JITFunction._do_compile = compile_
        driver.reset_active() if driver._default is not None else driver.set_active(None)
        for fn in touched:
            fn.device_caches.pop(0, None)


class _NoOps:
    """dsv4_rocm._C stand-in: every launcher is a no-op."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def ops_as_on_gpu():
    """CPU tensors run the GPU path of every op: hip > triton > reference as on a GPU, no value checks
    (they need a host sync there), HIP launchers stubbed. Restored on exit."""
    from .. import hip_ops
    from ..ops import _dispatch
    saved_backends, saved_vc, saved_load = _dispatch._machine_backends, _dispatch.value_checks, hip_ops.load
    patched = [m for name, m in sys.modules.items() if name.startswith("dsv4_rocm") and
               getattr(m, "value_checks", None) is saved_vc]
    _dispatch._machine_backends = lambda device_type: ("reference", "triton", "hip")
    no_values = lambda t: False  # noqa: E731
    for m in patched:
        m.value_checks = no_values
    _dispatch.value_checks = no_values
    hip_ops.load = lambda: _NoOps()
    _dispatch.forget_implementations()
    try:
        yield
    finally:
        _dispatch._machine_backends, _dispatch.value_checks, hip_ops.load = saved_backends, saved_vc, saved_load
        for m in patched:
            m.value_checks = saved_vc
        _dispatch.forget_implementations()


# ---- the calls -----------------------------------------------------------------------------------------
def c4_decode_calls(device, b: int = 128, ctx: int = 8192, seed: int = 0):
    """([(name, fn)], outputs) for the public-op calls of a C4 layer's decode step (V4-Flash dims, 64 local
    heads, b decode requests at context ``ctx``), each fn() one eager call, in the layer's order: the step's
    index sets, projections, norms, insert, both compressors, the indexer, attention and the output path.
    ``outputs()`` gives every result and written cache (the calls repeat the same writes, so a second
    pass gives the same bytes). Cache contents start as zeros (host time does not depend on them)."""
    from ..config import get_config
    from ..kv_cache import LayerCache
    from ..reference.compressor import coff
    from ..reference.rope import build_cos_sin_cache
    from ..weights import LayerWeights
    from .layer import _step
    dev = torch.device(device)
    cfg = get_config("v4-flash")
    lt = cfg.layer_type(2)
    W = LayerWeights.random(cfg, lt, seed, dev)
    cache = LayerCache.allocate(lt, b * ctx // 256, b * 4, dev, num_swa_blocks=b * ctx // 64)
    g = torch.Generator(device=dev).manual_seed(seed)
    step = _step(dev, g, b, ctx)
    step.build((4,))
    cs = build_cos_sin_cache(cfg.compress_rope_theta, ctx + 2, device=dev)
    H, G, K, nh = cfg.local_heads, cfg.local_groups, cfg.index_topk, cfg.index_n_heads
    T, ql = b, cfg.q_lora_rank
    x = torch.randn(T, cfg.hidden_size, device=dev, generator=g).bfloat16()
    n_entries = -(-(ctx + 1) // 4)
    attn = torch.empty(T, 64, 512, dtype=torch.bfloat16, device=dev)
    z = torch.empty(T, G, cfg.o_lora_rank, dtype=torch.bfloat16, device=dev)
    topk = torch.empty(T, K, dtype=torch.int32, device=dev)
    swa_idx = torch.empty(T, 128, dtype=torch.int32, device=dev)
    swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
    comp, idx = cache.comp_view(), cache.idx_view()           # the views the layer keeps (attention.py)
    swa4, comp4, idx4 = cache.swa_view().unsqueeze(-2), comp.unsqueeze(-2), idx.unsqueeze(-2)
    st = {}

    def compressor(prefix, w_kv, ape, state, kvc, dim, w_norm):
        c = coff(4)

        def kv_score():
            st[prefix + "kvs"] = ops.compressor_kv_score(x, w_kv).split([c * dim, c * dim], dim=-1)

        def save():
            kv, score = st[prefix + "kvs"]
            ops.save_partial_states(kv, score, ape, step.positions, state, step.state_slots[4], 4, c * dim, 4)

        def store():
            ops.compress_norm_rope_store(
                state_cache=state, num_actual=T, token_to_req_indices=step.token_to_req, positions=step.positions,
                slot_mapping=step.state_slots[4], block_table=step.state_block_table, block_size=4,
                state_width=c * dim, cos_sin_cache=cs, kv_cache=kvc, k_cache_metadata=step.compressed_slots[4],
                pdl_kwargs={}, head_dim=dim, rope_head_dim=64, compress_ratio=4, overlap=True, use_fp4_cache=False,
                rms_norm_weight=w_norm, rms_norm_eps=1e-6, quant_block=64 if dim == 512 else 128,
                token_stride=576 if dim == 512 else 128, scale_dim=8 if dim == 512 else 4)
        return [(f"{prefix}compressor_kv_score", kv_score), (f"{prefix}save_partial_states", save),
                (f"{prefix}compress_norm_rope_store", store)]

    def put(key, f):
        def call():
            st[key] = f()
        return call

    calls = [
        ("compute_swa_indices_and_lens", lambda: ops.compute_swa_indices_and_lens(
            swa_idx, swa_lens, 128, step.query_start_loc, step.seq_lens, step.token_to_req, step.is_valid_token,
            step.swa_block_table, 64)),
        ("get_compressed_slot_mapping", lambda: ops.get_compressed_slot_mapping(
            T, step.query_start_loc, step.seq_lens, step.compressed_block_table, 64, 4)),
        ("fp8_linear (wq_a + wkv)", put("qr_kv", lambda: ops.fp8_linear(x, W.wqkv8, W.wqkv_s))),
        ("fused_q_kv_rmsnorm", put("qr,kv", lambda: ops.fused_q_kv_rmsnorm(
            st["qr_kv"][:, :ql], st["qr_kv"][:, ql:], W.q_norm, W.kv_norm, 1e-6))),
        ("fp8_linear (wq_b)", put("q", lambda: ops.fp8_linear(st["qr,kv"][0], W.wq_b8, W.wq_b_s).view(T, H, 512))),
        ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", put("qp", lambda:
            ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(st["q"], st["qr,kv"][1], cache.swa,
                                                                  step.slot_mapping, step.positions, cs, 64, 1e-6,
                                                                  64))),
        *compressor("", W.comp_w, W.comp_ape, cache.comp_state, comp, 512, W.comp_norm),
        *compressor("indexer ", W.idx_comp_w, W.idx_comp_ape, cache.idx_state, idx, 128, W.idx_comp_norm),
        ("fp8_linear (indexer wq_b)", put("qi", lambda: ops.fp8_linear(st["qr,kv"][0], W.idx_wq_b8,
                                                                       W.idx_wq_b_s).view(T, nh, 128))),
        ("indexer weights (torch.matmul)", put("wi", lambda: torch.matmul(x, W.idx_wproj.t()))),
        ("fused_indexer_q_rope_quant", put("q8,wq", lambda: ops.fused_indexer_q_rope_quant(
            step.positions, st["qi"], cs, st["wi"], 128 ** -0.5, nh ** -0.5))),
        ("get_paged_mqa_logits_metadata", put("sched", lambda: ops.get_paged_mqa_logits_metadata(
            step.indexer_lens.view(b, 1), 64, 1))),
        ("fp8_paged_mqa_logits", put("lg", lambda: ops.fp8_paged_mqa_logits(
            st["q8,wq"][0].view(b, 1, nh, 128), idx4, st["q8,wq"][1],
            step.indexer_lens.view(b, 1), step.compressed_block_table, st["sched"], n_entries))),
        ("top_k_per_row_decode", lambda: ops.top_k_per_row_decode(
            st["lg"], 1, step.indexer_lens.view(b, 1), topk, T, st["lg"].stride(0), st["lg"].stride(1), K)),
        ("compute_global_topk_indices_and_lens", put("gi,gl", lambda: ops.compute_global_topk_indices_and_lens(
            topk, step.token_to_req, step.compressed_block_table, 64, step.is_valid_token))),
        ("sparse_mla_decode", lambda: ops.sparse_mla_decode(
            st["qp"].unsqueeze(1), swa4, step.swa_indices.unsqueeze(1), step.swa_lens,
            W.attn_sink, comp4, st["gi,gl"][0].unsqueeze(1), st["gi,gl"][1],
            cfg.softmax_scale, out=attn.view(T, 1, 64, 512))),
        ("fused_inv_rope_fp8_quant", put("a8,sa", lambda: ops.fused_inv_rope_fp8_quant(
            attn[:, :H], step.positions, cs, G, H // G))),
        ("fp8_einsum (wo_a)", lambda: ops.fp8_einsum("bhr,hdr->bhd", st["a8,sa"], (W.wo_a8.view(torch.float8_e4m3fn),
                                                                                 W.wo_a_s), z)),
        ("fp8_linear (wo_b)", lambda: ops.fp8_linear(z.view(T, -1), W.wo_b8, W.wo_b_s)),
    ]
    for _, fn in calls:          # in order: fills st with every intermediate, compiles what needs it
        fn()

    def outputs():
        """Every result of the calls (returned or written in place) and the caches they write."""
        res = {k: v for k, v in st.items()}
        res.update(swa_idx=swa_idx, swa_lens=swa_lens, topk=topk, attn=attn, z=z, swa=cache.swa, comp=cache.comp,
                   idx=cache.idx, comp_state=cache.comp_state, idx_state=cache.idx_state)
        return res
    return calls, outputs


def flash_mla_b2_call(device, pool_tokens: int = 1 << 16):
    """fn() of the host-path case through ``dsv4_rocm.flash_mla`` (first call made), and its inputs."""
    from .. import flash_mla
    from .sparse_mla import decode_call, make_decode_inputs
    c = dict(b=2, s_q=2, h=64, topk=128, bs=256, etopk=512, ebs=64)
    args, _ = make_decode_inputs(c, device, pool_tokens=pool_tokens)
    return decode_call(flash_mla, args), args


# ---- timing ---------------------------------------------------------------------------------------------
def host_us(fn, n: int = 200, sync=None, best: bool = False) -> float:
    """Median (``best``: minimum, for a shared CPU) over 5 rounds of the wall time of ``n`` back-to-back calls
    divided by n, in us (the GPU is synchronized only around each round, by ``sync``)."""
    fn()
    rounds = []
    for _ in range(5):
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        if sync:
            sync()
    return min(rounds) if best else sorted(rounds)[2]


def profile_top(fn, calls: int = 200, top: int = 15) -> str:
    """cProfile of ``calls`` calls of fn: the ``top`` entries by own time, as text."""
    import cProfile
    import io
    import pstats
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main_job_decode_step_ms(device, layer: str, config: str = "v4-flash", heads=None, requests: int = 4,
                            prompt_len: int = 160, decode_steps: int = 8, chunk: int = 512, profile: bool = False):
    """The main job's eager decode step of one layer type (``python -m dsv4_rocm run``'s trace and
    defaults): the mean host-clock time of its pure decode steps, in ms, after a warm-up pass, the GPU
    synchronized around each step as the main job does. With ``profile``: (ms, a cProfile top-25 of the
    timed decode steps by own time)."""
    from ..config import LayerType, get_config
    from ..trace_check import trace
    from ..serving import SyntheticServer
    cfg = get_config(config)
    cfg = cfg.with_tp(cfg.num_heads // (heads or cfg.local_heads))
    lt = LayerType(layer)
    steps, total = trace(requests, prompt_len, decode_steps, chunk)
    max_len = max(total) + 2
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(max_len, cfg.hidden_size, generator=g).bfloat16().to(device) for _ in range(requests)]
    gpu = torch.device(device).type == "cuda"
    times = []
    import cProfile
    pr = cProfile.Profile()
    for timed in (False, True):
        srv = SyntheticServer(cfg, lt, requests, max_len, device=device)
        for st in steps:
            tokens = {b: xs[b][a:e] for b, (a, e) in st.items()}
            decode = timed and all(e - a == 1 and a > 0 for a, e in st.values())
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if decode and profile:
                pr.enable()
            srv.step(tokens)
            if gpu:
                torch.cuda.synchronize()
            if decode:
                times.append(time.perf_counter() - t0)
                pr.disable()
    ms = 1e3 * sum(times) / max(len(times), 1)
    if not profile:
        return ms
    import io
    import pstats
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    return ms, out.getvalue()
