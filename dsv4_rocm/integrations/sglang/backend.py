"""The backend class of the SGLang plugin: SGLang's HIP DeepSeek-V4 backend with dsv4_rocm underneath.

``dsv4_backend_class()`` derives it from ``DeepseekV4HipRadixBackend`` (imported then, not at module
import): SGLang's forward metadata (page indices, top-k lengths, compressor plans), memory pools,
compressor and indexer are used as they are; the sparse attention and the fp8_ds_mla stores go through
the hooked entrypoint and store (``hooks``). The one override: the opus sparse prefill, which gathers the
caches with its own kernels, is never taken, so every prefill and decode reads the caches through
dsv4_rocm. ``isinstance`` checks against SGLang's class still hold, and the attention registry keeps
creating it under the name "dsv4".
"""
import functools


@functools.lru_cache(maxsize=None)
def dsv4_backend_class():
    from sglang.srt.layers.attention.deepseek_v4_backend_hip_radix import DeepseekV4HipRadixBackend

    base = getattr(DeepseekV4HipRadixBackend, "_dsv4_rocm_base", DeepseekV4HipRadixBackend)

    class DeepseekV4Dsv4RocmBackend(base):
        """SGLang's ``dsv4`` attention backend on ROCm, its attention and cache stores on dsv4_rocm."""
        _dsv4_rocm_base = base

        def _opus_prefill_applies(self, q, forward_batch, compress_ratio) -> bool:
            return False

    DeepseekV4Dsv4RocmBackend.__module__ = __name__
    return DeepseekV4Dsv4RocmBackend
