"""The SGLang plugin (dsv4_rocm.integrations.sglang).

Without SGLang (any test venv): the hook functions themselves. The attention hook on FlashMLA's keywords as
SGLang's HIP backend builds them equals dsv4_rocm's FlashMLA decode and the oracle, int64 lengths
converted, SGLang's interleaved inverse-RoPE table read right; the store hook writes dsv4_rocm's records
(padding slots skipped) and hands other stores to SGLang's function; routing by backend name and record
size; ``register`` on a CPU torch changes nothing.

With the real sglang==0.5.23 (``bash ci/engine_tier_sglang.sh`` builds its venv; elsewhere these skip with the
reason): SGLang's plugin loader finds the entry point; the guards pass; registering and SGLang's
``HookRegistry.apply_hooks`` replace the backend class, the kernel-name resolver, the entrypoint and the
store in SGLang's modules and in every module that imported them; the backend name stays "dsv4"; the
entrypoint called as the HIP backend calls it runs dsv4_rocm; a store through the memory pool's imported
``fused_store_cache`` writes dsv4_rocm's bytes, which SGLang's own dequantizer (its Triton kernel, run
by the interpreter) reads back as the oracle's values.
"""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4_rocm import flash_mla, ops
from dsv4_rocm import layout as L
from dsv4_rocm.integrations import sglang as plugin
from dsv4_rocm.integrations.sglang import hooks
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import rope as R
from helpers import random_k, random_paged_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not importable here: bash ci/engine_tier_sglang.sh "
                                                          "builds a venv with sglang==0.5.23 and runs these")


def sglang_page_buffer(num_pages, page_size, seed):
    """A page buffer as SGLang's DeepSeek-V4 pool allocates it ([pages, page bytes padded to 576]), every
    slot a record of random K; and its [pages, page_size, 1, 584] view as the HIP backend slices it."""
    pages, _ = random_paged_cache(num_pages, page_size, "cpu", seed)
    view = pages[:, :page_size * 584].view(num_pages, page_size, 1, 584)
    return pages, view


def backend_kwargs(b=3, h=64, topk=128, etopk=64, seed=0):
    """FlashMLA's keywords as DeepseekV4HipRadixBackend._forward_attention builds them (int32 lengths [b],
    indices [b, 1, topk] aligned to 64, the sink, no block table, no scheduling object on HIP)."""
    g = torch.Generator().manual_seed(seed)
    swa_pages, swa = sglang_page_buffer(4, 64, seed)
    c_pages, comp = sglang_page_buffer(8, 2, seed + 1)
    idx = torch.randint(-1, 4 * 64, (b, 1, topk), generator=g).int()
    eidx = torch.randint(-1, 16, (b, 1, etopk), generator=g).int()
    kw = dict(q=torch.randn(b, 1, h, 512, generator=g).bfloat16(), k_cache=swa, head_dim_v=512, block_table=None,
              cache_seqlens=None, tile_scheduler_metadata=None, softmax_scale=512 ** -0.5, is_fp8_kvcache=True,
              indices=idx, topk_length=torch.randint(0, topk + 1, (b,), generator=g).int(),
              attn_sink=torch.randn(h, generator=g), extra_k_cache=comp, extra_indices_in_kvcache=eidx,
              extra_topk_length=torch.randint(1, etopk + 1, (b,), generator=g).int())
    return kw


# ---- the hook functions (no SGLang needed) ---------------------------------------------------------
def test_attention_hook_is_flash_mla_on_sglangs_keywords():
    kw = backend_kwargs()
    out, lse = hooks.attention(None, backend=hooks.BACKEND, **kw)
    want, want_lse = flash_mla.flash_mla_with_kvcache(
        kw["q"], kw["k_cache"], None, None, 512, flash_mla.get_mla_metadata()[0], softmax_scale=kw["softmax_scale"],
        is_fp8_kvcache=True, indices=kw["indices"], attn_sink=kw["attn_sink"], extra_k_cache=kw["extra_k_cache"],
        extra_indices_in_kvcache=kw["extra_indices_in_kvcache"], topk_length=kw["topk_length"],
        extra_topk_length=kw["extra_topk_length"])
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # int64 lengths, as another caller might pass them, give the same result
    kw64 = dict(kw, topk_length=kw["topk_length"].long(), extra_topk_length=kw["extra_topk_length"].long())
    assert torch.equal(hooks.attention(None, backend=hooks.BACKEND, **kw64)[0], out)


