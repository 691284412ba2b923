"""AMDGCN report of the portable sparse MLA kernels, compiled on the CPU, and the time it predicts on AMD parts.

For each sparse MLA entry of the compile matrix (``build_tools/compile_matrix.py``: the same kernels, the
same constexprs and options the modules pick per arch) on gfx942 and gfx950, compiled with
``triton.compile(..., target=GPUTarget("hip", arch, 64))`` (no GPU needed), the report reads from the
AMDGCN:

  * registers: arch VGPRs, accumulation VGPRs (AGPRs), SGPRs, VGPR/SGPR spills and scratch bytes;
  * LDS bytes of a workgroup (Triton allocates it at launch: the larger of the ELF's fixed size and the
    compile's ``metadata.shared``);
  * occupancy: waves per SIMD from the unified 512-entry VGPR file (allocation granule 8) and from the LDS
    of a CU (64 KB gfx942, 160 KB gfx950), in whole workgroups;
  * each loop of the kernel, found by its back-edge (a branch to a label defined above it): the instruction
    mix of one iteration (VALU, of it transcendental; MFMA with their FLOP; vector-memory loads by width;
    stores; LDS reads / writes and their bytes; s_waitcnt; s_barrier), scaled to 64 keys when the loop
    walks BLOCK_N keys an iteration;
  * bytes in flight: the loop body is walked twice (the second pass is the steady state), vector-memory
    operations enter a queue and ``s_waitcnt vmcnt(N)`` retires all but the newest N (on gfx9 vmcnt counts
    loads and stores); the peak of the queued load bytes x 64 lanes is a wave's bytes in flight, times the
    waves a CU holds is the CU's.

``--predict`` then turns the key loop's counts into the time of the issue's decode and prefill cases on
MI300X (gfx942) and MI355X (gfx950), beside the floor max(bytes / HBM bandwidth, FLOP / dense bf16 peak).
Per 16-key iteration of a workgroup (the key tile), on one SIMD (the workgroup's waves spread over 4):

  * MFMA: waves per SIMD x the iteration's MFMA FLOP / the SIMD's rate (gfx942: 512 FLOP/clock, the 1307
    TFLOP/s peak; gfx950: 1024 for the double-K bf16 shapes 16x16x32 / 32x32x16, 512 for the older shapes);
  * VALU: waves per SIMD x (4 clocks a VALU instruction of a wave64 on a 16-lane SIMD, 16 for a
    transcendental one);
  * LDS: the workgroup's LDS bytes of an iteration at 128 B/clock per CU;
  * latency: the memory round trips an iteration waits for (``s_waitcnt vmcnt`` that retire loads) x an
    assumed 700 ns a round trip (``--latency-ns``; an HBM gather on MI300X-class parts, an L2 hit is
    faster: not measured here). By Little's law the CU's bandwidth is then its bytes in flight / 700
    ns: the CU's share of the HBM (MI300X 17.4 B/ns, MI355X 31 B/ns) needs 12-22 KB in flight.

The iteration takes the largest of these (``max``: perfect overlap), their sum (``serial``: no overlap), or
(``likely``) the latency plus the largest of the other three: with one workgroup a CU its waves wait for
the loads of an iteration together, the loads being issued in the iteration that waits for them, while
the MFMA, VALU and LDS work of the two waves on a SIMD overlaps. The program takes its tiles times that,
the grid its rounds of programs over the CUs (``_num_splits`` of the decode picks the splits); split
partials add their fp32 write and the combine launch's read at the HBM rate. All of it is a prediction
from static counts: no AMD GPU was used. Prints the tables (``--json`` writes the rows). Each target
compiles in its own process, as the compile matrix does (Triton keeps per-arch lowering choices
process-wide).

    python -m build_tools.amd_isa_report [--target gfx942] [--only sparse_mla_decode] [--predict]

The tables and what they say about the kernels: docs/perf_notes.md#amd-isa.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

from .compile_matrix import ROOT, TARGETS, triton_kernels

AMD_TARGETS = ("gfx942", "gfx950")
KERNEL_PREFIX = "sparse_mla_"             # the compile matrix entries this report covers
LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
MAX_WAVES_PER_SIMD = 8
VGPRS_PER_SIMD_LANE = 512                 # arch + accumulation VGPRs share one file on gfx90a / gfx942 / gfx950
VGPR_GRANULE = 8
TRANSCENDENTAL = re.compile(r"v_(exp|log|rcp|rsq|sqrt|sin|cos)_")


# ---- the parts the prediction is for ---------------------------------------------------------------------
PARTS = {  # target: (part, CUs, clock GHz, HBM TB/s, dense bf16 TFLOP/s)
    "gfx942": ("MI300X", 304, 2.1, 5.3, 1307.0),
    "gfx950": ("MI355X", 256, 2.4, 8.0, 2500.0),
}
LATENCY_NS = 700.0      # assumed load-to-use latency of one gather round trip (module docstring)


def mfma_flop(op: str) -> int:
    """FLOP of one MFMA instruction of a wave, from its shape (``v_mfma_f32_32x32x8_bf16``: 2 x 32 x 32 x 8;
    a ``_4x4x4_16b`` shape does 16 blocks)."""
    m = re.search(r"_(\d+)x(\d+)x(\d+)(?:_?(\d+)b)?", op)
    if not m:
        return 0
    f = 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    return f * (int(m.group(4)) if m.group(4) else 1)


def mfma_clocks(op: str, target: str) -> float:
    """Clocks one MFMA occupies its SIMD's matrix unit: FLOP / the SIMD's rate for that shape. bf16 / f16:
    512 FLOP a clock on gfx942 (its 1307 TFLOP/s); gfx950 doubles it for the double-K shapes (16x16x32,
    32x32x16) only. fp8: twice the 16-bit rate of the shape's generation (gfx950's f8f6f4: 2048)."""
    m = re.search(r"_(\d+)x(\d+)x(\d+)", op)
    double_k = bool(m) and (m.group(1), m.group(3)) in (("16", "32"), ("32", "16"))
    rate = 1024.0 if target == "gfx950" and double_k else 512.0
    if "f8f6f4" in op:
        rate = 2048.0
    elif re.search(r"fp8|bf8", op):
        rate = 1024.0
    return mfma_flop(op) / rate


def load_bytes(op: str) -> int:
    """Bytes a lane moves with a vector-memory or LDS instruction (``global_load_dwordx4``: 16)."""
    if "read2st64" in op or "read2" in op or "write2" in op:
        m = re.search(r"_b(\d+)", op)
        return 2 * int(m.group(1)) // 8 if m else 8
    m = re.search(r"dwordx(\d)", op)
    if m:
        return 4 * int(m.group(1))
    if re.search(r"dword\b|_b32|_u32|_i32", op) or op.endswith("dword"):
        return 4
    m = re.search(r"_b(\d+)", op)
    if m:
        return int(m.group(1)) // 8
    if re.search(r"short|_u16|_i16|_d16", op):
        return 2
    if re.search(r"byte|_u8|_i8", op):
        return 1
    return 4


def classify(op: str) -> str:
    if op.startswith("v_mfma"):
        return "mfma"
    if op.startswith(("global_load", "buffer_load", "flat_load")):
        return "vmem_load"
    if op.startswith(("global_store", "buffer_store", "flat_store", "global_atomic", "buffer_atomic")):
        return "vmem_store"
    if op.startswith("ds_"):
        return "lds_write" if "write" in op or op.startswith(("ds_store", "ds_add")) else "lds_read"
    if op.startswith("v_"):
        return "valu"
    if op == "s_waitcnt":
        return "waitcnt"
    if op == "s_barrier":
        return "barrier"
    if op.startswith("s_"):
        return "salu"
    return "other"


# ---- parsing ---------------------------------------------------------------------------------------------
def kernel_text(asm: str) -> list:
    """The instruction lines of the kernel's code (the text section up to the end of the function),
    comments stripped, labels kept as ``label:``."""
    out = []
    for line in asm.splitlines():
        if line.startswith(".Lfunc_end"):
            break
        s = line.split(";", 1)[0].strip()
        if not s or (s.startswith(".") and not s.endswith(":") and not re.match(r"\.LBB\d+_\d+:", s)):
            continue
        out.append(s)
    return out


def metadata(asm: str) -> dict:
    def get(key):
        m = re.search(rf"\.{key}:\s*(\d+)", asm)
        return int(m.group(1)) if m else 0
    acc = re.search(r"\.amdhsa_accum_offset\s+(\d+)", asm)
    return dict(vgpr=get("vgpr_count"), agpr=get("agpr_count"), sgpr=get("sgpr_count"),
                vgpr_spill=get("vgpr_spill_count"), sgpr_spill=get("sgpr_spill_count"),
                scratch=get("private_segment_fixed_size"), lds_fixed=get("group_segment_fixed_size"),
                accum_offset=int(acc.group(1)) if acc else 0)


def loops(lines: list) -> list:
    """(first, last) line indices of each loop: a label and the last branch back to it from below. Nested
    loops are kept apart (an inner loop's lines count in its outer loop too)."""
    where = {l[:-1]: i for i, l in enumerate(lines) if l.endswith(":")}
    back = {}
    for i, l in enumerate(lines):
        m = re.match(r"s_(c?branch\w*)\s+(\.LBB\d+_\d+)", l)
        if m and m.group(2) in where and where[m.group(2)] < i:
            back[m.group(2)] = i
    return sorted((where[lab], last) for lab, last in back.items())


def mix(body: list, target: str) -> dict:
    """Instruction counts of one pass over ``body`` (conditional blocks counted as taken)."""
    c = dict(valu=0, transcendental=0, mfma=0, mfma_flop=0, mfma_clocks=0.0, vmem_load=0, vmem_load_bytes=0,
             vmem_store=0, lds_read=0, lds_write=0, lds_bytes=0, waitcnt=0, barrier=0, salu=0,
             loads_by_width={}, mfma_ops={})
    for l in body:
        if l.endswith(":"):
            continue
        op = l.split()[0]
        k = classify(op)
        if k == "valu":
            c["valu"] += 1
            c["transcendental"] += bool(TRANSCENDENTAL.match(op))
        elif k == "mfma":
            c["mfma"] += 1
            c["mfma_flop"] += mfma_flop(op)
            c["mfma_clocks"] += mfma_clocks(op, target)
            c["mfma_ops"][op] = c["mfma_ops"].get(op, 0) + 1
        elif k == "vmem_load":
            b = load_bytes(op)
            c["vmem_load"] += 1
            c["vmem_load_bytes"] += b
            c["loads_by_width"][b] = c["loads_by_width"].get(b, 0) + 1
        elif k == "vmem_store":
            c["vmem_store"] += 1
        elif k in ("lds_read", "lds_write"):
            c[k] += 1
            if "bpermute" not in op and "swizzle" not in op:
                c["lds_bytes"] += load_bytes(op)
        elif k in ("waitcnt", "barrier", "salu"):
            c[k] += 1
    return c


def in_flight(body: list) -> tuple:
    """(peak bytes a lane has in flight in vector-memory loads, memory round trips an iteration waits for)
    over the steady state of the loop: the body walked twice, ``s_waitcnt vmcnt(N)`` leaving the newest N
    operations outstanding (stores count in vmcnt on gfx9); a wait that retires a load is a round trip the
    wave sits through (the loads it retires were issued in this iteration or the one before)."""
    queue, peak, trips = [], 0, 0
    for rnd in range(2):
        for l in body:
            if l.endswith(":"):
                continue
            op = l.split()[0]
            k = classify(op)
            if k == "vmem_load":
                queue.append(load_bytes(op))
            elif k == "vmem_store":
                queue.append(0)
            elif op == "s_waitcnt":
                m = re.search(r"vmcnt\((\d+)\)", l)
                if m and int(m.group(1)) < len(queue):
                    gone, queue = queue[:len(queue) - int(m.group(1))], queue[len(queue) - int(m.group(1)):]
                    trips += rnd == 1 and any(gone)
            if rnd == 1:
                peak = max(peak, sum(queue))
    return peak, trips


def occupancy(meta: dict, lds: int, num_warps: int, target: str) -> dict:
    """Waves per SIMD the VGPRs and the LDS allow, in whole workgroups of ``num_warps`` waves over 4 SIMDs."""
    total = meta["accum_offset"] + meta["agpr"] if meta["agpr"] else meta["vgpr"]
    alloc = max(VGPR_GRANULE, -(-total // VGPR_GRANULE) * VGPR_GRANULE)
    by_vgpr = min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // alloc)
    per_simd = max(1, num_warps // 4)                     # waves of one workgroup on a SIMD
    wg_vgpr = by_vgpr * 4 // num_warps
    wg_lds = LDS_PER_CU[target] // lds if lds else 10 ** 6
    wgs = max(0, min(wg_vgpr, wg_lds, MAX_WAVES_PER_SIMD * 4 // num_warps))
    return dict(vgpr_total=total, waves_by_vgpr=by_vgpr, wgs_by_lds=min(wg_lds, 99), wgs_per_cu=wgs,
                waves_per_simd=wgs * per_simd, waves_per_cu=wgs * num_warps)


def analyze(asm: str, shared: int, num_warps: int, target: str, keys_per_iter=None, block_h=None) -> dict:
    """Everything the report prints about one compiled kernel (pure: the asm text and the compile's facts)."""
    meta = metadata(asm)
    lds = max(meta["lds_fixed"], shared)
    occ = occupancy(meta, lds, num_warps, target)
    lines = kernel_text(asm)
    found = []
    for a, b in loops(lines):
        body = lines[a:b + 1]
        m = mix(body, target)
        fly, trips = in_flight(body)
        m.update(first=a, last=b, lines=b - a + 1, in_flight_lane=fly, round_trips=trips)
        found.append(m)
    # the key loop: the one doing the most matrix work (else the longest)
    key = max(found, key=lambda m: (m["mfma_flop"], m["lines"])) if found else None
    return dict(meta=meta, lds=lds, occ=occ, loops=found, key=key, num_warps=num_warps,
                keys_per_iter=keys_per_iter, block_h=block_h, target=target)


# ---- compiling (one process per target) ------------------------------------------------------------------
def selected(only=None, names=None):
    return [k for k in triton_kernels() if k.name.startswith(KERNEL_PREFIX) and (not only or only in k.name)
            and (not names or k.name in names)]


def _worker(target: str, only=None, asm_dir=None, names=None) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    backend, arch, warp, plat, _ = TARGETS[target]
    rows = []
    for k in selected(only, names):
        if not k.applies_to(target):
            continue
        consts, opts = k.constexprs(plat), k.options(plat)
        src = ASTSource(k.fn, k.signature(), constexprs=consts, attrs=k.attrs())
        try:
            c = triton.compile(src, target=GPUTarget(backend, arch, warp), options=opts)
        except Exception as e:  # noqa: BLE001  (a compile error is a row of the report)
            rows.append(dict(kernel=k.name, target=target, error=str(e).strip().splitlines()[-1][:200]))
            continue
        asm = c.asm["amdgcn"]
        if asm_dir:
            with open(os.path.join(asm_dir, re.sub(r"[^\w.+-]", "_", k.name) + f".{target}.s"), "w") as f:
                f.write(asm)
        r = analyze(asm, c.metadata.shared, opts["num_warps"], target, consts.get("BLOCK_N"), consts.get("BLOCK_H"))
        rows.append(dict(kernel=k.name, **r))
    print(json.dumps(rows))


def compile_rows(targets=AMD_TARGETS, only=None, asm_dir=None, names=None) -> list:
    """The analyzed rows of the selected kernels, each target compiled in a process of its own."""
    rows = []
    for t in targets:
        cmd = [sys.executable, "-m", "build_tools.amd_isa_report", "--worker", t]
        cmd += [a for n in names or () for a in ("--kernel", n)]
        cmd += (["--only", only] if only else []) + (["--asm-dir", asm_dir] if asm_dir else [])
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        out = r.stdout.strip().splitlines()
        if r.returncode or not out:
            raise RuntimeError(f"compile worker for {t} failed (exit {r.returncode}): {r.stderr[-2000:]}")
        rows += json.loads(out[-1])
    return rows


# ---- per 64 keys ------------------------------------------------------------------------------------------
def per64(row: dict, k: dict = None) -> dict:
    """Loop k's counts (default: the key loop's) scaled to 64 keys (a wave's instructions; x waves for the
    workgroup)."""
    k, n = k or row["key"], row["keys_per_iter"]
    if not k or not n or not k["mfma"]:
        return {}
    s = 64 / n
    return dict(iters=s, valu=k["valu"] * s, trans=k["transcendental"] * s, mfma=k["mfma"] * s,
                mfma_clocks=k["mfma_clocks"] * s, loads=k["vmem_load"] * s, load_b=k["vmem_load_bytes"] * s,
                lds_r=k["lds_read"] * s, lds_w=k["lds_write"] * s, lds_b=k["lds_bytes"] * s,
                waitcnt=k["waitcnt"] * s, barrier=k["barrier"] * s, trips=k["round_trips"] * s,
                cu_load_b=k["vmem_load_bytes"] * s * 64 * row["num_warps"],
                # the matrix work the math needs (S = Q K^T and P V over 512 dims) / what the waves issue
                useful=(4 * row["block_h"] * 64 * 512 / (k["mfma_flop"] * s * row["num_warps"])
                        if row.get("block_h") else 0.0))


def iteration_clocks(row: dict, latency_ns: float = LATENCY_NS) -> dict:
    """Clocks of one key-loop iteration of a workgroup on a SIMD, by bound (module docstring)."""
    k, occ, target = row["key"], row["occ"], row["target"]
    w = max(1, row["num_warps"] // 4)                         # the workgroup's waves on a SIMD
    mfma = w * k["mfma_clocks"]
    valu = w * 4 * (k["valu"] + 3 * k["transcendental"])
    lds = row["num_warps"] * 64 * k["lds_bytes"] / 128.0
    lat = k["round_trips"] * latency_ns * PARTS[target][2]         # round trips the waves sit through
    return dict(mfma=mfma, valu=valu, lds=lds, latency=lat)


# ---- the cases ------------------------------------------------------------------------------------
DECODE_CASES = [  # name, heads, batch, s_q, main keys, extra keys
    ("V4-Flash h64 s_q2 b64 128+512", 64, 64, 2, 128, 512),
    ("V4-Flash h64 s_q2 b148 128+512", 64, 148, 2, 128, 512),
    ("V4-Pro h128 s_q2 b64 128+1024", 128, 64, 2, 128, 1024),
    ("V4-Pro h128 s_q2 b148 128+1024", 128, 148, 2, 128, 1024),
]
PREFILL_CASES = [  # name, s_q, heads, topk, s_kv (bf16 rows of 1024 B)
    ("prefill h64 topk512 s_q4096 s_kv8K", 4096, 64, 512, 8192),
    ("prefill h128 topk1024 s_q4096 s_kv8K", 4096, 128, 1024, 8192),
]


def floor_us(target: str, nbytes: float, flop: float) -> tuple:
    _, _, _, tbs, tflops = PARTS[target]
    return nbytes / (tbs * 1e6), flop / (tflops * 1e6)


def predict(rows: list, latency_ns: float = LATENCY_NS) -> list:
    """Predicted time and fraction of the floor of each case, per target, from the key loop of the decode
    kernel (V40_584, 64-head blocks) and of the prefill kernel."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import _num_splits
    out = []
    by = {(r["kernel"], r["target"]): r for r in rows if "error" not in r}
    for target in AMD_TARGETS:
        part, cus, ghz = PARTS[target][:3]
        dec, pre = by.get(("sparse_mla_decode", target)), by.get(("sparse_mla_prefill", target))
        cases = [(c, dec, "decode") for c in DECODE_CASES] + [(c, pre, "prefill") for c in PREFILL_CASES]
        for case, row, kind in cases:
            if not row or not row["key"]:
                continue
            bn, bh = row["keys_per_iter"], 64
            if kind == "decode":
                name, h, b, s_q, mk, ek = case
                T, keys = b * s_q, mk + ek
                nbytes = T * (keys * 584 + 2 * h * 512 * 2)          # records + q + out (FlashMLA's counting)
                tiles = -(-mk // bn) + -(-ek // bn)
                programs = T * (h // bh)
                splits = _num_splits(programs, tiles, cus * row["occ"]["wgs_per_cu"])
                tiles_per_prog = -(-tiles // splits)
                programs *= splits
            else:
                name, s_q, h, topk, s_kv = case
                T, keys = s_q, topk
                nbytes = s_kv * 1024 + T * 2 * h * 512 * 2            # unique rows + q + out; gathers hit L2
                tiles_per_prog, programs, splits = -(-topk // bn), T * (h // bh), 1
            # split partials (fp32 [splits, T, h, 512]): written by the programs, read back by the combine
            # launch, both at the HBM rate (a lower bound: the second launch and its tail come on top)
            extra_us = (2 * splits * T * h * 512 * 4 / (PARTS[target][3] * 1e6)) if splits > 1 else 0.0
            flop = T * h * keys * 2048
            f_mem, f_mma = floor_us(target, nbytes, flop)
            floor = max(f_mem, f_mma)
            # the workgroups a CU holds share its SIMDs and LDS (their clocks add) and overlap their latency
            wgs = max(1, min(row["occ"]["wgs_per_cu"], -(-programs // cus)))
            it = {n: v * (wgs if n != "latency" else 1) for n, v in iteration_clocks(row, latency_ns).items()}
            rounds = max(1, math.ceil(programs / (cus * wgs)))
            t_max = rounds * tiles_per_prog * max(it.values()) / (ghz * 1e3) + extra_us
            t_sum = rounds * tiles_per_prog * sum(it.values()) / (ghz * 1e3) + extra_us
            # likely: the waves of the one workgroup a CU holds wait for memory together (the loads an
            # iteration waits for are issued in it), while their VALU, MFMA and LDS work overlaps
            busy = it["latency"] + max(it["mfma"], it["valu"], it["lds"])
            t_likely = rounds * tiles_per_prog * busy / (ghz * 1e3) + extra_us
            bound = max(it, key=it.get)
            out.append(dict(target=target, part=part, case=name, splits=splits, combine_us=extra_us,
                            programs=programs, rounds=rounds,
                            tiles=tiles_per_prog, floor_us=floor, floor_kind="memory" if f_mem >= f_mma else "matrix",
                            t_max_us=t_max, t_serial_us=t_sum, t_likely_us=t_likely, frac_likely=floor / t_likely,
                            bound=bound, frac_max=floor / t_max,
                            frac_serial=floor / t_sum, iter_clocks=it))
    return out


# ---- printing ---------------------------------------------------------------------------------------------
def print_report(rows: list, preds=None) -> None:
    print(f"{'kernel':44s} {'target':7s} {'VGPR a+acc':>10s} {'SGPR':>5s} {'spill v/s/scr':>13s} {'LDS B':>7s} "
          f"{'waves/SIMD':>10s} {'loops':>5s}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:44s} {r['target']:7s} compile error: {r['error']}")
            continue
        m, o = r["meta"], r["occ"]
        print(f"{r['kernel']:44s} {r['target']:7s} {m['vgpr']:>4d}+{m['agpr']:<5d} {m['sgpr']:5d} "
              f"{m['vgpr_spill']:>4d}/{m['sgpr_spill']}/{m['scratch']:<4d} {r['lds']:7d} "
              f"{o['waves_per_simd']:>4d} ({o['waves_by_vgpr']}v,{o['wgs_by_lds']}wg) {len(r['loops']):5d}")
    print("\nkey loop, per 64 keys, per wave (BLOCK_N keys an iteration; x waves = the workgroup's)")
    print(f"{'kernel':44s} {'target':7s} {'BN':>3s} {'VALU':>6s} {'trans':>5s} {'MFMA':>5s} {'MFMA clk':>8s} "
          f"{'vmem ld':>7s} {'widths (B: n/iter)':>18s} {'LDS r/w':>9s} {'LDS B':>6s} {'waitcnt':>7s} {'barrier':>7s} "
          f"{'trips':>5s} {'KB ld/CU':>8s} {'B in flight wave/CU':>20s} {'MFMA useful':>11s}")
    for r, k in [(r, k) for r in rows if "error" not in r for k in r["loops"] if k["mfma"]]:
        p = per64(r, k)
        if not p:
            continue
        several = sum(1 for x in r["loops"] if x["mfma"]) > 1
        name = r["kernel"] + (f" loop@{k['first']}" if several else "")
        widths = ",".join(f"{b}:{n}" for b, n in sorted(k["loads_by_width"].items(), key=lambda x: int(x[0])))
        wave_b = k["in_flight_lane"] * 64
        print(f"{name:44s} {r['target']:7s} {r['keys_per_iter']:3d} {p['valu']:6.0f} {p['trans']:5.0f} "
              f"{p['mfma']:5.0f} {p['mfma_clocks']:8.0f} {p['loads']:7.0f} {widths:>18s} "
              f"{p['lds_r']:4.0f}/{p['lds_w']:<4.0f} {p['lds_b']:6.0f} {p['waitcnt']:7.0f} {p['barrier']:7.0f} "
              f"{p['trips']:5.0f} {p['cu_load_b'] / 1024:8.1f} {wave_b:>8d} / {wave_b * r['occ']['waves_per_cu']:<9d} "
              f"{p['useful']:11.2f}")
    if preds:
        print("\npredicted (static counts; no AMD GPU): time = rounds x tiles x iteration clocks; "
              "fraction = floor / time")
        print(f"{'part':7s} {'case':38s} {'splits':>6s} {'rounds':>6s} {'tiles':>5s} {'floor us':>12s} "
              f"{'iter clk mfma/valu/lds/lat':>28s} {'bound':>8s} {'t max..serial us':>17s} {'likely':>7s} "
              f"{'fraction max..serial':>20s} {'likely':>6s}")
        for p in preds:
            it = p["iter_clocks"]
            print(f"{p['part']:7s} {p['case']:38s} {p['splits']:6d} {p['rounds']:6d} {p['tiles']:5d} "
                  f"{p['floor_us']:6.1f} {p['floor_kind'][:3]:>5s} "
                  f"{it['mfma']:>6.0f}/{it['valu']:.0f}/{it['lds']:.0f}/{it['latency']:<6.0f} {p['bound']:>8s} "
                  f"{p['t_max_us']:7.1f}..{p['t_serial_us']:<7.1f} {p['t_likely_us']:7.1f} "
                  f"{p['frac_max']:14.2f}..{p['frac_serial']:.2f} {p['frac_likely']:6.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", choices=AMD_TARGETS)
    p.add_argument("--only", default=None, help="substring of the kernels' matrix names")
    p.add_argument("--kernel", action="append", default=None, help="a kernel's exact matrix name; repeat for several")
    p.add_argument("--predict", action="store_true", help="also the predicted times of the issue's cases")
    p.add_argument("--latency-ns", type=float, default=LATENCY_NS,
                   help="assumed latency of one memory round trip (default %(default)s)")
    p.add_argument("--asm-dir", default=None, help="keep each kernel's AMDGCN there")
    p.add_argument("--json", default=None, help="write the rows (and predictions) to this file")
    p.add_argument("--worker", choices=AMD_TARGETS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.worker, a.only, a.asm_dir, a.kernel)
        return 0
    if a.asm_dir:
        os.makedirs(a.asm_dir, exist_ok=True)
    rows = compile_rows(a.target or AMD_TARGETS, a.only, a.asm_dir, a.kernel)
    preds = predict(rows, a.latency_ns) if a.predict else None
    print_report(rows, preds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, predictions=preds), f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
