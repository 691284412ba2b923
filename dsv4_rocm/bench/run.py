"""Run every benchmark suite (``dsv4_rocm/bench/*.py`` modules with a ``suite(ctx)`` function) and print
one table: time, TFLOP/s, TB/s, fraction of the measured floor, and the ratio to any peer timed in the
same run. Results go to a JSON file and a PNG (``plot.py``).

Under torchrun (``torchrun --nproc-per-node N -m dsv4_rocm bench``, or srun starting torchrun on several
nodes) every rank times its own GPU over its share of the cases, or over every case (``every_case``, to
compare GPUs); rank 0 gathers the ranks' reports with torch.distributed and writes the one JSON, table and
PNG of all devices (``merge.py``). A rank whose suite fails still sends what it has, with the error.
"""
import importlib
import json
import pkgutil

from .context import BenchContext


def suites():
    """The suite modules of this package, in name order."""
    pkg = importlib.import_module(__package__)
    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{__package__}.{info.name}")
        if callable(getattr(mod, "suite", None)):
            mods.append(mod)
    return mods


def run(device="cuda", out_json=None, only=None, sweep=False, plot=None, every_case=False) -> dict:
    """The report of this process's device; under torch.distributed with several ranks, on rank 0 the
    merged report of every rank's device (``merge.merge``), on the others their own."""
    from ..tp import rank_and_size
    rank, size = rank_and_size()
    if size > 1:
        return _run_ranks(device, out_json, only, sweep, plot, every_case, rank, size)
    ctx = BenchContext(device=device, only=only, sweep=sweep)
    ctx.measure_ceilings()
    for mod in suites():
        n = len(ctx.rows)
        mod.suite(ctx)
        if len(ctx.rows) > n:                 # each suite's rows as they come, and the report so far on disk
            print_table(dict(ctx.report(), rows=ctx.rows[n:]), header=n == 0)
            if out_json:
                with open(out_json, "w") as f:
                    json.dump(ctx.report(), f, indent=1)
    report = ctx.report()
    if plot and report["rows"]:
        from .plot import write_plot
        write_plot(report, plot)
    return report


def _run_ranks(device, out_json, only, sweep, plot, every_case, rank, size) -> dict:
    import torch.distributed as dist

    from . import merge
    ctx = BenchContext(device=device, only=only, sweep=sweep, shard=None if every_case else (rank, size))
    errors = []
    ctx.measure_ceilings()
    for mod in suites():
        name, n = mod.__name__.rsplit(".", 1)[-1], len(ctx.rows)
        try:
            mod.suite(ctx)
            print(f"rank {rank} ({ctx.device}): {name}: {len(ctx.rows) - n} rows", flush=True)
        except Exception as e:             # the others wait in the gather: send the error with the rows
            errors.append(f"{name}: {type(e).__name__}: {e}")
            print(f"rank {rank} ({ctx.device}): {errors[-1]}", flush=True)
    own = dict(ctx.report(), rank=rank, errors=errors)
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(own, gathered, dst=0)
    if rank != 0:
        return own
    report = merge.merge(gathered, [f"rank {r}" for r in range(size)])
    report.update(ranks=size, every_case=every_case)
    merge.print_table(report)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(report, f, indent=1)
    if plot and report["rows"]:
        from .plot import write_plot
        write_plot(report, plot)
    return report


def print_table(rep, header=True):
    if header:
        print(f"\n{rep['device']} ({rep['arch']}), copy {rep['copy_TBps']:.2f} TB/s, "
              f"bf16 mm {rep['bf16_TFLOPs']:.0f} TFLOP/s")
        print(f"{'case':36s} {'config':10s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} {'floor':>6s} {'peer':>24s}")
    for r in rep["rows"]:
        peer = ""
        if r.get("ratio") is not None:
            peer = f"{r['ratio']:.2f}x {r['peer']} ({r['peer_us']:.1f}us)"
        print(f"{r['case']:36s} {r['config']:10s} {r['us']:9.1f} {r['tflops']:8.1f} {r['tbps']:6.2f} "
              f"{r['frac_floor']:6.0%} {peer:>24s}")
