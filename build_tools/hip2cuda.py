"""Reverse hipify: translate the project's HIP sources to CUDA for nvcc (docs/platforms.md#hip-extension).

Built on PyTorch's ``torch.utils.hipify.cuda_to_hip_mappings`` (hipify-torch's tables), inverted with care:
  1. only entries whose HIP side names a HIP/ROCm symbol (``hip``/``roc``/``HIP``/``ROC``) are inverted;
  2. a HIP name with several CUDA sources takes the runtime ``cuda*`` name over the driver ``cu*``/``CU*``
     one, then a name without ``_v2``/``Optin``, then the shortest;
  3. explicit overrides (headers, error and stream types) win over the table;
  4. rules for HIP-only spellings the table never produces: ``hipLaunchKernelGGL(k, g, b, sh, st, a...)``
     becomes ``k<<<g, b, sh, st>>>(a...)`` (parenthesis-aware), mask-less ``__shfl*`` / ``__ballot``
     become their ``*_sync`` forms with a full 32-lane mask;
  5. unportable constructs are errors: ``__builtin_amdgcn_*`` outside an AMD-only preprocessor branch,
     ``*_fnuz`` types, ``gcnArchName``.

CLI: ``python -m build_tools.hip2cuda SRC.hip... -o OUTDIR`` writes ``OUTDIR/NAME.cu``.
"""
import argparse
import functools
import os
import re
import sys

OVERRIDES = {
    "hip/hip_runtime.h": "cuda_runtime.h",
    "hip/hip_runtime_api.h": "cuda_runtime_api.h",
    "hip/hip_fp16.h": "cuda_fp16.h",
    "hip/hip_bf16.h": "cuda_bf16.h",
    "hipError_t": "cudaError_t",
    "hipSuccess": "cudaSuccess",
    "hipStream_t": "cudaStream_t",
    "hipGetLastError": "cudaGetLastError",
    "hipGetErrorString": "cudaGetErrorString",
}
AMD_GUARDS = ("__gfx", "__AMDGCN__", "DSV4_AMD", "__HIP_PLATFORM_AMD__", "__HIP_DEVICE_COMPILE__")
SHFL = ("__shfl_xor", "__shfl_up", "__shfl_down", "__shfl")


class TranslationError(ValueError):
    pass


def _rank(cuda_name: str):
    driver = not cuda_name.startswith("cuda")
    legacy = ("_v2" in cuda_name) or ("Optin" in cuda_name)
    return (driver, legacy, len(cuda_name), cuda_name)


@functools.lru_cache(maxsize=None)
def reverse_table() -> dict:
    """HIP identifier -> CUDA identifier."""
    from torch.utils.hipify.cuda_to_hip_mappings import CUDA_TO_HIP_MAPPINGS
    cands = {}
    for table in CUDA_TO_HIP_MAPPINGS:
        for cuda, hip in table.items():
            hip = hip[0] if isinstance(hip, tuple) else hip
            if not re.search(r"hip|roc|HIP|ROC", hip):
                continue
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", hip) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cuda):
                continue
            cands.setdefault(hip, set()).add(cuda)
    out = {hip: min(cs, key=_rank) for hip, cs in cands.items()}
    out.update({k: v for k, v in OVERRIDES.items() if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)})
    return out


def _split_args(s: str, start: int):
    """Arguments of the call whose '(' is at s[start]; returns (args, index after ')'). Commas nested in
    (), [], {} do not split; in the first argument (a kernel name) neither do commas inside <...>."""
    depth, angle, args, cur = 0, 0, [], []
    for i in range(start, len(s)):
        ch = s[i]
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return ([] if args == [""] else args), i + 1
        elif depth == 1 and not args and ch in "<>":
            angle += 1 if ch == "<" else -1
        elif ch == "," and depth == 1 and angle == 0:
            args.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    raise TranslationError("unbalanced parentheses in a call")


def _rewrite_calls(src: str, name: str, fn) -> str:
    out, i = [], 0
    pat = re.compile(r"\b" + re.escape(name) + r"\s*\(")
    while True:
        m = pat.search(src, i)
        if not m:
            out.append(src[i:])
            return "".join(out)
        out.append(src[i:m.start()])
        args, end = _split_args(src, m.end() - 1)
        out.append(fn(args))
        i = end


def _launch(args):
    if len(args) < 5:
        raise TranslationError("hipLaunchKernelGGL needs kernel, grid, block, shared bytes, stream")
    k, g, b, sh, st = args[:5]
    if k.startswith("(") and k.endswith(")"):
        k = k[1:-1]
    return f"{k}<<<{g}, {b}, {sh}, {st}>>>({', '.join(args[5:])})"


def _check_unportable(src: str, path: str):
    """__builtin_amdgcn_* only inside #if branches that name an AMD target; no fnuz types, no gcnArchName."""
    problems, stack = [], []          # stack of [amd_branch_active]
    for n, line in enumerate(src.splitlines(), 1):
        s = line.strip()
        if s.startswith("#if"):
            stack.append(any(g in s for g in AMD_GUARDS))
        elif s.startswith("#elif"):
            if stack:
                stack[-1] = any(g in s for g in AMD_GUARDS)
        elif s.startswith("#else"):
            if stack:
                stack[-1] = False
        elif s.startswith("#endif"):
            if stack:
                stack.pop()
        code = s.split("//")[0]
        if "__builtin_amdgcn_" in code and not any(stack):
            problems.append(f"{path}:{n}: __builtin_amdgcn_* outside an AMD-only #if branch")
        if re.search(r"\w*_fnuz\b", code):
            problems.append(f"{path}:{n}: fnuz fp8 type (the cache holds OCP bytes; see portable.h)")
        if "gcnArchName" in code:
            problems.append(f"{path}:{n}: gcnArchName in device code")
    return problems


def translate(src: str, path: str = "<src>") -> str:
    problems = _check_unportable(src, path)
    if problems:
        raise TranslationError("unportable HIP:\n  " + "\n  ".join(problems))
    out = _rewrite_calls(src, "hipLaunchKernelGGL", _launch)
    for name in SHFL:
        out = _rewrite_calls(out, name, lambda a, n=name: f"{n}_sync(0xffffffffu, {', '.join(a)})")
    out = _rewrite_calls(out, "__ballot", lambda a: f"__ballot_sync(0xffffffffu, {', '.join(a)})")
    for hip_h, cuda_h in OVERRIDES.items():
        if hip_h.endswith(".h"):
            out = out.replace(f"<{hip_h}>", f"<{cuda_h}>").replace(f'"{hip_h}"', f'"{cuda_h}"')
    table = reverse_table()
    return re.sub(r"\b(hip[A-Za-z0-9_]*|HIP[A-Za-z0-9_]*|roc[A-Za-z0-9_]*|ROC[A-Za-z0-9_]*)\b",
                  lambda m: table.get(m.group(1), m.group(1)), out)


def translate_file(src_path: str, out_dir: str) -> str:
    with open(src_path) as f:
        text = translate(f.read(), src_path)
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.splitext(os.path.basename(src_path))[0] + ".cu")
    header = f"// Generated by build_tools/hip2cuda.py from {os.path.basename(src_path)}; do not edit.\n"
    with open(dst, "w") as f:
        f.write(header + text)
    return dst


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+")
    p.add_argument("-o", "--out-dir", required=True)
    a = p.parse_args(argv)
    try:
        for s in a.sources:
            print(translate_file(s, a.out_dir))
    except TranslationError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
