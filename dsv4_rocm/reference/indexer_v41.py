"""DeepSeek-V4.1 indexer (docs/math.md#v41-indexer): the indexer-K store and the two-level candidate
selection, the oracle of the Triton kernels.

``indexer_k_norm_rope_store`` (vLLM's, vllm/models/deepseek_v41/common/ops/indexer_k_store.py): the index
key of a compressed group is derived from the kv source's latent, k_pre = wk(latent) bf16 [T, 128]. For a
token at position p with (p + 1) % r == 0 and a slot >= 0:

    k  = bf16(RMSNorm(k_pre; k_norm weight, eps))            fp32 inside (reference.compressor's RMSNorm)
    z  = bf16(RoPE(k, (p // r) * r))                         GPT-J pairs on dims 64..127, fp32 inside
    FP8 record (132 B):   e = ceil(log2(max(max|z|, 1e-4) / 448)); 128 e4m3 bytes of z * 2^-e at
                          page + o * 128, fp32 2^e at page + bs * 128 + o * 4
    MXFP4 record (68 B):  4 blocks of 32 E2M1 values (reference.quant.mxfp4_quantize) at page + o * 64,
                          4 UE8M0 bytes at page + bs * 64 + o * 4

Records are row-major on every vendor (vLLM's ROCm build tiles them for aiter's readers; dsv4_rocm's own
readers take this layout everywhere).

Two-level selection. The candidate source scores every visible compressed entry of a token (logits row
r, entries [0, n_r)), groups them in blocks of ``block_size`` entries and publishes its candidate blocks
(``select_candidate_blocks``): the block holding the newest entry, (n_r - 1) // block_size, always, and
the C - 1 others with the largest block score (the maximum logit of the block, in the order of
``reference.indexer.order_key``: NaN above +inf), ties to the lower block id; ascending block ids, -1
after them. A row with at most C visible blocks publishes all of them. Later index sources
(``mask_candidate_logits``) set their logits outside the candidate blocks to -inf before their top-k.
"""
import torch

from .. import layout as L
from .compressor import _records, bf16_bits, rms_normalize
from .compressor_v41 import record_slots_ok, store_records
from .indexer import order_key

INDEX_DIM = 128
FP8_RECORD = (128, 4)        # (data bytes, scale bytes) of a token: 128 e4m3 + fp32 scale
MXFP4_RECORD = (64, 4)       # 64 bytes of E2M1 pairs + 4 UE8M0 scales


def record_layout(use_fp4_cache: bool) -> tuple:
    return MXFP4_RECORD if use_fp4_cache else FP8_RECORD


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                              kv_slot_mapping, compress_ratio, use_fp4_cache, mxfp4_n_per_tile=0) -> None:
    """vLLM's op (module docstring); the first len(kv_slot_mapping) tokens."""
    n = kv_slot_mapping.shape[0]
    if n == 0:
        return
    data_bytes, scale_bytes = record_layout(use_fp4_cache)
    cap = k_cache.shape[0] * k_cache.shape[1]
    p, ok = record_slots_ok(kv_slot_mapping, positions, n, cap, cos_sin_cache.shape[0], compress_ratio)
    t = torch.nonzero(ok).flatten()
    if t.numel() == 0:
        return
    k = bf16_bits(rms_normalize(k_pre[t].float(), rms_norm_weight, rms_norm_eps)).view(torch.bfloat16).float()
    data, scales = _records(k, (p[t] // compress_ratio) * compress_ratio, cos_sin_cache.float(), INDEX_DIM,
                            use_fp4_cache)
    store_records(k_cache, kv_slot_mapping[t].long(), data, scales, data_bytes + scale_bytes, data_bytes)


def visible_entries(lens, rows: int, ncols: int) -> torch.Tensor:
    """int64 [rows]: lens clamped into [0, ncols]."""
    return lens[:rows].long().clamp(0, ncols)


def block_keys(row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """int64 order keys (reference.indexer.order_key) of the maxima of the blocks of row[:n]."""
    nb = -(-n // block_size)
    k = order_key(row[:n])
    pad = torch.full((nb * block_size - n,), -1, dtype=k.dtype, device=k.device)
    return torch.cat([k, pad]).view(nb, block_size).amax(1)


def select_candidate_blocks(logits, lens, candidate_blocks, block_size: int) -> None:
    """candidate_blocks int32 [rows, C] of logits fp32 [rows, cols] (module docstring); row r sees
    lens[r] entries (clamped into [0, cols])."""
    rows, C = candidate_blocks.shape
    n = visible_entries(lens, rows, logits.shape[1])
    dev = candidate_blocks.device
    for r in range(rows):
        nr = int(n[r])
        nb = -(-nr // block_size)
        out = torch.full((C,), -1, dtype=torch.int64, device=dev)
        if nb <= C:
            out[:nb] = torch.arange(nb, device=dev)
        else:
            keys = block_keys(logits[r].float(), (nb - 1) * block_size, block_size)   # every block but the newest
            order = torch.sort(keys, descending=True, stable=True).indices            # ties: lower block first
            out[:C - 1] = torch.sort(order[:C - 1]).values
            out[C - 1] = nb - 1
        candidate_blocks[r] = out.to(candidate_blocks.dtype)


def mask_candidate_logits(logits, lens, candidate_blocks, block_size: int) -> None:
    """In place: logits[r, c] = -inf for c < lens[r] whose block c // block_size is not among
    candidate_blocks[r] (entries < 0 are none); columns at or past lens[r] are not touched."""
    rows = candidate_blocks.shape[0]
    n = visible_entries(lens, rows, logits.shape[1])
    cols = torch.arange(logits.shape[1], device=logits.device)
    for r in range(rows):
        nr = int(n[r])
        if nr == 0:
            continue
        keep = torch.zeros(-(-nr // block_size), dtype=torch.bool, device=logits.device)
        b = candidate_blocks[r].long()
        b = b[(b >= 0) & (b < keep.shape[0])]
        keep[b] = True
        drop = (cols < nr) & ~keep[(cols // block_size).clamp(max=keep.shape[0] - 1)]
        logits[r] = logits[r].masked_fill(drop, float("-inf"))


def pages_bytes(num_blocks: int, block_size: int, use_fp4_cache: bool, device=None) -> torch.Tensor:
    """A zeroed indexer-K cache [num_blocks, block_size, record] whose pages are padded to 576 B."""
    rec = sum(record_layout(use_fp4_cache))
    page = L.round_up(block_size * rec, L.PAGE_ALIGN)
    buf = torch.zeros(num_blocks, page, dtype=torch.uint8, device=device)
    return torch.as_strided(buf, (num_blocks, block_size, rec), (page, rec, 1))

