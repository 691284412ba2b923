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
``python -m build_tools.compile_matrix`` prints kernel x target -> status, registers, LDS/shared, spills
and the CPU seconds the compile took (compiler processes included), then each target's total and the
costliest kernels, and exits non-zero on any failure. The targets' processes and the HIP compiles run
``--jobs`` at a time. ``--out DIR`` writes each task's rows to ``DIR/<task>.json`` as it finishes: the
compile tests start such a run in the background when they are collected (``Background``) and read it.

On NVIDIA targets the register and spill report is the log of the ptxas run that built the cubin (kept
beside the kernel in Triton's cache, so a warm cache runs no ptxas).
"""
import argparse
import contextlib
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
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
    exact_fp32: bool = False             # compiled with fp fusion off: no fma may appear in the PTX ...
    own_fma: str = ""                    # ... unless the kernel calls tl.fma itself: why ("" = it does not)
    fp8_mma: bool = False                # its matrix instructions must take fp8 (e4m3) operands
    sgpr_spills: object = ""             # why SGPR spills (to VGPR lanes, not memory) are accepted; "" = none are
    ptxas_spills: object = ""            # why ptxas spills (NVIDIA targets) are accepted; "" = none are
    # (either reason may be a dict {target: reason}: accepted on those targets only)
    targets: tuple = ()                  # the targets it is written for (a Gluon kernel: one arch); () = all
    wgmma_pipelined: bool = False        # ptxas must keep its wgmma asynchronous (no C75xx serialization note)

    def applies_to(self, target: str) -> bool:
        return not self.targets or target in self.targets

    def accepted(self, reason, target: str) -> str:
        """The reason spills are accepted on ``target`` ("" where they are not)."""
        return reason.get(target, "") if isinstance(reason, dict) else reason

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
    """Every entry of the ``COMPILE_SPECS`` lists that the modules of ``dsv4_rocm.triton`` and its stage packages
    declare: dicts with the TritonKernel fields (``constexprs`` and ``options`` are functions of the platform
    arch). Modules are taken in the order of their own names, whatever their stage."""
    import importlib
    import pkgutil
    import dsv4_rocm.triton as pkg
    kernels = []
    infos = [i for i in pkgutil.walk_packages(pkg.__path__, prefix="dsv4_rocm.triton.") if not i.ispkg]
    for info in sorted(infos, key=lambda i: i.name.rsplit(".", 1)[1]):
        mod = importlib.import_module(info.name)
        kernels += [TritonKernel(**spec) for spec in getattr(mod, "COMPILE_SPECS", ())]
    return kernels


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of the child processes it has waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _run_timed(cmd, **kw):
    """``subprocess.run(cmd, capture_output=True, text=True)`` that also returns the CPU seconds of the child
    and of its own children, taken from wait4: compiles running side by side in threads each get theirs."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, **kw)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        r = subprocess.CompletedProcess(cmd, p.returncode, out.read().decode(errors="replace"),
                                        err.read().decode(errors="replace"))
    return r, ru.ru_utime + ru.ru_stime


PTXAS_LOG = "dsv4_ptxas.log"     # kept beside a kernel in Triton's cache: the log of the ptxas run that built it


