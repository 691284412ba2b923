"""How vLLM's DeepSeek-V4 layer calls into dsv4_rocm.

vLLM builds one ``DeepseekV4Attention`` subclass per platform (ROCm: ``DeepseekV4ROCMAiterMLAAttention``,
CUDA: ``DeepseekV4FlashMLAAttention``, CPU: ``DeepseekV4CPUAttention``). ``attention_class(base)`` derives
from it a class that, when the user selected ``--attention-backend DSV4_ROCM``, replaces the layer's
attention hooks with dsv4_rocm's and otherwise is the base class unchanged:

- ``get_padded_num_q_heads``: 64 or 128 (the heads the sparse kernels run);
- ``_fused_qnorm_rope_kv_insert``: ``ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` (q norm + RoPE,
  padded q; kv RoPE + fp8 quant into the SWA cache), in place of ``torch.ops._C``'s;
- ``forward_mqa``: the one attention step (``dsv4_rocm.attention_step.attend_step``, as dsv4_rocm's layer runs
  it) for every token of the step, decode and prefill alike, over the window's SWA slots and the compressed
  entries (C4: the indexer's top-k made global per token; C128: all visible entries), with the sink,
  straight from the fp8 pages (no bf16 workspace, no prefill chunks);
- ``backend_cls`` / ``swa_backend_cls``: dsv4_rocm's backends, whose builders make the step's metadata.

Building a layer with our backend selected first refuses a ``--kv-cache-dtype`` that has no fp8_ds_mla
meaning (``SparseMLABackend.check_kv_cache_dtype``), before vLLM allocates anything for it.

The projections, the compressors, the indexer and the output projection stay vLLM's. A profile run (vLLM
runs the layer once with no metadata to size memory) writes no cache and leaves the output zero.
"""
from ... import layout as L
from ... import ops
from ...attention import padded_q
from ...attention_step import attend_step
from .backend import BACKEND_NAME, SparseMLABackend, SWABackend

from vllm.forward_context import get_forward_context


def selected(vllm_config) -> bool:
    """True when the user chose dsv4_rocm's backend (``--attention-backend DSV4_ROCM``)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == BACKEND_NAME


class _Hooks:
    """The attention hooks; each defers to the base class when the layer was built without our backend."""
    _dsv4_rocm = False

    def __init__(self, vllm_config, *args, **kwargs):
        # decided before the base constructor runs: it reads the padded head count and the backends
        object.__setattr__(self, "_dsv4_rocm", selected(vllm_config))
        if self._dsv4_rocm:
            SparseMLABackend.check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
        super().__init__(vllm_config, *args, **kwargs)

    @property
    def backend_cls(self):
        return SparseMLABackend if self._dsv4_rocm else super().backend_cls

    @property
    def swa_backend_cls(self):
        return SWABackend if self._dsv4_rocm else super().swa_backend_cls

    def get_attn_backend(self):
        return SparseMLABackend if self._dsv4_rocm else super().get_attn_backend()

    def get_padded_num_q_heads(self, num_heads: int) -> int:
        if not self._dsv4_rocm:
            return super().get_padded_num_q_heads(num_heads)
        if not 0 < num_heads <= 128:
            raise ValueError(f"DeepSeek-V4 attention on dsv4_rocm runs 1..128 local heads, got {num_heads}")
        return 64 if num_heads <= 64 else 128

    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        if not self._dsv4_rocm:
            return super()._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)
        if not isinstance(attn_metadata, dict):
            # profile run: no cache write, q padded to the kernels' head count
            return padded_q(q, self.padded_heads)
        swa = attn_metadata[self.swa_cache_layer.prefix]
        cache = self.swa_cache_layer.kv_cache
        n = swa.step.num_tokens
        return ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q[:n], kv[:n], cache.view(cache.shape[0], -1), swa.step.slot_mapping, positions[:n],
            self.rotary_emb.cos_sin_cache, self.padded_heads, self.eps, L.SWA_BLOCK_SIZE)

    def forward_mqa(self, q, kv, positions, output) -> None:
        if not self._dsv4_rocm:
            return super().forward_mqa(q, kv, positions, output)
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            output.zero_()          # profile run: nothing to attend, no workspace to reserve
            return
        step = attn_metadata[self.swa_cache_layer.prefix].step
        n = step.num_tokens
        if n < output.shape[0]:
            output[n:].zero_()      # graph padding rows
        sparse_mla_forward(self, q[:n], output[:n], step, attn_metadata.get(self.prefix))


def sparse_mla_forward(layer, q, output, step, layer_metadata) -> None:
    """Attention of the step's tokens (q bf16 [T, padded_heads, 512]) into ``output`` [T, padded_heads, 512]
    by the one attention step (``dsv4_rocm.attention_step.attend_step``): the SWA set from ``step``, the
    compressed set from the layer's group metadata and, for C4, the indexer's per-token top-k
    (``layer.topk_indices_buffer``, local entry ids)."""
    r, T = layer.compress_ratio, q.shape[0]
    comp = layer.kv_cache.unsqueeze(-2) if r in (4, 128) else None
    attend_step(q, output, step, layer.swa_cache_layer.kv_cache.unsqueeze(-2), layer.attn_sink, layer.scale, comp,
                topk=layer.topk_indices_buffer[:T] if r == 4 else None,
                block_table=layer_metadata.block_table if r == 4 else None,
                block_size=L.compressed_block_size(4) if r == 4 else 0,
                indices=layer_metadata.c128_indices if r == 128 else None,
                lens=layer_metadata.c128_lens if r == 128 else None)


_CLASSES = {}


def attention_class(base: type) -> type:
    """The subclass of vLLM's platform layer ``base`` with dsv4_rocm's hooks (one per base)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_Hooks, base), {
            "__module__": __name__, "__qualname__": base.__qualname__,
            "__doc__": f"{base.__name__} whose attention runs on dsv4_rocm with --attention-backend "
                       f"{BACKEND_NAME} (dsv4_rocm/integrations/vllm/layer.py)"})
    return _CLASSES[base]


def is_hooked(cls: type) -> bool:
    return issubclass(cls, _Hooks)


__all__ = ["attention_class", "is_hooked", "selected", "sparse_mla_forward"]
