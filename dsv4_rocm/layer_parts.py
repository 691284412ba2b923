"""The parts a layer's plan picks (``dsv4_rocm.layer_plan``): compressors and indexers.

Each part is a small stateless object; its methods take the layer (``m``: its weights ``w``, caches, RoPE
table ``cos_sin_cache``, ``eps``, ``max_model_len``, shared buffers) and the step's tensors, and write the
caches the plan says the layer owns.

* ``PooledCompressor`` (V4.0, vLLM's DeepseekCompressor): projection, state save into the state cache,
  then the pooled entries of the tokens that close a window, normed, roped, quantized into the compressed
  cache.
* ``LatentCompressor`` (V4.1 kv source): kv_score = x @ fused_wkv_wgate^T -> fused_save_compress_norm (ring
  for ratio 2, pooling, RMSNorm -> bf16 latent) -> rope_quant_insert into its compressed cache; returns
  the latent the indexer's keys are made of.
* ``PooledIndexer`` (V4.0 C4): its own pooled compressor into the indexer-K cache, its query, logits and
  a top-k of its own.
* ``LatentIndexer`` (V4.1 index source): a kv source's index keys k_norm(wk(latent)); its own query, logits
  over the kv source's indexer-K cache, the candidate blocks (select or mask), top-k into the stack's
  shared buffer.

Both indexers score with ``score_topk``: the decode rows by the paged logits op, the prefill rows of each
request over its gathered keys in row chunks, as vLLM does.
"""
import torch

from . import ops
from .reference.compressor import coff, state_block_size

