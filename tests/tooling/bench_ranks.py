"""What each rank of the cluster-benchmark test runs (tests/tooling/test_bench_cluster.py), under torchrun on the
CPU with gloo: ``bench.run.run`` itself (the case shards, the gather to rank 0, the merged JSON, table and
PNG) over a stand-in case list, since a CPU has no kernels to time. The stand-ins: the two ceilings, and
the suites: one whose eight cases take (case + 1) * (rank + 1) us, and one that fails on rank 1.

    torchrun --standalone --nproc-per-node 2 tests/tooling/bench_ranks.py OUT_DIR

writes OUT_DIR/shared.json (each case on one rank) and OUT_DIR/every.json (every case on every rank),
with their PNGs."""
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(_HERE)), _HERE]

import torch.distributed as dist                             # noqa: E402

from dsv4_rocm import tp                                     # noqa: E402
from dsv4_rocm.bench import run as bench_run                 # noqa: E402
from dsv4_rocm.bench.context import BenchContext             # noqa: E402

CASES = [f"stand-in case {i}" for i in range(8)]


def timed_suite(ctx):
    for i, name in enumerate(CASES):
        if ctx.wants(name, "stand-in"):
            ctx.add(name, "cfg", 1e-3 * (i + 1) * (dist.get_rank() + 1), flop=1e6, nbytes=1e6)


def failing_suite(ctx):
    if dist.get_rank() == 1:
        raise RuntimeError("out of memory on the stand-in GPU")


def measure_ceilings(self):
    self.bw, self.mm = 1e12, 1e15


if __name__ == "__main__":
    out = sys.argv[1]
    tp.init_from_env("cpu")
    BenchContext.measure_ceilings = measure_ceilings
    bench_run.suites = lambda: [types.SimpleNamespace(__name__="dsv4_rocm.bench.timed", suite=timed_suite),
                                types.SimpleNamespace(__name__="dsv4_rocm.bench.failing", suite=failing_suite)]
    for name, every in (("shared", False), ("every", True)):
        bench_run.run("cpu", os.path.join(out, f"{name}.json"), plot=os.path.join(out, f"{name}.png"),
                      every_case=every)
    dist.destroy_process_group()
