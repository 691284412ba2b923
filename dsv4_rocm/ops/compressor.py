"""KV compressor of C4 / C128 layers."""
import torch

from .. import _checks as C
from ..reference import compressor as _rcomp
from ._dispatch import register, run as _run

__all__ = ["compressor_kv_score", "fused_compress_norm_rope_insert"]

register("compressor_kv_score", _rcomp.compressor_kv_score)
register("fused_compress_norm_rope_insert", _rcomp.compress_norm_rope_insert)


def compressor_kv_score(x, w_kv_gate, ape, positions, ratio: int):
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("w_kv_gate", w_kv_gate, shape=(None, x.shape[1]))
    C.tensor("ape", ape, shape=(ratio, w_kv_gate.shape[0] // 2))
    C.tensor("positions", positions, dtype=C.INDEX, shape=(x.shape[0],))
    return _run("compressor_kv_score", x.device, x, w_kv_gate, ape, positions, ratio)


def fused_compress_norm_rope_insert(kv, score, positions, query_start_loc, state, state_indices, norm_weight,
                                    cos_sin_cache, compressed_slot_mapping, out_cache, block_size: int, ratio: int,
                                    target: str = "main", eps: float = 1e-6):
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    if target not in ("main", "indexer"):
        raise ValueError(f"target must be 'main' or 'indexer', got {target!r}")
    D = 512 if target == "main" else 128
    c = _rcomp.coff(ratio)
    C.tensor("kv", kv, dtype=torch.float32, shape=(None, c * D))
    C.tensor("score", score, dtype=torch.float32, shape=kv.shape)
    C.tensor("state", state, dtype=torch.float32, shape=(None, _rcomp.ring_size(ratio), 2 * c * D))
    C.tensor("query_start_loc", query_start_loc, dtype=C.INDEX, dim=1)
    C.tensor("state_indices", state_indices, dtype=C.INDEX, shape=(query_start_loc.shape[0] - 1,))
    C.tensor("norm_weight", norm_weight, shape=(D,))
    C.cos_sin(cos_sin_cache, positions)
    C.slots("compressed_slot_mapping", compressed_slot_mapping, out_cache, block_size, indexer=target == "indexer")
    if int(query_start_loc[-1]) != kv.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])}, kv has {kv.shape[0]} tokens")
    if state_indices.numel() and int(state_indices.max()) >= state.shape[0]:
        raise ValueError(f"state_indices: {int(state_indices.max())} >= {state.shape[0]} state slots")
    return _run("fused_compress_norm_rope_insert", kv.device, kv, score, positions, query_start_loc, state,
                state_indices, norm_weight, cos_sin_cache, compressed_slot_mapping, out_cache, block_size, ratio,
                target, eps)
