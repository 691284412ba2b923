"""One scheduler step as vLLM's metadata builders hand it to the attention layers, and the index sets all
the layers of a step share.

The batch follows vLLM's conventions: requests are ordered decode-first; the first ``num_decodes``
requests are decode requests with ``num_decode_tokens // num_decodes`` tokens each (1, or 1 + speculative
tokens), the rest are prefill (or chunked-prefill) requests; padding tokens have slot -1. Positions are
absolute. Block tables are vLLM's: the SWA cache in 64-token blocks, the compressed caches in blocks of 256
token positions (64 entries of C4, 2 of C128; the indexer-K cache shares the C4 table), the compressor
state in blocks of 4 (C4) or 8 (C128) token positions.

``StepMetadata.build`` runs the metadata ops once per step (what vLLM's builders do), into tensors whose
shapes depend only on the batch shape, so a decode step builds and runs inside a CUDA/HIP graph. The
host integers (request and token counts) come from the scheduler, never from device tensors.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from . import layout as L
from . import ops
from .reference.compressor import state_block_size


@dataclass
class StepMetadata:
    query_start_loc: torch.Tensor          # int32 [B + 1]
    seq_lens: torch.Tensor                 # int32 [B]: tokens of each request after this step
    positions: torch.Tensor                # int64 [T]
    slot_mapping: torch.Tensor             # int64 [T]: SWA cache slot of each token, -1 = padding
    swa_block_table: torch.Tensor          # int32 [B, *]
    compressed_block_table: torch.Tensor   # int32 [B, *]
    state_block_table: torch.Tensor        # int32 [B, *]
    num_decodes: int                       # decode requests (first in the batch)
    num_decode_tokens: int                 # their tokens (first in the batch)
    max_model_len: int
    window: int = 128
    query_start_loc_cpu: Optional[torch.Tensor] = None   # host copies the scheduler has (prefill planning)
    seq_lens_cpu: Optional[torch.Tensor] = None
    # built once per step by ``build`` (shared by every layer of the step)
    token_to_req: Optional[torch.Tensor] = None        # int32 [T]
    is_valid_token: Optional[torch.Tensor] = None      # bool [T]
    swa_indices: Optional[torch.Tensor] = None         # int32 [T, window]: SWA cache slots of each token
    swa_lens: Optional[torch.Tensor] = None            # int32 [T]
    compressed_slots: Dict[int, torch.Tensor] = field(default_factory=dict)  # ratio -> int64 [T]
    state_slots: Dict[int, torch.Tensor] = field(default_factory=dict)       # ratio -> int64 [T]
    c128_indices: Optional[torch.Tensor] = None        # int32 [T, Kmax]: C128 cache slots of each token
    c128_lens: Optional[torch.Tensor] = None           # int32 [T]
    indexer_lens: Optional[torch.Tensor] = None        # int32 [T]: compressed entries each token sees (C4)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_query_len(self) -> int:
        return self.num_decode_tokens // self.num_decodes if self.num_decodes else 0

    def build(self, ratios=(4, 128)) -> "StepMetadata":
        """Fill the shared index sets for the layer ratios of the model (no host sync)."""
        T, dev = self.num_tokens, self.positions.device
        if self.num_decodes and self.num_decode_tokens % self.num_decodes:
            raise ValueError(f"num_decode_tokens {self.num_decode_tokens} is not a multiple of num_decodes "
                             f"{self.num_decodes}: decode requests must have the same query length")
        comp = {r: ops.get_compressed_slot_mapping(T, self.query_start_loc, self.seq_lens, self.compressed_block_table,
                                                   L.compressed_block_size(r), r) for r in ratios}
        if ops.backend_for("compute_swa_indices_and_lens", dev) == "triton":
            from .triton.step_index_sets import step_index_sets      # one launch (masks comp in place)
            sets = step_index_sets(self.query_start_loc, self.positions, self.slot_mapping, self.state_block_table,
                                   comp)
        else:
            sets = index_sets_torch(self.query_start_loc, self.positions, self.slot_mapping, self.state_block_table,
                                    comp)
        self.token_to_req, self.is_valid_token, self.state_slots, lens = sets
        self.compressed_slots = comp
        if 4 in ratios:
            self.indexer_lens = lens
        self.swa_indices = torch.empty(T, self.window, dtype=torch.int32, device=dev)
        self.swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
        ops.compute_swa_indices_and_lens(self.swa_indices, self.swa_lens, self.window, self.query_start_loc,
                                         self.seq_lens, self.token_to_req, self.is_valid_token, self.swa_block_table,
                                         L.SWA_BLOCK_SIZE)
        if 128 in ratios:
            kmax = c128_max_entries(self.max_model_len)
            self.c128_indices = torch.empty(T, kmax, dtype=torch.int32, device=dev)
            self.c128_lens = torch.empty(T, dtype=torch.int32, device=dev)
            # every token attends from the pages (decode and prefill alike): global slots for all of them
            ops.build_c128a_topk_metadata(self.positions, 128, T, self.token_to_req, self.compressed_block_table,
                                          L.compressed_block_size(128), self.slot_mapping, self.c128_indices,
                                          self.c128_lens, self.c128_indices[:0], kmax)
        return self


def index_sets_torch(query_start_loc, positions, slot_mapping, state_block_table, compressed_slots: dict):
    """The per-token index sets of a step with torch ops (the CPU path, and the oracle of
    ``dsv4_rocm/triton/step_index_sets.py``): (token_to_req int32, is_valid_token bool, state_slots {ratio:
    int64}, indexer_lens int32 or None); ``compressed_slots`` (ratio -> slots) get -1 at invalid tokens."""
    T, R = positions.shape[0], query_start_loc.shape[0] - 1
    lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    token_to_req = torch.repeat_interleave(torch.arange(R, device=positions.device, dtype=torch.int32), lens,
                                          output_size=T)
    valid = slot_mapping >= 0
    state_slots = {}
    for r in compressed_slots:
        compressed_slots[r] = compressed_slots[r].masked_fill(~valid, -1)
        sbs = state_block_size(r)
        col = torch.where(valid, positions // sbs, 0)   # padding reads column 0
        blk = state_block_table[token_to_req.long(), col].long()
        state_slots[r] = torch.where(valid, blk * sbs + positions % sbs, -1)
    indexer_lens = torch.where(valid, (positions + 1) // 4, 0).to(torch.int32) if 4 in compressed_slots else None
    return token_to_req, valid, state_slots, indexer_lens


def c128_max_entries(max_model_len: int) -> int:
    """Kmax = round_up(ceil(max_model_len / 128), 128): the C128 index width vLLM sizes its buffers with."""
    return -(-(-(-max_model_len // 128)) // 128) * 128
