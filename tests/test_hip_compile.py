"""Every hip_kernels/*.hip compiles for gfx942 and gfx950 (clang-22, HIP headers from the triton wheel)
and, through hip2cuda, for sm_90a and sm_100a (nvcc): no errors, no s_trap, no spills, hardware fp8
converts in the kernels that write fp8."""
import pytest

from build_tools import compile_matrix as cm


@pytest.mark.parametrize("target", sorted(cm.TARGETS))
@pytest.mark.parametrize("source", cm.hip_sources())
def test_hip_kernel_compiles_clean(source, target, tmp_path_factory):
    row = cm.compile_hip(source, target, str(tmp_path_factory.getbasetemp() / "hipmatrix"))
    print(row)
    assert row["problems"] == []
