"""dsv4_rocm's attention backends for vLLM's DeepSeek-V4 layers, in the shape of vLLM's
``DeepseekV4FlashMLABackend`` (vllm/models/deepseek_v4/sparse_mla.py) and of its sliding-window backend.

``SparseMLABackend`` is the backend of the compressed (C4/C128) cache group and the name a user selects
(``--attention-backend DSV4_ROCM``); ``SWABackend`` that of the sliding-window cache every layer has.
DeepSeek-V4 runs attention inside its own layer (``DeepseekV4Attention.forward_mqa``), so, as in vLLM,
neither backend has an impl class: the layer hooks of ``dsv4_rocm.integrations.vllm.layer`` call the ops.

Cache layout (docs/cache_format.md): one fp8_ds_mla record of 584 bytes per token or compressed entry,
pages padded to a multiple of 576 bytes; the SWA cache in 64-token blocks, the compressed caches in
blocks of 256 token positions (64 C4 entries, 2 C128 entries).
"""
from typing import ClassVar, List, Tuple

import torch

from ... import layout as L
from .metadata import MLAMetadataBuilder, SWAMetadataBuilder

from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

BACKEND_NAME = "DSV4_ROCM"
SWA_BACKEND_NAME = "DSV4_ROCM_SWA"


def _kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, int, int]:
    if num_kv_heads != 1 or head_size != L.HEAD_DIM:
        raise ValueError(f"DeepSeek-V4's cache has one KV head of {L.HEAD_DIM}, got num_kv_heads={num_kv_heads} "
                         f"head_size={head_size}")
    return (num_blocks, block_size, L.TOKEN_BYTES)


class _Geometry:
    """The fp8_ds_mla record geometry both backends share."""
    supported_dtypes: ClassVar[List[torch.dtype]] = [torch.bfloat16]
    # auto and fp8 resolve to fp8_ds_mla (vLLM's _resolve_dsv4_kv_cache_dtype), as for FlashMLA
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "fp8_ds_mla", "fp8"]
    TOKEN_BYTES: ClassVar[int] = L.TOKEN_BYTES
    PAGE_ALIGNMENT: ClassVar[int] = L.PAGE_ALIGN

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int = 1, head_size: int = L.HEAD_DIM,
                           cache_dtype_str: str = "fp8_ds_mla") -> Tuple[int, int, int]:
        """uint8 [num_blocks, block_size, 584]: the records of a page; vLLM allocates each page padded to
        a multiple of 576 bytes (``page_bytes``), so the view's stride(0) is the padded page."""
        return _kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def page_bytes(block_size: int) -> int:
        return L.page_bytes(block_size)

    @classmethod
    def check_kv_cache_dtype(cls, cache_dtype: str) -> None:
        """Refuse, by name, a ``--kv-cache-dtype`` without an fp8_ds_mla meaning. In vLLM 0.33.0 ``bfloat16``
        (and ``fp8_e4m3``) select the plain-row caches of FLASHINFER_MLA_SPARSE_DSV4 (Blackwell): each token's
        512 values as bf16 (or per-tensor e4m3) rows [num_blocks, block_size, 512], a layout none of
        dsv4_rocm's kernels reads or writes."""
        if cache_dtype in cls.supported_kv_cache_dtypes:
            return
        plain = " (vLLM's plain-row layout of FLASHINFER_MLA_SPARSE_DSV4: whole rows of 512 values, no " \
                "fp8_ds_mla records)" if cache_dtype in ("bfloat16", "fp8_e4m3") else ""
        raise ValueError(f"--kv-cache-dtype {cache_dtype}{plain} is not supported by --attention-backend "
                         f"{BACKEND_NAME}: dsv4_rocm keeps DeepSeek-V4's KV caches as fp8_ds_mla records of "
                         f"{L.TOKEN_BYTES} bytes. Use --kv-cache-dtype {' / '.join(cls.supported_kv_cache_dtypes)} "
                         "(each means fp8_ds_mla here), or another attention backend.")

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("DeepSeek-V4 attention runs inside vLLM's DeepseekV4Attention layer, through "
                                  "the hooks of dsv4_rocm.integrations.vllm.layer; there is no impl class")

    @classmethod
    def get_supported_head_sizes(cls) -> List[int]:
        return [L.HEAD_DIM]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        """gfx942 (9.4), gfx950 (9.5), Hopper (9.0) and Blackwell (10.x) run the kernels."""
        return capability.major in (9, 10)


class SWABackend(_Geometry, DeepseekSparseSWABackend):
    @staticmethod
    def get_name() -> str:
        return SWA_BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [L.SWA_BLOCK_SIZE]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return L.SWA_BLOCK_SIZE

    @staticmethod
    def get_builder_cls():
        return SWAMetadataBuilder


class SparseMLABackend(_Geometry, DeepseekV4SparseMLABackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [L.LOGICAL_BLOCK_TOKENS]

    @staticmethod
    def get_builder_cls():
        return MLAMetadataBuilder