def _ptxas_log(c, arch: int, printed: str) -> str:
    """The ``ptxas -v`` log of compiled kernel c's cubin: what Triton printed while building it (``printed``),
    else the copy kept beside the kernel in Triton's cache (a warm cache), else (a kernel cached before this
    report existed) a ptxas run with the flags Triton builds the cubin with. Kept in the cache either way."""
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.cache import get_cache_manager
    cache = get_cache_manager(c.hash)
    if "ptxas" in printed:
        cache.put(printed, PTXAS_LOG, binary=False)
        return printed
    kept = cache.get_file(PTXAS_LOG)
    if kept:
        with open(kept) as f:
            return f.read()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(c.asm["ptx"])
        fmad = [] if c.metadata.enable_fp_fusion else ["--fmad=false"]
        r = subprocess.run([get_ptxas(arch).path, "-lineinfo", *fmad, "-v", f"--gpu-name=sm_{arch}a", src,
                            "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    cache.put(r.stderr, PTXAS_LOG, binary=False)
    return r.stderr


def _ptxas_report(log: str):
    """(registers, spilled bytes, notes that ptxas serialized a wgmma) from a ``ptxas -v`` log."""
    notes = [l for l in log.splitlines() if "wgmma.mma_async instructions are serialized" in l]
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(regs.group(1)) if regs else -1, (int(spill.group(1)) + int(spill.group(2))) if spill else 0, notes


def _amd_report(asm: str):
    def get(key):
        m = re.search(rf"\.{key}:\s*(\d+)", asm)
        return int(m.group(1)) if m else 0
    return dict(vgpr=get("vgpr_count"), sgpr=get("sgpr_count"), vgpr_spill=get("vgpr_spill_count"),
                sgpr_spill=get("sgpr_spill_count"), scratch=get("private_segment_fixed_size"),
                lds=get("group_segment_fixed_size"))


def _selected(name: str, names=None, only=None) -> bool:
    return (not names or name in names) and (not only or only in name)


def _worker(target: str, names=None, only=None) -> None:
    """Compile the selected Triton kernels for one target in this process; print one JSON line: the rows
    (each with the CPU and wall seconds its compile took) and the CPU seconds of the process's start-up."""
    kernels = [k for k in triton_kernels() if _selected(k.name, names, only) and k.applies_to(target)]
    startup = _cpu_s()
    rows = []
    for k in kernels:
        c0, w0 = _cpu_s(), time.perf_counter()
        try:
            row = _compile_triton_here(k, target)
        except Exception as e:          # a compile error is a result of the matrix, not a crash of it
            msg = str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__
            row = dict(kernel=k.name, target=target, regs="-", smem=0, spills="-",
                       problems=[f"compile error: {msg}"])
        row.update(cpu_s=round(_cpu_s() - c0, 2), wall_s=round(time.perf_counter() - w0, 2))
        rows.append(row)
    print(json.dumps(dict(rows=rows, startup_cpu_s=round(startup, 2))))


def _compile_triton_here(k: TritonKernel, target: str) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    backend, arch, warp, plat_arch, limit = TARGETS[target]
    constexprs, options = k.constexprs(plat_arch), k.options(plat_arch)
    # kernels taking a PDL constexpr are launched with programmatic dependent launch on NVIDIA targets
    # (dsv4_rocm/triton/_pdl.py): compiled here as those GPUs run them
    pdl = backend == "cuda" and "PDL" in k.fn.arg_names
    if pdl:
        constexprs, options = dict(constexprs, PDL=True), dict(options, launch_pdl=True)
    if getattr(k.fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
        constexprs = dict(constexprs, num_warps=options["num_warps"])
    src = ASTSource(k.fn, k.signature(), constexprs=constexprs, attrs=k.attrs())
    # Triton prints the log of the ptxas run that builds the cubin when asked: the report reads it
    # instead of running ptxas a second time
    with knobs.nvidia.scope(), contextlib.redirect_stdout(io.StringIO()) as printed:
        knobs.nvidia.dump_ptxas_log = True
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
        if rep["sgpr_spill"] and not k.accepted(k.sgpr_spills, target):
            row["problems"].append(f"SGPR spills {rep['sgpr_spill']}")
    else:
        ptx = c.asm["ptx"]
        regs, spill, notes = _ptxas_report(_ptxas_log(c, arch, printed.getvalue()))
        if k.wgmma_pipelined and notes:
            row["problems"].append("ptxas serialized the wgmma")
        # a warp-specialized kernel: the cap, then the register counts its partitions switch to
        moves = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
        row.update(regs=f"{regs}" + (f" ({'/'.join(map(str, moves))})" if moves else ""), smem=c.metadata.shared,
                   spills=str(spill))
        mma = "wgmma" if arch == 90 else "tcgen05"
        # fp8 readers decode with the hardware convert, or with the integer path (inline prmt with the
        # sign-replicate selector, dsv4_rocm/triton/attention/sparse_mla_decode.py): never a software float path
        if k.fp8_convert and "cvt.rn.f16x2.e4m3x2" not in ptx and "0x9180" not in ptx:
            row["problems"].append("no hardware fp8 convert")
        if k.fp8_encode and "cvt.rn.satfinite.e4m3x2.f32" not in ptx:
            row["problems"].append("no hardware fp8 encode")
        if k.exact_fp32 and not k.own_fma and re.search(r"\bfma\.", ptx):
            row["problems"].append("fma in an exact-fp32 kernel")
        if k.matrix and mma not in ptx:
            row["problems"].append(f"no {mma}")
        if pdl and "griddepcontrol.wait" not in ptx:
            row["problems"].append("PDL kernel without griddepcontrol.wait")
        fp8_mma = r"wgmma\.mma_async\S*\.e4m3\.e4m3" if arch == 90 else r"tcgen05\.mma\S*kind::f8f6f4"
        if k.fp8_mma and not re.search(fp8_mma, ptx):
            row["problems"].append(f"no fp8 {mma}")
        if spill and not k.accepted(k.ptxas_spills, target):
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


def pip_nvcc():
    """nvcc from NVIDIA's ``nvidia-cuda-nvcc`` wheel, which installs it off PATH, or None."""
    import sysconfig
    exe = os.path.join(sysconfig.get_paths()["platlib"], "nvidia", "cu13", "bin", "nvcc")
    return exe if os.path.isfile(exe) else None


def find_nvcc():
    from .rocm_root import find_tool
    return find_tool(["nvcc"]) or pip_nvcc()


def compile_hip(name: str, target: str, workdir: str) -> dict:
    """The matrix row of hip_kernels/<name> on target, with the compiler's CPU and wall seconds."""
    from .hip2cuda import translate_file
    from .rocm_root import find_tool, make_rocm_root
    backend, arch, _, _, limit = TARGETS[target]
    src = os.path.join(HIP_DIR, name)
    stem = name[:-4]
    row = dict(kernel=stem + ".hip", target=target, problems=[], regs="-", smem=0, spills="-")
    w0 = time.perf_counter()
    if backend == "hip":
        clang = find_tool(["clang++-22"])
        if clang is None:
            row["problems"].append("clang++-22 not found (apt-get install clang-22 lld-22 llvm-22)")
            return row
        root = make_rocm_root(os.path.join(workdir, "rocm_root"))
        out = os.path.join(workdir, f"{stem}.{arch}.s")
        r, cpu = _run_timed([clang, *CLANG_FLAGS, f"--offload-arch={arch}", f"--rocm-path={root}",
                             f"-I{HIP_INCLUDE}", "-S", src, "-o", out])
        row.update(cpu_s=round(cpu, 2), wall_s=round(time.perf_counter() - w0, 2))
        if r.returncode:
            row["problems"].append("compile error: " + r.stderr.strip().splitlines()[0][:200])
            return row
        with open(out) as f:
            asm = f.read()
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
        nvcc = find_nvcc()
        if nvcc is None:
            row["problems"].append("nvcc not found")
            return row
        cu = translate_file(src, os.path.join(workdir, f"cuda_{arch}"))
        env = dict(os.environ, PATH=os.path.dirname(nvcc) + os.pathsep + os.environ.get("PATH", ""))
        r, cpu = _run_timed([nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{arch}a,code=sm_{arch}a",
                             f"-I{HIP_INCLUDE}", "-Xptxas", "-v", "-c", cu,
                             "-o", os.path.join(workdir, f"{stem}.{arch}.o")], env=env)
        row.update(cpu_s=round(cpu, 2), wall_s=round(time.perf_counter() - w0, 2))
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


# ---- tasks: a Triton target (one process) or the HIP sources of a target ---------------------------------
def tasks(targets=None, triton=True, hip=True):
    """Task names (``triton-<target>``, ``hip-<target>``), the costliest first so that parallel jobs end
    together: Triton's NVIDIA targets run ptxas on top of LLVM."""
    ts = [t for t in TARGETS if not targets or t in targets]
    order = sorted(ts, key=lambda t: TARGETS[t][0] != "cuda")
    return [f"triton-{t}" for t in order if triton] + [f"hip-{t}" for t in order if hip]


def run_task(task: str, workdir: str, names=None, only=None) -> dict:
    """One task (HIP compiles write in ``workdir``): dict(task, rows, cpu_s (the task's processes, start-up
    included), startup_cpu_s, wall_s, error (a crash of the task itself; a compile error is a row's problem))."""
    kind, target = task.split("-", 1)
    w0 = time.perf_counter()
    res = dict(task=task, rows=[], cpu_s=0.0, startup_cpu_s=0.0, error=None)
    if kind == "triton":
        cmd = [sys.executable, "-m", "build_tools.compile_matrix", "--worker", target]
        cmd += [a for n in names or () for a in ("--kernel", n)] + (["--only", only] if only else [])
        r, cpu = _run_timed(cmd, cwd=ROOT)
        out = r.stdout.strip().splitlines()
        res["cpu_s"] = round(cpu, 2)
        if r.returncode or not out:
            res["error"] = f"compile worker for {target} failed (exit {r.returncode}): {r.stderr[-2000:]}"
        else:
            w = json.loads(out[-1])
            res.update(rows=w["rows"], startup_cpu_s=w["startup_cpu_s"])
    else:
        res["rows"] = [compile_hip(n, target, workdir) for n in hip_sources() if _selected(n, names, only)]
        res["cpu_s"] = round(sum(r.get("cpu_s", 0.0) for r in res["rows"]), 2)
    res["wall_s"] = round(time.perf_counter() - w0, 2)
    return res


def _write_json(path: str, obj) -> None:
    """Write atomically: a reader polling for the file never sees half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def run(targets=None, only=None, quiet=False, workdir=None, jobs=None, names=None, out_dir=None,
        triton=True, hip=True):
    """Compile the matrix, ``jobs`` tasks at a time; returns the task results in ``tasks()`` order. With
    ``out_dir``, each task's result is written to ``out_dir/<task>.json`` as soon as it is done."""
    from concurrent.futures import ThreadPoolExecutor
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="dsv4_compile_matrix_") as d:
            return run(targets, only, quiet, d, jobs, names, out_dir, triton, hip)
    os.makedirs(workdir, exist_ok=True)
    todo = tasks(targets, triton, hip)
    amd_hip = [t for t in todo if t.startswith("hip-") and TARGETS[t[4:]][0] == "hip"]
    if amd_hip:
        from .rocm_root import find_tool, make_rocm_root
        if find_tool(["clang++-22"]) and find_tool(["llvm-as-22", "llvm-as"]):
            make_rocm_root(os.path.join(workdir, "rocm_root"))      # once, before tasks share it
    jobs = max(1, jobs or min(len(todo), os.cpu_count() or 1))

    def one(task):
        res = run_task(task, workdir, names, only)
        if out_dir:
            _write_json(os.path.join(out_dir, f"{task}.json"), res)
        return res
    with ThreadPoolExecutor(jobs) as ex:
        results = list(ex.map(one, todo))
    if not quiet:
        print_matrix(results)
    return results


def matrix_rows(results):
    """The rows of every task, kernel by kernel (Triton kernels in COMPILE_SPECS order, then HIP sources),
    target by target; a Triton kernel not written for a target gets an n/a row."""
    by = {(r["kernel"], r["target"]): r for res in results for r in res["rows"]}
    ran = {res["task"] for res in results}
    kernels = [k for k in triton_kernels()]
    rows = []
    for k in kernels:
        for t in TARGETS:
            if f"triton-{t}" not in ran:
                continue
            if (k.name, t) in by:
                rows.append(by[k.name, t])
            elif not k.applies_to(t) and any(k.name == r["kernel"] for r in by.values()):
                rows.append(dict(kernel=k.name, target=t, regs="-", smem=0, spills="-", problems=[], applies=False))
    hip = sorted({r["kernel"] for (n, _), r in by.items() if n.endswith(".hip")})
    rows += [by[n, t] for n in hip for t in TARGETS if (n, t) in by]
    return rows


def print_matrix(results, top=8):
    print(f"{'kernel':40s} {'target':8s} {'status':6s} {'regs':>10s} {'LDS/smem':>9s} {'spills':>8s} {'CPU s':>6s}  "
          f"problems")
    rows = matrix_rows(results)
    for r in rows:
        st = "n/a" if r.get("applies") is False else "ok" if not r["problems"] else "FAIL"
        cpu = f"{r['cpu_s']:6.1f}" if "cpu_s" in r else f"{'-':>6s}"
        print(f"{r['kernel']:40s} {r['target']:8s} {st:6s} {r['regs']:>10s} {r['smem']:9d} {r['spills']:>8s} {cpu}  "
              f"{'; '.join(r['problems'])}")
    print(f"\n{'task':16s} {'rows':>5s} {'CPU s':>7s} {'start-up':>9s} {'wall s':>7s}")
    for res in results:
        print(f"{res['task']:16s} {len(res['rows']):5d} {res['cpu_s']:7.1f} {res['startup_cpu_s']:9.1f} "
              f"{res['wall_s']:7.1f}" + (f"  {res['error']}" if res["error"] else ""))
    print(f"{'all':16s} {len(rows):5d} {sum(r['cpu_s'] for r in results):7.1f}")
    costly = sorted((r for r in rows if "cpu_s" in r), key=lambda r: -r["cpu_s"])[:top]
    if costly:
        print("costliest compiles (CPU s): " + ", ".join(f"{r['kernel']} {r['target']} {r['cpu_s']:.1f}"
                                                         for r in costly))


class Background:
    """The matrix compiled by another process while this one does other work: the test suite starts one
    when it collects the compile tests and each test reads its row when it runs. Results land in
    ``out_dir`` (``run(out_dir=...)``), the process's output in ``out_dir/run.log``; ``out_dir/run.json``
    names the process and its tasks, so that other processes (pytest-xdist's workers) can ``attach``."""

    def __init__(self, out_dir: str, pid: int, tasks: list, proc=None):
        self.out_dir, self.pid, self.tasks, self.proc = out_dir, pid, tasks, proc
        self.log = os.path.join(out_dir, "run.log")
        self.waited = 0.0        # seconds this process spent waiting for results

    @classmethod
    def start(cls, out_dir: str, names=None, targets=None, jobs: int = 1, niceness: int = 0, triton: bool = True,
              hip: bool = True) -> "Background":
        """Start the run: ``jobs`` tasks at a time, ``niceness`` below this process's CPU priority."""
        os.makedirs(out_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "build_tools.compile_matrix", "--out", out_dir, "--jobs", str(jobs), "--quiet",
               "--workdir", os.path.join(out_dir, "work")]
        cmd += [a for t in targets or () for a in ("--target", t)]
        cmd += [a for n in names or () for a in ("--kernel", n)]
        cmd += [] if triton else ["--no-triton"]
        cmd += [] if hip else ["--no-hip"]
        with open(os.path.join(out_dir, "run.log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        todo = tasks(targets, triton, hip)
        _write_json(os.path.join(out_dir, "run.json"), dict(pid=proc.pid, tasks=todo))
        return cls(out_dir, proc.pid, todo, proc)

    @classmethod
    def attach(cls, out_dir: str) -> "Background":
        """The run another process started in ``out_dir``."""
        with open(os.path.join(out_dir, "run.json")) as f:
            meta = json.load(f)
        return cls(out_dir, meta["pid"], meta["tasks"])

    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:                                    # a process this one did not start: alive and not a zombie
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def result(self, task: str, timeout: float = 3600) -> dict:
        """Task's result, waiting for it; raises RuntimeError if the run ended without it."""
        path = os.path.join(self.out_dir, f"{task}.json")
        t0 = time.perf_counter()
        while not os.path.exists(path):
            if not self.running() and not os.path.exists(path):
                with open(self.log) as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"the compile matrix run ended without {task}: {tail}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"no result for {task} after {timeout:.0f} s (see {self.log})")
            time.sleep(0.2)
        self.waited += time.perf_counter() - t0
        with open(path) as f:
            res = json.load(f)
        if res["error"]:
            raise RuntimeError(res["error"])
        return res

    def row(self, kernel: str, target: str) -> dict:
        """The row of a Triton kernel (by its matrix name) or of a HIP source (``name.hip``) on target."""
        res = self.result(f"{'hip' if kernel.endswith('.hip') else 'triton'}-{target}")
        for r in res["rows"]:
            if r["kernel"] == kernel:
                return r
        raise RuntimeError(f"{kernel}: not compiled for {target} (rows: {sorted(r['kernel'] for r in res['rows'])})")

    def done(self):
        """The results present now, in task order."""
        out = []
        for t in self.tasks:
            p = os.path.join(self.out_dir, f"{t}.json")
            if os.path.exists(p):
                with open(p) as f:
                    out.append(json.load(f))
        return out

    def stop(self):
        """End the run (its process group: the driver and its compile workers) if this process started it."""
        if self.proc is not None and self.proc.poll() is None:
            import signal
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", choices=sorted(TARGETS))
    p.add_argument("--only", default=None, help="substring of kernel names")
    p.add_argument("--kernel", action="append", default=None,
                   help="a kernel's exact matrix name (a Triton entry or NAME.hip); repeat for several")
    p.add_argument("--jobs", type=int, default=None, help="tasks compiled at once (default: one per CPU)")
    p.add_argument("--out", default=None, help="write each task's rows to OUT/<task>.json as it finishes")
    p.add_argument("--no-triton", action="store_true", help="only the HIP sources")
    p.add_argument("--no-hip", action="store_true", help="only the Triton kernels")
    p.add_argument("--quiet", action="store_true", help="print no table")
    p.add_argument("--workdir", default=None, help="where HIP compiles write (default: a temporary directory)")
    p.add_argument("--worker", choices=sorted(TARGETS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.worker, a.kernel, a.only)
        return 0
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    results = run(a.target, a.only, quiet=a.quiet, workdir=a.workdir, jobs=a.jobs, names=a.kernel, out_dir=a.out,
                  triton=not a.no_triton, hip=not a.no_hip)
    return 1 if any(r["error"] or any(row["problems"] for row in r["rows"]) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
