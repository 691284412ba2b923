"""What every benchmark suite shares: the device, the two ceilings measured in this run, the case filter,
and the rows. A suite module (any ``dsv4_rocm/bench/*.py`` with a ``suite(ctx)`` function) times its cases
and calls ``ctx.add``; ``bench.run`` finds the suites, runs them and prints one table.

Fraction of floor = max(bytes / copy bandwidth, FLOP / matmul rate) / time, with the bandwidth and
the matmul rate measured in the same run (``timing``). A peer (FlashMLA, torch, ...) is timed in the
same run on the same tensors and recorded beside the row: ratio = peer time / our time.

Under torchrun each rank has a context of its own GPU; ``shard`` = (rank, ranks) gives each case to one
rank (by a hash of its name, the same on every rank and every machine), or every rank times every case
(``shard`` None) to compare GPUs.
"""
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .timing import bf16_matmul_rate, copy_bandwidth


@dataclass
class BenchContext:
    device: str = "cuda"
    only: Optional[str] = None
    sweep: bool = False
    shard: Optional[Tuple[int, int]] = None      # (this rank, ranks): time only the cases that fall to it
    rows: List[dict] = field(default_factory=list)
    bw: float = 0.0          # bytes/s, device-to-device copy (read + write)
    mm: float = 0.0          # FLOP/s, bf16 matmul

    def measure_ceilings(self):
        self.bw = copy_bandwidth(self.device)
        self.mm = bf16_matmul_rate(self.device)

    def selects(self, text: str) -> bool:
        """Whether ``--only`` (a substring) selects ``text``: a case name, or a word naming a suite's cases."""
        return not self.only or self.only in text

    def wants(self, name: str, group: Optional[str] = None) -> bool:
        """Whether this run times case ``name``: ``--only`` selects its name or its ``group`` (a word that
        selects all of a suite's cases), and in a sharded run the case falls to this rank."""
        if not (self.selects(name) or (group is not None and self.only and self.only in group)):
            return False
        return self.shard is None or zlib.crc32(name.encode()) % self.shard[1] == self.shard[0]

    def add(self, case: str, config: str, ms: float, flop: float = 0, nbytes: float = 0, peer: str = None,
            peer_ms: float = None, rate: float = None, **extra) -> dict:
        """One timed result. ``rate`` overrides the matmul rate of the floor (e.g. the fp8 rate)."""
        mm = rate or self.mm
        floor_ms = max(nbytes / self.bw if self.bw else 0.0, flop / mm if mm else 0.0) * 1e3
        row = dict(case=case, config=config, us=ms * 1e3, tflops=flop / ms / 1e9, tbps=nbytes / ms / 1e9,
                   floor_us=floor_ms * 1e3, frac_floor=floor_ms / ms if ms else 0.0, peer=peer,
                   peer_us=None if peer_ms is None else peer_ms * 1e3,
                   ratio=None if peer_ms is None else peer_ms / ms, **extra)
        self.rows.append(row)
        return row

    def report(self) -> dict:
        """This device's report: what it is (``device``, ``arch``, the ``host`` and ``gpu`` index that tell
        it from the others of a cluster run), the two ceilings, and the rows."""
        import socket
        import time
        from ..platform import detect
        dev = torch.device(self.device)
        gpu = dev.type == "cuda"
        index = (dev.index if dev.index is not None else torch.cuda.current_device()) if gpu else None
        return dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(dev) if gpu else str(dev),
                    arch=detect(dev).arch if gpu else "cpu", host=socket.gethostname(), gpu=index,
                    copy_TBps=self.bw / 1e12, bf16_TFLOPs=self.mm / 1e12, rows=self.rows)
