"""What every rank of the tensor-parallel test runs (tests/layer/test_tp.py): under torchrun, a rank of the layer
sharded by heads (dsv4_rocm.tp); without it, the unsharded layer. For each layer type of the tiny config
(16 heads, two output groups) it builds the layer from one seeded checkpoint (this rank's shard of it),
runs the same steps (two prefills, a chunked prefill beside decodes, decodes) and saves, per step, the
layer output and this rank's attention output o (its heads), and the caches at the end.

    torchrun --standalone --nproc-per-node 2 tests/layer/tp_ranks.py OUT_DIR [--device cpu|cuda] [--backend B]

writes OUT_DIR/rank{r}.pt; ``run(out_path, ...)`` is the same in one process (TP = 1)."""
import argparse
import contextlib
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(_HERE)), _HERE]      # this checkout's package and the tests' helpers

from dsv4_rocm import ops, tp                                 # noqa: E402
from dsv4_rocm.config import LayerType, tiny_config          # noqa: E402
from dsv4_rocm.serving import SyntheticServer                # noqa: E402
from test_weights import checkpoint                          # noqa: E402

CFG = tiny_config(num_heads=16)
MAX_LEN = 320
CACHES = ("swa", "comp", "idx", "comp_state", "idx_state")


def steps(cfg, seed=0):
    """Token rows per step: request 0 prefills 150 (past one C128 window), request 1 prefills 40 in two
    chunks beside request 0's decodes, then both decode."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(n, cfg.hidden_size, generator=g).bfloat16() for n in (156, 45)]
    return [{0: x[0][:150]}, {0: x[0][150:151], 1: x[1][:20]}, {0: x[0][151:152], 1: x[1][20:40]}] + \
        [{0: x[0][t:t + 1], 1: x[1][40 + t - 152:41 + t - 152]} for t in range(152, 156)]


def run(out_path, device=None, backend=None):
    rank, size, dev = tp.init_from_env(device)
    result = dict(rank=rank, size=size)
    with ops.use_backend(backend) if backend else contextlib.nullcontext():
        for layer in (CFG.first_layer_of(t) for t in LayerType):
            cfg, w = tp.rank_weights(checkpoint(CFG, layer, seed=layer), CFG, layer, device=dev)
            s = SyntheticServer(cfg, cfg.layer_type(layer), 2, MAX_LEN, device=str(dev), weights=w)
            s.layer = tp.TensorParallel(s.layer)
            seen = []
            o_proj = s.layer.layer._o_proj
            s.layer.layer._o_proj = lambda o, positions: (seen.append(o.float().cpu()), o_proj(o, positions))[1]
            ys, os_ = [], []
            for st in steps(CFG, seed=layer):
                out = s.step({b: t.to(dev) for b, t in st.items()})
                ys.append(torch.cat([out[b] for b in sorted(out)]).cpu())
                order = s.order({b: t.shape[0] for b, t in st.items()})     # rows of o are in step order
                ranges, at = {}, 0
                for b in order:
                    ranges[b], at = (at, at + st[b].shape[0]), at + st[b].shape[0]
                os_.append(torch.cat([seen[-1][slice(*ranges[b])] for b in sorted(st)]))
            caches = {n: getattr(s.cache, n).cpu() for n in CACHES if getattr(s.cache, n) is not None}
            result[cfg.layer_type(layer).value] = dict(y=ys, o=os_, caches=caches)
    torch.save(result, out_path.format(rank=rank))
    if size > 1:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default=None)
    a = p.parse_args()
    run(os.path.join(a.out_dir, "rank{rank}.pt"), a.device, a.backend)
