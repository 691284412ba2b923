"""Command line: ``python -m dsv4_rocm {run,bench,parity,info}``."""
import argparse
import sys


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dsv4_rocm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a DeepSeek-V4 layer of each type over a synthetic serving batch")
    r.add_argument("--config", default="v4-flash", help="v4-flash | v4-pro | tiny")
    r.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    r.add_argument("--backend", default=None, help="reference | triton | hip (default: fastest present)")
    r.add_argument("--requests", type=int, default=4)
    r.add_argument("--prompt-len", type=int, default=160)
    r.add_argument("--decode-steps", type=int, default=8)
    r.add_argument("--heads", type=int, default=None, help="local heads (default: the config's; CPU default 8)")
    r.add_argument("--layers", default="swa,c4a,c128a")
    b = sub.add_parser("bench", help="time the kernels against the measured floor and FlashMLA")
    b.add_argument("--device", default="cuda")
    b.add_argument("--json", default=None)
    b.add_argument("--only", default=None, help="substring of the case names to run")
    b.add_argument("--sweep", action="store_true", help="time every tile configuration, not only the default")
    pr = sub.add_parser("parity", help="golden vectors and cross-vendor parity reports")
    pr.add_argument("--write-golden", action="store_true", help="regenerate tests/golden from the reference")
    pr.add_argument("--golden-dir", default=None)
    pr.add_argument("--only", default=None, help="with --write-golden: only the cases whose name contains this")
    pr.add_argument("--device", default=None)
    pr.add_argument("--report", default=None, help="write a JSON parity report of this device")
    pr.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two parity reports")
    sub.add_parser("info", help="platform, backends and build")
    a = p.parse_args(argv)
    if a.cmd == "run":
        from .main_job import main_job
        return main_job(a)
    if a.cmd == "bench":
        from .bench.run import run
        run(a.device, a.json, a.only, a.sweep)
        return 0
    if a.cmd == "parity":
        from . import parity
        return parity.cli(a)
    if a.cmd == "info":
        import torch
        from . import ops
        from .platform import detect
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        print(detect(dev))
        print("backends:", ops.machine_backends(dev))
        print("torch", torch.__version__, "hip", torch.version.hip, "cuda", torch.version.cuda)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
