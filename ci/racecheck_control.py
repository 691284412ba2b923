"""A control for racecheck (ci/gpu_sanitize.sh): what the tool reports on a hand-off that is correct by the
mbarrier protocol, the same protocol as the Hopper decode kernel's P / alpha and row-factor hand-offs.

Two partitions of a Gluon kernel pass a shared 64-float buffer back and forth ROUNDS times: the producer (the
default partition, 4 warps) waits on ``free`` (parity (n & 1) ^ 1), writes the buffer, passes a partition
barrier and arrives on ``ready`` (one thread); the consumer (a 4-warp worker) waits on ``ready`` (parity
n & 1), reads the buffer, passes a partition barrier and arrives on ``free``. Every read sees the round's
values (checked on the output), so any hazard racecheck reports here is an ordering it cannot see, not a
race. Run it as ``compute-sanitizer --tool racecheck python ci/racecheck_control.py`` (Hopper, Gluon).
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
def _hand_off_kernel(out_ptr, ROUNDS: gl.constexpr, num_warps: gl.constexpr):
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [64], PLAIN)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize([(_producer, (buf, ready, free, ROUNDS)),
                        (_consumer, (buf, ready, free, out_ptr, ROUNDS))], [4], [128])


def main():
    out = torch.full((ROUNDS, 64), float("nan"), device="cuda")
    _hand_off_kernel[(1, )](out, ROUNDS=ROUNDS, num_warps=4)
    want = torch.arange(64, device="cuda").float() + 1000.0 * torch.arange(ROUNDS, device="cuda").float()[:, None]
    ok = torch.equal(out, want)
    print(f"racecheck control: {ROUNDS} mbarrier hand-offs between two partitions, every round read "
          f"{'its own values' if ok else 'WRONG values'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
