"""Triton kernels of the attention stage (dsv4_rocm/ops/attention.py and its vLLM ROCm call forms): sparse MLA
decode and prefill, and the helper ops of those call forms."""
