"""dsv4_rocm as an SGLang plugin: SGLang 0.5.23's ``--attention-backend dsv4`` on ROCm runs its DeepSeek-V4
sparse attention and fp8_ds_mla cache stores on dsv4_rocm.

The package declares an ``sglang.srt.plugins`` entry point named ``dsv4_rocm`` (pyproject.toml) pointing at
``register``. SGLang's ``load_plugins`` (every process, before the model is built) calls it, then applies
the hooks it registered with SGLang's ``HookRegistry`` (which also rebinds every ``from X import Y`` copy of
a replaced name). ``SGLANG_PLUGINS=dsv4_rocm`` restricts SGLang to this plugin; uninstalling dsv4_rocm or
leaving it out of ``SGLANG_PLUGINS`` gives SGLang's own kernels back. Nothing in SGLang's files is edited.

On a ROCm torch (gfx942, gfx950) ``register``:

1. checks the SGLang version and the signatures of everything it hooks (``guards.mismatches``); on any
   difference it logs one line naming it and registers nothing;
2. registers (``hooks``): the HIP DeepSeek-V4 backend class replaced by ``backend.dsv4_backend_class()``,
   a subclass keeping SGLang's metadata, pools, compressor and indexer (the backend name stays "dsv4");
   ``resolve_hip_flashmla_backend`` answering ``"dsv4_rocm"`` (so the model pads heads to 64 and no
   aiter-only path is taken); ``flash_mla_with_kvcache_entrypoint`` running dsv4_rocm's sparse MLA over the
   584-byte caches; ``fused_store_cache`` writing fp8_ds_mla records with dsv4_rocm's writer.

On any other torch (CUDA, where SGLang's dsv4 backend is FlashMLA / TRT-LLM; CPU) it registers nothing.
``register(force=True)`` registers anyway (the CPU tests of the hooks against the real package).
"""
import logging

logger = logging.getLogger("dsv4_rocm.integrations.sglang")

PLUGIN_NAME = "dsv4_rocm"
_state = {"registered": None}


def _on_rocm() -> bool:
    import torch
    return torch.version.hip is not None


def register(force: bool = False) -> bool:
    """The ``sglang.srt.plugins`` entry point. Returns whether the hooks were registered (once per process;
    later calls return the first answer)."""
    if _state["registered"] is not None:
        return _state["registered"]
    if not (force or _on_rocm()):
        logger.info("dsv4_rocm: not a ROCm torch; SGLang's DeepSeek-V4 backend is left as it is")
        _state["registered"] = False
        return False
    from . import guards, hooks
    problems = guards.mismatches()
    if problems:
        logger.warning("dsv4_rocm: SGLang differs from the %s this plugin was written for, so it changes "
                       "nothing: %s", " / ".join(guards.SUPPORTED_SGLANG), "; ".join(problems))
        _state["registered"] = False
        return False
    hooks.register_all()
    logger.info("dsv4_rocm: SGLang's DeepSeek-V4 attention and fp8_ds_mla stores run on dsv4_rocm")
    _state["registered"] = True
    return True
