"""Output path: inverse RoPE + FP8 quant (vLLM's form), the grouped FP8 einsum (DeepGEMM's form), the FP8
linear, and merging of attention states (vLLM's in-place form)."""
import torch

from .. import _checks as C
from ..reference import output as _ro
from ._dispatch import HAVE_TRITON, register, run as _run

__all__ = ["fused_inv_rope_fp8_quant", "fp8_einsum", "fp8_linear", "merge_attn_states"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.output.fp8_einsum import fp8_einsum as _triton_einsum, fp8_linear as _triton_linear
    from ..triton.output.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant as _triton_inv_rope_quant
    from ..triton.output.merge_attn_states import merge_attn_states as _triton_merge
else:
    _triton_einsum = _triton_linear = _triton_inv_rope_quant = _triton_merge = None
register("fused_inv_rope_fp8_quant", _ro.fused_inv_rope_fp8_quant, triton=_triton_inv_rope_quant)
register("fp8_einsum", _ro.fp8_einsum, triton=_triton_einsum)
register("fp8_linear", _ro.fp8_linear, triton=_triton_linear)
register("merge_attn_states", _ro.merge_attn_states, triton=_triton_merge)


def _flag(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return v


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int, heads_per_group: int, nope_dim: int = 448,
                             rope_dim: int = 64, quant_group_size: int = 128, tma_aligned_scales: bool = False,
                             quantize: bool = True):
    """vLLM's ``fused_inv_rope_fp8_quant``: (fp8 [T, G, D] over [G, T, D] storage, MN-major scales), D =
    heads_per_group * 512; fp32 scales [T, G, D/quant_group_size] (SM90 form) or, with
    ``tma_aligned_scales``, UE8M0 bytes packed 4 an int32 [T, G, D/(4 quant_group_size)] (SM100 form);
    quant_group_size 128 (DeepSeek-V4's), or 32, 64 (256, 512 unpacked), as vLLM's op allows. With ``quantize=False`` (vLLM 0.33, for a
    bf16 output projection): the rotated rows as bf16 [T, G, D] over [G, T, D] storage and an empty scale
    tensor (int32 with ``tma_aligned_scales``, else fp32). dsv4_rocm.reference.output has the math."""
    C.tensor("o", o, dtype=torch.bfloat16, dim=3)
    C.positive_int("n_groups", n_groups)
    C.positive_int("heads_per_group", heads_per_group)
    if (nope_dim, rope_dim) != (448, 64):
        raise ValueError(f"nope_dim, rope_dim must be DeepSeek-V4's 448, 64; got {nope_dim}, {rope_dim}")
    _flag("tma_aligned_scales", tma_aligned_scales)
    if isinstance(quant_group_size, bool) or quant_group_size not in _ro.QUANT_GROUPS or (
            tma_aligned_scales and quantize and (512 // quant_group_size) % 4):
        raise ValueError(f"quant_group_size must be one of {_ro.QUANT_GROUPS} (32, 64 or 128 with tma_aligned_scales: "
                         f"4 UE8M0 bytes a word), got {quant_group_size!r}")
    _flag("quantize", quantize)
    T, H, D = o.shape
    if D != nope_dim + rope_dim or o.stride(2) != 1:
        raise ValueError(f"o must be [T, H, {nope_dim + rope_dim}] with unit stride along the head dim, got shape "
                         f"{tuple(o.shape)} strides {o.stride()}")
    if H != n_groups * heads_per_group:
        raise ValueError(f"n_groups * heads_per_group = {n_groups} * {heads_per_group} must equal o's {H} heads")
    C.cos_sin(cos_sin_cache, positions, dtype=(torch.float32, torch.bfloat16), n_tokens=T)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must have unit stride along its 64 columns")
    C.same_device(o=o, positions=positions, cos_sin_cache=cos_sin_cache)
    return _run("fused_inv_rope_fp8_quant", o.device, o, positions, cos_sin_cache, n_groups, heads_per_group,
                nope_dim, rope_dim, quant_group_size, tma_aligned_scales, quantize)


def _pair(name, p):
    if not (isinstance(p, (tuple, list)) and len(p) == 2):
        raise ValueError(f"{name} must be a (fp8 tensor, scales) pair")
    return p


def _scales(name, s, lead, rows, r_blocks):
    """fp32 [*lead, rows, r/128] or packed UE8M0 int32 [*lead, rows, ceil(r/512)]."""
    C.tensor(name, s, dtype=(torch.float32, torch.int32), dim=len(lead) + 2)
    cols = r_blocks if s.dtype == torch.float32 else (r_blocks + 3) // 4
    C.tensor(name, s, shape=(*lead, rows, cols))


def fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128)) -> None:
    """DeepGEMM's ``fp8_einsum("bhr,hdr->bhd", (a, a_scale), (w, w_scale), d, recipe=(1, gran_n, 128))``:
    d [T, G, n] = sum_r dequant(a)[t, g, r] dequant(w)[g, n, r], written in place (bf16 or fp32). Scales:
    fp32 or packed UE8M0 int32 (dsv4_rocm.reference.output lists the forms), any strides."""
    if expr != "bhr,hdr->bhd":
        raise ValueError(f"expr: only 'bhr,hdr->bhd' is implemented, got {expr!r}")
    (a8, sa), (w8, sw) = _pair("a", a), _pair("b", b)
    if c is not None:
        raise ValueError("c (accumulating into d) is not supported for 'bhr,hdr->bhd'")
    if not (isinstance(recipe, (tuple, list)) and len(recipe) == 3 and recipe[0] == 1 and recipe[1] in (1, 128)
            and recipe[2] == 128):
        raise ValueError(f"recipe must be (1, 128, 128) or (1, 1, 128), got {recipe!r}")
    if isinstance(d, (tuple, list)):
        raise ValueError("d: an fp8 (d, sfd) output is not supported; pass a bf16 or fp32 tensor")
    C.fp8_bytes("a", a8)
    C.fp8_bytes("w", w8)
    C.tensor("a", a8, dim=3)
    T, G, r = a8.shape
    if r == 0 or r % 128:
        raise ValueError(f"a: r = {r} must be a positive multiple of 128 (the scale block)")
    C.tensor("w", w8, shape=(G, None, r))
    n = w8.shape[1]
    C.no_overlap("d", C.tensor("d", d, dtype=(torch.bfloat16, torch.float32), shape=(T, G, n)))
    for name, t in (("a", a8), ("w", w8), ("d", d)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}")
    _scales("a_scale", sa, (T,), G, r // 128)
    gran_n = recipe[1]
    if sw.dtype == torch.int32 and gran_n != 1:
        raise ValueError("w_scale: packed UE8M0 weight scales are per row: use recipe (1, 1, 128)")
    _scales("w_scale", sw, (G,), -(-n // gran_n), r // 128)
    C.same_device(a=a8, a_scale=sa, w=w8, w_scale=sw, d=d)
    _run("fp8_einsum", a8.device, expr, (a8, sa), (w8, sw), d, None, tuple(recipe))


def fp8_linear(x, w8, w_scale):
    """bf16 x [T, K] times a block-FP8 weight [N, K] (fp32 scales [N/128, K/128]) -> bf16 [T, N]; x is
    quantized per token per 128 columns (UE8M0, eps 1e-4) as DeepGEMM's 1x128 recipe does."""
    C.fp8_bytes("weight", w8)
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("weight", w8, shape=(None, x.shape[1]))
    if x.shape[1] % 128 or w8.shape[0] % 128:
        raise ValueError(f"weight dims {tuple(w8.shape)} must be multiples of 128")
    C.tensor("weight_scale", w_scale, dtype=torch.float32, shape=(w8.shape[0] // 128, x.shape[1] // 128))
    C.same_device(x=x, weight=w8, weight_scale=w_scale)
    return _run("fp8_linear", x.device, x, w8, w_scale)


_MERGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_OUT = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _check_lse(name, t, H, T, dev):
    C.tensor(name, t, dtype=torch.float32, shape=(H, T), device=dev)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                      prefill_tokens_with_context=None, output_scale=None) -> None:
    """vLLM's ``merge_attn_states``, in place: ``output`` [T, H, D] (bf16, fp16, fp32, or with ``output_scale``
    float8_e4m3fn or float8_e4m3fnuz, vLLM's fp8 dtype on gfx942) gets the merge of ``prefix_output`` and
    ``suffix_output`` [T, H, D] (bf16, fp16 or fp32, one dtype) by their lse [H, T] fp32; ``output_lse``
    [H, T] fp32 gets the merged lse when given. Tokens at or past ``prefill_tokens_with_context`` (an int in
    [0, T]; None = T) copy the suffix. An lse of +inf (an empty part, FlashMLA's convention) is read as
    -inf. Any strides but a unit last one for
    the [T, H, D] tensors, any strides for the lse; ``output`` may be one of the inputs. The math:
    dsv4_rocm.reference.output.merge_attn_states."""
    C.tensor("prefix_output", prefix_output, dtype=_MERGE_DTYPES, dim=3)
    T, H, D = prefix_output.shape
    dev = prefix_output.device
    C.tensor("suffix_output", suffix_output, dtype=prefix_output.dtype, shape=(T, H, D), device=dev)
    fp8 = output_scale is not None
    if not fp8 and getattr(output, "dtype", None) in _FP8_OUT:
        raise ValueError(f"output_scale is required when output is {output.dtype}")
    C.tensor("output", output, dtype=_FP8_OUT if fp8 else _MERGE_DTYPES, shape=(T, H, D), device=dev)
    if fp8:
        C.tensor("output_scale", output_scale, dtype=torch.float32, device=dev)
        if output_scale.numel() != 1:
            raise ValueError(f"output_scale must hold one value, got shape {tuple(output_scale.shape)}")
    for name, t in (("output", output), ("prefix_output", prefix_output), ("suffix_output", suffix_output)):
        if t.stride(-1) != 1 and D > 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    _check_lse("prefix_lse", prefix_lse, H, T, dev)
    _check_lse("suffix_lse", suffix_lse, H, T, dev)
    if output_lse is not None:
        _check_lse("output_lse", output_lse, H, T, dev)
    n = prefill_tokens_with_context
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= T):
        raise ValueError(f"prefill_tokens_with_context must be None or an int in [0, {T}], got {n!r}")
    _run("merge_attn_states", dev, output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, n,
         output_scale)
