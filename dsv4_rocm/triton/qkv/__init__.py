"""Triton kernels of the qkv stage (dsv4_rocm/ops/qkv.py): the fused q-norm / RoPE / quantize / cache insert."""
