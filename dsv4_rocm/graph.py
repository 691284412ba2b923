"""A decode step captured into a CUDA/HIP graph, as a serving engine runs it.

``DecodeGraph`` owns fixed input buffers for one batch shape (num_decodes requests of decode_query_len
tokens): hidden states, positions, query_start_loc, seq_lens, slot mapping and the three block tables.
It captures the step's metadata build and the layers' forward once; ``replay`` copies a new step's
inputs into the buffers and replays. Nothing inside syncs the host or depends on tensor values on the
host, so the captured kernels serve every later step of that shape.

The warm-up and the capture run with every slot set to -1 (padding): they compile the kernels and record
the launches without writing a byte of any cache.
"""
from typing import Sequence

import torch

from .attention import DeepseekV4Attention
from .step import StepMetadata


class DecodeGraph:
    def __init__(self, layers: Sequence[DeepseekV4Attention], num_decodes: int, decode_query_len: int,
                 swa_blocks: int, compressed_blocks: int, state_blocks: int, max_model_len: int,
                 ratios=(4, 128)):
        if not layers:
            raise ValueError("layers: at least one DeepseekV4Attention is needed")
        dev = layers[0].cos_sin_cache.device
        if dev.type != "cuda":
            raise ValueError(f"graph capture needs a GPU; the layers are on {dev}")
        self.layers, self.ratios = list(layers), tuple(ratios)
        B, T = num_decodes, num_decodes * decode_query_len
        hidden = layers[0].cfg.hidden_size
        i32 = dict(dtype=torch.int32, device=dev)
        self.x = torch.zeros(T, hidden, dtype=torch.bfloat16, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(0, T + 1, decode_query_len, **i32)
        self.seq_lens = torch.full((B,), decode_query_len, **i32)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self.swa_block_table = torch.zeros(B, swa_blocks, **i32)
        self.compressed_block_table = torch.zeros(B, compressed_blocks, **i32)
        self.state_block_table = torch.zeros(B, state_blocks, **i32)
        self.step = StepMetadata(self.query_start_loc, self.seq_lens, self.positions, self.slot_mapping,
                                 self.swa_block_table, self.compressed_block_table, self.state_block_table,
                                 num_decodes=B, num_decode_tokens=T, max_model_len=max_model_len,
                                 window=layers[0].cfg.sliding_window)
        self._run()                                    # compile every kernel outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self):
        self.step.build(self.ratios)
        return [layer(self.positions, self.x, self.step) for layer in self.layers]

    def replay(self, x, positions, query_start_loc, seq_lens, slot_mapping, swa_block_table,
               compressed_block_table, state_block_table):
        """Copy one decode step's inputs (the shapes of the capture) into the buffers and replay; returns
        the outputs of the layers (views of the graph's buffers, overwritten by the next replay)."""
        for dst, src, name in ((self.x, x, "x"), (self.positions, positions, "positions"),
                               (self.query_start_loc, query_start_loc, "query_start_loc"),
                               (self.seq_lens, seq_lens, "seq_lens"), (self.slot_mapping, slot_mapping, "slot_mapping"),
                               (self.swa_block_table, swa_block_table, "swa_block_table"),
                               (self.compressed_block_table, compressed_block_table, "compressed_block_table"),
                               (self.state_block_table, state_block_table, "state_block_table")):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name} has shape {tuple(src.shape)}, the graph was captured for {tuple(dst.shape)}")
            dst.copy_(src)
        self.graph.replay()
        return self.out
