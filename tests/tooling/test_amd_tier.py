"""The AMD execution tier (docs/platforms.md#amd-tier).

CPU: every Triton kernel with a target-dependent branch, constexpr or tile configuration runs under the
Triton interpreter as gfx942 and gfx950 (and sm_100 where its constexprs differ from sm_90's) launch it,
against the oracle (``tests/tooling/amd_tier.py`` holds the cases: bytes and integers exact, floats within
docs/numerics.md's tolerances, and the launches checked for the target's constexprs). One interpreter
process per target runs all of that target's cases; they run two at a time. The fp8 instruction models
(``dsv4_rocm/triton/_fp8.py``) are checked against torch's casts over every byte and about two million fp32
values, in one more process.

GPU (``-m gpu``): the same probe kernels compiled for the GPU, i.e. the hardware converts, against the
models run under the interpreter, byte for byte.
"""
import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch

import amd_tier
from amd_tier import CASE_FORMATS, CASES, TARGETS
from helpers import float_mismatch
from dsv4_rocm.platform import target as platform_target
from dsv4_rocm.triton import _launch

TIER = os.path.abspath(amd_tier.__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(TIER)))
MODEL = "model"
MODEL_CHECKS = ("encode_ocp", "encode_fnuz", "kernel_encode_ocp_route", "kernel_encode_fnuz_route", "decode_ocp",
                "decode_fnuz", "decode_ptx_scaled_bf16", "decode_ptx_e2m1_scaled_bf16")


