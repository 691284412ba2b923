"""Filter of the engine tiers' output: ``... 2>&1 | python3 ci/engine_warnings.py ENGINE LABEL``.

Passes every line through except the known harmless warnings ENGINE's modules print on a CPU machine
(KNOWN below: each a pattern, the number of lines the warning spans, and why it is harmless), and at the end
says in one line, prefixed with LABEL, how many lines of which warnings it dropped. Only lines starting at
column 0 are matched, so pytest's own summaries pass untouched."""
import re
import sys

KNOWN = {
    "vllm": [
        (r"Failed to import from (amdsmi|vllm\._C\w*|vllm\._rocm_C)\b", 1,
         "vLLM's compiled CUDA/ROCm/CPU extensions and amdsmi, absent from the --no-deps CPU install (the "
         "import of vllm._C_stable_libtorch reports libcuda.so.1 missing); the tier runs vLLM's Python paths"),
        (r"\S*torch/jit/_script\.py:\d+: DeprecationWarning: `torch\.jit\.script_method` is deprecated", 2,
         "torch's deprecation of torch.jit.script_method, which vLLM's imports use"),
        (r"\S*vllm/triton_utils/dispatcher\.py:\d+: FutureWarning: `torch\.distributed\.reduce_op` is deprecated", 2,
         "torch's deprecation of torch.distributed.reduce_op, touched by vLLM's Triton dispatcher"),
    ],
    "sglang": [
        (r"sys:1: DeprecationWarning: builtin type swigvarlink has no __module__ attribute", 1,
         "Python's deprecation note on a SWIG-built extension (sentencepiece, which SGLang's tokenizer imports), "
         "printed at interpreter exit"),
    ],
}


def main(engine, label, lines=sys.stdin, out=sys.stdout):
    known = [(re.compile(p), n, why) for p, n, why in KNOWN[engine]]
    counts = [0] * len(known)
    skip = 0
    for line in lines:
        if skip:
            skip -= 1
            continue
        hit = next((i for i, (p, _, _) in enumerate(known) if p.match(line)), None)
        if hit is None:
            out.write(line)
            out.flush()
            continue
        counts[hit] += 1
        skip = known[hit][1] - 1
    dropped = [f"{c} x {why}" for c, (_, _, why) in zip(counts, known) if c]
    out.write(f"{label}: filtered {sum(c * k[1] for c, k in zip(counts, known))} lines of known harmless "
              f"{engine} warnings{': ' + '; '.join(dropped) if dropped else ''}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
