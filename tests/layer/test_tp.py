"""Tensor parallelism by heads (dsv4_rocm.tp): the layer of every type sharded over two ranks, started by
torchrun (gloo on the CPU, NCCL/RCCL on two GPUs), equals the unsharded layer on the same steps.

What is compared (tests/layer/tp_ranks.py runs the steps):
  * the caches: nothing in them is per head (one shared latent per token, MQA; the compressor state and
    the indexer K come from replicated weights), so a rank's shard of a cache is the whole cache: every
    rank's caches hold, byte for byte, the unsharded layer's caches;
  * what is per head: rank r's attention output o is heads [8r, 8r + 8) of the unsharded layer's o
    (bit for bit on the reference backend; on GPUs the kernels' split merges may differ with the head count);
  * the layer output: the same on both ranks, and within the rounding of the all-reduce of the unsharded
    output (docs/numerics.md#tensor-parallelism): relative Frobenius error <= 2^-7 per step (the rounding
    of two bf16 partials and of their sum gives about 2^-8.5; a rank's missing partial gives about 0.7).
"""
import os
import subprocess
import sys

import pytest
import torch

import tp_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "layer", "tp_ranks.py")
TYPES = ("swa", "c4a", "c128a")


def _torchrun(n, out_dir, device, backend=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", SCRIPT,
           str(out_dir), "--device", device] + (["--backend", backend] if backend else [])
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _compare(tp1, ranks, o_tol, y_tol):
    H = tp_ranks.CFG.num_heads // len(ranks)
    for r, rank in enumerate(ranks):
        assert (rank["rank"], rank["size"]) == (r, len(ranks))
        for t in TYPES:
            a, b = tp1[t], rank[t]
            assert set(b["caches"]) == set(a["caches"]) and len(b["caches"]) == {"swa": 1, "c4a": 5, "c128a": 3}[t]
            for name, c in a["caches"].items():
                assert torch.equal(_bytes(b["caches"][name]), _bytes(c)), f"rank {r} {t} {name} cache"
            for s, (o1, o) in enumerate(zip(a["o"], b["o"])):
                shard = o1[:, r * H:(r + 1) * H]
                assert o.shape == shard.shape
                if o_tol == 0:
                    assert torch.equal(o, shard), f"rank {r} {t} step {s}: o differs from heads {r * H}..{r * H + H - 1}"
                else:
                    assert _rel(o, shard) <= o_tol, f"rank {r} {t} step {s}: o"
            assert len(a["y"]) == len(b["y"]) == len(tp_ranks.steps(tp_ranks.CFG))
            for s, (y1, y) in enumerate(zip(a["y"], b["y"])):
                assert torch.equal(y, ranks[0][t]["y"][s]), f"rank {r} {t} step {s}: ranks disagree"
                err = _rel(y, y1)
                assert torch.isfinite(y.float()).all() and err <= y_tol, f"{t} step {s}: TP=2 vs TP=1 error {err:.3g}"


def test_tp2_equals_tp1_on_cpu_over_gloo(tmp_path):
    run = _torchrun(2, tmp_path, "cpu", "reference")
    try:
        tp1 = tp_ranks.run(str(tmp_path / "tp1.pt"), "cpu", "reference")      # TP = 1 here, meanwhile
        out, _ = run.communicate(timeout=900)
    finally:
        run.kill()
    assert run.returncode == 0, out[-4000:]
    _compare(tp1, [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)], o_tol=0, y_tol=2 ** -7)


def test_tensor_parallel_wrapper_is_the_layer_on_one_rank():
    from dsv4_rocm.serving import SyntheticServer
    from dsv4_rocm.tp import TensorParallel
    cfg = tp_ranks.CFG
    s = SyntheticServer(cfg, cfg.layer_type(0), 1, 64)
    x = torch.randn(5, cfg.hidden_size).bfloat16()
    step = s.make_step({0: 5})
    step.build(s.ratios())
    wrapped = TensorParallel(s.layer)
    assert (wrapped.tp_rank, wrapped.tp_size) == (0, 1) and wrapped.n_local_heads == cfg.num_heads
    before = s.cache.swa.clone()
    y = wrapped(step.positions, x, step)
    s.cache.swa.copy_(before)
    assert torch.equal(y, s.layer(step.positions, x, step))


@pytest.mark.gpu
def test_tp2_equals_tp1_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs on one machine (NCCL / RCCL)")
    run = _torchrun(2, tmp_path, "cuda")
    try:
        tp1 = tp_ranks.run(str(tmp_path / "tp1.pt"), "cuda:0")
        out, _ = run.communicate(timeout=900)
    finally:
        run.kill()
    assert run.returncode == 0, out[-4000:]
    # the GPU kernels may merge a different number of splits per head block: o within the sparse attention's
    # bf16 output rounding, and y within that plus the all-reduce's
    _compare(tp1, [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)], o_tol=2 ** -7, y_tol=2 ** -6)


def test_shard_of_the_unsharded_weights_is_the_checkpoints_shard():
    from dataclasses import fields

    from dsv4_rocm.tp import rank_weights
    from dsv4_rocm.weights import LayerWeights
    from test_weights import checkpoint
    cfg = tp_ranks.CFG
    for layer in (0, 1, 2):
        ck = checkpoint(cfg, layer, seed=layer)
        full = LayerWeights.from_checkpoint(ck, cfg, layer)
        for r in (0, 1):
            a, b = full.shard(cfg.with_tp(2), r), LayerWeights.from_checkpoint(ck, cfg.with_tp(2), layer, tp_rank=r)
            for f in fields(LayerWeights):
                x, y = getattr(a, f.name), getattr(b, f.name)
                assert (x is None and y is None) or torch.equal(x, y), f.name
        c1, w1 = rank_weights(full, cfg, layer)                  # no process group: the unsharded layer
        assert c1.tp_size == 1 and w1 is full
    with pytest.raises(ValueError, match="tp_rank"):
        full.shard(cfg.with_tp(2), 2)
    with pytest.raises(ValueError, match="hold 8 heads and 1 output groups; the unsharded tiny layer has 16 and 2"):
        full.shard(cfg.with_tp(2), 0).shard(cfg.with_tp(2), 0)
