"""A ROCm device-library root made from the HIP headers and ocml/ockl bitcode inside the triton wheel,
so clang can compile HIP for gfx942 / gfx950 on a machine without ROCm (docs/platforms.md#compile-matrix). The oclc
control libraries the wheel lacks are one-constant LLVM modules, assembled here with llvm-as."""
import os
import shutil
import subprocess

# name -> (symbol, type, value)
_OCLC = {
    "oclc_daz_opt_on": ("__oclc_daz_opt", "i8", 1), "oclc_daz_opt_off": ("__oclc_daz_opt", "i8", 0),
    "oclc_unsafe_math_on": ("__oclc_unsafe_math_opt", "i8", 1),
    "oclc_unsafe_math_off": ("__oclc_unsafe_math_opt", "i8", 0),
    "oclc_finite_only_on": ("__oclc_finite_only_opt", "i8", 1),
    "oclc_finite_only_off": ("__oclc_finite_only_opt", "i8", 0),
    "oclc_correctly_rounded_sqrt_on": ("__oclc_correctly_rounded_sqrt32", "i8", 1),
    "oclc_correctly_rounded_sqrt_off": ("__oclc_correctly_rounded_sqrt32", "i8", 0),
    "oclc_wavefrontsize64_on": ("__oclc_wavefrontsize64", "i8", 1),
    "oclc_wavefrontsize64_off": ("__oclc_wavefrontsize64", "i8", 0),
    "oclc_isa_version_942": ("__oclc_ISA_version", "i32", 9402),
    "oclc_isa_version_950": ("__oclc_ISA_version", "i32", 9500),
    "oclc_abi_version_400": ("__oclc_ABI_version", "i32", 400),
    "oclc_abi_version_500": ("__oclc_ABI_version", "i32", 500),
    "oclc_abi_version_600": ("__oclc_ABI_version", "i32", 600),
}


# clang's data layout for amdgcn-amd-amdhsa; the control libraries must carry it to link quietly
_LAYOUT = ("e-m:e-p:64:64-p1:64:64-p2:32:32-p3:32:32-p4:64:64-p5:32:32-p6:32:32-p7:160:256:256:32-"
           "p8:128:128:128:48-p9:192:256:256:32-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-"
           "v512:512-v1024:1024-v2048:2048-n32:64-S32-A5-G1-ni:7:8:9")


def find_tool(names):
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def make_rocm_root(root: str, llvm_as: str = None) -> str:
    """Create (once) <root>/include (HIP headers) and <root>/amdgcn/bitcode/*.bc; returns root."""
    import triton
    amd = os.path.join(os.path.dirname(triton.__file__), "backends", "amd")
    bc_dir = os.path.join(root, "amdgcn", "bitcode")
    stamp = os.path.join(root, ".complete")
    if os.path.exists(stamp):
        return root
    llvm_as = llvm_as or find_tool(["llvm-as-22", "llvm-as"])
    if llvm_as is None:
        raise RuntimeError("llvm-as not found (install llvm-22)")
    os.makedirs(bc_dir, exist_ok=True)
    inc = os.path.join(root, "include")
    if not os.path.exists(inc):
        shutil.copytree(os.path.join(amd, "include"), inc)
    for lib in ("ocml.bc", "ockl.bc"):
        shutil.copy(os.path.join(amd, "lib", lib), os.path.join(bc_dir, lib))
    # clang only accepts a device-library directory that also holds hip.bc and opencl.bc; these kernels
    # call nothing from them, so empty modules do
    for name, (sym, ty, val) in list(_OCLC.items()) + [("hip", (None, None, None)), ("opencl", (None, None, None))]:
        ll = os.path.join(bc_dir, name + ".ll")
        with open(ll, "w") as f:
            f.write(f'target datalayout = "{_LAYOUT}"\ntarget triple = "amdgcn-amd-amdhsa"\n')
            if sym:
                f.write(f"@{sym} = linkonce_odr protected local_unnamed_addr addrspace(4) constant {ty} {val}\n")
        subprocess.run([llvm_as, ll, "-o", os.path.join(bc_dir, name + ".bc")], check=True)
        os.remove(ll)
    open(stamp, "w").close()
    return root
