"""What the kernel launchers keep between calls, so a launch costs no device query and no allocation
beyond its outputs (a serving engine calls the attention launchers once per layer per step).

* ``device_facts(device)``: (arch, reads the cache as fnuz, SM / CU count) per device, queried once.
* ``scratch(device, numel)``: an fp32 buffer of at least ``numel`` elements for split partials, one per
  (device, stream). It only grows; a buffer it replaces is kept alive, because a captured CUDA/HIP graph
  may still hold its address (a graph does not own the memory its kernels touch). Calls on one stream
  run in order, so one buffer per stream is never used by two calls at once.
* ``zeroed_state(device, numel)``: the same for an int32 buffer that starts as zeros and that every
  kernel using it leaves as zeros (counters, atomic maxima), so no call and no graph replay clears it.

CPU tensors (the Triton interpreter, ``TRITON_INTERPRET=1``) get arch "cpu", no fnuz and one "SM".
"""
import functools

import torch

from ..platform import detect


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _facts(device_type: str, index: int):
    if device_type == "cpu":
        return "cpu", False, 1
    dev = torch.device(device_type, index)
    plat = detect(dev)
    return plat.arch, plat.fp8_decode == "fnuz_scale_plus_one", \
        torch.cuda.get_device_properties(dev).multi_processor_count


def device_facts(device: torch.device):
    """(arch, fnuz, sm_count) of ``device``, cached."""
    if device.type == "cpu":
        return _facts("cpu", 0)
    return _facts(device.type, device_index(device))


_SCRATCH = {}     # (kind, device type, index, stream) -> tensor
_RETIRED = []     # buffers replaced by larger ones: graphs captured earlier may still write them


def _cached(kind: str, device: torch.device, numel: int, make) -> torch.Tensor:
    if device.type == "cpu":
        key = (kind, "cpu", 0, 0)
    else:
        index = device_index(device)
        key = (kind, device.type, index, torch.cuda.current_stream(index).cuda_stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = make(max(numel, 2 * (buf.numel() if buf is not None else 0)), device=device)
        _SCRATCH[key] = buf
    return buf


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A 1-D fp32 buffer of at least ``numel`` elements, reused by every call on this device and stream."""
    return _cached("scratch", device, numel, lambda n, device: torch.empty(n, dtype=torch.float32, device=device))


def zeroed_state(device: torch.device, numel: int) -> torch.Tensor:
    """A 1-D int32 buffer of at least ``numel`` zeros, reused by every call on this device and stream; its
    users return it to zeros before they finish."""
    return _cached("state", device, numel, lambda n, device: torch.zeros(n, dtype=torch.int32, device=device))
