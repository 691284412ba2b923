"""Public ops of dsv4_rocm, one module per stage of the layer.

Each op checks its arguments (a ValueError naming the argument), then runs the implementation picked
for the device: ``hip`` (dsv4_rocm._C) > ``triton`` > ``reference`` among those the op has
(``_dispatch``). Names and argument orders follow vLLM (FlashMLA / DeepGEMM where the op is theirs).
"""
from ._dispatch import (BACKENDS, backend_for, implementation, machine_backends, registered_ops,  # noqa: F401
                        use_backend, validation, value_checks)
from .cache import *  # noqa: F401,F403
from .qkv import *  # noqa: F401,F403
from .compressor import *  # noqa: F401,F403
from .indexer import *  # noqa: F401,F403
from .metadata import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .vllm_rocm_sparse_attn import *  # noqa: F401,F403
from .output import *  # noqa: F401,F403
from .compressor_v41 import *  # noqa: F401,F403
from .indexer_v41 import *  # noqa: F401,F403
from .metadata_v41 import *  # noqa: F401,F403
from . import library  # noqa: F401,E402  (torch.ops.dsv4_rocm.*: vLLM's custom-op schemas)
