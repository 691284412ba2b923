"""dsv4_rocm.integrations.vllm.torch_ops: the ``torch.ops._C`` / ``torch.ops._C_cache_ops`` forms vLLM 0.33
calls, defined over dsv4_rocm's ops where absent, never over an op already there.

In a fresh process (the namespaces are process-wide): an op predefined under ``_C`` keeps its own
implementation; the others are defined, give the bytes of dsv4_rocm's op of the same name called the same
way (the indexer-K insert through ``_C_cache_ops``, the kv-only insert and the fused insert through
``_C``), trace under FakeTensorMode, and a second call defines nothing.
"""
import textwrap

from helpers import run_interpreted

_SCRIPT = textwrap.dedent("""
    import torch
    seen = []
    pre = torch.library.Library("_C", "FRAGMENT")      # a build that has one of the ops already
    pre.define("persistent_topk(Tensor logits, Tensor lengths, Tensor(a!) output, Tensor workspace, int k, "
               "int max_seq_len) -> ()")
    pre.impl("persistent_topk", lambda *a: seen.append("vllm's"), "CPU")

    from dsv4_rocm import ops
    from dsv4_rocm.integrations.vllm import torch_ops
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    import sys
    sys.path.insert(0, "tests")
    from helpers import random_k

    done = torch_ops.register_missing(load_vllm_kernels=False)
    print("defined", len(done), "_C::persistent_topk" in done, "_C_cache_ops::indexer_k_quant_and_cache" in done,
          "_C::fused_deepseek_v4_kv_rope_insert" in done)
    logits = torch.randn(2, 64)
    torch.ops._C.persistent_topk(logits, torch.tensor([64, 64], dtype=torch.int32), torch.empty(2, 4, dtype=torch.int32),
                                 torch.empty(0, dtype=torch.uint8), 4, 64)
    print("kept", seen == ["vllm's"])

    g = torch.Generator().manual_seed(0)
    k = torch.randn(9, 128, generator=g).bfloat16()
    slots = torch.randperm(2 * 16, generator=g)[:9]
    slots[2] = -1
    a = torch.full((2, 64, 132), 0xA5, dtype=torch.uint8)
    b = a.clone()
    torch.ops._C_cache_ops.indexer_k_quant_and_cache(k, a, slots, 128, "ue8m0")
    ops.indexer_k_quant_and_cache(k, b, slots, 128, "ue8m0")
    print("indexer", torch.equal(a, b) and not torch.equal(a, torch.full_like(a, 0xA5)))

    kv, pos, cs = random_k(9, gen=g), torch.randint(0, 4096, (9,), generator=g), build_cos_sin_cache(10000.0, 4096)
    a = torch.full((2, 16 * 584), 0xA5, dtype=torch.uint8)
    b, c = a.clone(), a.clone()
    torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, a, slots, pos, cs, 16, None, False)
    ops.fused_deepseek_v4_kv_rope_insert(kv, b, slots, pos, cs, 16)
    q = torch.randn(9, 8, 512, generator=g).bfloat16()
    qa = torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, c, slots, pos, cs, 16, 1e-6, 16)
    qb = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, b.clone(), slots, pos, cs, 16, 1e-6, 16)
    print("inserts", torch.equal(a, b) and torch.equal(a, c) and torch.equal(qa, qb))

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (q, kv, c, slots, pos, cs)]
        out = torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(*f, 16, 1e-6, 16)
        print("fake", tuple(out.shape) == (9, 16, 512))
    print("again", torch_ops.register_missing(load_vllm_kernels=False) == [])
""")


def test_missing_namespace_ops_are_defined_and_present_ones_kept(tmp_path):
    r = run_interpreted(_SCRIPT, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert rows[0] == ["defined", "10", "False", "True", "True"]
    assert rows[1:] == [["kept", "True"], ["indexer", "True"], ["inserts", "True"], ["fake", "True"],
                        ["again", "True"]]
