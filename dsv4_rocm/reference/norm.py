"""RMSNorm (docs/math.md#rmsnorm): fp32 math, one rounding at the store."""
import torch


def rmsnorm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """fp32 x * rsqrt(mean(x^2) + eps) * w over the last dim; weight None = no weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def fused_q_kv_rmsnorm(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                       eps: float):
    """(bf(RMSNorm(qr; q_w)), bf(RMSNorm(kv; kv_w))): the q_lora and kv latent norms of one step."""
    return rmsnorm(qr, q_weight, eps).to(qr.dtype), rmsnorm(kv, kv_weight, eps).to(kv.dtype)
