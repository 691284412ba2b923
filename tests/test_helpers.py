"""The comparison the tests share for floats that may hold NaN (helpers.same_floats): any NaN matches any
NaN, every other value matches only its own bits. The interpreter fixes (helpers.patch_interpreter_*) go in
exactly where their probes show a bug, and leave the probes right."""
import torch

from helpers import float_mismatch, run_interpreted, same_floats


def test_nan_payloads_and_signs_do_not_matter_other_bits_do():
    x = torch.tensor([1.5, float("nan"), float("-inf"), 0.0, float("nan")])
    y = x.clone()
    y.view(torch.int32)[1] = 0x7F800001                       # a signalling NaN, another payload
    y.view(torch.int32)[4] = -0x400000                         # 0xFFC00000: the negative default NaN
    assert torch.isnan(y[1]) and torch.isnan(y[4]) and not torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert same_floats(x, y) and same_floats(x.bfloat16(), y.bfloat16())
    for i, v in ((0, 1.5000001), (2, float("inf")), (3, -0.0), (1, 1.0)):
        z = y.clone()
        z[i] = v
        assert not same_floats(x, z) and float_mismatch(x, z).nonzero().flatten().tolist() == [i], (i, v)
    assert not same_floats(x, x[:4]) and not same_floats(x, x.double())
    f8 = torch.tensor([0x7F, 0xFF, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert same_floats(f8, torch.tensor([0xFF, 0x7F, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn))


INTERPRETER_FIXES = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import triton
import helpers as h
loop, mask, bf16 = h._loop_bound_broken(), h._scalar_mask_broken(), h._bf16_broken()
applied = h.patch_interpreter_scalars() + h.patch_interpreter_bf16()
expected = ({"loop bound"} if loop else set()) | ({"scalar mask"} if mask else set()) | bf16
assert set(applied) == expected, (applied, loop, mask, bf16)
assert not h._loop_bound_broken() and not h._scalar_mask_broken() and not h._bf16_broken()
assert h.patch_interpreter_scalars() == () and h.patch_interpreter_bf16() == ()     # nothing left to fix
print(triton.__version__, "fixed:", sorted(applied))
"""


def test_interpreter_fixes_go_where_the_probes_fail(tmp_path):
    """Under the interpreter: each fix is applied iff its probe kernel shows the bug, after which every probe
    (bf16 +, *, <, widening with denormals, rounding ties, tl.dot; a loaded loop bound; a mask with a scalar comparison) matches torch's
    bits, and a second call finds nothing to fix."""
    r = run_interpreted(INTERPRETER_FIXES, tmp_path)
    assert r.returncode == 0 and "fixed:" in r.stdout, r.stderr[-3000:]
    print(r.stdout)
