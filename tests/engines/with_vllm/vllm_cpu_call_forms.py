"""vLLM 0.33.0's CPU DeepSeek-V4 kernels (``torch.ops._C.*_cpu``, vllm/_custom_ops.py) as calls of dsv4_rocm's ops.

vLLM's CPU build brings its own kernels for these call forms; its CUDA wheel, which the engine tier installs,
has none, so vLLM's tests of them (tests/kernels/test_deepseek_v4_cpu_kernels.py) skip. The engine tier's
plugin (vllm_suite.py) defines them in the ``_C`` namespace with ``SCHEMAS`` and the functions of the same
name here, so those tests run against dsv4_rocm's math instead. Each
function here only moves arguments between the two call forms (shapes, views, index dtypes); the math is
the op's:

| vLLM's CPU op | dsv4_rocm op | what the translation does |
|---|---|---|
| save_partial_states_cpu | ops.save_partial_states | block size, state width and ratio read from the shapes |
| compress_norm_rope_store_cpu, _indexer_cpu | ops.compress_norm_rope_store | see ``_compress`` |
| flash_mla_with_kvcache_cpu | ops.sparse_mla_decode | heads padded to 64 (vLLM's GPU layer pads q so), FlashMLA views of the pages |
| fused_qnorm_rope_kv_insert_cpu | ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert | argument order |
| inverse_gptj_rope_o_proj_cpu | reference.rope.rope_inv | inverse RoPE alone is no public op (the output path fuses it with the FP8 quant): the oracle that op is tested against |
| fp8_paged_mqa_logits_cpu | ops.fp8_paged_mqa_logits | next_n = 1 and the indexer-K views of the pages |
| fused_indexer_q_rope_quant_cpu | ops.fused_indexer_q_rope_quant | results copied into vLLM's output buffers |
"""
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference.rope import rope_inv

SCHEMAS = {
    "save_partial_states_cpu": "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
                               "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
    "compress_norm_rope_store_cpu": "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
                                    "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
                                    "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
                                    "int kv_cache_block_size, int compress_ratio) -> ()",
    "compress_norm_rope_store_indexer_cpu": "compress_norm_rope_store_indexer_cpu(Tensor state_cache, "
                                            "Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
                                            "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
                                            "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
    "flash_mla_with_kvcache_cpu": "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
                                  "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
                                  "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, "
                                  "float scale) -> ()",
    "fused_qnorm_rope_kv_insert_cpu": "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
                                      "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
                                      "int q_head_padded, float eps, int cache_block_size) -> Tensor",
    "inverse_gptj_rope_o_proj_cpu": "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
                                    "int rope_dim) -> Tensor",
    "fp8_paged_mqa_logits_cpu": "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
                                "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor",
    "fused_indexer_q_rope_quant_cpu": "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
                                      "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
                                      "float index_weights_softmax_scale, float index_weights_head_scale, "
                                      "Tensor(b!) index_weights_out) -> ()",
}


def save_partial_states_cpu(kv, score, ape, positions, state_cache, slot_mapping):
    ops.save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, state_cache.shape[1], kv.shape[1],
                            ape.shape[0])


