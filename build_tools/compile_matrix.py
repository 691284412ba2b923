"""CPU-only compile check of every kernel for gfx942, gfx950, sm_90a and sm_100a.

HIP kernels (``hip_kernels/*.hip``): gfx942 / gfx950 with clang-22 against the HIP headers and bitcode
inside the triton wheel (``rocm_root.py``); sm_90a / sm_100a with nvcc after ``hip2cuda``. Checked: no
compile error, no ``s_trap``, no VGPR spills or scratch, no ptxas spills, and a hardware fp8 convert in
every kernel that writes fp8 bytes.

Triton kernels are compiled ahead of time with ``triton.compile(ASTSource(...), target=GPUTarget(...))``
(``GluonASTSource`` for a Gluon kernel) using the tile configuration each kernel module picks for that arch,
on the targets its spec names (``targets``; the others print as n/a), then checked:
  * AMD: ``v_mfma`` present in matrix kernels, no ``s_trap``, no VGPR spills or scratch, LDS within the
    workgroup limit (64 KB gfx942, 160 KB gfx950);
  * NVIDIA: ``wgmma`` (sm_90a) / ``tcgen05`` (sm_100a) present in matrix kernels, no spills (ptxas -v
    with the ptxas Triton ships; a kernel may state why its spills are accepted, ``ptxas_spills``), shared
    memory within 227 KB; kernels marked ``wgmma_pipelined``: no ptxas note that it serialized the wgmma;
  * fp8 GEMM kernels (``fp8_mma``): the matrix instruction takes fp8 operands (``v_mfma_*_fp8_*`` /
    ``v_mfma_*_f8f6f4``, ``wgmma ... .e4m3.e4m3``, ``tcgen05.mma ... kind::f8f6f4``);
  * kernels that write fp8 bytes use the hardware encode (``v_cvt_[scalef32_]pk_fp8_f32`` /
    ``cvt.rn.satfinite.e4m3x2.f32``); kernels whose fp32 arithmetic must be exact have no fma in their PTX.
Each target is compiled in a process of its own: Triton 3.6 keeps per-arch lowering decisions for AMD
targets process-wide (a gfx942 compile after a gfx950 one picks gfx950's fp8 conversions, and fails).
``python -m build_tools.compile_matrix`` prints kernel x target -> status, registers, LDS/shared, spills,
and exits non-zero on any failure.
"""
import argparse
import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict

TARGETS = {  # name: (backend, arch, warp size, platform arch string, LDS/shared limit)
    "gfx942": ("hip", "gfx942", 64, "gfx942", 64 * 1024),
    "gfx950": ("hip", "gfx950", 64, "gfx950", 160 * 1024),
    "sm_90a": ("cuda", 90, 32, "sm_90", 227 * 1024),
    "sm_100a": ("cuda", 100, 32, "sm_100", 227 * 1024),
}


