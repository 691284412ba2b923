"""A control for initcheck (gpu/sanitize.sh): does the tool see what a torch matrix product writes?

Each case writes a fresh tensor whole with one torch op, then reads all of it (a conversion to fp32 and a
sum), so a read initcheck reports here is of memory the tool did not see written, not of unwritten memory.
The shapes are those of the decode-step test of the fused q-norm insert (qr [16, 1024] @ wq [1024, 32768],
bf16), whose reads of the product initcheck reported; beside it the same product in fp32 and a plain fill.
Run it as ``compute-sanitizer --tool initcheck python gpu/initcheck_control.py`` (any CUDA GPU).
"""
import sys

import torch


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    qr = torch.randn(16, 1024, device="cuda", generator=g)
    wq = torch.randn(1024, 32768, device="cuda", generator=g) * 0.03
    cases = {
        "bf16_gemm": lambda: qr.bfloat16() @ wq.bfloat16(),
        "fp32_gemm": lambda: qr @ wq,
        "fill": lambda: torch.full((16, 32768), 1.5, device="cuda").bfloat16(),
    }
    for name, make in cases.items():
        print(f"control case {name}", flush=True)
        out = make()
        total = float(out.float().sum())
        torch.cuda.synchronize()
        print(f"initcheck control {name}: {tuple(out.shape)} {out.dtype} written by torch, read whole "
              f"(sum {total:.3e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
