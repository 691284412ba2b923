"""vLLM's per-step metadata for the DeepSeek-V4 layers, built into dsv4_rocm's StepMetadata.

vLLM hands each KV-cache group's builder a ``CommonAttentionMetadata`` (query_start_loc, seq_lens,
positions, the group's block table and slot mapping; decode requests first). A DeepSeek-V4 layer spans
two groups, so two builders feed it:

- ``SWAMetadataBuilder`` (the sliding-window cache of every layer, 64 tokens a block): the step's
  ``StepMetadata`` with the per-token sets every layer shares: token_to_req, is_valid_token, the window's
  slots and lengths, for all tokens, decode and prefill alike (every token attends from the fp8 pages).
  Decode requests may have different query lengths (speculative decode with a draft length per request):
  the split is vLLM's own (``split_decodes_and_prefills`` at 1 + num_speculative_tokens) and
  ``uniform_decode`` says whether their lengths agree, read from the host copy of query_start_loc.
- ``MLAMetadataBuilder`` (the compressed cache of the C4 or C128 layers, 256 positions a block): vLLM's
  metadata fields (vLLM's compressor writes the compressed cache at its ``slot_mapping``), made by
  dsv4_rocm's ops: the compressed slot mapping (``ops.get_compressed_slot_mapping``) and, for C128, the
  global compressed-cache slots of every token's visible entries (``ops.build_c128a_topk_metadata``).

Both write into buffers allocated once for ``max_num_batched_tokens`` rows and return views of them, so
a captured graph replays with the same addresses; nothing reads a device tensor on the host.
"""
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ... import layout as L
from ... import ops
from ...step import StepMetadata, c128_max_entries

from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata, DeepseekV4SparseMLAMetadataBuilder
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata,
                                       max_decode_query_len)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills


@dataclass
class SWAMetadata:
    """What the sliding-window group's builder hands the layers: the step, and the split vLLM uses."""
    step: StepMetadata
    block_size: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.step.slot_mapping


@dataclass
class MLAMetadata(DeepseekV4FlashMLAMetadata):
    """vLLM's compressed-group metadata, plus the C128 index set of every token (None for C4)."""
    c128_indices: Optional[torch.Tensor] = None     # int32 [T, Kmax]: global compressed-cache slots
    c128_lens: Optional[torch.Tensor] = None        # int32 [T]


def _hf_config(vllm_config):
    return vllm_config.model_config.hf_config


class SWAMetadataBuilder(AttentionMetadataBuilder[SWAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: Optional[int] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != L.SWA_BLOCK_SIZE:
            raise ValueError(f"kv_cache_spec.block_size: the SWA cache has {L.SWA_BLOCK_SIZE}-token blocks, "
                             f"got {kv_cache_spec.block_size}")
        self.window = _hf_config(vllm_config).sliding_window
        self.max_model_len = vllm_config.model_config.max_model_len
        self.decode_threshold = max_decode_query_len(vllm_config)
        n = vllm_config.scheduler_config.max_num_batched_tokens
        self.token_to_req = torch.empty(n, dtype=torch.int32, device=device)
        self.is_valid_token = torch.empty(n, dtype=torch.bool, device=device)
        self.swa_indices = torch.empty(n, self.window, dtype=torch.int32, device=device)
        self.swa_lens = torch.empty(n, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False, **_) -> SWAMetadata:
        cm = common_attn_metadata
        R = cm.num_reqs
        T = cm.num_actual_tokens            # rows past them (graph padding) are the layer's to zero
        if cm.positions is None:
            raise ValueError("common_attn_metadata.positions is None: the DeepSeek-V4 step needs positions")
        nd, npf, ndt, npt = split_decodes_and_prefills(cm, decode_threshold=self.decode_threshold)
        qsl_cpu = cm.query_start_loc_cpu[:R + 1]
        q_lens = qsl_cpu[1:nd + 1] - qsl_cpu[:nd]                  # host copy: no device sync
        uniform = nd == 0 or bool((q_lens == q_lens[0]).all())
        step = StepMetadata(cm.query_start_loc[:R + 1], cm.seq_lens[:R], cm.positions[:T], cm.slot_mapping[:T],
                            cm.block_table_tensor[:R], None, None, num_decodes=nd, num_decode_tokens=ndt,
                            max_model_len=self.max_model_len, window=self.window, query_start_loc_cpu=qsl_cpu,
                            seq_lens_cpu=cm.seq_lens_cpu_upper_bound, uniform_decode=uniform,
                            token_to_req=self.token_to_req[:T], is_valid_token=self.is_valid_token[:T],
                            swa_indices=self.swa_indices[:T], swa_lens=self.swa_lens[:T])
        step.build(ratios=())
        return SWAMetadata(step=step, block_size=L.SWA_BLOCK_SIZE, num_decodes=nd, num_prefills=npf,
                           num_decode_tokens=ndt, num_prefill_tokens=npt)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> SWAMetadata:
        return self.build(0, common_attn_metadata)


class MLAMetadataBuilder(DeepseekV4SparseMLAMetadataBuilder):
    """vLLM's compressed-group builder (its buffers, reorder threshold and metadata fields), its index sets
    made by dsv4_rocm's ops: the compressed slot mapping vLLM's compressor writes with, and for C128 one
    global set of visible entries for every token."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.entries_per_block = kv_cache_spec.block_size // self.compress_ratio
        if self.compress_ratio not in (4, 128) or \
                self.entries_per_block != L.compressed_block_size(self.compress_ratio):
            raise ValueError(f"kv_cache_spec: the compressed caches hold {L.LOGICAL_BLOCK_TOKENS} positions a "
                             f"block at ratio 4 or 128, got block_size {kv_cache_spec.block_size} at ratio "
                             f"{self.compress_ratio}")
        if self.compress_ratio == 128:
            n = vllm_config.scheduler_config.max_num_batched_tokens
            kmax = c128_max_entries(vllm_config.model_config.max_model_len)
            self.c128_indices = torch.empty(n, kmax, dtype=torch.int32, device=device)
            self.c128_lens = torch.empty(n, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLAMetadata:
        cm = common_attn_metadata
        T, R = cm.num_actual_tokens, cm.num_reqs
        req = cm.token_to_req_indices(self.req_id_per_token_buffer)      # vLLM's, shared by the step's groups
        block_table = cm.block_table_tensor
        slots = self.compressed_slot_mapping_buffer[:T]
        ops.get_compressed_slot_mapping(T, cm.query_start_loc[:R + 1], cm.seq_lens[:R], block_table[:R],
                                        self.entries_per_block, self.compress_ratio, out=slots)
        slots.masked_fill_(cm.slot_mapping[:T] < 0, -1)                   # padding tokens write nothing
        c128 = {}
        if self.compress_ratio == 128:
            idx, lens = self.c128_indices[:T], self.c128_lens[:T]
            ops.build_c128a_topk_metadata(cm.positions[:T], 128, T, req, block_table[:R], self.entries_per_block,
                                          cm.slot_mapping[:T], idx, lens, idx[:0], idx.shape[1])
            c128 = dict(c128_indices=idx, c128_lens=lens)
        return MLAMetadata(num_reqs=R, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
                           num_actual_tokens=T, query_start_loc=cm.query_start_loc, slot_mapping=slots,
                           block_table=block_table, req_id_per_token=req, block_size=self.kv_cache_spec.block_size,
                           topk_tokens=self.topk_tokens, **c128)
