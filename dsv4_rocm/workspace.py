"""Device buffers kept between calls, so that a launcher or an adapter on a serving path allocates nothing
once it has run at a shape (docs/conventions.md, "Serving paths").

``buffer(kind, device, numel, dtype)`` gives a 1-D tensor of at least ``numel`` elements, one per (kind,
dtype, device, stream): every call with that key gets the same memory, so two tensors that must not alias
within one call need two kinds. Calls on one stream run in order, so one buffer per stream is never used by
two calls at once. A buffer only grows (to at least twice its size, so a sequence of growing shapes
allocates a few times only); the buffer it replaces is kept alive, because a CUDA/HIP graph captured
earlier may still hold its address (a graph does not own the memory its kernels touch).
``workspace(kind, device, shape, dtype)`` is its first ``prod(shape)`` elements viewed as a contiguous
``shape``.

Nothing here reads tensor values or synchronizes: the size is a host integer the caller computes from
shapes.
"""
import math

import torch

_BUFFERS = {}     # (kind, dtype, device type, index, stream) -> tensor
_RETIRED = []     # buffers replaced by larger ones: graphs captured earlier may still use them


def _key(kind, dtype, device: torch.device):
    if device.type == "cpu":
        return kind, dtype, "cpu", 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return kind, dtype, device.type, index, torch.cuda.current_stream(index).cuda_stream


def buffer(kind, device: torch.device, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A 1-D ``dtype`` tensor of at least ``numel`` elements, the same one for every call with this kind on
    this device and stream (module docstring); zeroed when allocated if ``zero``."""
    key = _key(kind, dtype, device)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(numel, 2 * (buf.numel() if buf is not None else 0), 1)
        buf = torch.zeros(n, dtype=dtype, device=device) if zero else torch.empty(n, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf


def workspace(kind, device: torch.device, shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous ``shape`` view of ``buffer(kind, device, prod(shape), dtype)``; its values are whatever
    the last user left."""
    return buffer(kind, device, math.prod(shape), dtype)[:math.prod(shape)].view(shape)
