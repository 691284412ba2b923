"""Triton kernels, one op a file named like the op, in a package per stage of dsv4_rocm/ops: qkv, compressor,
indexer, metadata, attention, output. hopper/ holds the Hopper-only Gluon kernel. At this root: what the
stages share (``_launch``: launches and per-device facts; ``_fp8``: the fp8 conversions and their models;
``_records``: the record stores and exact scalar math; ``_compat``: Triton version differences;
``_decode_tiles``: the decode tiles of attention/ and hopper/). The ops import their kernels from here
(dsv4_rocm/ops/_dispatch.py); nothing in this package chooses a backend."""