INDEXER_PREFILL_ROWS = 2048     # query rows per prefill logits launch: bounds the [rows, entries] fp32 buffer
INDEX_BLOCK = 64                # indexer-K entries a page


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's unquantized ReplicatedLinear of V4.1 (wk, weights_proj): bf16 x @ weight^T with fp32
    accumulation, one rounding to bf16. Computed as an fp32 GEMM of the bf16 values, so every device and the
    oracle round the same sums (a bf16 GEMM's blocking changes which sums round where)."""
    return torch.matmul(x.float(), weight.float().t()).bfloat16()


def pooled_compress(m, x, w_kv_gate, ape, norm_w, positions, step, state, kv_cache, kslots, dim: int, ratio: int):
    """vLLM's DeepseekCompressor.forward (module docstring) of ``ratio`` into ``kv_cache`` at ``kslots``."""
    c, sbs, main = coff(ratio), state_block_size(ratio), dim == 512
    kv, score = ops.compressor_kv_score(x, w_kv_gate).split([c * dim, c * dim], dim=-1)
    sslots = step.state_slots[ratio]
    ops.save_partial_states(kv, score, ape, positions, state, sslots, sbs, c * dim, ratio)
    ops.compress_norm_rope_store(
        state_cache=state, num_actual=x.shape[0], token_to_req_indices=step.token_to_req, positions=positions,
        slot_mapping=sslots, block_table=step.state_block_table, block_size=sbs, state_width=c * dim,
        cos_sin_cache=m.cos_sin_cache, kv_cache=kv_cache, k_cache_metadata=kslots, pdl_kwargs={},
        head_dim=dim, rope_head_dim=64, compress_ratio=ratio, overlap=ratio == 4, use_fp4_cache=False,
        rms_norm_weight=norm_w, rms_norm_eps=m.eps, quant_block=64 if main else 128,
        token_stride=576 if main else 128, scale_dim=8 if main else 4)


class PooledCompressor:
    needs = ("comp_w", "comp_ape", "comp_norm")
    caches = ("comp", "comp_state")

    def write(self, m, x, positions, step):
        w = m.w
        pooled_compress(m, x, w.comp_w, w.comp_ape, w.comp_norm, positions, step, m.cache.comp_state, m._comp,
                        step.compressed_slots[m.ratio], 512, m.ratio)
        return None

    def profile(self, m, x) -> None:
        ops.compressor_kv_score(x, m.w.comp_w)


class LatentCompressor:
    needs = ("comp_w", "comp_norm", "idx_wk", "idx_k_norm")
    caches = ("comp", "idx")

    def write(self, m, x, positions, step) -> torch.Tensor:
        """The bf16 latent of every group-closing token (other rows unspecified), its record in the
        compressed cache."""
        r, w = m.ratio, m.w
        kv_score = ops.compressor_kv_score(x, w.comp_w)
        latent = torch.empty(x.shape[0], 512, dtype=torch.bfloat16, device=x.device)
        slots = step.compressed_slots[r]
        if r == 2:
            ops.fused_save_compress_norm(kv_score, positions, m.cache.ring, step.state_slots[2],
                                         step.query_start_loc, step.token_to_req, w.comp_norm, m.eps, 2, latent)
        else:
            ops.fused_save_compress_norm(kv_score, positions, None, slots, None, None, w.comp_norm, m.eps, 1, latent)
        ops.rope_quant_insert(latent, positions, m.cos_sin_cache, m._comp, slots, r,
                              kv_layout=m.cache.comp_format.layout)
        return latent

    def profile(self, m, x) -> None:
        ops.compressor_kv_score(x, m.w.comp_w)


class PooledIndexer:
    needs = ("idx_comp_w", "idx_comp_ape", "idx_comp_norm", "idx_wq_b8", "idx_wq_b_s", "idx_wproj")

    def write_keys(self, m, x, latent, positions, step) -> None:
        """The indexer's compressor: its state, and the index keys of the tokens that close a window."""
        w = m.w
        pooled_compress(m, x, w.idx_comp_w, w.idx_comp_ape, w.idx_comp_norm, positions, step, m.cache.idx_state,
                        m._idx, step.compressed_slots[4], 128, 4)

    def query_inputs(self, m, x, qr):
        """The indexer's query heads (wq_b of qr) and their weights before RoPE and quantization."""
        return index_heads(m, qr), torch.matmul(x, m.w.idx_wproj.t())

    def query(self, m, x, qr, positions):
        """The indexer's query heads and weights, RoPE'd and quantized: (q fp8 [T, nh, 128], w fp32 [T, nh])."""
        return quantized_query(m, *self.query_inputs(m, x, qr), positions)

    def profile(self, m, x, qr, positions) -> None:
        ops.compressor_kv_score(x, m.w.idx_comp_w)
        self.query(m, x, qr, positions)

    def topk(self, m, x, qr, latent, positions, step, query=None) -> torch.Tensor:
        """Writes the indexer-K cache; each token's top-k local compressed indices int32 [T, index_topk]
        (valid first, -1 after). ``query``: the quantized query when the layer's fused front made it."""
        self.write_keys(m, x, latent, positions, step)
        q8, wq = query if query is not None else self.query(m, x, qr, positions)
        topk = torch.empty(x.shape[0], m.cfg.index_topk, dtype=torch.int32, device=x.device)
        score_topk(m, q8, wq, step.indexer_lens, step, topk, None)
        return topk


class LatentIndexer:
    needs = ("idx_wq_b8", "idx_wq_b_s", "idx_wproj")

    def write_keys(self, m, x, latent, positions, step) -> None:
        """A kv source's index keys: k_norm(wk(latent)), RoPE'd and quantized into its indexer-K cache (an
        index source reading another layer's keys writes none)."""
        if latent is None:
            return
        k_pre = bf16_linear(latent, m.w.idx_wk)
        ops.indexer_k_norm_rope_store(k_pre, positions, m.cos_sin_cache, m.w.idx_k_norm, m.eps, m.cache.idx,
                                      step.compressed_slots[m.ratio], m.ratio, False)

    def query_inputs(self, m, x, qr):
        """As ``PooledIndexer.query_inputs``, its head weights by ``bf16_linear``."""
        return index_heads(m, qr), bf16_linear(x, m.w.idx_wproj)

    def query(self, m, x, qr, positions):
        """As ``PooledIndexer.query``, its head weights by ``bf16_linear``."""
        return quantized_query(m, *self.query_inputs(m, x, qr), positions)

    def profile(self, m, x, qr, positions) -> None:
        self.query(m, x, qr, positions)

    def topk(self, m, x, qr, latent, positions, step, query=None) -> torch.Tensor:
        """The index source's top-k into the shared buffer (its rows of the step), candidate blocks first.
        ``query`` as in ``PooledIndexer.topk``."""
        self.write_keys(m, x, latent, positions, step)
        q8, wq = query if query is not None else self.query(m, x, qr, positions)
        topk = m.shared.topk[:x.shape[0]]
        hook = None
        if m.plan.candidates is not None:
            op = ops.select_candidate_blocks if m.plan.candidates == "select" else ops.mask_candidate_logits

            def hook(logits, lens, row0):
                op(logits, lens, m.shared.candidates[row0:row0 + logits.shape[0]], m.cfg.candidate_block_size)
        score_topk(m, q8, wq, step._built(m.plan.index_lens), step, topk, hook)
        return topk


INDEX_SOFTMAX_SCALE = 128 ** -0.5         # the indexer's logits scale (its head dim), folded into the weights


def index_heads(m, qr):
    """The indexer's query heads: wq_b of qr, bf16 [T, nh, 128]."""
    w, nh = m.w, m.cfg.index_n_heads
    return ops.fp8_linear(qr, w.idx_wq_b8, w.idx_wq_b_s).view(qr.shape[0], nh, 128)


def quantized_query(m, qi, head_weights, positions):
    """The query heads and their weights RoPE'd and quantized: (q fp8 [T, nh, 128], w fp32 [T, nh])."""
    nh = m.cfg.index_n_heads
    return ops.fused_indexer_q_rope_quant(positions, qi, m.cos_sin_cache, head_weights, INDEX_SOFTMAX_SCALE,
                                          nh ** -0.5)


def score_topk(m, q8, wq, lens, step, topk, logits_hook) -> None:
    """Logits of the indexer's query over the layer's indexer-K cache and each row's top-k into ``topk``.
    ``lens``: the entries each token sees; ``logits_hook(logits, ends, first_row)`` runs on each block of
    rows' logits before its top-k (V4.1's candidate blocks). Decode rows (the step's uniform decode
    requests) in one paged logits launch; the rest as prefill rows (``score_prefill``)."""
    T, nh, K, r = q8.shape[0], m.cfg.index_n_heads, m.cfg.index_topk, m.ratio
    idx_kv = m._idx
    nd, ndr, nn = step.num_decode_tokens, step.num_decodes, step.decode_query_len
    if not nn:
        nd = ndr = 0    # decode requests of different query lengths are scored as prefill rows are
    if nd:
        dl = lens[:nd].view(ndr, nn)
        logits = ops.fp8_paged_mqa_logits(q8[:nd].view(ndr, nn, nh, 128), idx_kv.unsqueeze(-2), wq[:nd], dl,
                                          step.compressed_block_table[:ndr],
                                          ops.get_paged_mqa_logits_metadata(dl, INDEX_BLOCK, 1),
                                          -(-m.max_model_len // r))
        if logits_hook is not None:
            logits_hook(logits, lens[:nd], 0)
        ops.top_k_per_row_decode(logits, nn, dl, topk[:nd], nd, logits.stride(0), logits.stride(1), K)
    if nd < T:
        score_prefill(q8, wq, idx_kv, step, topk, K, ndr, r, lens, logits_hook)


def score_prefill(q8, wq, idx_kv, step, topk, K: int, first_request: int, ratio: int, lens, logits_hook=None):
    """Rows of the requests from ``first_request`` on: each request's indexer-K entries gathered once,
    logits over them in row chunks. ``lens``: the entries each token sees, ``ratio`` the positions an entry
    stands for."""
    dev = q8.device
    qsl = step.query_start_loc_cpu if getattr(step, "query_start_loc_cpu", None) is not None \
        else step.query_start_loc.cpu()
    seq = step.seq_lens_cpu if getattr(step, "seq_lens_cpu", None) is not None else step.seq_lens.cpu()
    for b in range(first_request, step.num_requests):
        a, e = int(qsl[b]), int(qsl[b + 1])
        n = int(seq[b]) // ratio
        if e == a:
            continue
        k8 = torch.empty(max(n, 1), 128, dtype=torch.float8_e4m3fn, device=dev)
        ks = torch.empty(max(n, 1), dtype=torch.float32, device=dev)
        ops.cp_gather_indexer_k_quant_cache(idx_kv, k8[:n], ks[:n], step.compressed_block_table[b:b + 1],
                                            torch.tensor([0, n], dtype=torch.int32, device=dev))
        for r0 in range(a, e, INDEXER_PREFILL_ROWS):
            r1 = min(e, r0 + INDEXER_PREFILL_ROWS)
            ends = lens[r0:r1]
            starts = torch.zeros_like(ends)
            logits = ops.fp8_mqa_logits(q8[r0:r1], (k8, ks), wq[r0:r1], starts, ends)
            if logits_hook is not None:
                logits_hook(logits, ends, r0)
            ops.top_k_per_row_prefill(logits, starts, ends, topk[r0:r1], r1 - r0, logits.stride(0),
                                      logits.stride(1), K)


# the parts by the names a plan gives them (LayerPlan.compressor, LayerPlan.indexer)
COMPRESSORS = {"pooled": PooledCompressor(), "latent": LatentCompressor()}
INDEXERS = {"pooled": PooledIndexer(), "latent": LatentIndexer()}
