"""Serving batches for the compressor tests: requests with their own state-cache and output-cache pages,
steps mixing prefill chunks and decode tokens, padding tokens, and vLLM's two calls per step."""
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import compressor as rc
from dsv4_rocm.reference.rope import build_cos_sin_cache

# (token_stride, scale_dim): "main" V40_584, "v41" V41_528, "fp4" V41_FP4_288 (head 512), "fp8" / "mxfp4" indexer
RECORD = {"main": (576, 8), "v41": (512, 16), "fp4": (256, 32), "fp8": (128, 4), "mxfp4": (64, 4)}
QUANT_BLOCK = {"main": 64, "v41": 32, "fp4": 16, "fp8": 128, "mxfp4": 32}
HEAD512 = ("main", "v41", "fp4")
# the head-512 targets' record formats in the layout vLLM's call (no kv_layout) writes: V4.1's interleaved
FORMATS = {"main": L.V40_584, "v41": L.with_layout(L.V41_528), "fp4": L.with_layout(L.V41_FP4_288)}


def _offsets(S, off):
    """(data offset, scale offset) of record ``off`` inside a page of S's output cache."""
    if S.target in FORMATS:
        f = FORMATS[S.target]
        return L.data_offset(f, off), L.record_scale_offset(f, S.bs, off)
    ts, sd = RECORD[S.target]
    return off * ts, S.bs * ts + off * sd


@dataclass
class Setup:
    ratio: int
    target: str                  # "main" | "v41" | "fp4" | "fp8" | "mxfp4"
    kv_score: list               # per request fp32 [len, 2 * coff * D] (the projection's output)
    ape: torch.Tensor
    norm_w: torch.Tensor
    cos_sin: torch.Tensor
    state: torch.Tensor          # [ns, sbs, 2 * coff * D] fp32, padded page stride
    state_bt: torch.Tensor       # int32 [B, cols]
    pages: torch.Tensor          # uint8 [nb, page stride]
    comp_bt: torch.Tensor        # int32 [B, cols]

    @property
    def D(self):
        return 512 if self.target in HEAD512 else 128

    @property
    def bs(self):                # entries per output page
        return 256 // self.ratio if self.target in HEAD512 else 64

    @property
    def record(self):
        return sum(RECORD[self.target])

    @property
    def kv_cache(self):
        return rc.kv_cache_view(self.pages, self.bs, self.record)

    def clone(self):
        return Setup(self.ratio, self.target, self.kv_score, self.ape, self.norm_w, self.cos_sin, self.state.clone(),
                     self.state_bt, self.pages.clone(), self.comp_bt)

    def to(self, device):
        """A copy on another device (the state cache keeps its padded page stride)."""
        state = rc.new_state_cache(self.state.shape[0], self.ratio, self.D, device)
        state.copy_(self.state)
        mv = lambda t: t.to(device, copy=True)     # noqa: E731
        return Setup(self.ratio, self.target, [mv(t) for t in self.kv_score], mv(self.ape), mv(self.norm_w),
                     mv(self.cos_sin), state, mv(self.state_bt), mv(self.pages), mv(self.comp_bt))


