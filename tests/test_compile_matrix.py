"""Every Triton kernel compiles for gfx942, gfx950, sm_90a and sm_100a on this CPU-only machine, with
the matrix instructions and hardware fp8 converts present, no spills and LDS/shared within limits."""
import pytest

from build_tools import compile_matrix as cm

KERNELS = [k.name for k in cm.triton_kernels()]


@pytest.mark.parametrize("target", sorted(cm.TARGETS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernel_compiles_clean(kernel, target):
    k = next(k for k in cm.triton_kernels() if k.name == kernel)
    if not k.applies_to(target):
        pytest.skip(f"{kernel} is written for {', '.join(k.targets)} only")
    row = cm.compile_triton(k, target)
    print(row)
    assert row["problems"] == []