def _interpret(*args, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(TIER)]))
    return subprocess.run([sys.executable, TIER, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


class _Tier:
    """The results of the interpreter processes this session's selected tests need, run two at a time."""

    def __init__(self, processes):
        self.results, self.logs = {}, {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for proc, r in zip(processes, pool.map(_interpret, processes)):
                self.logs[proc] = (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
                for line in r.stdout.splitlines():
                    if line.startswith("AMD-TIER "):
                        res = json.loads(line[len("AMD-TIER "):])
                        self.results[(res["case"], res["target"])] = res

    def get(self, case, target):
        if (case, target) not in self.results:
            code, out, err = self.logs.get(target, (None, "", "not run"))
            pytest.fail(f"no result for {case} on {target} (process exit {code}):\n{out}\n{err}")
        return self.results[(case, target)]


@pytest.fixture(scope="module")
def tier(request):
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is sys.modules[__name__] and spec is not None:
            t = spec.params.get("target", MODEL if "check" in spec.params else None)
            if t is not None and t not in wanted:
                wanted.append(t)
    return _Tier(wanted)


def _describe(res):
    """What a case ran: its kernels' constexprs and the launch options the interpreter does not execute."""
    out = []
    for kernel, seen in res["launches"].items():
        consts = ", ".join(f"{k}={'|'.join(v)}" for k, v in seen["constexprs"].items())
        opts = ", ".join(f"{k}={'|'.join(v)}" for k, v in seen["compile_only"].items())
        out.append(f"  {kernel}({consts})\n    compile-only launch options (the interpreter ignores them; "
                   f"build_tools/compile_matrix.py compiles them for {res['target']}): {opts or 'none'}")
    return "\n".join(out)


@pytest.mark.parametrize("case, target", [(c, t) for c, ts in CASES.items() for t in ts],
                         ids=[f"{c}-{t}" for c, ts in CASES.items() for t in ts])
def test_kernel_runs_the_target_branches_against_the_oracle(case, target, tier):
    """The kernel under the interpreter as ``target`` launches it: the oracle's bytes / values within
    tolerance, and launches carrying the target's constexprs (FNUZ on gfx942, the target's tiles)."""
    res = tier.get(case, target)
    print(f"{case} on {target}: {target}'s branches ({res.get('seconds')} s)\n" + "\n".join(
        "  " + line for line in res["lines"]) + "\n" + _describe(res))
    assert res["ok"], res["error"]


@pytest.mark.parametrize("check", MODEL_CHECKS)
def test_fp8_model_against_torch(check, tier):
    """Encoders over ~2.1 M fp32 values (every e4m3 value of both formats, the ties between neighbours and
    the floats beside them, subnormals, saturation and overflow edges, +-0, +-inf, NaN, random bit patterns,
    random values of e4m3's range): the OCP encode equals torch's e4m3fn cast after the kernels' clamp to
    +-448 (NaN -> 0x7F); the fnuz encode equals torch's e4m3fnuz cast (NaN 0x80 past 240's rounding range); the
    kernels' encoder through either route (gfx942: fnuz of x / 2) gives the OCP byte, -0 written 0x00.
    Decoders over all 256 bytes: torch's float8_e4m3fn / float8_e4m3fnuz values bit for bit, and the integer
    e4m3 -> bf16 decode of the NVIDIA decode kernels the e4m3 value times 2^-120."""
    res = tier.get(check, MODEL)
    print(f"{check}: {res['values']} values, {res['mismatches']} mismatches")
    assert res["ok"] and res["mismatches"] == 0


def test_emulated_target_facts_and_caches():
    """CPU tensors launch as the emulated target inside ``emulate_target`` and as "cpu" outside; the
    per-device caches are emptied on the switch; unknown targets are refused by name."""
    from dsv4_rocm.triton.compressor import compress_norm_rope_store as C
    cpu = torch.device("cpu")
    before = _launch.device_facts(cpu)
    assert before[0] == "cpu" and not before[1]
    assert C._device_facts(cpu) == ("cpu", False)
    for arch, fnuz, sms in (("gfx942", True, 304), ("gfx950", False, 256), ("sm_100", False, 148)):
        with _launch.emulate_target(arch) as plat:
            assert plat.arch == arch and _launch.device_facts(cpu) == (arch, fnuz, sms, True)
            assert C._device_facts(cpu) == (arch, fnuz)
        assert _launch.device_facts(cpu) == before and C._device_facts(cpu) == ("cpu", False)
    with _launch.emulate_target("gfx942", sm_count=8):
        assert _launch.emulated_target().sm_count == 8
    assert _launch.emulated_target() is None
    with pytest.raises(ValueError, match="unknown target 'gfx1100'"):
        with _launch.emulate_target("gfx1100"):
            pass
    assert platform_target("gfx942").fp8_decode == "fnuz_scale_plus_one"
    assert platform_target("gfx950").triton_fp8_dtype == "fp8e4nv" and platform_target("sm_90").wave_size == 32


PTXAS_ONLY_OPTIONS = ("maxnreg",)


def kernel_modules() -> dict:
    """{module name: module} of every kernel module of dsv4_rocm.triton, in its stage packages (the names are
    unique across stages: one op, one file)."""
    import importlib
    import pkgutil

    import dsv4_rocm.triton as pkg
    infos = [i for i in pkgutil.walk_packages(pkg.__path__, prefix="dsv4_rocm.triton.") if not i.ispkg]
    mods = {i.name.rsplit(".", 1)[1]: importlib.import_module(i.name) for i in infos}
    assert len(mods) == len(infos), "two kernel modules share a name"
    return mods


def test_every_target_dependent_kernel_has_a_case():
    """Every kernel module whose compile-matrix constexprs or options differ between targets has a case here
    (the Gluon kernel is Hopper-only and out of the tier's scope)."""
    differing = set()
    for name, mod in kernel_modules().items():
        for spec in getattr(mod, "COMPILE_SPECS", ()):
            if spec.get("targets"):                                   # written for one target (Gluon)
                continue
            # a register cap for ptxas (maxnreg, set per Triton version) changes no branch of the kernel
            seen = {(repr(sorted(spec["constexprs"](a).items())),
                     repr(sorted((k, v) for k, v in spec["options"](a).items() if k not in PTXAS_ONLY_OPTIONS)))
                    for a in ("gfx942", "gfx950", "sm_90", "sm_100")}
            if len(seen) > 1:
                differing.add(name)
    missing = differing - set(CASES)
    print("target-dependent kernel modules:", sorted(differing))
    assert not missing, f"no AMD-tier case for {sorted(missing)}"
    assert set(TARGETS) == {t for ts in CASES.values() for t in ts}


FORMAT_KEYS = ("FMT", "MAIN_FMT", "EXTRA_FMT")


def test_every_record_format_variant_has_a_case():
    """Every record-format variant the compile specs of a target-dependent kernel build (its FMT / MAIN_FMT /
    EXTRA_FMT constexprs: V4.0, the V4.1 records, the FNUZ flavour) is one a case runs (``CASE_FORMATS``),
    and the case runs on every target the module's other cases do."""
    covered = {}
    for case, (module, variants) in CASE_FORMATS.items():
        assert case in CASES, case
        for v in variants:
            covered.setdefault(module, {}).setdefault(repr(sorted(v.items())), set()).update(CASES[case])
    seen = 0
    modules = kernel_modules()
    for module, by in covered.items():
        targets = {t for case, (m, _) in CASE_FORMATS.items() if m == module for t in CASES[case]}
        for spec in modules[module].COMPILE_SPECS:
            if spec.get("targets"):
                continue
            consts = spec["constexprs"]("gfx942")
            fmts = {k: consts[k] for k in FORMAT_KEYS if k in consts}
            if not fmts:
                continue
            seen += 1
            key = repr(sorted(fmts.items()))
            assert key in by, f"{spec['name']}: no AMD-tier case runs its record formats {fmts}"
            assert by[key] == targets, f"{spec['name']}: its formats run on {sorted(by[key])}, not {sorted(targets)}"
    assert seen >= 6


@pytest.mark.gpu
def test_fp8_models_match_the_gpu_convert(tmp_path):
    """The probe kernels compiled for this GPU (the hardware converts: NVIDIA cvt.rn.satfinite.e4m3x2.f32 and
    the e4m3 decode, the decode kernel's integer PTX; on AMD v_cvt_pk_fp8_f32 / v_cvt_f32_fp8) against the
    same kernels under the interpreter (the models), on the model test's ~2.1 M values and all 256 bytes.
    Byte for byte except for NaN inputs, where both must give a NaN byte (the hardware's is printed)."""
    x = amd_tier.probe_values()
    hw = amd_tier.run_probes(x.cuda())
    torch.save(x, tmp_path / "x.pt")
    r = _interpret("probe", str(tmp_path / "x.pt"), str(tmp_path / "model.pt"))
    assert r.returncode == 0, r.stderr[-3000:]
    model = torch.load(tmp_path / "model.pt")
    nan = torch.isnan(x)
    for name, got in hw.items():
        want = model[name]
        if name.startswith("decode"):
            bad = int(float_mismatch(got, want).sum())
        else:
            bad = int(((got != want) & ~nan).sum())
            nan_codes = (0x80,) if "fnuz" in name else (0x7F, 0xFF)
            hw_nan = sorted(set(got[nan].tolist()))
            print(f"{name}: hardware bytes of NaN inputs {[hex(v) for v in hw_nan]}")
            assert all(v in nan_codes for v in hw_nan), name
        print(f"{name}: {got.numel()} values, {bad} differ from the model")
        assert bad == 0, name
