"""One scheduler step as vLLM's metadata builders hand it to the attention layers, and the index sets all
the layers of a step share.

The batch follows vLLM's conventions: requests are ordered decode-first; the first ``num_decodes``
requests are decode requests with ``num_decode_tokens // num_decodes`` tokens each (1, or 1 + speculative
tokens), the rest are prefill (or chunked-prefill) requests; padding tokens have slot -1. Positions are
absolute. Block tables are vLLM's: the SWA cache in 64-token blocks, the compressed caches in blocks of 256
token positions (64 entries of C4, 2 of C128; the indexer-K cache shares the C4 table), the compressor
state in blocks of 4 (C4) or 8 (C128) token positions.

``StepMetadata.build`` computes the index sets once per step (what vLLM's builders do), into tensors whose
shapes depend only on the batch shape, so a decode step builds and runs inside a CUDA/HIP graph. On a GPU
that is one kernel launch (dsv4_rocm/triton/step_index_sets.py); ``build_from_ops`` composes the same sets
from the public metadata ops, the reference the kernel is tested against. Padding tokens (slot -1, or past
the last request's query range) get token_to_req -1 where outside every request, lengths 0 and rows of
-1. The host integers (request and token counts) come from the scheduler, never from device tensors.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from . import layout as L
from . import ops
from .reference import metadata_v41 as _rm41
from .reference.compressor import state_block_size
from .reference.compressor_v41 import RING_CAPACITY
from .reference.metadata import slot_mapping_from_block_table

V41_RATIOS = (1, 2)               # DeepSeek-V4.1's compressed layers (ratio 0 is the sliding window alone)
V41_COMPRESSED_BLOCK = 64         # V4.1 compressed / indexer-K entries a page (vLLM: cache block_size entries)


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
    # DeepSeek-V4.1 (ratios 1, 2): compressed_slots[r] as above (64 entries a page), state_slots[2] the
    # compressor ring's slots, v41_lens[r] the entries each token sees (dsv4_rocm/reference/metadata_v41.py)
    v41_lens: Dict[int, torch.Tensor] = field(default_factory=dict)       # ratio -> int32 [T]

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
        """Fill the shared index sets for the layer ratios of the model (no host sync): one launch of the
        step's index-set kernel (dsv4_rocm/triton/step_index_sets.py) where the metadata ops run Triton,
        else ``build_from_ops``. The results are the same; the kernel writes into the buffers of the
        previous build when the step's shape is unchanged (a captured graph keeps their addresses)."""
        ratios = self._check(ratios)
        if ops.backend_for("compute_swa_indices_and_lens", self.positions.device) == "triton":
            return self.build_fused(ratios)
        return self.build_from_ops(ratios)

    def build_fused(self, ratios=(4, 128)) -> "StepMetadata":
        """``build`` in one kernel launch (a GPU, or CPU tensors under TRITON_INTERPRET=1)."""
        from .triton.step_index_sets import step_index_sets
        ratios, v41 = _split(self._check(ratios))
        T, dev = self.num_tokens, self.positions.device

        def buf(old, shape, dtype):
            if old is not None and tuple(old.shape) == shape and old.dtype == dtype and old.device == dev:
                return old
            return torch.empty(shape, dtype=dtype, device=dev)
        self.token_to_req = buf(self.token_to_req, (T,), torch.int32)
        self.is_valid_token = buf(self.is_valid_token, (T,), torch.bool)
        self.swa_indices = buf(self.swa_indices, (T, self.window), torch.int32)
        self.swa_lens = buf(self.swa_lens, (T,), torch.int32)
        for r in ratios:
            self.compressed_slots[r] = buf(self.compressed_slots.get(r), (T,), torch.int64)
            self.state_slots[r] = buf(self.state_slots.get(r), (T,), torch.int64)
        c4 = c128 = None
        if 4 in ratios:
            self.indexer_lens = buf(self.indexer_lens, (T,), torch.int32)
            c4 = (self.compressed_slots[4], self.state_slots[4], self.indexer_lens)
        if 128 in ratios:
            self.c128_indices = buf(self.c128_indices, (T, c128_max_entries(self.max_model_len)), torch.int32)
            self.c128_lens = buf(self.c128_lens, (T,), torch.int32)
            c128 = (self.compressed_slots[128], self.state_slots[128], self.c128_indices, self.c128_lens)
        step_index_sets(self.query_start_loc, self.seq_lens, self.positions, self.slot_mapping, self.swa_block_table,
                        self.compressed_block_table, self.state_block_table, self.token_to_req, self.is_valid_token,
                        self.swa_indices, self.swa_lens, c4, c128)
        return self._build_v41(v41, ops)

    def build_from_ops(self, ratios=(4, 128), impl=ops) -> "StepMetadata":
        """``build`` as a composition of the public metadata ops (``impl``: dsv4_rocm.ops, or the oracle
        module dsv4_rocm.reference.metadata, which skips the ops' value checks) and torch: the reference
        the one-launch kernel is tested against. A token outside every request's query range has
        token_to_req -1; a state slot whose request, position, column or page is invalid is -1."""
        ratios, v41 = _split(self._check(ratios))
        T, R, dev = self.num_tokens, self.num_requests, self.positions.device
        req = torch.searchsorted(self.query_start_loc, torch.arange(T, device=dev, dtype=torch.int32), right=True,
                                 out_int32=True) - 1
        self.token_to_req = req.masked_fill(req == R, -1)
        self.is_valid_token = self.slot_mapping >= 0
        self.swa_indices = torch.empty(T, self.window, dtype=torch.int32, device=dev)
        self.swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
        impl.compute_swa_indices_and_lens(self.swa_indices, self.swa_lens, self.window, self.query_start_loc,
                                          self.seq_lens, self.token_to_req, self.is_valid_token, self.swa_block_table,
                                          L.SWA_BLOCK_SIZE)
        for r in ratios:
            slots = impl.get_compressed_slot_mapping(T, self.query_start_loc, self.seq_lens,
                                                     self.compressed_block_table, L.compressed_block_size(r), r)
            self.compressed_slots[r] = slots.masked_fill(~self.is_valid_token, -1)
            state = slot_mapping_from_block_table(self.positions, self.token_to_req, self.state_block_table,
                                                  state_block_size(r))
            self.state_slots[r] = state.masked_fill(~self.is_valid_token, -1)
        if 4 in ratios:
            seen = self.is_valid_token & (self.positions >= 0)
            self.indexer_lens = torch.where(seen, (self.positions + 1) // 4, 0).to(torch.int32)
        if 128 in ratios:
            kmax = c128_max_entries(self.max_model_len)
            self.c128_indices = torch.empty(T, kmax, dtype=torch.int32, device=dev)
            self.c128_lens = torch.empty(T, dtype=torch.int32, device=dev)
            # every token attends from the pages (decode and prefill alike): global slots for all of them
            impl.build_c128a_topk_metadata(self.positions, 128, T, self.token_to_req, self.compressed_block_table,
                                           L.compressed_block_size(128), self.slot_mapping, self.c128_indices,
                                           self.c128_lens, self.c128_indices[:0], kmax)
        return self._build_v41(v41, impl)

    def _build_v41(self, ratios, impl) -> "StepMetadata":
        """The DeepSeek-V4.1 sets of ``ratios`` (1, 2) in one launch of v41_step_index_sets (the oracle
        module's function when ``impl`` is not dsv4_rocm.ops), into the buffers of the previous build when
        the step's shape is unchanged."""
        if not ratios:
            return self
        T, dev = self.num_tokens, self.positions.device

        def buf(d, r, dtype):
            old = d.get(r)
            if old is None or old.shape != (T,) or old.dtype != dtype or old.device != dev:
                d[r] = torch.empty(T, dtype=dtype, device=dev)
            return d[r]
        outs = {r: (buf(self.compressed_slots, r, torch.int64), buf(self.v41_lens, r, torch.int32))
                + ((buf(self.state_slots, r, torch.int64),) if r == 2 else ()) for r in ratios}
        fn = impl.v41_step_index_sets if impl is ops else _rm41.v41_step_index_sets
        fn(self.positions, self.token_to_req, self.is_valid_token, self.compressed_block_table, self.state_block_table,
           V41_COMPRESSED_BLOCK, RING_CAPACITY, outs.get(1), outs.get(2))
        return self

    def _check(self, ratios) -> tuple:
        """Structure of the step (ValueError naming the argument before any write); returns the ratios."""
        ratios = tuple(ratios)
        for r in ratios:
            if r not in (4, 128) + V41_RATIOS or isinstance(r, bool):
                raise ValueError(f"ratios: compress ratios are 4 and 128 (DeepSeek-V4), 1 and 2 (V4.1), got {r!r}")
        if self.num_decodes and self.num_decode_tokens % self.num_decodes:
            raise ValueError(f"num_decode_tokens {self.num_decode_tokens} is not a multiple of num_decodes "
                             f"{self.num_decodes}: decode requests must have the same query length")
        T, R = self.num_tokens, self.num_requests
        for name, t, dtype, shape in (("query_start_loc", self.query_start_loc, torch.int32, (R + 1,)),
                                      ("seq_lens", self.seq_lens, torch.int32, (R,)),
                                      ("positions", self.positions, torch.int64, (T,)),
                                      ("slot_mapping", self.slot_mapping, torch.int64, (T,))):
            if t.dtype != dtype or tuple(t.shape) != shape or (t.numel() > 1 and t.stride(0) != 1):
                raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        for name in ("swa_block_table", "compressed_block_table", "state_block_table"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != R or (t.shape[1] > 1 and t.stride(1) != 1):
                raise ValueError(f"{name} must be an int32 [{R}, blocks] tensor with contiguous rows (one row per "
                                 f"request), got {t.dtype} {tuple(t.shape)}")
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "swa_block_table", "compressed_block_table",
                     "state_block_table"):
            if getattr(self, name).device != self.positions.device:
                raise ValueError(f"{name} is on {getattr(self, name).device}, positions on {self.positions.device}")
        return ratios


def _split(ratios) -> tuple:
    """(V4.0 ratios, V4.1 ratios) of a checked ratio tuple."""
    return tuple(r for r in ratios if r not in V41_RATIOS), tuple(r for r in ratios if r in V41_RATIOS)


def c128_max_entries(max_model_len: int) -> int:
    """Kmax = round_up(ceil(max_model_len / 128), 128): the C128 index width vLLM sizes its buffers with."""
    return -(-(-(-max_model_len // 128)) // 128) * 128