@dataclass
class TritonKernel:
    name: str
    fn: Callable
    pointers: Dict[str, str]             # pointer args -> Triton pointer type
    floats: tuple                        # fp32 scalar args
    constexprs: Callable                 # (arch) -> dict of constexpr values
    options: Callable                    # (arch) -> dict(num_warps=..., num_stages=...)
    matrix: bool                         # must use the matrix units
    fp8_convert: bool = False            # must decode fp8 with the hardware convert (no software path)
    fp8_encode: bool = False             # must encode fp8 with the hardware convert
    exact_fp32: bool = False             # compiled with fp fusion off: no fma may appear in the PTX
    fp8_mma: bool = False                # its matrix instructions must take fp8 (e4m3) operands
    sgpr_spills: str = ""                # why SGPR spills (to VGPR lanes, not memory) are accepted; "" = none are
    ptxas_spills: str = ""               # why ptxas spills (NVIDIA targets) are accepted; "" = none are
    targets: tuple = ()                  # the targets it is written for (a Gluon kernel: one arch); () = all
    wgmma_pipelined: bool = False        # ptxas must keep its wgmma asynchronous (no C75xx serialization note)

    def applies_to(self, target: str) -> bool:
        return not self.targets or target in self.targets

    def signature(self):
        sig = {}
        for n in self.fn.arg_names:
            if n in self.pointers:
                sig[n] = self.pointers[n]
            elif n in self.floats:
                sig[n] = "fp32"
            elif n.isupper() or n == "num_warps":      # a Gluon kernel takes num_warps as a constexpr
                sig[n] = "constexpr"
            else:
                sig[n] = "i32"
        return sig

    def attrs(self):
        # pointers and strides are 16-byte aligned at run time (Triton specializes them the same way)
        names = [n for n in self.fn.arg_names if n in self.pointers or "stride" in n]
        return {(self.fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def triton_kernels():
    """Every entry of the ``COMPILE_SPECS`` lists that the modules of ``dsv4_rocm.triton`` declare: dicts
    with the TritonKernel fields (``constexprs`` and ``options`` are functions of the platform arch)."""
    import importlib
    import pkgutil
    import dsv4_rocm.triton as pkg
    kernels = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"dsv4_rocm.triton.{info.name}")
        kernels += [TritonKernel(**spec) for spec in getattr(mod, "COMPILE_SPECS", ())]
    return kernels


def _ptxas_report(ptx: str, arch: int, notes: list = None):
    import tempfile
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    exe = os.path.join(bindir, "ptxas-blackwell" if arch >= 100 and os.path.exists(
        os.path.join(bindir, "ptxas-blackwell")) else "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    if notes is not None:
        notes += [l for l in r.stderr.splitlines() if "wgmma.mma_async instructions are serialized" in l]
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return int(regs.group(1)) if regs else -1, (int(spill.group(1)) + int(spill.group(2))) if spill else 0


def _amd_report(asm: str):
    def get(key):
        m = re.search(rf"\.{key}:\s*(\d+)", asm)
        return int(m.group(1)) if m else 0
    return dict(vgpr=get("vgpr_count"), sgpr=get("sgpr_count"), vgpr_spill=get("vgpr_spill_count"),
                sgpr_spill=get("sgpr_spill_count"), scratch=get("private_segment_fixed_size"),
                lds=get("group_segment_fixed_size"))


def compile_triton(k: TritonKernel, target: str, only: str = None) -> dict:
    """The matrix row of kernel k on target, compiled in that target's own process (with every kernel
    whose name contains ``only``)."""
    if not k.applies_to(target):
        return dict(kernel=k.name, target=target, regs="-", smem=0, spills="-", problems=[], applies=False)
    rows = _target_rows(target, only)
    if k.name not in rows:
        raise RuntimeError(f"{k.name}: not compiled for {target} (worker rows: {sorted(rows)})")
    return rows[k.name]


@functools.lru_cache(maxsize=None)
def _target_rows(target: str, only: str = None) -> dict:
    r = subprocess.run([sys.executable, "-m", "build_tools.compile_matrix", "--worker", target]
                       + (["--only", only] if only else []), cwd=ROOT, capture_output=True, text=True)
    out = r.stdout.strip().splitlines()
    if r.returncode or not out:
        raise RuntimeError(f"compile worker for {target} failed: {r.stderr[-2000:]}")
    return {row["kernel"]: row for row in json.loads(out[-1])}


def _worker(target: str, only: str = None) -> None:
    rows = []
    for k in triton_kernels():
        if (only and only not in k.name) or not k.applies_to(target):
            continue
        try:
            rows.append(_compile_triton_here(k, target))
        except Exception as e:          # a compile error is a result of the matrix, not a crash of it
            msg = str(e).splitlines()[-1][:160] if str(e) else type(e).__name__
            rows.append(dict(kernel=k.name, target=target, regs="-", smem=0, spills="-",
                             problems=[f"compile error: {msg}"]))
    print(json.dumps(rows))


def _compile_triton_here(k: TritonKernel, target: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    backend, arch, warp, plat_arch, limit = TARGETS[target]
    constexprs, options = k.constexprs(plat_arch), k.options(plat_arch)
    if getattr(k.fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
        constexprs = dict(constexprs, num_warps=options["num_warps"])
    src = ASTSource(k.fn, k.signature(), constexprs=constexprs, attrs=k.attrs())
    c = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
    row = dict(kernel=k.name, target=target, problems=[])
    if backend == "hip":
        asm = c.asm["amdgcn"]
        rep = _amd_report(asm)
        lds = max(rep["lds"], c.metadata.shared)
        row.update(regs=f"v{rep['vgpr']}/s{rep['sgpr']}", smem=lds,
                   spills=f"v{rep['vgpr_spill']}/s{rep['sgpr_spill']}")
        if k.matrix and "v_mfma" not in asm:
            row["problems"].append("no v_mfma")
        if k.fp8_mma and not re.search(r"v_mfma\w*_(fp8|f8f6f4)", asm):
            row["problems"].append("no fp8 v_mfma")
        if k.fp8_convert and not re.search(r"v_cvt_(scalef32_)?pk_f32_fp8", asm):
            row["problems"].append("no hardware fp8 convert")
        if k.fp8_encode and not re.search(r"v_cvt_(scalef32_)?pk_fp8_f32", asm):
            row["problems"].append("no hardware fp8 encode")
        if "s_trap" in asm:
            row["problems"].append("s_trap")
        if rep["vgpr_spill"] or rep["scratch"]:
            row["problems"].append(f"VGPR spills {rep['vgpr_spill']}, scratch {rep['scratch']} B")
        if rep["sgpr_spill"] and not k.sgpr_spills:
            row["problems"].append(f"SGPR spills {rep['sgpr_spill']}")
    else:
        ptx = c.asm["ptx"]
        notes = []
        regs, spill = _ptxas_report(ptx, arch, notes)
        if k.wgmma_pipelined and notes:
            row["problems"].append("ptxas serialized the wgmma")
        # a warp-specialized kernel: the cap, then the register counts its partitions switch to
        moves = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
        row.update(regs=f"{regs}" + (f" ({'/'.join(map(str, moves))})" if moves else ""), smem=c.metadata.shared,
                   spills=str(spill))
        mma = "wgmma" if arch == 90 else "tcgen05"
        # fp8 readers decode with the hardware convert, or with the integer path (inline prmt with the
        # sign-replicate selector, dsv4_rocm/triton/sparse_mla_decode.py): never a software float path
        if k.fp8_convert and "cvt.rn.f16x2.e4m3x2" not in ptx and "0x9180" not in ptx:
            row["problems"].append("no hardware fp8 convert")
        if k.fp8_encode and "cvt.rn.satfinite.e4m3x2.f32" not in ptx:
            row["problems"].append("no hardware fp8 encode")
        if k.exact_fp32 and re.search(r"\bfma\.", ptx):
            row["problems"].append("fma in an exact-fp32 kernel")
        if k.matrix and mma not in ptx:
            row["problems"].append(f"no {mma}")
        fp8_mma = r"wgmma\.mma_async\S*\.e4m3\.e4m3" if arch == 90 else r"tcgen05\.mma\S*kind::f8f6f4"
        if k.fp8_mma and not re.search(fp8_mma, ptx):
            row["problems"].append(f"no fp8 {mma}")
        if spill and not k.ptxas_spills:
            row["problems"].append(f"{spill} B spilled")
    if row["smem"] > limit:
        row["problems"].append(f"LDS/shared {row['smem']} > {limit}")
    return row


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIP_DIR = os.path.join(ROOT, "hip_kernels")
HIP_INCLUDE = os.path.join(HIP_DIR, "include")
FP8_WRITERS = ("quantize_and_insert_k_cache", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
               "qnorm_rope_and_insert_full_k_cache")
CLANG_FLAGS = ["-x", "hip", "-std=c++17", "-O3", "-ffp-contract=off", "-fhip-fp32-correctly-rounded-divide-sqrt",
               "-Werror=float-conversion", "--cuda-device-only", "--no-gpu-bundle-output"]
NVCC_FLAGS = ["-std=c++17", "-O3", "--fmad=false", "-prec-div=true", "-prec-sqrt=true"]


def hip_sources():
    return sorted(f for f in os.listdir(HIP_DIR) if f.endswith(".hip"))


def compile_hip(name: str, target: str, workdir: str) -> dict:
    from .hip2cuda import translate_file
    from .rocm_root import find_tool, make_rocm_root
    backend, arch, _, _, limit = TARGETS[target]
    src = os.path.join(HIP_DIR, name)
    stem = name[:-4]
    row = dict(kernel=stem + ".hip", target=target, problems=[], regs="-", smem=0, spills="-")
    if backend == "hip":
        clang = find_tool(["clang++-22"])
        if clang is None:
            row["problems"].append("clang++-22 not found (apt-get install clang-22 lld-22 llvm-22)")
            return row
        root = make_rocm_root(os.path.join(workdir, "rocm_root"))
        out = os.path.join(workdir, f"{stem}.{arch}.s")
        r = subprocess.run([clang, *CLANG_FLAGS, f"--offload-arch={arch}", f"--rocm-path={root}",
                            f"-I{HIP_INCLUDE}", "-S", src, "-o", out], capture_output=True, text=True)
        if r.returncode:
            row["problems"].append("compile error: " + r.stderr.strip().splitlines()[0][:200])
            return row
        asm = open(out).read()
        rep = _amd_report(asm)
        row.update(regs=f"v{rep['vgpr']}/s{rep['sgpr']}", smem=rep["lds"],
                   spills=f"v{rep['vgpr_spill']}/s{rep['sgpr_spill']}")
        if "s_trap" in asm:
            row["problems"].append("s_trap")
        if rep["vgpr_spill"] or rep["scratch"]:
            row["problems"].append(f"VGPR spills {rep['vgpr_spill']}, scratch {rep['scratch']} B")
        if stem in FP8_WRITERS and "v_cvt_pk_fp8_f32" not in asm:
            row["problems"].append("no hardware fp8 convert")
    else:
        nvcc = find_tool(["nvcc"])
        if nvcc is None:
            row["problems"].append("nvcc not found")
            return row
        cu = translate_file(src, os.path.join(workdir, "cuda"))
        r = subprocess.run([nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{arch}a,code=sm_{arch}a", f"-I{HIP_INCLUDE}",
                            "-Xptxas", "-v", "-c", cu, "-o", os.path.join(workdir, f"{stem}.{arch}.o")],
                           capture_output=True, text=True)
        if r.returncode:
            err = [l for l in r.stderr.splitlines() if "error" in l] or r.stderr.splitlines()[:1]
            row["problems"].append("compile error: " + err[0][:200])
            return row
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spill = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)]
        smem = [int(x) for x in re.findall(r"(\d+) bytes smem", r.stderr)]
        row.update(regs=",".join(regs) or "-", smem=max(smem or [0]), spills=str(sum(spill)))
        if sum(spill):
            row["problems"].append(f"{sum(spill)} B spilled")
    if row["smem"] > limit:
        row["problems"].append(f"LDS/shared {row['smem']} > {limit}")
    return row


def run(targets=None, only=None, quiet=False, workdir=None):
    import tempfile
    rows = []
    workdir = workdir or os.path.join(tempfile.gettempdir(), "dsv4_compile_matrix")
    os.makedirs(workdir, exist_ok=True)
    for name in hip_sources():
        if only and only not in name:
            continue
        for t in targets or TARGETS:
            rows.append(compile_hip(name, t, workdir))
    for k in triton_kernels():
        if only and only not in k.name:
            continue
        for t in targets or TARGETS:
            rows.append(compile_triton(k, t, only))
    if not quiet:
        print(f"{'kernel':40s} {'target':8s} {'status':6s} {'regs':>10s} {'LDS/smem':>9s} {'spills':>8s}  problems")
        for r in rows:
            st = "n/a" if r.get("applies") is False else "ok" if not r["problems"] else "FAIL"
            print(f"{r['kernel']:40s} {r['target']:8s} {st:6s} {r['regs']:>10s} {r['smem']:9d} {r['spills']:>8s}  "
                  f"{'; '.join(r['problems'])}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", choices=sorted(TARGETS))
    p.add_argument("--only", default=None, help="substring of kernel names")
    p.add_argument("--worker", choices=sorted(TARGETS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.worker, a.only)
        return 0
    rows = run(a.target, a.only)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
