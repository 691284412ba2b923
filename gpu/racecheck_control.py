"""A control for racecheck (gpu/sanitize.sh): what the tool reports on a hand-off that is correct by the
mbarrier protocol, the same protocol as the Hopper decode kernel's P / alpha and row-factor hand-offs.

Two partitions of a Gluon kernel pass a shared 64-float buffer back and forth ROUNDS times: the producer (the
default partition, 4 warps) waits on ``free`` (parity (n & 1) ^ 1), writes the buffer, passes a partition
barrier and arrives on ``ready`` (one thread); the consumer (a 4-warp worker) waits on ``ready`` (parity
n & 1), reads the buffer, passes a partition barrier and arrives on ``free``. Every read sees the round's
values (checked on the output), so any hazard racecheck reports here is an ordering it cannot see, not a
race. Two layouts of the same protocol: ``_default_to_worker_kernel``, the producer the default partition
and the consumer a worker (as the decode kernel's loader -> consumers hand-off of K slots), and
``_worker_to_worker_kernel``, producer and consumer both workers beside a default partition that keeps
passing its own partition barriers (as the decode kernel's consumer 0 -> consumer 1 hand-offs of P, alpha
and the row factors, beside its loader). Run it as ``compute-sanitizer --tool racecheck python
gpu/racecheck_control.py`` (Hopper, Gluon).
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROUNDS = 8


@gluon.jit
def _producer(buf, ready, free, ROUNDS: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for n in range(ROUNDS):
        mbarrier.wait(free, (n & 1) ^ 1)
        buf.store(gl.arange(0, 64, layout=L).to(gl.float32) + n * 1000.0)
        gl.thread_barrier()
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _consumer(buf, ready, free, out_ptr, ROUNDS: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for n in range(ROUNDS):
        mbarrier.wait(ready, n & 1)
        v = buf.load(L)
        gl.store(out_ptr + n * 64 + gl.arange(0, 64, layout=L), v)
        gl.thread_barrier()
        mbarrier.arrive(free, count=1)


@gluon.jit
def _bystander(scratch, ROUNDS: gl.constexpr):
    """The default partition of the worker-to-worker layout: its own shared-memory work and partition
    barriers, touching nothing the hand-off uses."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for n in range(ROUNDS * 4):
        scratch.store(gl.arange(0, 128, layout=L).to(gl.float32) + n)
        gl.thread_barrier()


@gluon.jit
def _default_to_worker_kernel(out_ptr, ROUNDS: gl.constexpr, num_warps: gl.constexpr):
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [64], PLAIN)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize([(_producer, (buf, ready, free, ROUNDS)),
                        (_consumer, (buf, ready, free, out_ptr, ROUNDS))], [4], [128])


@gluon.jit
def _worker_to_worker_kernel(out_ptr, ROUNDS: gl.constexpr, num_warps: gl.constexpr):
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [64], PLAIN)
    scratch = gl.allocate_shared_memory(gl.float32, [128], PLAIN)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize([(_bystander, (scratch, ROUNDS)),
                        (_producer, (buf, ready, free, ROUNDS)),
                        (_consumer, (buf, ready, free, out_ptr, ROUNDS))], [4, 4], [128, 128])


def main():
    want = torch.arange(64, device="cuda").float() + 1000.0 * torch.arange(ROUNDS, device="cuda").float()[:, None]
    bad = 0
    for kernel in (_default_to_worker_kernel, _worker_to_worker_kernel):
        out = torch.full((ROUNDS, 64), float("nan"), device="cuda")
        kernel[(1, )](out, ROUNDS=ROUNDS, num_warps=4)
        ok = torch.equal(out, want)
        bad += not ok
        print(f"racecheck control {kernel.fn.__name__}: {ROUNDS} mbarrier hand-offs, every round read "
              f"{'its own values' if ok else 'WRONG values'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
