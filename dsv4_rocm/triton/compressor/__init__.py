"""Triton kernels of the compressor stage (dsv4_rocm/ops/compressor.py, compressor_v41.py): partial states,
the compressed rows' norm, RoPE and cache store."""
