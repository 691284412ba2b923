"""The per-step index sets of DeepSeek-V4.1's compressed layers (``step_index_sets_v41``): compressed-cache
slots, visible entries and compressor ring slots of every token, for ratios 1 and 2, in one launch. The
math is in ``dsv4_rocm.reference.metadata_v41``; invalid requests, positions, columns and pages give -1
slots and 0 entries, never another request's (docs/conventions.md).
"""
import torch

from .. import _checks as C
from ..reference import metadata_v41 as _rm
from ._dispatch import HAVE_TRITON, register, run as _run

__all__ = ["step_index_sets_v41", "v41_step_index_sets"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the op runs its oracle
    from ..triton.metadata.step_index_sets_v41 import step_index_sets_v41 as _triton_step_sets
else:
    _triton_step_sets = None
register("step_index_sets_v41", _rm.step_index_sets_v41, triton=_triton_step_sets)


def _out(name, t, T, dtype):
    C.tensor(name, t, dtype=dtype, shape=(T,))
    if T > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def step_index_sets_v41(positions, token_to_req, is_valid_token, compressed_block_table, state_block_table,
                        block_size: int, ring_capacity: int, r1=None, r2=None) -> None:
    """positions int64 [T], token_to_req int32 [T], is_valid_token bool [T], block tables int32 [R, *] with
    contiguous rows; fills r1 = (slots int64 [T], lens int32 [T]) and r2 = (slots, lens, ring int64 [T])
    where given (reference.metadata_v41)."""
    C.tensor("positions", positions, dtype=torch.int64, dim=1)
    T = positions.shape[0]
    for name, t, dt in (("token_to_req", token_to_req, torch.int32), ("is_valid_token", is_valid_token, torch.bool)):
        _out(name, t, T, dt)
    for name, t in (("compressed_block_table", compressed_block_table), ("state_block_table", state_block_table)):
        C.tensor(name, t, dtype=torch.int32, dim=2)
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous rows")
    if state_block_table.shape[0] != compressed_block_table.shape[0]:
        raise ValueError("state_block_table and compressed_block_table must have a row per request")
    C.positive_int("block_size", block_size)
    C.positive_int("ring_capacity", ring_capacity)
    outs = []
    for name, out, n in (("r1", r1, 2), ("r2", r2, 3)):
        if out is None:
            continue
        if not isinstance(out, (tuple, list)) or len(out) != n:
            raise ValueError(f"{name} must be a tuple of {n} output tensors or None")
        for i, t in enumerate(out):
            _out(f"{name}[{i}]", t, T, torch.int32 if i == 1 else torch.int64)
        outs += list(out)
    C.same_device(positions=positions, token_to_req=token_to_req, is_valid_token=is_valid_token,
                  compressed_block_table=compressed_block_table, state_block_table=state_block_table,
                  **{f"out{i}": t for i, t in enumerate(outs)})
    if not outs or T == 0:
        return
    _run("step_index_sets_v41", positions.device, positions, token_to_req, is_valid_token, compressed_block_table,
         state_block_table, block_size, ring_capacity, r1, r2)


# the op's name before the V4.1 modules took one style (the suffix, as the V4.0 kernel step_index_sets)
v41_step_index_sets = step_index_sets_v41
