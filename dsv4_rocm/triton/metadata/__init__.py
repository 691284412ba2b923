"""Triton kernels of the metadata stage (dsv4_rocm/ops/metadata.py, metadata_v41.py): the index sets of a serving
step."""