def test_attention_hook_reads_sglangs_interleaved_inverse_rope_table():
    kw = backend_kwargs(seed=1)
    cs = R.build_cos_sin_cache(10000.0, 512)                                    # cos | sin
    freqs_real = torch.stack([cs[:, :32], cs[:, 32:]], dim=-1).flatten(-2)     # view_as_real(freqs_cis) form
    pos = torch.tensor([3, 500, 0])
    plain, _ = hooks.attention(None, backend=hooks.BACKEND, **kw)
    rotated, _ = hooks.attention(None, backend=hooks.BACKEND, inv_rope=(freqs_real, pos), **kw)
    want = plain.clone().view(3, 64, 512)
    R.rocm_inverse_rope_rows_(want, pos, cs, 64)
    assert torch.equal(rotated.view(3, 64, 512), want)
    assert torch.equal(hooks.cos_sin_of(freqs_real), cs)


def test_attention_hook_routes_everything_else_to_sglang():
    calls = []

    def original(**kw):
        calls.append(kw["backend"])
        return "sglang"
    kw = backend_kwargs(seed=2)
    assert hooks.attention(original, backend="aiter_sparse", **kw) == "sglang"
    v41 = dict(kw, k_cache=torch.zeros(2, 64, 1, 528, dtype=torch.uint8))          # a V4.1 page
    assert hooks.attention(original, backend=hooks.BACKEND, **v41) == "sglang"
    assert calls == ["aiter_sparse", hooks.BACKEND]
    with pytest.raises(ValueError, match="does not take"):
        hooks.attention(original, backend=hooks.BACKEND, wo_a_quant_freqs=None, **kw)
    with pytest.raises(ValueError, match="sparse fp8 mode"):
        hooks.attention(original, backend=hooks.BACKEND, **dict(kw, is_fp8_kvcache=False))


def test_store_hook_writes_dsv4_rocm_records():
    pages = torch.randint(0, 256, (3, L.page_bytes(64)), dtype=torch.uint8)
    want = pages.clone()
    k = random_k(5)
    loc = torch.tensor([3, -1, 130, 64, 7])                   # int64, a padding slot
    assert hooks.store(None, k, pages, loc, page_size=64, type="flashmla", layout="v4") is None
    rc.quantize_and_insert_k_cache(k, want, loc, 64)
    assert torch.equal(pages, want)


def test_store_hook_leaves_other_stores_to_sglang():
    calls = []

    def original(*args, **kw):
        calls.append((kw["type"], str(kw["layout"]), kw["freqs_cis"] is not None))
    k, c, loc = random_k(2), torch.zeros(2, 8640, dtype=torch.uint8), torch.tensor([0, 1])
    before = c.clone()
    hooks.store(original, k[:, :128], c, loc, page_size=64, type="indexer")
    hooks.store(original, k, c, loc, page_size=64, type="flashmla", layout="v41")
    hooks.store(original, k, c, loc, page_size=64, type="flashmla", layout="v4", freqs_cis=torch.zeros(2, 64))
    assert calls == [("indexer", "v4", False), ("flashmla", "v41", False), ("flashmla", "v4", True)]
    assert torch.equal(c, before)


def test_register_on_a_cpu_torch_changes_nothing(monkeypatch):
    monkeypatch.setitem(plugin._state, "registered", None)
    assert plugin.register() is False
    assert plugin.register() is False                       # answered once per process


