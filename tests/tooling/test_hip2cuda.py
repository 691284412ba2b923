"""build_tools.hip2cuda: the reverse hipify on the tricky inputs (docs/platforms.md#hip-extension)."""
import pytest

from build_tools.hip2cuda import TranslationError, reverse_table, translate


def test_collisions_prefer_runtime_names_and_overrides():
    t = reverse_table()
    assert t["hipMalloc"] == "cudaMalloc"
    assert t["hipStream_t"] == "cudaStream_t"          # not the driver CUstream
    assert t["hipError_t"] == "cudaError_t"            # not CUresult
    assert t["hipMemcpyAsync"] == "cudaMemcpyAsync"
    assert not any(v.endswith("_v2") for k, v in t.items() if k in ("hipMalloc", "hipMemcpy"))
    # entries whose HIP side is not a HIP name are never inverted (int -> nvtxRangeId_t, ...)
    assert "int" not in t and "uint32_t" not in t


def test_includes_and_names():
    out = translate('#include <hip/hip_runtime.h>\nhipError_t e = hipGetLastError(); hipStream_t s;\n')
    assert "#include <cuda_runtime.h>" in out
    assert "cudaError_t e = cudaGetLastError(); cudaStream_t s;" in out


def test_launch_with_templates_and_nested_parentheses():
    src = ("hipLaunchKernelGGL((k<float, 4>), dim3((n + 3) / 4, f(a, b)), dim3(256), 0, (hipStream_t)st, "
           "x, g(y, z[1]), (int)w);")
    out = translate(src)
    assert out == ("k<float, 4><<<dim3((n + 3) / 4, f(a, b)), dim3(256), 0, (cudaStream_t)st>>>"
                   "(x, g(y, z[1]), (int)w);")
    assert translate("hipLaunchKernelGGL(kern<T, 2>, g, b, 0, s);") == "kern<T, 2><<<g, b, 0, s>>>();"


def test_maskless_shuffles_and_ballot():
    out = translate("v = __shfl_xor(v, 1, 32) + __shfl_down(v, 2) + __shfl(v, 0); m = __ballot(p);")
    assert "__shfl_xor_sync(0xffffffffu, v, 1, 32)" in out
    assert "__shfl_down_sync(0xffffffffu, v, 2)" in out
    assert "__shfl_sync(0xffffffffu, v, 0)" in out
    assert "__ballot_sync(0xffffffffu, p)" in out


def test_unguarded_amdgcn_builtin_fails_and_guarded_passes():
    with pytest.raises(TranslationError, match="outside an AMD-only"):
        translate("__device__ int f(float v) { return __builtin_amdgcn_cvt_pk_fp8_f32(v, 0, 0, false); }\n")
    ok = ("#if defined(__gfx942__)\nint a = __builtin_amdgcn_cvt_pk_fp8_f32(v, 0, 0, false);\n"
          "#else\nint a = 0;\n#endif\n")
    translate(ok)
    bad_else = "#if defined(__gfx942__)\nint a = 0;\n#else\nint a = __builtin_amdgcn_readfirstlane(x);\n#endif\n"
    with pytest.raises(TranslationError):
        translate(bad_else)


@pytest.mark.parametrize("src", ["__hip_fp8_e4m3_fnuz x;", "auto n = props.gcnArchName;"])
def test_unportable_constructs_fail(src):
    with pytest.raises(TranslationError):
        translate(src)