def _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps, cos_sin_cache,
              kv_cache_2d, kv_cache_block_size, compress_ratio, head_dim):
    """vLLM's CPU compressor takes each token's window of state rows as explicit slots (``gather_slots``
    [T, coff * ratio], -1 = missing); ours finds them through a block table from the token's position. The
    translation copies each token's rows into blocks of its own (a missing row gets score -inf, so it
    weighs nothing, as in vLLM's kernel) and names them in a block table. The caller supplies every row of
    the window, so positions are shifted by one window (and the RoPE table with them): none of the rows
    then lies before position 0, which our op would leave out."""
    T, window = gather_slots.shape
    r = compress_ratio
    coff = window // r
    width = state_cache.shape[-1] // 2
    live = gather_slots >= 0
    s = gather_slots.clamp(min=0)
    rows = state_cache[s // state_cache.shape[1], s % state_cache.shape[1]]          # [T, window, 2 * width]
    rows[..., width:].masked_fill_(~live.unsqueeze(-1), float("-inf"))
    blocks = rows.reshape(T * coff, r, 2 * width)
    shift = window
    pos = positions.long() + shift
    table = torch.zeros(T, int(pos.max()) // r + 1, dtype=torch.int32)
    first = (pos - window + 1).clamp(min=0) // r
    for t in range(T):
        table[t] = t * coff + coff - 1
        for j in range(coff):
            if int(first[t]) + j < table.shape[1]:
                table[t, int(first[t]) + j] = t * coff + j
    state_slots = (torch.arange(T) * coff + coff - 1) * r + r - 1
    cos_sin = torch.cat([cos_sin_cache.new_zeros(shift, cos_sin_cache.shape[1]), cos_sin_cache]).float()
    record = L.TOKEN_BYTES if head_dim == L.HEAD_DIM else L.INDEXER_TOKEN_BYTES
    kv_cache = kv_cache_2d.unflatten(1, (kv_cache_block_size, record))
    main = head_dim == L.HEAD_DIM
    ops.compress_norm_rope_store(
        blocks, T, torch.arange(T, dtype=torch.int32), pos, state_slots, table, r, width, cos_sin, kv_cache,
        kv_slot_mapping, {}, head_dim, 64, r, coff == 2, False, rms_norm_weight, rms_norm_eps,
        64 if main else 128, 576 if main else 128, 8 if main else 4)


def compress_norm_rope_store_cpu(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps,
                                 cos_sin_cache, kv_cache_2d, kv_cache_block_size, compress_ratio):
    _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps, cos_sin_cache,
              kv_cache_2d, kv_cache_block_size, compress_ratio, L.HEAD_DIM)


def compress_norm_rope_store_indexer_cpu(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight,
                                         rms_norm_eps, cos_sin_cache, kv_cache_2d, kv_cache_block_size,
                                         compress_ratio):
    _compress(state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps, cos_sin_cache,
              kv_cache_2d, kv_cache_block_size, compress_ratio, L.INDEXER_DIM)


def _pages(cache_2d, block_size, record):
    """FlashMLA's [num_blocks, block_size, 1, record] view of vLLM's [num_blocks, page bytes] pages."""
    return cache_2d.unflatten(1, (block_size, record)).unsqueeze(-2)


def flash_mla_with_kvcache_cpu(out, q, window_cache_2d, window_slots, window_block_size, compressed_cache_2d,
                               compressed_slots, compressed_block_size, attn_sink, scale):
    T, H, D = q.shape
    heads = 64 if H <= 64 else 128
    qp = q.new_zeros(T, 1, heads, D)
    qp[:, 0, :H] = q
    sink = torch.cat([attn_sink.float(), attn_sink.new_full((heads - H,), float("-inf"), dtype=torch.float32)])
    idx = window_slots.to(torch.int32).unsqueeze(1)
    lens = torch.full((T,), idx.shape[-1], dtype=torch.int32)
    extra = (None, None, None)
    if compressed_slots.shape[1]:
        cidx = compressed_slots.to(torch.int32).unsqueeze(1)
        extra = (_pages(compressed_cache_2d, compressed_block_size, L.TOKEN_BYTES), cidx,
                 torch.full((T,), cidx.shape[-1], dtype=torch.int32))
    o, _ = ops.sparse_mla_decode(qp, _pages(window_cache_2d, window_block_size, L.TOKEN_BYTES), idx, lens, sink,
                                 *extra, scale)
    out.copy_(o[:, 0, :H])


def fused_qnorm_rope_kv_insert_cpu(q, kv, positions, swa_kv_cache_2d, slot_mapping, cos_sin_cache, q_head_padded, eps,
                                   cache_block_size):
    return ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, swa_kv_cache_2d, slot_mapping, positions,
                                                                 cos_sin_cache, q_head_padded, eps, cache_block_size)


def inverse_gptj_rope_o_proj_cpu(o, positions, cos_sin_cache, rope_dim):
    if cos_sin_cache.shape[-1] != rope_dim:
        raise ValueError(f"rope_dim {rope_dim} differs from the cos/sin table's {cos_sin_cache.shape[-1]} columns")
    return rope_inv(o, positions, cos_sin_cache)


def fp8_paged_mqa_logits_cpu(q_fp8, kvcache_fp8, weight, seq_lens, page_table, block_size, max_seq_len):
    B = q_fp8.shape[0]
    lens = seq_lens.to(torch.int32).contiguous()
    pages = _pages(kvcache_fp8, block_size, L.INDEXER_TOKEN_BYTES)
    return ops.fp8_paged_mqa_logits(q_fp8.unsqueeze(1), pages, weight, lens, page_table.to(torch.int32),
                                    ops.get_paged_mqa_logits_metadata(lens, block_size, 1), max_seq_len)[:B]


def fused_indexer_q_rope_quant_cpu(positions, index_q, index_q_cos_sin_cache, index_q_fp8, index_weights,
                                   index_weights_softmax_scale, index_weights_head_scale, index_weights_out):
    q8, w = ops.fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                                           index_weights_softmax_scale, index_weights_head_scale)
    index_q_fp8.copy_(q8)
    index_weights_out.copy_(w)

