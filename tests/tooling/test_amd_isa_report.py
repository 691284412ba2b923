"""build_tools/amd_isa_report.py: the AMDGCN parse on a hand-written loop (exact counts), and the tool run on
one real kernel and target (a loop found, nonzero counts)."""
import json
import os
import subprocess
import sys

import pytest

from build_tools import amd_isa_report as rep

# a kernel body in the shape LLVM prints: a loop whose back-edge is the s_branch at its end, a masked
# block inside it, two vector-memory round trips an iteration, a store, LDS traffic and two MFMAs
ASM = """
\t.text
_k:
\ts_load_dwordx2 s[0:1], s[0:1], 0x0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
\tglobal_load_dword v1, v[2:3], off
\tglobal_load_dword v4, v[2:3], off offset:4
\ts_waitcnt vmcnt(0)
\tv_add_u32_e32 v5, v1, v4
\ts_cbranch_execz .LBB0_3
\tglobal_load_dwordx4 v[8:11], v[2:3], off
\tglobal_load_ushort v12, v[2:3], off
.LBB0_3:                                ;   in Loop: Header=BB0_1 Depth=1
\tglobal_store_dword v[2:3], v5, off
\ts_waitcnt vmcnt(1)
\tv_exp_f32_e32 v6, v5
\tv_pk_mul_f32 v[6:7], v[6:7], v[8:9]
\tds_write_b64 v0, v[8:9]
\ts_barrier
\tds_read2_b64 v[20:23], v0 offset1:8
\tds_read_u16 v24, v0
\ts_waitcnt lgkmcnt(0)
\tv_mfma_f32_16x16x16_bf16 v[30:33], v[20:21], v[22:23], 0
\tv_mfma_f32_32x32x8_bf16 v[34:49], v[20:21], v[22:23], 0
\ts_add_i32 s4, s4, 1
\ts_cmp_lt_i32 s4, s5
\ts_cbranch_scc0 .LBB0_4
\ts_branch .LBB0_1
.LBB0_4:
\ts_endpgm
.Lfunc_end0:
\t.amdhsa_accum_offset 52
amdhsa.kernels:
  - .agpr_count:     0
    .group_segment_fixed_size: 0
    .private_segment_fixed_size: 0
    .sgpr_count:     40
    .sgpr_spill_count: 0
    .vgpr_count:     227
    .vgpr_spill_count: 0
"""


def test_the_parse_counts_a_known_loop_exactly():
    r = rep.analyze(ASM, shared=65536, num_warps=8, target="gfx942", keys_per_iter=16, block_h=64)
    assert len(r["loops"]) == 1
    k = r["key"]
    assert k["vmem_load"] == 4 and k["loads_by_width"] == {4: 2, 16: 1, 2: 1} and k["vmem_load_bytes"] == 26
    assert k["vmem_store"] == 1
    assert k["mfma"] == 2 and k["mfma_flop"] == 2 * 16 * 16 * 16 + 2 * 32 * 32 * 8
    assert k["mfma_clocks"] == 16 + 32                     # 512 FLOP a clock on gfx942
    assert k["valu"] == 3 and k["transcendental"] == 1
    assert (k["lds_read"], k["lds_write"], k["lds_bytes"]) == (2, 1, 16 + 2 + 8)
    assert k["waitcnt"] == 3 and k["barrier"] == 1
    # in flight: the two index words (8 B), then the record and the short with the store behind them:
    # vmcnt(1) retires the loads and leaves the store; two waits that retire loads = two round trips
    assert k["in_flight_lane"] == 18 and k["round_trips"] == 2
    # 227 VGPRs -> 232 allocated -> 2 waves a SIMD; 64 KB LDS -> one workgroup of 8 waves a gfx942 CU
    assert r["occ"] == dict(vgpr_total=227, waves_by_vgpr=2, wgs_by_lds=1, wgs_per_cu=1, waves_per_simd=2,
                            waves_per_cu=8)
    p = rep.per64(r)
    assert p["iters"] == 4 and p["mfma"] == 8 and p["valu"] == 12 and p["trips"] == 8


def test_gfx950_runs_double_k_mfma_at_twice_the_rate_and_holds_more_lds():
    assert rep.mfma_clocks("v_mfma_f32_16x16x32_bf16", "gfx950") == 16
    assert rep.mfma_clocks("v_mfma_f32_16x16x16_bf16", "gfx950") == 16
    assert rep.mfma_clocks("v_mfma_f32_16x16x16_bf16", "gfx942") == 16
    small = rep.metadata(ASM.replace("227", "120"))
    assert rep.occupancy(small, 65536, 8, "gfx950")["wgs_per_cu"] == 2       # 160 KB of LDS, 4 waves/SIMD
    assert rep.occupancy(small, 65536, 8, "gfx942")["wgs_per_cu"] == 1


def _hip_backend_reason():
    try:
        from triton.backends import backends
    except Exception as e:  # noqa: BLE001
        return f"no Triton: {e}"
    return "" if "amd" in backends else "this Triton has no AMD backend"


@pytest.mark.skipif(bool(_hip_backend_reason()), reason=_hip_backend_reason() or "-")
def test_tool_reports_the_decode_kernels_loop_on_gfx942(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "build_tools.amd_isa_report", "--target", "gfx942", "--kernel",
                        "sparse_mla_decode", "--json", str(out)], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sparse_mla_decode" in r.stdout and "per 64 keys" in r.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kernel"] == "sparse_mla_decode" and row["target"] == "gfx942"
    assert row["loops"] and row["key"] is not None
    k = row["key"]
    for n in ("valu", "mfma", "vmem_load", "lds_read", "waitcnt", "in_flight_lane", "round_trips"):
        assert k[n] > 0, n
    assert row["meta"]["vgpr"] > 0 and row["lds"] > 0 and row["occ"]["waves_per_simd"] >= 1
    assert row["meta"]["vgpr_spill"] == 0 and row["meta"]["scratch"] == 0
