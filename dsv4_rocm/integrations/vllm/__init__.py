"""dsv4_rocm as a vLLM plugin: ``pip install dsv4_rocm[vllm]``, then ``--attention-backend DSV4_ROCM``.

The package declares a ``vllm.general_plugins`` entry point (pyproject.toml) naming ``register``; vLLM's
plugin loader (``vllm.plugins.load_general_plugins``) calls it in the API server, the engine core and every
worker, before any model is built. ``register``:

1. checks the vLLM version and the signatures of everything the plugin extends or calls
   (``guards.check``); on any difference it logs one line saying which and changes nothing;
2. registers the backend name ``DSV4_ROCM`` with vLLM's attention-backend registry
   (``register_backend``), so that ``--attention-backend DSV4_ROCM`` parses;
3. defines the ``torch.ops._C`` / ``torch.ops._C_cache_ops`` forms of dsv4_rocm's ops that vLLM calls and
   its build lacks (``torch_ops.register_missing``: vLLM's compiled ops, where present, are never replaced);
4. derives, from the platform's DeepSeek-V4 attention layer class, a subclass with dsv4_rocm's hooks
   (``layer.attention_class``) and binds it under the base class's name in vLLM's DeepSeek-V4 modules,
   when they are imported (or at once if they already are). Layers built without ``DSV4_ROCM`` selected
   behave exactly as the base class; ``isinstance`` checks against the base class still hold.

``register`` may run many times in one process (vLLM says plugins must tolerate that); it does its work
once. It never edits vLLM's files. Variables of ours never start with ``VLLM_``: vLLM rejects unknown ones.
"""
import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger("dsv4_rocm.integrations.vllm")

BACKEND_NAME = "DSV4_ROCM"
BACKEND_PATH = "dsv4_rocm.integrations.vllm.backend.SparseMLABackend"

# platform -> (module defining vLLM's DeepSeek-V4 attention layer for it, class name)
PLATFORM_LAYERS = {
    "rocm": ("vllm.models.deepseek_v4.amd.rocm", "DeepseekV4ROCMAiterMLAAttention"),
    "cuda": ("vllm.models.deepseek_v4.nvidia.flashmla", "DeepseekV4FlashMLAAttention"),
    "cpu": ("vllm.models.deepseek_v4.cpu.cpu_sparse", "DeepseekV4CPUAttention"),
}

_state = {"registered": None}


def _platform_key():
    from vllm.platforms import current_platform
    for key, test in (("rocm", "is_rocm"), ("cuda", "is_cuda"), ("cpu", "is_cpu")):
        if getattr(current_platform, test)():
            return key
    return None


def _bind_hooked_class(module) -> None:
    """Put the hooked subclass of ``module``'s layer class under its name there and in every vLLM
    DeepSeek-V4 module that already imported the base class by name."""
    from .layer import attention_class, is_hooked
    name = PLATFORM_LAYERS[_state["platform"]][1]
    base = getattr(module, name)
    if is_hooked(base):
        return
    hooked = attention_class(base)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm.models.deepseek_v4") and mod.__dict__.get(name) is base:
            setattr(mod, name, hooked)
    logger.info("dsv4_rocm: %s.%s runs attention on dsv4_rocm when --attention-backend %s is selected",
                module.__name__, name, BACKEND_NAME)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``_bind_hooked_class`` right after vLLM imports the layer's module (before any module that
    imports the class from it), so a process that never loads DeepSeek-V4 never imports its code."""

    def __init__(self, module_name: str):
        self.module_name = module_name
        self._loader = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module_name or self._loader is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _bind_hooked_class(module)


def _register_torch_ops() -> None:
    """The ``torch.ops._C`` / ``_C_cache_ops`` forms vLLM calls and its build lacks (``torch_ops``)."""
    from . import torch_ops
    try:
        torch_ops.register_missing()
    except Exception as e:        # never stop vLLM from starting: the ops stay absent, as without the plugin
        logger.warning("dsv4_rocm: could not define the missing torch.ops forms: %r", e)


def register() -> bool:
    """vLLM's general-plugin entry point. Returns whether the plugin is active in this process."""
    if _state["registered"] is not None:
        return _state["registered"]
    from . import guards
    reasons = guards.check()
    if reasons:
        logger.warning("dsv4_rocm: the vLLM plugin stays inactive (vLLM is unchanged): %s", "; ".join(reasons))
        _state["registered"] = False
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    platform = _platform_key()
    _state.update(registered=True, platform=platform)
    _register_torch_ops()
    if platform is None:
        logger.warning("dsv4_rocm: backend %s registered, but this vLLM platform has no DeepSeek-V4 layer the "
                       "plugin knows; DeepSeek-V4 keeps vLLM's attention", BACKEND_NAME)
        return True
    module_name = PLATFORM_LAYERS[platform][0]
    if module_name in sys.modules:
        _bind_hooked_class(sys.modules[module_name])
    elif not any(isinstance(f, _AfterImport) and f.module_name == module_name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module_name))
    return True
