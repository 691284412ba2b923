"""Index metadata of a serving step: slot ids, SWA / top-k / C128 index sets, prefill indices."""
import torch

from .. import _checks as C
from ..reference import metadata as _rm
from ._dispatch import register, run as _run

__all__ = [
    "get_compressed_slot_mapping", "compute_swa_indices_and_lens", "compute_global_topk_indices_and_lens",
    "build_c128a_topk_metadata", "combine_topk_swa_indices"]

register("get_compressed_slot_mapping", _rm.get_compressed_slot_mapping)
register("compute_swa_indices_and_lens", _rm.compute_swa_indices_and_lens)
register("compute_global_topk_indices_and_lens", _rm.compute_global_topk_indices_and_lens)
register("build_c128a_topk_metadata", _rm.build_c128a_topk_metadata)
register("combine_topk_swa_indices", _rm.combine_topk_swa_indices)


def _check_bt(block_table, token_to_req, **others):
    C.tensor("block_table", block_table, dtype=C.INDEX, dim=2)
    C.tensor("token_to_req", token_to_req, dtype=C.INDEX, dim=1)
    C.same_device(block_table=block_table, token_to_req=token_to_req, **others)
    if token_to_req.numel() and int(token_to_req.max()) >= block_table.shape[0]:
        raise ValueError("token_to_req names a request beyond block_table's rows")


def get_compressed_slot_mapping(positions, token_to_req, block_table, ratio: int, block_size: int, slot_mapping=None):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping)
    C.tensor("positions", positions, dtype=C.INDEX, shape=token_to_req.shape)
    C.positive_int("block_size", block_size)
    C.positive_int("ratio", ratio)
    return _run("get_compressed_slot_mapping", positions.device, positions, token_to_req, block_table, ratio,
                block_size, slot_mapping)


def compute_swa_indices_and_lens(positions, token_to_req, block_table, slot_mapping, window: int, block_size: int = 64):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping)
    C.tensor("positions", positions, dtype=C.INDEX, shape=token_to_req.shape)
    C.positive_int("window", window)
    return _run("compute_swa_indices_and_lens", positions.device, positions, token_to_req, block_table, slot_mapping,
                window, block_size)


def compute_global_topk_indices_and_lens(topk_local, token_to_req, block_table, block_size: int, is_valid_token):
    _check_bt(block_table, token_to_req, topk_local=topk_local, is_valid_token=is_valid_token)
    C.tensor("topk_local", topk_local, dtype=C.INDEX, shape=(token_to_req.shape[0], None))
    return _run("compute_global_topk_indices_and_lens", topk_local.device, topk_local, token_to_req, block_table,
                block_size, is_valid_token)


def build_c128a_topk_metadata(positions, token_to_req, block_table, slot_mapping, is_decode_token,
                              max_model_len: int, block_size: int = 2, ratio: int = 128):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping,
              is_decode_token=is_decode_token)
    C.positive_int("max_model_len", max_model_len)
    return _run("build_c128a_topk_metadata", positions.device, positions, token_to_req, block_table, slot_mapping,
                is_decode_token, max_model_len, block_size, ratio)


def combine_topk_swa_indices(topk_local, topk_lens, positions, req_in_chunk, gather_start, num_compressed_rows: int,
                             rows_per_req: int, window: int):
    C.tensor("topk_local", topk_local, dtype=C.INDEX, dim=2)
    C.tensor("topk_lens", topk_lens, dtype=C.INDEX, shape=(topk_local.shape[0],))
    C.same_device(topk_local=topk_local, topk_lens=topk_lens, positions=positions, req_in_chunk=req_in_chunk,
                  gather_start=gather_start)
    return _run("combine_topk_swa_indices", topk_local.device, topk_local, topk_lens, positions, req_in_chunk,
                gather_start, num_compressed_rows, rows_per_req, window)
