"""Command line: ``python -m dsv4_rocm {run,bench,parity,info}``.

A user error (a bad argument, a device the machine lacks, a file that is not there) is reported as one
line on stderr naming what is wrong and what to do, with exit status 2 and no traceback.
"""
import argparse
import importlib.util
import json
import os
import shutil
import signal
import sys

LAYER_TYPES = ("swa", "c4a", "c128a")


class UsageError(Exception):
    """A mistake in the command line or in what it asks of this machine; the message is the one line
    printed to the user, after the command (``prog``) it concerns."""

    def __init__(self, message, prog=None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse with its errors raised as one-line ``UsageError``s instead of usage text + exit."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _positive(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _layers(text):
    names = [t.strip() for t in text.split(",")]
    if all(t.isdigit() for t in names):           # DeepSeek-V4.1: layer ids of the stack
        return names
    bad = [t for t in names if t not in LAYER_TYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown layer type {bad[0]!r} in {text!r}; give a comma-separated "
                                         f"list of {', '.join(LAYER_TYPES)} (DeepSeek-V4: layer types) or of "
                                         "layer ids (DeepSeek-V4.1: the stack)")
    return names


# kv_cache.RECORD_FORMATS, named here so that the parser imports no torch
V41_RECORD_NAMES = ("V40_584", "V41_528", "V41_528+V41_FP4_288")


def _config_names():
    from .config import PRESETS
    return sorted(PRESETS) + ["tiny", "tiny-v4.1"]


def _parser():
    from .ops import BACKENDS
    p = _Parser(prog="python -m dsv4_rocm",
                description="DeepSeek-V4 attention kernels: the main job, benchmarks, parity reports, platform info.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="{run,bench,parity,info}")
    r = sub.add_parser("run", help="run a DeepSeek-V4 layer of each type over a synthetic serving batch")
    r.add_argument("--config", default="v4-flash", choices=_config_names())
    r.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present, else cpu)")
    r.add_argument("--backend", default=None, choices=BACKENDS, help="default: the fastest present")
    r.add_argument("--requests", type=_positive, default=4)
    r.add_argument("--prompt-len", type=_positive, default=160)
    r.add_argument("--decode-steps", type=_positive, default=8)
    r.add_argument("--heads", type=_positive, default=None,
                   help="local heads (default: the config's; CPU default 8)")
    r.add_argument("--layers", type=_layers, default=None,
                   help="comma-separated: swa,c4a,c128a (DeepSeek-V4; default all three) or layer ids (DeepSeek-V4.1: "
                        "the stack; default one layer of each kind with the sources they read)")
    r.add_argument("--chunk", type=_positive, default=512,
                   help="tokens a step may hold (decode tokens first, then prefill chunks); default 512")
    r.add_argument("--record", default=None, choices=V41_RECORD_NAMES,
                   help="DeepSeek-V4.1: the records of the sliding-window and compressed caches: V40_584 (default; "
                        "vLLM's fp8_ds_mla on ROCm and Hopper), V41_528 (its fp8_ds_mla on Blackwell) or "
                        "V41_528+V41_FP4_288 (its nvfp4_ds_mla)")
    r.add_argument("--long", action="store_true",
                   help="the long-context check instead of the trace: sampled rows of every layer kind at each "
                        "--long-lengths against a float64 reference, the C4 needle, the decode drift (bounded time; "
                        "prints the check table last)")
    r.add_argument("--long-lengths", default="32768,65536,131072", help="--long: context lengths (comma-separated)")
    r.add_argument("--long-decode-steps", type=_positive, default=8, help="--long: decode steps checked per length")
    r.add_argument("--long-needle-lengths", default="65536,131072", help="--long: contexts of the needle ('' for none)")
    r.add_argument("--long-drift-length", type=_positive, default=65536, help="--long: context of the drift run")
    r.add_argument("--long-drift-steps", type=int, default=1024, help="--long: decode steps of the drift run (0: none)")
    r.add_argument("--long-drift-kinds", default="c4a", help="--long: layer kinds of the drift run")
    r.add_argument("--long-v41-records", default=",".join(V41_RECORD_NAMES),
                   help="--long: records of the V4.1 stack checked, the first at every length, the others at the "
                        "longest ('none' to skip the stack)")
    r.add_argument("--long-kernels", default="default,portable",
                   help="--long: sparse-attention kernels the V4.0 kinds run on: default (the platform's: the "
                        "warp-specialized kernel on Hopper) and/or portable (the Triton kernel AMD runs; a second "
                        "kernel at the longest length)")
    r.add_argument("--long-out", default=None, help="--long: directory for long_context.txt and .json")
    b = sub.add_parser("bench", help="time the kernels against the measured floor and FlashMLA (needs a GPU)")
    b.add_argument("--device", default="cuda", help="cuda | cuda:N")
    b.add_argument("--json", default=None, help="write the report to this JSON file")
    b.add_argument("--plot", default=None,
                   help="PNG of fraction of floor and ratio to peers (default: beside --json, else dsv4_bench.png)")
    b.add_argument("--only", default=None, help="substring of the case names to run")
    b.add_argument("--sweep", action="store_true", help="time every tile configuration, not only the default")
    b.add_argument("--every-case", action="store_true",
                   help="under torchrun: every rank times every case (to compare GPUs), not its share of them")
    b.add_argument("--merge", nargs="+", metavar="REPORT",
                   help="join bench JSON reports (GPUs, machines, vendors) into one table, --json and --plot; "
                        "needs no GPU")
    pr = sub.add_parser("parity", help="golden vectors and cross-vendor parity reports")
    pr.add_argument("--write-golden", action="store_true", help="regenerate tests/golden from the reference")
    pr.add_argument("--golden-dir", default=None)
    pr.add_argument("--only", default=None, help="with --write-golden: only the cases whose name contains this")
    pr.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present, else cpu)")
    pr.add_argument("--report", default=None, help="write a JSON parity report of this device")
    pr.add_argument("--compare", nargs="+", metavar="REPORT",
                    help="compare two or more parity reports: fails on an output that failed anywhere, on bytes "
                         "that differ between devices, and on reports of different golden vectors")
    sub.add_parser("info", help="platform, backends and the state of the HIP extension")
    return p


