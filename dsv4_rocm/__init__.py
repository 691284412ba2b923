"""dsv4_rocm: DeepSeek-V4 attention kernels (fp8_ds_mla cache, compressor, indexer, sparse MLA) for
AMD Instinct first, NVIDIA Hopper/Blackwell from the same sources."""
__version__ = "0.1.0"

from . import config, layout, platform  # noqa: F401
