"""Inputs of the DeepSeek-V4.1 op tests: batches of request chunks, and values every kernel conversion
(bf16, e4m3, e2m1) represents exactly, so that even the Triton interpreter (which does not round those
conversions like the hardware) must give the oracle's bytes."""
import torch

from dsv4_rocm.reference.quant import e4m3_decode


def batch(starts, lens, ring_blocks=None, capacity=8, device="cpu"):
    """A step of len(starts) request chunks: request b has lens[b] tokens at positions starts[b]... Returns
    (query_start_loc int32 [R + 1], positions int64 [T], token_to_req int32 [T], ring slots int64 [T]:
    ring_blocks[b] * capacity + p % capacity, ring block b + 1 by default)."""
    R = len(starts)
    ring_blocks = ring_blocks if ring_blocks is not None else [b + 1 for b in range(R)]
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).long()
    t2r = torch.repeat_interleave(torch.arange(R), torch.tensor(lens)).int()
    ring = torch.tensor([ring_blocks[b] for b in t2r.tolist()]).long() * capacity + pos % capacity
    return qsl.to(device), pos.to(device), t2r.to(device), ring.to(device)


def quarter_turn_table(rows: int, seed: int = 0) -> torch.Tensor:
    """fp32 [rows, 64] cos/sin rows of random multiples of 90 degrees: RoPE with it only permutes and negates
    values, so its results are exact in any precision."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 4, (rows, 32), generator=g)
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[q]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[q]
    return torch.cat([cos, sin], 1)


def e4m3_grid(shape, gen, block: int = 64) -> torch.Tensor:
    """fp32 values on the e4m3 grid (normal and subnormal codes, both signs) times 2^s per block of
    ``block``, one element of each block at +-448 * 2^s: UE8M0 fp8 quantization of a block then divides by
    2^s exactly and every value is an e4m3 code."""
    codes = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)
    codes = codes | (torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)
    v = e4m3_decode(codes)
    v = v.reshape(*shape[:-1], shape[-1] // block, block)
    v[..., 0] = 448.0 * torch.where(torch.rand(v.shape[:-1], generator=gen) < 0.5, -1.0, 1.0)
    s = torch.randint(-12, 4, v.shape[:-1] + (1,), generator=gen).float()
    return (v * torch.exp2(s)).reshape(shape)


def e2m1_grid(shape, gen, block: int = 32) -> torch.Tensor:
    """fp32 values on the E2M1 grid times 2^s per block, one of each block at +-6 * 2^s (exact MXFP4)."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = mags[torch.randint(0, 8, shape, generator=gen)] * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    v = v.reshape(*shape[:-1], shape[-1] // block, block)
    v[..., 0] = 6.0
    s = torch.randint(-10, 4, v.shape[:-1] + (1,), generator=gen).float()
    return (v * torch.exp2(s)).reshape(shape)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
