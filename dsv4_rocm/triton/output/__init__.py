"""Triton kernels of the output stage (dsv4_rocm/ops/output.py): inverse RoPE + fp8 quantization, the fp8
einsum / linear, merging attention states."""