# ---- against the real SGLang package -----------------------------------------------------------------
@pytest.fixture(scope="module")
def applied():
    """Register the hooks as SGLang's loader would on ROCm (force: this is a CPU torch) and apply them."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dsv4_rocm.integrations.sglang import guards
    import sglang.srt.layers.attention.hip_flash_mla as hfm
    import sglang.kernels.ops.attention.dsv4.attn as attn
    import sglang.srt.layers.attention.deepseek_v4_backend_hip_radix as radix
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool
    import sglang.srt.layers.attention.attention_registry as registry
    originals = dict(resolve=hfm.resolve_hip_flashmla_backend, entry=hfm.flash_mla_with_kvcache_entrypoint,
                     store=attn.fused_store_cache, backend=radix.DeepseekV4HipRadixBackend,
                     dsv4=registry.ATTENTION_BACKENDS["dsv4"])
    plugin._state["registered"] = None
    assert plugin.register(force=True) is True, guards.mismatches()
    HookRegistry.apply_hooks()
    return dict(originals=originals, hfm=hfm, attn=attn, radix=radix, pool=pool, registry=registry)


@needs_sglang
def test_sglang_plugin_loader_finds_the_entry_point():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert found[plugin.PLUGIN_NAME][0] is plugin.register


@needs_sglang
def test_guards_pass_on_sglang_0_5_23():
    from dsv4_rocm.integrations.sglang import guards
    assert guards.mismatches() == []


@needs_sglang
def test_hooks_replace_sglangs_functions_everywhere(applied):
    hfm, radix, pool, attn = applied["hfm"], applied["radix"], applied["pool"], applied["attn"]
    o = applied["originals"]
    assert hfm.resolve_hip_flashmla_backend() == "dsv4_rocm"
    assert hfm.hip_attention_needs_head_pad()                   # SGLang pads the heads to 64 for us
    # the copies other modules took with `from ... import` are rebound too
    assert radix.resolve_hip_flashmla_backend is hfm.resolve_hip_flashmla_backend is not o["resolve"]
    assert pool.resolve_hip_flashmla_backend is hfm.resolve_hip_flashmla_backend
    assert radix.flash_mla_with_kvcache_entrypoint is hfm.flash_mla_with_kvcache_entrypoint is not o["entry"]
    assert pool.fused_store_cache is attn.fused_store_cache is not o["store"]
    from sglang.srt.layers.attention.dsv4 import unified_kv_gate
    assert unified_kv_gate.is_unified_kv_triton() is False


@needs_sglang
def test_backend_class_is_sglangs_with_dsv4_rocm_underneath(applied):
    radix, registry, o = applied["radix"], applied["registry"], applied["originals"]
    cls = radix.DeepseekV4HipRadixBackend
    assert cls is not o["backend"] and issubclass(cls, o["backend"])
    assert cls.__name__ == "DeepseekV4Dsv4RocmBackend"
    assert registry.ATTENTION_BACKENDS["dsv4"] is o["dsv4"]     # still created under the name "dsv4"
    assert cls._opus_prefill_applies(None, None, None, 0) is False
    assert o["backend"]._opus_prefill_applies is not cls._opus_prefill_applies


@needs_sglang
def test_entrypoint_called_as_the_hip_backend_calls_it(applied):
    hfm = applied["hfm"]
    kw = backend_kwargs(seed=4)
    backend = hfm.resolve_hip_flashmla_backend()
    o = hfm.flash_mla_with_kvcache_entrypoint(**kw, backend=backend)[0]
    want, _ = flash_mla.flash_mla_with_kvcache(
        kw["q"], kw["k_cache"], None, None, 512, flash_mla.get_mla_metadata()[0], softmax_scale=kw["softmax_scale"],
        is_fp8_kvcache=True, indices=kw["indices"], attn_sink=kw["attn_sink"], extra_k_cache=kw["extra_k_cache"],
        extra_indices_in_kvcache=kw["extra_indices_in_kvcache"], topk_length=kw["topk_length"],
        extra_topk_length=kw["extra_topk_length"])
    assert torch.equal(o, want)


_READ_BACK = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path[:0] = [{root!r}, {tests!r}]
    from sglang.srt.plugins.hook_registry import HookRegistry
    from dsv4_rocm.integrations import sglang as plugin
    from dsv4_rocm import layout as L
    from dsv4_rocm.reference import cache as rc
    from helpers import random_k
    assert plugin.register(force=True)
    HookRegistry.apply_hooks()
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool
    from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged_dsv4
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    pages = torch.zeros(5, KVLayout.V4.page_bytes(64), dtype=torch.uint8)     # SGLang's pool allocation
    k = random_k(40)
    loc = torch.randperm(5 * 64)[:40]
    pool.fused_store_cache(input=k, cache=pages, indices=loc, page_size=64, type="flashmla", layout=KVLayout.V4)
    want = torch.zeros_like(pages)
    rc.quantize_and_insert_k_cache(k, want, loc, 64)
    assert torch.equal(pages, want), "bytes"
    got = dequantize_k_cache_paged_dsv4(pages, loc, 64)[:, 0]
    ref = rc.decode_k_records(rc.encode_k_records(k)).bfloat16()
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), "values"
    print("read back", got.shape[0])
""")


@needs_sglang
def test_sglangs_dequantizer_reads_what_the_hooked_store_wrote(tmp_path):
    script = tmp_path / "read_back.py"
    script.write_text(_READ_BACK.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    print(r.stdout[-2000:], r.stderr[-4000:])
    assert r.returncode == 0 and "read back 40" in r.stdout