def make_setup(ratio, target, lens, device="cpu", seed=0, garbage=True, scale=1.0):
    """Random requests of the given lengths; pages of different requests interleaved; the output pages
    (and the state cache) start as random bytes / values when ``garbage``."""
    g = torch.Generator().manual_seed(seed)
    D = 512 if target in HEAD512 else 128
    c = rc.coff(ratio)
    kv_score = [(torch.randn(n, 2 * c * D, generator=g) * scale).to(device) for n in lens]
    ape = (torch.randn(ratio, c * D, generator=g) * 0.5).to(device)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().to(device)
    cos_sin = build_cos_sin_cache(160000.0, max(lens) + 1, device=device)
    sbs = rc.state_block_size(ratio)
    ncols = -(-max(lens) // sbs)
    ns = len(lens) * ncols + 3
    state = rc.new_state_cache(ns, ratio, D, device)
    if garbage:
        state.copy_(torch.randn(state.shape, generator=g).to(device))
    state_bt = torch.randperm(ns, generator=g)[:len(lens) * ncols].view(len(lens), ncols).to(torch.int32)
    bs = 256 // ratio if target in HEAD512 else 64
    ccols = -(-(max(lens) // ratio + 1) // bs)
    nb = len(lens) * ccols + 2
    ts, sd = RECORD[target]
    pb = L.round_up(bs * (ts + sd), 576)
    pages = torch.randint(0, 256, (nb, pb), generator=g, dtype=torch.uint8) if garbage else \
        torch.zeros(nb, pb, dtype=torch.uint8)
    comp_bt = torch.randperm(nb, generator=g)[:len(lens) * ccols].view(len(lens), ccols).to(torch.int32)
    return Setup(ratio, target, kv_score, ape, norm_w, cos_sin, state, state_bt.to(device), pages.to(device),
                 comp_bt.to(device))


def step_inputs(S, ranges, pad=0):
    """Token arrays of one step: ``ranges`` maps request -> (start, end) positions; ``pad`` padding tokens
    (state slot -1, cache slot -1, garbage positions / request ids) are appended."""
    dev = S.state.device
    sbs = rc.state_block_size(S.ratio)
    toks = [(b, p) for b, (a, e) in sorted(ranges.items()) for p in range(a, e)]
    req = torch.tensor([b for b, _ in toks] + [7] * pad, dtype=torch.int32, device=dev)
    pos = torch.tensor([p for _, p in toks] + [3] * pad, dtype=torch.int64, device=dev)
    n = len(toks)
    r, p = req[:n].long(), pos[:n]
    sslots = torch.cat([S.state_bt[r, p // sbs].long() * sbs + p % sbs, torch.full((pad,), -1, device=dev)])
    j = p // S.ratio
    ks = S.comp_bt[r, j // S.bs].long() * S.bs + j % S.bs
    kslots = torch.cat([torch.where((p + 1) % S.ratio == 0, ks, -1), torch.full((pad,), -1, device=dev)])
    rows = [S.kv_score[b][q] for b, q in toks] + [torch.full_like(S.kv_score[0][0], float("nan"))] * pad
    kv_score = torch.stack(rows) if rows else S.kv_score[0][:0]
    return kv_score, pos, req, sslots, kslots


def compress_kwargs(S, n, req, pos, sslots, kslots):
    ts, sd = RECORD[S.target]
    c = rc.coff(S.ratio)
    return dict(state_cache=S.state, num_actual=n, token_to_req_indices=req, positions=pos, slot_mapping=sslots,
                block_table=S.state_bt, block_size=rc.state_block_size(S.ratio), state_width=c * S.D,
                cos_sin_cache=S.cos_sin, kv_cache=S.kv_cache, k_cache_metadata=SimpleNamespace(slot_mapping=kslots),
                pdl_kwargs={}, head_dim=S.D, rope_head_dim=64, compress_ratio=S.ratio, overlap=S.ratio == 4,
                use_fp4_cache=S.target == "mxfp4", rms_norm_weight=S.norm_w, rms_norm_eps=1e-6,
                quant_block=QUANT_BLOCK[S.target], token_stride=ts, scale_dim=sd)


def run_step(S, ranges, pad=0):
    """vLLM's DeepseekCompressor.forward for one step: split, save_partial_states, compress_norm_rope_store."""
    kv_score, pos, req, sslots, kslots = step_inputs(S, ranges, pad)
    c = rc.coff(S.ratio)
    kv, score = kv_score.split([c * S.D, c * S.D], dim=-1)
    ops.save_partial_states(kv=kv, score=score, ape=S.ape, positions=pos, state_cache=S.state, slot_mapping=sslots,
                            block_size=rc.state_block_size(S.ratio), state_width=c * S.D, compress_ratio=S.ratio,
                            pdl_kwargs={})
    ops.compress_norm_rope_store_triton(**compress_kwargs(S, sslots.shape[0], req, pos, sslots, kslots))


def run_schedule(S, schedule, pad=0):
    for ranges in schedule:
        run_step(S, ranges, pad)
    return S


def entry_slot(S, b, j):
    return int(S.comp_bt[b, j // S.bs]) * S.bs + j % S.bs


def read_entry(S, b, j):
    """(data bytes, scale bytes) of request b's compressed entry j."""
    ts, sd = RECORD[S.target]
    slot = entry_slot(S, b, j)
    page, off = S.pages[slot // S.bs], slot % S.bs
    d0, s0 = _offsets(S, off)
    return page[d0:d0 + ts], page[s0:s0 + sd]


def written_mask(S, lens):
    """Bytes of the output pages that the requests' entries own."""
    ts, sd = RECORD[S.target]
    m = torch.zeros_like(S.pages, dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(n // S.ratio):
            slot = entry_slot(S, b, j)
            page, off = slot // S.bs, slot % S.bs
            d0, s0 = _offsets(S, off)
            m[page, d0:d0 + ts] = True
            m[page, s0:s0 + sd] = True
    return m
