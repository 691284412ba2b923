"""Argument checks shared by the public ops: every failure is a ValueError naming the argument."""
import torch


def tensor(name, t, dtype=None, dim=None, shape=None, device=None, contiguous=False):
    """Check one tensor argument; ``shape`` entries of None match any size. Every public op calls this for
    most of its arguments, so the passing case is a handful of attribute reads and comparisons."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        td = t.dtype
        if td is not dtype and (type(dtype) is torch.dtype or td not in dtype):
            allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
            raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)}, got {td}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        ts = t.shape
        if len(ts) != len(shape) or any(s is not None and s != n for s, n in zip(shape, ts)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {tuple(ts)}")
    if device is not None and t.device != device and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


INDEX = (torch.int32, torch.int64)


def positive_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def same_device(**tensors):
    dev = None
    for t in tensors.values():
        if isinstance(t, torch.Tensor):
            if dev is None:
                dev = t.device
            elif t.device != dev:
                devs = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
                raise ValueError("tensors on different devices: " + ", ".join(f"{n}={d}" for n, d in devs.items()))


EXACT_OVERLAP_LIMIT = 1 << 24     # elements: beyond this an unusual layout is rejected instead of enumerated


def no_overlap(name, t):
    """Structure check of a buffer an op writes (``out=``, an in-place output, a cache): no two of its
    elements share memory, so no two results land in one place (``buf[:1].expand(2, ...)`` would put every
    request's rows in the same memory). Contiguous buffers and the strided slices engines pass (a column
    slice of a workspace: each stride beyond the span of the smaller ones) cost a handful of comparisons;
    any other layout is settled by enumerating its element offsets (or, past EXACT_OVERLAP_LIMIT elements,
    rejected as unprovable)."""
    if t.is_contiguous():
        return t
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 0                               # the largest offset the smaller strides reach
    for st, n in dims:
        if st <= span:
            break
        span += st * (n - 1)
    else:
        return t
    if t.numel() == 0:
        return t
    overlap = dims[0][0] == 0
    if not overlap:
        if t.numel() > EXACT_OVERLAP_LIMIT:
            raise ValueError(f"{name}: cannot show that its elements do not overlap (shape {tuple(t.shape)}, "
                             f"strides {t.stride()}); pass a buffer whose strides nest (e.g. a contiguous one)")
        off = torch.zeros((), dtype=torch.int64)
        for st, n in zip(t.stride(), t.shape):
            off = (off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st)
        overlap = torch.unique(off.flatten()).numel() < t.numel()
    if overlap:
        raise ValueError(f"{name}: elements overlap in memory (shape {tuple(t.shape)}, strides {t.stride()}), so "
                         "two results would be written to one place; pass a buffer with distinct elements")
    return t


def fp8_bytes(name, t):
    """Accept fp8 e4m3fn tensors or raw uint8 bytes."""
    return tensor(name, t, dtype=(torch.uint8, torch.float8_e4m3fn))


def value_checks(t) -> bool:
    """Whether checks that read the values of ``t`` run now (dsv4_rocm/ops/_dispatch.py)."""
    from .ops import _dispatch      # imported here: dsv4_rocm.ops imports this module
    return _dispatch.value_checks(t)


def cos_sin(cos_sin_cache, positions, dtype=torch.float32, n_tokens=None):
    """The RoPE table [max_pos, 64] (``dtype``: one dtype or a tuple) and int positions [n_tokens] inside it."""
    tensor("cos_sin_cache", cos_sin_cache, dtype=dtype, shape=(None, 64))
    tensor("positions", positions, dtype=INDEX, dim=1)
    if n_tokens is not None and positions.shape[0] != n_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {n_tokens} tokens")
    if positions.numel() and value_checks(positions) and (
            int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (rows of cos_sin_cache)")


def slots(name, slots, cache, block_size, indexer=False):
    """int slots [n] into a paged cache; negative = padding; past the cache rejected (a value check)."""
    tensor(name, slots, dtype=INDEX, dim=1)
    from .reference.cache import as_pages
    pages = as_pages(cache, block_size, indexer=indexer)
    slots_inside(name, slots, pages.shape[0] * block_size, f"({pages.shape[0]} pages x {block_size})")
    return pages


def slots_inside(name, slots, capacity: int, what: str = ""):
    """Value check: every non-negative entry of ``slots`` is below ``capacity``."""
    if slots.numel() and value_checks(slots) and int(slots.max()) >= capacity:
        raise ValueError(f"{name}: slot {int(slots.max())} is outside the cache {what}".rstrip())


def finite_float(name, v, minimum=None):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite float, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v!r}")
    return float(v)
