"""Float32 torch oracle of every dsv4_rocm op (docs/math.md), one module per stage; runs on any device."""
from . import attention, cache, compressor, indexer, metadata, norm, output, qkv, quant, rope  # noqa: F401
