"""KV compressor of C4 / C128 layers (DSV4_SPEC §5): gated pooling, RMSNorm, RoPE, quant, insert.

Per token: kv = x W_kv^T, score = x W_gate^T + ape[pos % r] (fp32, coff*D each, coff = 2 for C4).
Entry j is produced by the token at p = (j+1)*r - 1 from the window
    C128: u in [128j, 128j+127], full vectors;
    C4:   u in [4j-4, 4j+3]; u < 4j uses the first D of kv/score, u >= 4j the second D; u < 0 masked.
    y = sum_u softmax_u(score)[u, c] * kv[u, c];  yh = RMSNorm(y; w, eps)  (fp32)
Targets: main (D=512): fp8_ds_mla record from bf(yh) NoPE + bf(RoPE(yh)) rope, at position j*r;
indexer (D=128): bf(RoPE(yh)) as one 128-block UE8M0 FP8 + fp32 scale.

State: a ring per request, ``state[slot, pos % (coff*r), :] = [kv | score]`` (fp32, 2*coff*D), so a
window that started in an earlier step (chunk or decode) is read back from it. Results do not depend on
how a request is split into steps.
"""
import torch

from .cache import encode_k_records, insert_k_records, indexer_k_insert, KV_EPS
from .norm import rmsnorm
from .quant import quantize_blocks
from .rope import rope_fwd


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def ring_size(ratio: int) -> int:
    return coff(ratio) * ratio


def new_state(num_slots: int, ratio: int, dim: int, device=None) -> torch.Tensor:
    c = coff(ratio)
    return torch.zeros(num_slots, c * ratio, 2 * c * dim, dtype=torch.float32, device=device)


def compressor_kv_score(x, w_kv_gate, ape, positions, ratio: int):
    """x bf16 [T, hidden], w_kv_gate bf16 [2*coff*D, hidden], ape fp32 [r, coff*D] -> (kv, score) fp32."""
    ks = x.float() @ w_kv_gate.float().t()
    kv, sc = ks.chunk(2, dim=-1)
    return kv, sc + ape.float()[positions.long() % ratio]


def _window(ratio: int, p: int):
    """Positions of the window of the boundary token at p and which half of coff*D each one uses."""
    if ratio == 4:
        j = p // 4
        return [(u, 0 if u < 4 * j else 1) for u in range(4 * j - 4, 4 * j + 4)]
    return [(u, 0) for u in range(p - 127, p + 1)]


def pool(kv_rows: torch.Tensor, sc_rows: torch.Tensor) -> torch.Tensor:
    """Softmax-gated sum over the window (dim 0), fp32."""
    return (torch.softmax(sc_rows, dim=0) * kv_rows).sum(0)


def compress_norm_rope_insert(kv, score, positions, query_start_loc, state, state_indices, norm_weight,
                              cos_sin_cache, compressed_slot_mapping, out_cache, block_size: int, ratio: int,
                              target: str = "main", eps: float = 1e-6):
    """Compress every boundary token of this step into out_cache, then save the step's tokens into the
    state rings. kv/score: [T, coff*D] fp32 for tokens grouped by request (query_start_loc)."""
    D = kv.shape[1] // coff(ratio)
    ring = ring_size(ratio)
    B = query_start_loc.shape[0] - 1
    for b in range(B):
        a, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        sidx = int(state_indices[b])
        if e == a or sidx < 0:          # empty or padding request: nothing to compress or save
            continue
        p0 = int(positions[a])
        for t in range(a, e):
            p = int(positions[t])
            slot = int(compressed_slot_mapping[t])
            if (p + 1) % ratio or slot < 0:
                continue
            kvs, scs = [], []
            for u, half in _window(ratio, p):
                if u < 0:
                    continue
                if u >= p0:
                    row_kv, row_sc = kv[t - (p - u)], score[t - (p - u)]
                else:
                    row = state[sidx, u % ring]
                    row_kv, row_sc = row[:kv.shape[1]], row[kv.shape[1]:]
                kvs.append(row_kv[half * D:(half + 1) * D])
                scs.append(row_sc[half * D:(half + 1) * D])
            y = pool(torch.stack(kvs), torch.stack(scs))
            yh = rmsnorm(y, norm_weight, eps)
            pos = torch.tensor([(p // ratio) * ratio], device=kv.device)
            roped = rope_fwd(yh.unsqueeze(0), pos, cos_sin_cache)[0]
            s = torch.tensor([slot], device=kv.device)
            if target == "main":
                k = torch.cat([yh[:448], roped[448:]]).to(torch.bfloat16).unsqueeze(0)
                insert_k_records(encode_k_records(k), out_cache, s, block_size)
            elif target == "indexer":
                z = roped.to(torch.bfloat16).float().unsqueeze(0)
                q, ex = quantize_blocks(z, 128, KV_EPS)
                indexer_k_insert(q, torch.ldexp(torch.ones(1, device=kv.device), ex[:, 0].float()), out_cache, s,
                                 block_size)
            else:
                raise ValueError(f"target must be 'main' or 'indexer', got {target!r}")
        for t in range(a, e):
            state[sidx, int(positions[t]) % ring] = torch.cat([kv[t], score[t]])