def _gpu_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(flag, device, allow_cpu=True, needs=None):
    """The device string, validated against this machine; raises UsageError. ``needs``: what to tell a
    user who asked for a GPU this machine lacks (default: use --device cpu)."""
    import torch
    use = f"use {'cpu, ' if allow_cpu else ''}cuda or cuda:N (ROCm GPUs are cuda devices in torch)"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"{flag} {device!r} is not a device; {use}")
    if dev.type == "cpu" and allow_cpu:
        return device
    if dev.type != "cuda":
        raise UsageError(f"{flag} {device!r} is not supported; {use}")
    n = _gpu_count()
    if n == 0:
        build = ("a CPU-only build" if torch.version.cuda is None and torch.version.hip is None
                 else "which finds no device")
        raise UsageError(f"{flag} {device}: this machine has no GPU visible to torch (torch {torch.__version__}, "
                         f"{build}); {needs or 'use --device cpu'}")
    if dev.index is not None and dev.index >= n:
        raise UsageError(f"{flag} {device}: this machine has {n} GPU(s), cuda:0 to cuda:{n - 1}")
    return device


def _check_writable(flag, path):
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"{flag} {path}: directory {d} does not exist; create it or choose another path")


def cmd_run(a):
    import torch
    from .config import get_config
    device = check_device("--device", a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = get_config(a.config)
    heads = a.heads or (8 if device == "cpu" else cfg.local_heads)
    if cfg.num_heads % heads or cfg.o_groups % (cfg.num_heads // heads):
        divisors = [cfg.num_heads // tp for tp in range(1, cfg.o_groups + 1) if cfg.o_groups % tp == 0
                    and cfg.num_heads % tp == 0]
        raise UsageError(f"--heads {heads} does not split {a.config} ({cfg.num_heads} heads, {cfg.o_groups} "
                         f"output groups) over tensor-parallel ranks; choose one of {divisors}")
    from . import ops
    have = ops.machine_backends(device)
    env = os.environ.get("DSV4_BACKEND") or None
    for name, flag in ((a.backend, "--backend"), (None if a.backend else env, "DSV4_BACKEND")):
        if name is not None and name not in have:
            raise UsageError(f"{flag} {name} is not available on {device} here (available: {', '.join(have)}); "
                             f"pick one of those or leave {flag} unset")
    a.layers = a.layers or _default_layers(cfg)
    if cfg.is_v41 != all(t.isdigit() for t in a.layers):
        takes = "layer ids (a DeepSeek-V4.1 stack)" if cfg.is_v41 else f"layer types ({', '.join(LAYER_TYPES)})"
        raise UsageError(f"--layers {','.join(a.layers)}: {a.config} takes {takes}")
    if cfg.is_v41:
        from .serving import check_stack
        try:
            check_stack(cfg, [int(t) for t in a.layers])
        except ValueError as e:
            raise UsageError(f"--layers {','.join(a.layers)}: {e}")
    elif a.record is not None:
        raise UsageError(f"--record {a.record}: {a.config} is a DeepSeek-V4 config, whose caches hold V40_584 records; "
                         "--record picks a DeepSeek-V4.1 stack's")
    if a.long:
        _check_long_flags(a)
    a.device, a.heads, a.layers = device, heads, ",".join(a.layers)
    from .trace_check import run_trace_check
    return run_trace_check(a)


def _check_long_flags(a):
    """--long's lists: whole numbers >= 2 for the lengths, known record names (UsageError otherwise)."""
    for flag in ("long_lengths", "long_needle_lengths"):
        text = getattr(a, flag)
        try:
            vals = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            vals = [0]
        if any(v < 2 for v in vals) or (flag == "long_lengths" and not vals):
            raise UsageError(f"--{flag.replace('_', '-')} {text!r}: give comma-separated whole numbers of at least 2")
    recs = a.long_v41_records.split(",")
    bad = [r for r in recs if r not in V41_RECORD_NAMES] if a.long_v41_records != "none" else []
    if bad:
        raise UsageError(f"--long-v41-records {a.long_v41_records!r}: {bad[0]!r} is not one of "
                         f"{', '.join(V41_RECORD_NAMES)} (or 'none')")
    bad = [k for k in a.long_kernels.split(",") if k not in ("default", "portable")]
    if bad or not a.long_kernels:
        raise UsageError(f"--long-kernels {a.long_kernels!r}: give default and/or portable, comma-separated")


def _default_layers(cfg):
    """V4.0: every layer type. V4.1: V4.1-Flash's one layer of each kind, or every layer of a smaller config."""
    if not cfg.is_v41:
        return list(LAYER_TYPES)
    from .serving import FLASH_LAYERS
    if cfg.num_hidden_layers > max(FLASH_LAYERS):
        return [str(x) for x in FLASH_LAYERS]
    return [str(x) for x in range(cfg.num_hidden_layers)]


def _load_bench_report(path):
    try:
        with open(path) as f:
            rep = json.load(f)
    except OSError as e:
        raise UsageError(f"--merge: cannot read {path} ({e.strerror}); give reports written by bench --json")
    except ValueError as e:
        raise UsageError(f"--merge: {path} is not JSON ({e}); give reports written by bench --json")
    if not isinstance(rep, dict) or not isinstance(rep.get("rows"), list):
        raise UsageError(f"--merge: {path} is not a bench report (no 'rows'); give reports written by bench --json")
    return rep


def cmd_bench_merge(a):
    from .bench import merge
    from .bench.plot import write_plot
    reps = [_load_bench_report(p) for p in a.merge]
    if a.json:
        _check_writable("--json", a.json)
    plot = a.plot or (os.path.splitext(a.json)[0] + ".png" if a.json else "dsv4_bench_merged.png")
    _check_writable("--plot", plot)
    rep = merge.merge(reps, [os.path.basename(p) for p in a.merge])
    merge.print_table(rep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    if rep["rows"]:
        write_plot(rep, plot)
    return 0


def cmd_bench(a):
    if a.merge:
        return cmd_bench_merge(a)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1 and a.device.split(":")[0] == "cuda" and _gpu_count():
        # torchrun's rank: its own GPU (cuda:LOCAL_RANK); the ranks exchange only their reports, over gloo
        from .tp import init_from_env
        a.device = str(init_from_env(a.device, backend="gloo")[2])
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > _gpu_count():
            print(f"bench: {os.environ['LOCAL_WORLD_SIZE']} ranks share this machine's {_gpu_count()} GPU(s): "
                  "a rank's times include the others' work", file=sys.stderr)
    if a.device.split(":")[0] == "cpu":
        raise UsageError("bench times GPU kernels and cannot run on --device cpu (Triton has no CPU driver); "
                         "run it on a GPU machine, or time a CPU run with python -m dsv4_rocm run --device cpu")
    check_device("--device", a.device, allow_cpu=False,
                 needs="bench times GPU kernels: run it on a machine with an AMD Instinct or NVIDIA GPU")
    if a.json:
        _check_writable("--json", a.json)
    plot = a.plot or (os.path.splitext(a.json)[0] + ".png" if a.json else "dsv4_bench.png")
    _check_writable("--plot", plot)
    from .bench.run import run
    rep = run(a.device, a.json, a.only, a.sweep, plot=plot, every_case=a.every_case)
    if "devices" in rep or ranks == 1:      # rank 0 of several (the merged report), or a run of one GPU
        if not rep["rows"]:
            raise UsageError(f"--only {a.only!r} matches no benchmark case; run without --only to see the case names")
    return 1 if rep.get("errors") else 0


BUILD_AT_INSTALL = "pip install --no-deps --no-build-isolation -e . with the ROCm or CUDA torch installed first"


def extension_status():
    """Lines on dsv4_rocm._C: built, to be built on first use, or why not and where it gets built."""
    import torch
    spec = importlib.util.find_spec("dsv4_rocm._C")
    if spec is not None:
        return [f"HIP extension dsv4_rocm._C: built ({spec.origin})"]
    from ._build import sources_present
    if torch.version.hip is None and torch.version.cuda is None:
        return ["HIP extension dsv4_rocm._C: not built: this torch is a CPU build, so the hip backend is absent "
                "(the reference backend needs no extension)",
                f"  it is built on a GPU machine, at install ({BUILD_AT_INSTALL}) or on first use of a hip op"]
    compiler = "hipcc" if torch.version.hip is not None else "nvcc"
    if not sources_present():
        return ["HIP extension dsv4_rocm._C: not built, and this install has no kernel sources to build it from",
                f"  build it from a source checkout: {BUILD_AT_INSTALL}"]
    if shutil.which(compiler) is None:
        return [f"HIP extension dsv4_rocm._C: not built, and {compiler} is not on PATH, so the hip backend is absent",
                f"  install {'ROCm' if compiler == 'hipcc' else 'the CUDA toolkit'}; it is then built on first use"]
    return [f"HIP extension dsv4_rocm._C: not built yet; {compiler} builds it on first use of a hip op (minutes, once)",
            f"  or build it now: {BUILD_AT_INSTALL}"]


def cmd_info(a):
    import torch
    from . import ops
    from .platform import detect
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(detect(dev))
    print("backends:", ", ".join(ops.machine_backends(dev)), f"(for {dev} tensors)")
    print("torch", torch.__version__, "hip", torch.version.hip, "cuda", torch.version.cuda)
    tr = importlib.util.find_spec("triton")
    if tr is None:
        print("triton: not installed (the Triton kernels need it: pip install triton)")
    else:
        import triton
        print("triton", triton.__version__)
    print("\n".join(extension_status()))
    return 0


def main(argv=None):
    try:
        a = _parser().parse_args(argv)
        if a.cmd == "run":
            return cmd_run(a)
        if a.cmd == "bench":
            return cmd_bench(a)
        if a.cmd == "parity":
            if a.device is not None:
                check_device("--device", a.device)
            from . import parity
            try:
                return parity.cli(a)
            except parity.ReportError as e:
                raise UsageError(str(e))
        return cmd_info(a)
    except UsageError as e:
        prog = e.prog or "python -m dsv4_rocm" + (f" {a.cmd}" if "a" in locals() else "")
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _stdout_closed():
    """The reader of stdout went away (``info | head -1``): stop quietly, as ``cat`` or ``seq`` do. What is
    still buffered goes nowhere, so that the interpreter's last flush cannot fail with a traceback either;
    the exit status is a death by SIGPIPE (the shell's 141) where the system has that signal, else 1."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    return 1


def _cli():
    try:
        rc = main()
        sys.stdout.flush()                  # a closed pipe shows here, not in the interpreter's exit flush
    except BrokenPipeError:
        rc = _stdout_closed()
    return rc


if __name__ == "__main__":
    sys.exit(_cli())
