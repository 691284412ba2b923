"""Output path: inverse RoPE + FP8 quant, grouped FP8 einsum, FP8 linear, merging of attention states."""
import torch

from .. import _checks as C
from ..reference import output as _ro
from ._dispatch import register, run as _run

__all__ = ["fused_inv_rope_fp8_quant", "fp8_einsum", "fp8_linear", "merge_attn_states"]

register("fused_inv_rope_fp8_quant", _ro.fused_inv_rope_fp8_quant)
register("fp8_einsum", _ro.fp8_einsum)
register("fp8_linear", _ro.fp8_linear)
register("merge_attn_states", _ro.merge_attn_states)


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int):
    C.tensor("o", o, dtype=torch.bfloat16, shape=(None, None, 512))
    C.positive_int("n_groups", n_groups)
    if o.shape[1] % n_groups:
        raise ValueError(f"n_groups {n_groups} must divide the {o.shape[1]} heads of o")
    C.cos_sin(cos_sin_cache, positions)
    return _run("fused_inv_rope_fp8_quant", o.device, o, positions, cos_sin_cache, n_groups)


def fp8_einsum(a8, a_scale, w8, w_scale):
    a8, w8 = C.fp8_bytes("a", a8), C.fp8_bytes("w", w8)
    C.tensor("a", a8, dim=3)
    T, G, r = a8.shape
    C.tensor("w", w8, shape=(G, None, r))
    C.tensor("a_scale", a_scale, dtype=torch.float32, shape=(T, G, r // 128))
    C.tensor("w_scale", w_scale, dtype=torch.float32, shape=(G, w8.shape[1] // 128, r // 128))
    return _run("fp8_einsum", a8.device, a8, a_scale, w8, w_scale)


def fp8_linear(x, w8, w_scale):
    w8 = C.fp8_bytes("weight", w8)
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("weight", w8, shape=(None, x.shape[1]))
    C.tensor("weight_scale", w_scale, dtype=torch.float32, shape=(w8.shape[0] // 128, x.shape[1] // 128))
    return _run("fp8_linear", x.device, x, w8, w_scale)


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    C.tensor("out_a", out_a, dim=3)
    C.tensor("out_b", out_b, shape=tuple(out_a.shape))
    C.tensor("lse_a", lse_a, dtype=torch.float32, shape=tuple(out_a.shape[:2]))
    C.tensor("lse_b", lse_b, dtype=torch.float32, shape=tuple(out_a.shape[:2]))
    return _run("merge_attn_states", out_a.device, out_a, lse_a, out_b, lse_b)
