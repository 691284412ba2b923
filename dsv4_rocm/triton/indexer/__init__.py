"""Triton kernels of the indexer stage (dsv4_rocm/ops/indexer.py, indexer_v41.py): query and key quantization,
the fp8 MQA logits, top-k, the DeepSeek-V4.1 candidate blocks."""
