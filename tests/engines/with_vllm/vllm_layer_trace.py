"""A multi-step trace through vLLM's DeepSeek-V4 layer and dsv4_rocm's reference layer with the same weights
(shared by the CPU and GPU layer tests).

The scheduler side is made here as vLLM's scheduler and block managers would: requests in a fixed order with
decode requests first, one block table per KV-cache group, physical pages handed out from a free list, and
the sliding-window group's pages that fall wholly behind every future token's window given back (the table
entry becomes vLLM's null block 0) and handed out again to later tokens: the cache wraps its pages.
"""
from dataclasses import dataclass
from typing import Dict, List

import torch

from dsv4_rocm import layout as L
from dsv4_rocm.step import StepMetadata

NULL_BLOCK = 0


class Tables:
    """Block tables of one request set for one group geometry (``block_size`` positions a block), drawn
    from one free list of ``num_blocks`` pages (0 is the null block); ``window`` > 0 frees blocks that fell
    behind the window, as vLLM's sliding-window manager does."""

    def __init__(self, num_requests: int, max_model_len: int, block_size: int, num_blocks: int, window: int = 0,
                 seed: int = 0):
        self.bs, self.window = block_size, window
        self.table = torch.full((num_requests, -(-max_model_len // block_size)), NULL_BLOCK, dtype=torch.int32)
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.num_blocks = num_blocks
        self.used, self.reused = set(), 0       # pages handed out so far; hand-outs of a page used before

    def extend(self, b: int, done: int, new: int) -> None:
        """Pages for positions [done, done + new) of request b; pages wholly before the window of the first
        new token go back to the free list first (they are read no more)."""
        if self.window:
            first_needed = max(0, done - self.window + 1)
            for j in range(first_needed // self.bs):
                if self.table[b, j] != NULL_BLOCK:
                    self.free.append(int(self.table[b, j]))
                    self.table[b, j] = NULL_BLOCK
        for j in range(done // self.bs, -(-(done + new) // self.bs)):
            if self.table[b, j] == NULL_BLOCK:
                page = self.free.pop()
                self.reused += page in self.used
                self.used.add(page)
                self.table[b, j] = page

    def slots(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.table[req, pos // self.bs].long() * self.bs + pos % self.bs


@dataclass
class Batch:
    done: List[int]
    new: List[int]

    @property
    def req(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.new)), torch.tensor(self.new))

    @property
    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(d, d + n) for d, n in zip(self.done, self.new)])


def common_metadata(batch: Batch, tables: Tables, device):
    """vLLM's CommonAttentionMetadata of one group for ``batch`` (requests in order, decode first)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    new = batch.new
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    seq = torch.tensor([d + n for d, n in zip(batch.done, new)], dtype=torch.int32)
    pos = batch.positions
    slots = tables.slots(batch.req, pos)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), num_reqs=len(new),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(new), max_seq_len=int(seq.max()),
        block_table_tensor=tables.table.to(device), slot_mapping=slots.to(device), positions=pos.to(device),
        seq_lens_cpu_upper_bound=seq.clone())


def reference_step(batch: Batch, swa: Tables, comp: Tables, state: Tables, max_model_len: int, window: int,
                   num_decodes: int, ratio: int, device) -> StepMetadata:
    """dsv4_rocm's StepMetadata of the same batch over the same tables (the oracle's own metadata path)."""
    new = batch.new
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    seq = torch.tensor([d + n for d, n in zip(batch.done, new)], dtype=torch.int32)
    dec = new[:num_decodes]
    step = StepMetadata(qsl.to(device), seq.to(device), batch.positions.to(device),
                        swa.slots(batch.req, batch.positions).to(device), swa.table.to(device),
                        comp.table.to(device), state.table.to(device), num_decodes=num_decodes,
                        num_decode_tokens=sum(dec), max_model_len=max_model_len, window=window,
                        query_start_loc_cpu=qsl, seq_lens_cpu=seq, uniform_decode=len(set(dec)) <= 1)
    return step.build(ratios=(ratio,) if ratio > 1 else ())


# ---- the layer, its caches and the per-step checks (shared by the CPU and GPU tests) ----------------------
MAX_LEN, MAX_TOKENS, R = 1024, 512, 3
# (name, new tokens per request, decode requests): requests in a fixed order, decode requests first
TRACE = [("prefill", [37, 150, 5], 0), ("decode", [1, 1, 1], 3), ("mixed", [1, 1, 70], 2),
         ("spec-decode", [3, 2, 40], 2), ("wrap", [1, 1, 300], 2), ("decode", [1, 1, 1], 3)]
END_TO_END_REL = 0.12
# DeepSeek-V4's index_topk. vLLM's CPU indexer takes no other (its top-k kernel is topk_transform_512_cpu);
# with at most 512 compressed entries a token (sequences up to 2048 positions) its indexer selects them all
CPU_INDEX_TOPK = 512


def kind(name: str) -> str:
    """The block-table geometry of a cache layer: the sliding window (64 tokens a block), a compressor's
    state (4 or 8), or a compressed cache (256 positions a block: the layer's own and the indexer's)."""
    return "swa" if name.endswith("swa_cache") else "state" if name.endswith("state_cache") else "comp"


@dataclass
class Built:
    vllm_config: object
    layer: object
    layer_id: int
    ratio: int
    weights: object
    groups: list
    num_blocks: Dict[str, int]


def build_layer(cls, cfg, model_dir: str, layer_type, device) -> Built:
    """vLLM's layer class ``cls`` for the first layer of ``layer_type`` of ``cfg``, constructed as vLLM's
    model constructs it (its config current, bf16 the default dtype), its weights loaded, its caches bound
    and its metadata builders made."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from dsv4_rocm.config import LayerType
    from dsv4_rocm.reference.compressor import state_block_size
    from dsv4_rocm.weights import LayerWeights
    import vllm_layer_harness as H
    vc = H.vllm_config(model_dir, MAX_LEN, MAX_TOKENS, num_spec=2)
    layer_id = cfg.first_layer_of(layer_type)
    prefix = f"model.layers.{layer_id}.attn"
    ratio = {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[layer_type]
    nblocks = {"swa": 64, "comp": 16, "state": R * (MAX_LEN // state_block_size(max(ratio, 4))) + 1}
    with set_current_vllm_config(vc):
        with set_default_torch_dtype(torch.bfloat16), torch.device(device):
            layer = cls(vc, prefix=prefix,
                        topk_indices_buffer=torch.empty(MAX_TOKENS, cfg.index_topk, dtype=torch.int32))
        assert layer._dsv4_rocm and layer.padded_heads == 64 and layer.compress_ratio == ratio
        weights = LayerWeights.random(cfg, layer_type, seed=3)
        H.load_weights(layer, H.checkpoint_tensors(weights, cfg, prefix), prefix, vc, device)
        groups = H.cache_groups(vc, {n: nblocks[kind(n)] for n in vc.compilation_config.static_forward_context},
                                device)
    return Built(vc, layer, layer_id, ratio, weights.to(device), groups, nblocks)


def vllm_layer_cache(groups, ratio):
    """dsv4_rocm's LayerCache over vLLM's own cache tensors (no copy)."""
    from dsv4_rocm.kv_cache import LayerCache
    by = {kind(g.name) + (".idx" if ".indexer." in g.name else ""): g for g in groups}
    c = LayerCache(swa=by["swa"].cache, ratio=ratio)
    if ratio > 1:
        c.comp, c.comp_state = by["comp"].cache, by["state"].module.kv_cache
    if ratio == 4:
        c.idx, c.idx_state = by["comp.idx"].cache, by["state.idx"].module.kv_cache
    return c


def snapshot(cache):
    from dsv4_rocm.kv_cache import LayerCache
    return LayerCache(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in cache.__dict__.items()})


class Trace:
    """Drives ``built.layer`` through the trace and checks every step (module docstring of the tests).
    ``exact_attention``: the attention output must equal dsv4_rocm's reference bit for bit (the plugin runs
    the reference backend, as on CPU); otherwise within the tolerance the sparse MLA kernels are tested to
    (tests/attention/sparse_mla_inputs.py: 2/128 relative plus 2^-8 of the largest key)."""

    def __init__(self, built: Built, cfg, device, exact_attention: bool):
        import vllm_layer_harness as H
        from dsv4_rocm.attention import DeepseekV4Attention
        from dsv4_rocm.config import LayerType
        from dsv4_rocm.kv_cache import LayerCache
        from dsv4_rocm.reference.compressor import state_block_size
        self.b, self.cfg, self.device, self.exact = built, cfg, device, exact_attention
        nb, ratio = built.num_blocks, built.ratio
        self.tables = {"swa": Tables(R, MAX_LEN, 64, nb["swa"], window=cfg.sliding_window, seed=1),
                       "comp": Tables(R, MAX_LEN, 256, nb["comp"], seed=2),
                       "state": Tables(R, MAX_LEN, state_block_size(max(ratio, 4)), nb["state"], seed=3)}
        self.cos_sin = built.layer.rotary_emb.cos_sin_cache
        assert self.cos_sin.dtype == torch.float32 and self.cos_sin.shape == (MAX_LEN, 64)
        layer_type = {1: LayerType.SWA, 4: LayerType.C4, 128: LayerType.C128}[ratio]
        self.oracle_cache = LayerCache.allocate(layer_type, nb["comp"], nb["state"], device=device,
                                                num_swa_blocks=nb["swa"])
        self.oracle = DeepseekV4Attention(cfg, built.layer_id, built.weights, self.oracle_cache, MAX_LEN,
                                          cos_sin_cache=self.cos_sin, device=device)
        self.live = vllm_layer_cache(built.groups, ratio)
        self.over_vllm = DeepseekV4Attention(cfg, built.layer_id, built.weights, self.live, MAX_LEN,
                                             cos_sin_cache=self.cos_sin, device=device)
        self.rec = H.Recorder(built.layer)
        self.g = torch.Generator().manual_seed(11)
        self.done = [0] * R
        self.entries_written = 0
        self.results = []

    def metadata(self, batch: Batch):
        return {gr.name: gr.group.build_metadata(common_metadata(batch, self.tables[kind(gr.name)], self.device))
                for gr in self.b.groups}

    def schedule(self, new) -> Batch:
        batch = Batch(list(self.done), new)
        for b in range(R):
            for t in self.tables.values():
                t.extend(b, self.done[b], new[b])
        return batch

    def hidden(self, T):
        return torch.randn(T, self.cfg.hidden_size, generator=self.g).bfloat16().to(self.device)

    def profile_run(self):
        from vllm.forward_context import set_forward_context
        before = snapshot(self.live)
        with set_forward_context(None, self.b.vllm_config):
            y = self.b.layer(torch.arange(16, device=self.device), self.hidden(16))
        assert y.shape == (16, self.cfg.hidden_size) and not y.any()
        for k in ("swa", "comp", "comp_state", "idx", "idx_state"):
            if getattr(self.live, k) is not None:
                assert torch.equal(getattr(self.live, k), getattr(before, k)), k

    def step(self, name, new, num_decodes):
        from vllm.forward_context import set_forward_context
        batch = self.schedule(new)
        md = self.metadata(batch)
        T, pos = sum(new), batch.positions.to(self.device)
        x = self.hidden(T)
        before = snapshot(self.live)
        self.rec.clear()
        with set_forward_context(md, self.b.vllm_config):
            y = self.b.layer(pos, x)
        rel = self.check(name, batch, num_decodes, pos, x, y, before)
        for b in range(R):
            self.done[b] += new[b]
        return batch, y, rel

    def check(self, name, batch, num_decodes, pos, x, y, before):
        import vllm_layer_harness as H
        from dsv4_rocm import ops
        from dsv4_rocm import layout as L
        from dsv4_rocm.reference.compressor import kv_cache_view
        cfg, ratio, layer = self.cfg, self.b.ratio, self.b.layer
        with ops.use_backend("reference"):
            step = reference_step(batch, self.tables["swa"], self.tables["comp"], self.tables["state"], MAX_LEN,
                                  cfg.sliding_window, num_decodes, ratio, self.device)
            q_in, kv_in, q_out = self.rec.seen["insert"]
            want = before.swa.clone()
            want_q = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
                q_in, kv_in, want, step.slot_mapping, pos, self.cos_sin, 64, cfg.rms_norm_eps, 64)
            assert torch.equal(self.live.swa, want) and not torch.equal(want, before.swa), f"{name}: SWA cache bytes"
            if self.exact:
                assert torch.equal(q_out.view(torch.int16), want_q.view(torch.int16)), f"{name}: padded q"
            else:
                torch.testing.assert_close(q_out.float(), want_q.float(), rtol=2 ** -7, atol=0, msg=f"{name}: q")
            if ratio > 1:
                comp, comp_state = before.comp.clone(), before.comp_state.clone()
                H.reference_compress(self.rec.seen["compressor"], layer.compressor.ape.data,
                                     layer.compressor.norm.weight.data, pos, step, comp_state,
                                     kv_cache_view(comp, L.compressed_block_size(ratio), L.TOKEN_BYTES),
                                     step.compressed_slots[ratio], 512, ratio, cfg.rms_norm_eps, self.cos_sin)
                n = int((step.compressed_slots[ratio] >= 0).sum())
                self.same_records(f"{name}: compressed cache", self.live.comp, comp, n * L.TOKEN_BYTES)
                self.same_state(f"{name}: compressor state", self.live.comp_state, comp_state)
                self.entries_written += n
            if ratio == 4:
                idx, idx_state = before.idx.clone(), before.idx_state.clone()
                H.reference_compress(self.rec.seen["indexer.compressor"], layer.indexer.compressor.ape.data,
                                     layer.indexer.compressor.norm.weight.data, pos, step, idx_state,
                                     kv_cache_view(idx, 64, L.INDEXER_TOKEN_BYTES), step.compressed_slots[4], 128,
                                     4, cfg.rms_norm_eps, self.cos_sin)
                n = int((step.compressed_slots[4] >= 0).sum())
                self.same_records(f"{name}: indexer-K cache", self.live.idx, idx, n * L.INDEXER_TOKEN_BYTES)
                self.same_state(f"{name}: indexer compressor state", self.live.idx_state, idx_state)
            topk = layer.topk_indices_buffer[:batch.positions.shape[0]] if ratio == 4 else None
            q_attn, out = self.rec.seen["mqa"]
            want_out = torch.full_like(out, 7.0)
            self.over_vllm.forward_mqa(q_attn, None, pos, want_out, step, topk)
            if self.exact:
                assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), f"{name}: attention output"
            else:
                torch.testing.assert_close(out.float(), want_out.float(), rtol=2 / 128,
                                           atol=2 ** -8 * float(want_out.float().abs().max()),
                                           msg=f"{name}: attention output")
            assert out[:, :cfg.local_heads].abs().sum() > 0 and torch.isfinite(out.float()).all()
            y_ref = self.oracle(pos, x, step)
        rel = float((y.float() - y_ref.float()).norm() / y_ref.float().norm())
        assert rel < END_TO_END_REL, f"{name}: output differs from dsv4_rocm's layer by {rel:.3f} in norm"
        self.results.append((name, int(pos.shape[0]), rel))
        return rel

    def same_records(self, what, got, want, written_bytes):
        """Cache pages written by vLLM's compressor against dsv4_rocm's reference stages. On CPU (``exact``) they
        are dsv4_rocm's ops behind vLLM's CPU kernel forms: equal bytes. On a GPU vLLM's own Triton compressor
        writes them, pooling in fp32 in its own order: an fp8 byte may round the other way where the pooled
        value lies on a rounding boundary, so at most 1 % of the written bytes may differ."""
        if self.exact:
            assert torch.equal(got, want), what
            return
        differ = int((got != want).sum())
        assert differ <= 0.01 * written_bytes, f"{what}: {differ} of {written_bytes} written bytes differ"

    def same_state(self, what, got, want):
        if self.exact:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), what
        else:
            torch.testing.assert_close(got, want, msg=what)

    def run(self):
        self.profile_run()
        for name, new, nd in TRACE:
            self.step(name, new, nd)
        assert self.tables["swa"].reused > 0, "the trace never handed a freed SWA page out again"
        assert self.b.ratio == 1 or self.entries_written >= 3, "too few compressed entries written to test them"
        return self.results
