"""The layer checked at long contexts (32K to 128K tokens) in minutes: sampled rows against a float64
reference on the indices they select, a planted needle for the C4 indexer, and a long decode run for drift.

Where the time of a plain long run goes, and what this check does instead:

* The main job's end-of-run check runs request 0 through the reference backend on the CPU: every token's
  indexer logits over every visible entry (O(n^2 / 4) dot products of 64 heads) and its attention, in
  exact emulation. At 32K tokens that alone is minutes. Here the reference is computed for a sample of rows
  only, each on the keys it attends (its window and its selected entries) plus one row of index logits.
* Every prefill token of a long prompt scores all its visible entries in the indexer (O(n^2 / 4) again,
  on the GPU). Rows nobody checks do not need scores: the prefix is written by ``fill_caches`` (the same
  kernels that ``forward`` runs to write the SWA records, the compressor state and entries and the index
  keys, in the same order, so the caches end byte for byte as after ``forward``) in chunks of ``chunk``
  tokens; the sampled prefill rows run ``forward`` in 2-token prefill steps, and every decode step runs
  ``forward``.
* A chunk of 512 tokens a step is 64 steps a request at 32K with their host work; a fill chunk is 8192.

What a sampled row at position p checks (each its own line of the table, the worst row's error):
  q         the kernel's q (after norm / RoPE) against the reference functions on the row's hidden state
  swa       the SWA records of p's window, read back from the pages at the slots the block table gives,
            against records encoded from the reference's keys
  comp      the compressed records p attends (C4: its top-k; C128 and V4.1: all, or the top-k), against
            entries pooled, normed, roped and quantized from the hidden states in float64
  index-k   the index keys of p's visible entries (C4: the indexer-K records; V4.1: the kv source's), the same
  top-k     the kernel's top-k against float64 logits of the row (q8 of the reference, keys from the pages):
            every selected entry scores within ``TOPK_TOL`` (relative to the largest logit) of the k-th
            largest, every other entry not above it; exact set when the row sees at most k entries
  attn      the kernel's attention output against float64 attention of the kernel's q over the keys at the
            slots the reference computes (window + selected entries) with the sink
  out       the layer output against the reference output path of the kernel's attention output
Position classes sampled (``position_classes``): window edge (the first full window, and its first slide),
compressed-block edge (the token closing an entry of every ratio), page wrap (the first token of an SWA page
and of a compressed page, and the last before it), the last prompt token and every decode step, the last
one being the last token of the context.
"""
import contextlib
import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import torch

from . import layout as L
from .config import AttentionConfig, LayerType, get_config
from .reference import cache as rc
from .reference import indexer as RI
from .reference import output as RO
from .reference.norm import fused_q_kv_rmsnorm, rmsnorm
from .reference.quant import dequantize_blocks, quantize_blocks
from .reference.rope import rope_fwd

LENGTHS = (32768, 65536, 131072)
V40_KINDS = ("swa", "c4a", "c128a")
V41_RECORDS = ("V40_584", "V41_528", "V41_528+V41_FP4_288")
FILL_CHUNK = 4096
# tolerances (docs/numerics.md#long-contexts): errors are relative (norm of the difference / norm of the reference) per
# row or record, the table shows the worst
TOL = {
    "q": 2e-2,          # the projections quantize their inputs to e4m3: an input one bf16 step off flips about
                        # 1 in 16 roundings by one e4m3 step (6-12%), 1-2% of q after the GEMM
    "swa": 2e-2,        # a record is bytes of fp8 / e2m1: an input one bf16 ulp apart moves a few elements a step
    "comp": 2e-2,
    "comp_fp4": 6e-2,   # one e2m1 step is up to a third of an element
    "index-k": 4e-2,    # two e4m3 roundings in a row (the projection's input, then the key's record)
    "top-k": 4e-2,      # relative to the row's largest |logit|: the keys' error carried into the logits
    "attn": 2e-2,       # bf16 output; P rounded to bf16 in the GPU kernels
    "out": 3e-2,        # fp8 activation quantization of the attention output may flip a step
}
CPU_ATTN_TOL = 1e-3     # the reference backend: fp32 attention rounded to bf16, a rare flip of one bf16 step


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative error of a against b (rows = leading dims, last dim the vector)."""
    a, b = a.double(), b.double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


# ---- which rows -------------------------------------------------------------------------------------
def position_classes(length: int, window: int, decode_steps: int, seed: int = 0) -> Dict[int, List[str]]:
    """{position: [classes]} of the rows a context of ``length`` tokens checks: prompt of
    ``length - decode_steps // 2 - 1`` tokens (so that decode steps cross the 256-token boundary at
    ``length``), then ``decode_steps`` decode steps."""
    prompt = prompt_len(length, decode_steps)
    g = torch.Generator().manual_seed(seed)
    mid = max(256, (length // 2) // 256 * 256)
    rows: Dict[int, List[str]] = {}

    def add(p, c):
        if 1 <= p < prompt + decode_steps:
            rows.setdefault(p, []).append(c)
    add(window - 1, "window edge")
    add(window, "window edge")
    add(mid - 1, "block edge")          # closes a C4, C128 and V4.1 entry, the last of a compressed page
    add(mid, "page wrap")               # first token of an SWA page and of a compressed page
    add(mid + 63, "page wrap")          # last slot of an SWA page
    add(int(torch.randint(window + 1, max(window + 2, prompt - 1), (), generator=g)), "middle")
    add(prompt - 1, "last prompt token")
    for p in range(prompt, prompt + decode_steps):
        add(p, "decode")
        if (p + 1) % 4 == 0:
            add(p, "block edge")
        if p % 64 == 0:
            add(p, "page wrap")
    add(prompt + decode_steps - 1, "last token")
    return dict(sorted(rows.items()))


def prompt_len(length: int, decode_steps: int) -> int:
    return max(2, length - decode_steps // 2 - 1)


# ---- running the layer ------------------------------------------------------------------------------
class Capture:
    """The attention inputs and outputs of the rows at ``positions`` of one layer module, recorded by
    wrapping its ``forward_mqa``: the kernel's q, its output, and the local top-k it attended (C4: the
    layer's own; V4.1: the stack's shared buffer, with the candidate blocks)."""

    def __init__(self, module, positions: Sequence[int]):
        self.module, self.want = module, set(int(p) for p in positions)
        self.rows: Dict[int, dict] = {}
        self._own = "forward_mqa" in vars(module)        # an instance attribute already (another capture)
        self._orig = module.forward_mqa
        module.forward_mqa = self._hook

    def _hook(self, q, kv, positions, output, step, topk=None):
        self._orig(q, kv, positions, output, step, topk)
        pos = positions.tolist() if positions.device.type == "cpu" else positions.cpu().tolist()
        shared = self.module.shared
        cand = shared.candidates[:q.shape[0]] if shared is not None and shared.candidates is not None else None
        for t, p in enumerate(pos):
            if p in self.want:
                self.rows[p] = dict(q=q[t].float().cpu(), o=output[t].float().cpu(),
                                    topk=None if topk is None else topk[t].cpu().clone(),
                                    cand=None if cand is None else cand[t].cpu().clone())

    def close(self):
        if self._own:
            self.module.forward_mqa = self._orig
        else:
            del self.module.forward_mqa


def _step_fill(srv, x_rows, modules):
    """Write the next rows of request 0 into the caches (``fill_caches`` of every module, in layer order)."""
    st = srv.make_step({0: x_rows.shape[0]})
    st.build(srv.ratios())
    for m in modules:
        m.fill_caches(st.positions, x_rows, st)
    srv.done[0] += x_rows.shape[0]


def _keys(srv) -> list:
    """The key of each layer of a server in the rows: a V4.0 layer's type, a V4.1 layer's id."""
    return [srv.layer_type.value] if srv.layer_type is not None else list(srv.layers)


def _modules(srv):
    return [srv.modules[x] for x in srv.layers]


def _forward(srv, x_rows) -> Dict:
    """One step of request 0 through every layer: {layer key: output rows}."""
    return {k: ys[0] for k, ys in zip(_keys(srv), srv.step_all({0: x_rows}).values())}


def run_rows(srv, x, rows: Sequence[int], decode_steps: int, prompt: int, chunk: int = FILL_CHUNK,
             full_prefill: bool = False) -> Dict[str, Dict[int, dict]]:
    """Prefill ``prompt`` tokens of request 0 then decode ``decode_steps``: the prefix by ``fill_caches``
    (``full_prefill``: by ``forward``) in chunks of ``chunk``, each sampled prefill row p in a 2-token
    forward step [p - 1, p + 1), every decode step by forward. Returns {layer key: {position: captured
    row, with its layer output "y"}}."""
    mods = _modules(srv)
    keys = [str(k) for k in _keys(srv)]
    caps = {k: Capture(m, rows) for k, m in zip(keys, mods)}
    want = sorted(p for p in rows if p < prompt)
    try:
        pos = 0

        def advance(to):
            nonlocal pos
            while pos < to:
                n = min(chunk, to - pos)
                if full_prefill:
                    _forward(srv, x[pos:pos + n])
                else:
                    _step_fill(srv, x[pos:pos + n], mods)
                pos += n

        for p in want:
            if p + 1 <= pos:
                continue
            advance(p - 1)
            ys = _forward(srv, x[pos:p + 1])
            for k, y in ys.items():
                for t, q in enumerate(range(pos, p + 1)):
                    if q in caps[str(k)].rows:
                        caps[str(k)].rows[q]["y"] = y[t].float().cpu()
            pos = p + 1
        advance(prompt)
        for p in range(prompt, prompt + decode_steps):
            ys = _forward(srv, x[p:p + 1])
            for k, y in ys.items():
                if p in caps[str(k)].rows:
                    caps[str(k)].rows[p]["y"] = y[0].float().cpu()
    finally:
        for c in caps.values():
            c.close()
    return {k: c.rows for k, c in caps.items()}


# ---- the reference of one layer ---------------------------------------------------------------------
class LayerReference:
    """Float64 / reference-function values of one layer of request 0 (hidden states ``x`` on any device;
    weights and cos/sin of the module). Compressed entries are computed for the entries asked, on x's
    device; rows on the CPU."""

    def __init__(self, srv, module, x: torch.Tensor, swa_fmt=L.V40_584, comp_fmt=L.V40_584, v41=False):
        self.srv, self.m, self.cfg = srv, module, module.cfg
        self.x = x
        self.dev = x.device                     # where the reference functions run (their results go to the CPU)
        self.W = module.w
        src = srv.modules[module.plan.kv_source] if v41 and module.ratio else module
        self.Wd = src.w                         # the kv source's, on the device, for the entries' projections
        self.cs = module.cos_sin_cache
        self.swa_fmt, self.comp_fmt, self.v41 = swa_fmt, comp_fmt, v41
        self.rows = srv._rows                   # host block tables: [swa, compressed, state][request]
        self._entries: Dict[tuple, torch.Tensor] = {}
        self._proj: Dict[int, tuple] = {}
        self._q: Dict[int, torch.Tensor] = {}
        self._iq: Dict[int, tuple] = {}
        self._keys: Optional[torch.Tensor] = None

    def _x_rows(self, idx):
        return self.x[torch.as_tensor(idx, device=self.x.device)]

    def _pos(self, ps):
        return torch.as_tensor(list(ps), dtype=torch.int64, device=self.dev)

    # slots, from the host block tables (independent of the step's metadata kernels)
    def swa_slot(self, p: int) -> int:
        return self.rows[0][0][p // L.SWA_BLOCK_SIZE] * L.SWA_BLOCK_SIZE + p % L.SWA_BLOCK_SIZE

    def comp_slot(self, j: int, bs: int) -> int:
        return self.rows[1][0][j // bs] * bs + j % bs

    # projections of rows (the reference functions: the kernels' arithmetic in fp32), computed once for all
    # the positions ``prepare`` names (each reference call dequantizes its weights: one call, not one a row)
    def prepare(self, rows: Sequence[int]) -> None:
        Wn = self.cfg.sliding_window
        need = sorted({u for p in rows for u in range(max(0, p - Wn + 1), p + 1)} - set(self._proj))
        if need:
            x, qr, kv = self._project(need)
            for i, u in enumerate(need):
                self._proj[u] = (x[i], qr[i], kv[i])
        rows = [p for p in rows if p not in self._q]
        if rows:
            qs = self._queries(rows)
            for p, q in zip(rows, qs.cpu()):
                self._q[p] = q
            if self.W.idx_wq_b8 is not None:
                q8, wq = self._index_queries(rows)
                q8, wq = q8.float().cpu(), wq.float().cpu()
                for i, p in enumerate(rows):
                    self._iq[p] = (q8[i], wq[i])

    def _project(self, ps):
        cfg, W = self.cfg, self.W
        x = self._x_rows(list(ps))
        qr_kv = RO.fp8_linear(x, W.wqkv8, W.wqkv_s)
        qr, kv = fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], W.q_norm, W.kv_norm,
                                    cfg.rms_norm_eps)
        return x, qr, kv

    def projections(self, ps: Sequence[int]):
        missing = [u for u in ps if u not in self._proj]
        if missing:
            self.prepare(missing)
        x, qr, kv = zip(*[self._proj[u] for u in ps])
        return torch.stack(x), torch.stack(qr), torch.stack(kv)

    def _queries(self, ps):
        cfg, W = self.cfg, self.W
        _, qr, _ = self.projections(ps)
        q = RO.fp8_linear(qr, W.wq_b8, W.wq_b_s).view(len(ps), cfg.local_heads, 512)
        pos = self._pos(ps)
        if self.v41:
            return rope_fwd(q, pos, self.cs).bfloat16()
        return rope_fwd(rmsnorm(q, None, cfg.rms_norm_eps), pos, self.cs).bfloat16()

    def q(self, p: int) -> torch.Tensor:
        if p not in self._q:
            self.prepare([p])
        return self._q[p]

    def window_keys(self, ps: Sequence[int]) -> torch.Tensor:
        """Decoded records fp32 [n, 512] of the window tokens ``ps``, encoded from the reference's keys."""
        _, _, kv = self.projections(ps)
        k = rope_fwd(kv, self._pos(ps), self.cs).bfloat16()
        return rc.decode_k_records(rc.encode_k_records(k, self.swa_fmt), self.swa_fmt).cpu()

    def index_query(self, p: int):
        """(q8 fp32 values [nh, 128], folded weights [nh]) of the row's indexer query."""
        if p not in self._iq:
            self.prepare([p])
        return self._iq[p]

    def _index_queries(self, ps):
        cfg, W = self.cfg, self.W
        x, qr, _ = self.projections(ps)
        nh = cfg.index_n_heads
        qi = RO.fp8_linear(qr, W.idx_wq_b8, W.idx_wq_b_s).view(len(ps), nh, 128)
        wi = (x.float() @ W.idx_wproj.float().t()).bfloat16()
        return RI.fused_indexer_q_rope_quant(self._pos(ps), qi, self.cs, wi, 128 ** -0.5, nh ** -0.5)

    # compressed entries, float64 pooling from the hidden states
    def entries(self, js: Sequence[int], target: str) -> torch.Tensor:
        """Decoded records fp32 [n, 512] (target "main") or dequantized index keys fp32 [n, 128] ("index")
        of compressed entries ``js``, computed from the hidden states (float64 projections and pooling)."""
        js = [int(j) for j in js]
        need = [j for j in js if (target, j) not in self._entries]
        per = max(1, 16384 // (8 if self.m.ratio == 4 else max(self.m.ratio, 1)))   # entries a chunk: 16K rows
        for a in range(0, len(need), per):
            part = need[a:a + per]
            vals = self._entries_v41(part, target) if self.v41 else self._entries_v40(part, target)
            for j, v in zip(part, vals):
                self._entries[(target, j)] = v
        if not js:
            return torch.zeros(0, 512 if target == "main" else 128)
        return torch.stack([self._entries[(target, j)] for j in js])

    def _entries_v40(self, js, target):
        r, main = self.m.ratio, target == "main"
        D = 512 if main else 128
        W = self.Wd
        w, ape, norm = (W.comp_w, W.comp_ape, W.comp_norm) if main else (W.idx_comp_w, W.idx_comp_ape, W.idx_comp_norm)
        dev = self.x.device
        j = torch.tensor(js, device=dev)
        if r == 4:
            u = 4 * j[:, None] + torch.arange(-4, 4, device=dev)[None]
            cur = u >= 4 * j[:, None]
        else:
            u = r * j[:, None] + torch.arange(r, device=dev)[None]
            cur = torch.ones_like(u, dtype=torch.bool)
        ok = u >= 0
        ks = self.x[u.clamp_min(0)].double() @ w.double().t()        # [J, window, 2 * coff * D]
        c = 2 if r == 4 else 1
        kv, sc = ks[..., :c * D], ks[..., c * D:] + ape.double()[u.clamp_min(0) % r]
        if r == 4:
            kv = torch.where(cur[..., None], kv[..., D:], kv[..., :D])
            sc = torch.where(cur[..., None], sc[..., D:], sc[..., :D])
        sc = sc.masked_fill(~ok[..., None], float("-inf"))
        y = (torch.softmax(sc, dim=1) * kv).sum(1)
        yh = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * norm.double()
        pos = j * r
        yh = yh.float()
        ro = rope_fwd(yh, pos, self.cs)
        if main:
            k = torch.cat([yh[:, :448], ro[:, 448:]], dim=1).bfloat16()
            return rc.decode_k_records(rc.encode_k_records(k, self.comp_fmt), self.comp_fmt).cpu()
        z = ro.bfloat16().float()
        q8, e = quantize_blocks(z, 128, 1e-4)
        return dequantize_blocks(q8, e, 128).cpu()

    def _entries_v41(self, js, target):
        r, W, eps = self.m.ratio, self.Wd, self.cfg.rms_norm_eps
        dev = self.x.device
        j = torch.tensor(js, device=dev)
        u = r * j[:, None] + torch.arange(r, device=dev)[None]
        ks = self.x[u].double() @ W.comp_w.double().t()               # [J, r, 512 * r]
        if r == 1:
            y = ks[:, 0, :512]
        else:
            y = (torch.softmax(ks[..., 512:], dim=1) * ks[..., :512]).sum(1)
        latent = (y * torch.rsqrt((y * y).mean(-1, keepdim=True) + eps) * W.comp_norm.double()).bfloat16()
        pos = j * r
        if target == "main":
            lat = latent
            if self.comp_fmt.name == L.V40_584.name:
                k = rope_fwd(lat, pos, self.cs).bfloat16()
                return rc.decode_k_records(rc.encode_k_records(k, self.comp_fmt), self.comp_fmt).cpu()
            return rc.decode_k_records(rc.encode_values(rope_fwd(lat.float(), pos, self.cs), self.comp_fmt),
                                       self.comp_fmt).cpu()
        k_pre = (latent.double() @ W.idx_wk.double().t()).bfloat16().double()
        k = (k_pre * torch.rsqrt((k_pre * k_pre).mean(-1, keepdim=True) + eps) * W.idx_k_norm.double())
        z = rope_fwd(k.bfloat16(), pos, self.cs).bfloat16().float()
        q8, e = quantize_blocks(z, 128, 1e-4)
        return dequantize_blocks(q8, e, 128).cpu()

    # what the pages hold
    def cached_window(self, ps) -> torch.Tensor:
        slots = torch.tensor([self.swa_slot(p) for p in ps], device=self.m.cache.swa.device)
        rec = rc.gather_k_records(self.m.cache.swa, slots, L.SWA_BLOCK_SIZE, self.swa_fmt)
        return rc.decode_k_records(rec.cpu(), self.swa_fmt)

    def cached_entries(self, js, bs: int) -> torch.Tensor:
        cache = self.m.cache.comp
        slots = torch.tensor([self.comp_slot(j, bs) for j in js], dtype=torch.int64, device=cache.device)
        rec = rc.gather_k_records(cache, slots, bs, self.comp_fmt)
        return rc.decode_k_records(rec.cpu(), self.comp_fmt)

    def cached_index_keys(self, n: int) -> torch.Tensor:
        """Dequantized index keys fp32 [n, 128] of entries 0..n-1, on the cache's device (read once for the
        largest n asked; an entry's key never changes once written, except by ``_plant``, which forgets)."""
        if self._keys is None or self._keys.shape[0] < n:
            self._keys = self._read_index_keys(max(n, self._want_keys))
        return self._keys[:n]

    _want_keys = 0

    def _read_index_keys(self, n: int) -> torch.Tensor:
        idx = self.m.cache.idx
        row = torch.tensor(self.rows[1][0], dtype=torch.int64, device=idx.device)
        j = torch.arange(n, device=idx.device)
        slots = row[j // 64] * 64 + j % 64
        b, s = rc.indexer_k_gather(idx, slots, 64)
        return b.view(torch.float8_e4m3fn).float() * s[:, None]


def topk_violation(logits: torch.Tensor, selected: torch.Tensor, k: int, allowed: Optional[torch.Tensor] = None):
    """How far the selection ``selected`` (valid entry ids first, -1 after) is from a top-k of ``logits``
    (float64 [n]; ``allowed`` bool [n]: the entries it may take): 0 for an exact top-k; else the largest
    gap, relative to max |logit|, by which a selected entry scores below the k-th largest or an unselected
    one above it. A selection of an invalid, repeated or disallowed entry, or of the wrong count, is inf."""
    n = logits.shape[0]
    allowed = torch.ones(n, dtype=torch.bool) if allowed is None else allowed
    m = int(allowed.sum())
    sel = selected[selected >= 0].long()
    want = min(k, m)
    if sel.numel() != want or (selected[:want] < 0).any() or (sel >= n).any() or sel.unique().numel() != want \
            or (want and not allowed[sel].all()):
        return float("inf")
    if m <= k:
        return 0.0
    vals = logits.masked_fill(~allowed, float("-inf"))
    tau = torch.topk(vals, k).values[-1]
    scale = float(logits[allowed].abs().max().clamp_min(1e-30))
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[sel] = True
    below = float((tau - vals[chosen].min()).clamp_min(0))
    others = vals[~chosen & allowed]
    above = float((others.max() - tau).clamp_min(0)) if others.numel() else 0.0
    return max(below, above) / scale


def index_logits(q8, wq, keys) -> torch.Tensor:
    """float64 [n]: sum_h w_h relu(q8_h . k_j) for dequantized keys [n, 128] (on any device)."""
    s = keys.double() @ q8.double().t().to(keys.device)            # [n, nh]
    return (s.clamp_min(0) @ wq.double().to(keys.device)).cpu()


def attend64(q: torch.Tensor, K: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of heads q [H, 512] over K = V [n, 512] with the sink in the denominator only."""
    q, K, sink = q.double(), K.double(), sink.double()
    lg = scale * q @ K.t()                                           # [H, n]
    m = torch.maximum(lg.amax(1), sink) if K.shape[0] else sink
    e = torch.exp(lg - m[:, None])
    return (e @ K) / (e.sum(1) + torch.exp(sink - m))[:, None]


def output_path(cfg, W, o: torch.Tensor, ps: Sequence[int], cs) -> torch.Tensor:
    """The reference output path of rows' attention outputs o [R, H, 512] (bf16 values) at positions ps:
    fp32 [R, hidden] (one call for all rows: each call dequantizes the weights)."""
    H, G, R = cfg.local_heads, cfg.local_groups, o.shape[0]
    dev = cs.device
    a8, sa = RO.fused_inv_rope_fp8_quant(o[:, :H].to(dev).bfloat16(), torch.tensor(list(ps), device=dev), cs, G,
                                         H // G)
    z = torch.empty(R, G, cfg.o_lora_rank, dtype=torch.bfloat16, device=dev)
    RO.fp8_einsum("bhr,hdr->bhd", (a8, sa), (W.wo_a8, W.wo_a_s), z)
    return RO.fp8_linear(z.reshape(R, -1), W.wo_b8, W.wo_b_s).float().cpu()


# ---- checking one layer's rows ----------------------------------------------------------------------
@dataclasses.dataclass
class RowCheck:
    """The errors of one sampled row of one layer: {quantity: error}."""
    pos: int
    classes: List[str]
    errs: Dict[str, float]
    needle: Optional[dict] = None


def check_row(ref: LayerReference, p: int, cap: dict, classes=(), planted=()) -> RowCheck:
    """Every quantity of the module docstring for the row at position p (``cap``: its Capture record).
    ``planted``: entries whose records were written by hand (the needle), left out of the cache checks."""
    m, cfg = ref.m, ref.cfg
    H, Wn = cfg.local_heads, cfg.sliding_window
    errs: Dict[str, float] = {}
    q_ref = ref.q(p)
    errs["q"] = float(_rel(cap["q"][:H], q_ref).max())
    win = list(range(max(0, p - Wn + 1), p + 1))
    K_win = ref.cached_window(win)
    errs["swa"] = float(_rel(K_win, ref.window_keys(win)).max())
    keys = [K_win]
    r = m.ratio
    if r > (0 if ref.v41 else 1):       # V4.0's ratio 1 and V4.1's ratio 0 are the window alone
        n = (p + 1) // r
        bs = L.compressed_block_size(r) if not ref.v41 else 64
        is_c4 = (r == 4 and not ref.v41)
        owns_topk = ref.v41 or is_c4
        sel = list(range(n))
        if owns_topk:
            tk = cap["topk"]
            sel = [int(j) for j in tk[tk >= 0].tolist()]
            if any(j >= n for j in sel):        # an entry not visible to the row (not yet written)
                errs["top-k"] = float("inf")
                sel = [j for j in sel if j < n]
            index_src = is_c4 or (ref.v41 and m.plan.owns_index)
            if index_src and n:
                keys_c = ref.cached_index_keys(n)
                check_js = sorted((set(sel) | {0, n - 1} | set(range(max(0, n - 4), n))) - set(planted))
                ref_k = ref.entries(check_js, "index")
                errs["index-k"] = float(_rel(keys_c[torch.tensor(check_js, device=keys_c.device)].cpu(), ref_k).max())
                q8, wq = ref.index_query(p)
                lg = index_logits(q8, wq, keys_c)
                allowed = None
                if ref.v41 and m.plan.candidates == "mask":
                    cb = cap["cand"]
                    blocks = set(int(b) for b in cb[cb >= 0].tolist())
                    allowed = torch.tensor([j // cfg.candidate_block_size in blocks for j in range(n)])
                errs["top-k"] = max(errs.get("top-k", 0.0), topk_violation(lg, tk, cfg.index_topk, allowed))
        if sel:
            K_c = ref.cached_entries(sel, bs)
            tol_key = "comp_fp4" if ref.comp_fmt.elem_bits == 4 else "comp"
            real = [i for i, j in enumerate(sel) if j not in planted]
            if real:
                errs[tol_key] = float(_rel(K_c[real], ref.entries([sel[i] for i in real], "main")).max())
            keys.append(K_c)
    K = torch.cat(keys)
    o_ref = attend64(cap["q"][:H], K, ref.W.attn_sink[:H].float().cpu(), cfg.softmax_scale)
    # against the float64 result rounded to bf16 as the kernels' output is: only rounding flips remain
    errs["attn"] = float(_rel(cap["o"][:H].reshape(1, -1), o_ref.bfloat16().reshape(1, -1)).max())
    if "y" in cap:
        y_ref = cap["y_ref"] if "y_ref" in cap else output_path(cfg, ref.W, cap["o"][None], [p], ref.cs)[0]
        errs["out"] = float(_rel(cap["y"][None], y_ref[None]).max())
    return RowCheck(p, list(classes), errs)


# ---- the check of one (kind, length, record) -----------------------------------------------------------
def _server(cfg, kind: str, max_len: int, device, record: Optional[str], seed=0, layers=None):
    if cfg.is_v41:
        from .serving import FLASH_LAYERS, SyntheticServer
        if layers is None:
            layers = FLASH_LAYERS if cfg.num_hidden_layers > max(FLASH_LAYERS) else tuple(range(cfg.num_hidden_layers))
        return SyntheticServer(cfg, None, 1, max_len, device=str(device), seed=seed, layers=layers,
                        max_step_tokens=FILL_CHUNK, record_format=record or "V40_584")
    from .serving import SyntheticServer
    return SyntheticServer(cfg, LayerType(kind), 1, max_len, device=str(device), seed=seed)


def _references(srv, x, cfg) -> Dict[str, LayerReference]:
    if cfg.is_v41:
        from .kv_cache import v41_records
        sf, cf = v41_records(srv.record_format)
        return {str(k): LayerReference(srv, srv.modules[k], x, sf, cf, v41=True) for k in srv.layers}
    return {srv.layer_type.value: LayerReference(srv, srv.layer, x)}


def hidden_states(n: int, hidden: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, hidden, generator=g, device=device).bfloat16()


def _reference_outputs(ref: LayerReference, caps: Dict[int, dict], ps: Sequence[int]) -> None:
    """Each captured row's reference layer output ("y_ref"), from its attention output, in one call."""
    ps = [p for p in ps if "y" in caps[p]]
    if ps:
        y = output_path(ref.cfg, ref.W, torch.stack([caps[p]["o"] for p in ps]), ps, ref.cs)
        for p, v in zip(ps, y):
            caps[p]["y_ref"] = v


def check_context(cfg: AttentionConfig, kind: str, length: int, device="cpu", record: Optional[str] = None,
                  decode_steps: int = 8, chunk: int = FILL_CHUNK, full_prefill=False, seed=0, layers=None):
    """Prefill ``length``-ish tokens and decode ``decode_steps``, check the sampled rows of every layer.
    Returns {layer label: [RowCheck]} and the seconds spent (run, reference)."""
    rows = position_classes(length, cfg.sliding_window, decode_steps, seed)
    prompt = prompt_len(length, decode_steps)
    max_len = prompt + decode_steps + 1
    srv = _server(cfg, kind, max_len, device, record, seed, layers)
    x = hidden_states(max_len, cfg.hidden_size, device, seed + 1)
    t0 = time.perf_counter()
    caps = run_rows(srv, x, list(rows), decode_steps, prompt, chunk, full_prefill)
    _sync(device)
    t1 = time.perf_counter()
    refs = _references(srv, x, cfg)
    out = {}
    for key, ref in refs.items():
        got = [p for p in rows if p in caps[key]]
        ref.prepare(got)
        _reference_outputs(ref, caps[key], got)
        ref._want_keys = (max(got) + 1) // max(ref.m.ratio, 1) if got else 0
        label = key if not cfg.is_v41 else f"{key} {cfg.v41_layer(int(key)).label}"
        out[label] = [check_row(ref, p, caps[key][p], rows[p]) for p in rows if p in caps[key]]
    return out, (t1 - t0, time.perf_counter() - t1)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def tolerance(key: str, device) -> float:
    if key == "attn" and _on_reference(device):
        return CPU_ATTN_TOL
    return TOL[key]


def _on_reference(device) -> bool:
    from . import ops
    return ops.backend_for("sparse_mla_decode", torch.device(device)) == "reference"


def summarize(kind: str, length: int, record: str, checks: List[RowCheck], device) -> List[dict]:
    """One table row per quantity: the worst row's error, its tolerance, and the position classes covered."""
    keys = sorted({k for c in checks for k in c.errs}, key=list(TOL).index)
    out = []
    for k in keys:
        have = [(c.errs[k], c) for c in checks if k in c.errs]
        err, worst = max(have, key=lambda t: t[0])
        tol = tolerance(k, device)
        out.append(dict(kind=kind, length=length, record=record, check=k, rows=len(have), max_err=err, tol=tol,
                        ok=err <= tol, worst_pos=worst.pos,
                        classes=sorted({cl for _, c in have for cl in c.classes})))
    return out


def format_summary(rows: List[dict]) -> str:
    """One line per (layer kind, length, record): the worst error / tolerance ratio over its checks."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["length"], r["record"]), []).append(r)
    lines = [f"{'layer kind':34s} {'length':>7s} {'record':20s} {'checks':>6s} {'worst err/tol':>13s}  ok"]
    for (kind, length, record), rs in groups.items():
        w = max(rs, key=lambda r: r["max_err"] / r["tol"])
        lines.append(f"{kind:34s} {length:7d} {record:20s} {len(rs):6d} {w['max_err'] / w['tol']:9.2f} {w['check']:>3s}"
                     f"  {'ok' if all(r['ok'] for r in rs) else 'FAILED'}")
    return "\n".join(lines)


def format_table(rows: List[dict]) -> str:
    lines = [f"{'layer kind':34s} {'length':>7s} {'record':20s} {'check':8s} {'rows':>4s} {'max err':>9s} "
             f"{'tol':>7s}  ok"]
    for r in rows:
        lines.append(f"{r['kind']:34s} {r['length']:7d} {r['record']:20s} {r['check']:8s} {r['rows']:4d} "
                     f"{r['max_err']:9.2e} {r['tol']:7.0e}  {'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


# ---- the needle ------------------------------------------------------------------------------------
NEEDLE_CLASSES = ("compressed cache", "in the window", "page first entry", "page last entry", "newest entry")
NEEDLE_MARGIN = 30.0        # the needle's attention logit exceeds every other key's by this, in every head
NEEDLE_COS = 0.99           # the attention output of every head is this close (cosine) to the needle's value


def needle_entry(cls: str, p: int, window: int) -> int:
    """The compressed entry (C4) a needle of class ``cls`` is planted in, for a query at position p."""
    n = (p + 1) // 4
    if cls == "compressed cache":
        return max(0, (p - window) // 8)                 # far before the window
    if cls == "in the window":
        return max(0, (p - window // 2) // 4)             # all its tokens inside p's window
    if cls == "page first entry":
        return (n // 2) // 64 * 64 if n >= 128 else 0
    if cls == "page last entry":
        return (n // 2) // 64 * 64 - 1 if n >= 128 else min(63, n - 1)
    if cls == "newest entry":
        return n - 1
    raise ValueError(f"needle class must be one of {NEEDLE_CLASSES}, got {cls!r}")


def _plant(ref: LayerReference, p: int, j: int, n: int):
    """Write entry j's index key and compressed record so that the row at p scores it first in the indexer
    and attends to it alone; returns (the saved bytes to restore, the needle's decoded value)."""
    m, cfg = ref.m, ref.cfg
    H = cfg.local_heads
    dev = m.cache.comp.device
    slot = torch.tensor([ref.comp_slot(j, 64)], dtype=torch.int64, device=dev)
    saved = (rc.gather_k_records(m.cache.comp, slot, 64).clone(), rc.indexer_k_gather(m.cache.idx, slot, 64))
    # index key d with q8_h . d = sign(w_h) for every head (the least-norm solution; 64 heads in 128 dims):
    # its logit is the sum of the positive weights, scaled past every other entry's
    q8, wq = ref.index_query(p)
    keys = ref.cached_index_keys(n)
    lg = index_logits(q8, wq, keys)
    Q = q8.double()
    d = torch.linalg.lstsq(Q, torch.sign(wq.double())[:, None], driver="gelsd").solution[:, 0]
    one = float(index_logits(q8, wq, d[None].float()))
    if one <= 0:
        raise RuntimeError(f"needle at entry {j}: no index key direction scores above 0 for the row at {p}")
    d = d * (4 * float(lg.abs().max()) + 1.0) / one
    kb, e = quantize_blocks(d[None].float(), 128, 1e-4)
    rc.indexer_k_insert(kb.to(dev), torch.exp2(e[:, 0].float()).to(dev), m.cache.idx, slot, 64)
    ref._keys = None
    # value u with q_h . u = 1 for every head (least-norm; H heads in 512 dims), scaled so that every head's
    # logit clears the others' by NEEDLE_MARGIN
    q = ref.q(p)[:H].double()
    u = torch.linalg.lstsq(q, torch.ones(H, 1, dtype=torch.float64), driver="gelsd").solution[:, 0]
    qu = cfg.softmax_scale * (q @ u)
    if (qu <= 0).any():
        raise RuntimeError(f"needle at entry {j}: no key scores above 0 in every head of the row at {p}")
    win = list(range(max(0, p - cfg.sliding_window + 1), p + 1))
    others = torch.cat([ref.cached_window(win), ref.cached_entries(list(range(n)), 64)]).double()
    top = (cfg.softmax_scale * q @ others.t()).amax(1)
    c = float(((top + NEEDLE_MARGIN) / qu).max())
    k = (c * u).float()[None].bfloat16()
    rc.insert_k_records(rc.encode_k_records(k).to(dev), m.cache.comp, slot, 64)
    return (slot, saved), rc.decode_k_records(rc.encode_k_records(k))[0]


def _restore(ref: LayerReference, saved) -> None:
    slot, (rec, (kb, ks)) = saved
    m = ref.m
    rc.insert_k_records(rec, m.cache.comp, slot, 64)
    rc.indexer_k_insert(kb, ks, m.cache.idx, slot, 64)
    ref._keys = None


def needle(cfg: AttentionConfig, length: int, device="cpu", classes=NEEDLE_CLASSES, chunk: int = FILL_CHUNK,
           seed: int = 0) -> List[dict]:
    """A C4 layer filled to ``length`` tokens; for each class a needle planted in one compressed entry (its
    index key and its record), then one decode step: the indexer's top-k must hold the entry, every head's
    output must be the needle's value (cosine >= NEEDLE_COS) and the row must pass ``check_row``."""
    steps = 2 * len(classes) + 2
    max_len = length + steps + 1
    srv = _server(cfg, "c4a", max_len, device, None, seed)
    x = hidden_states(max_len, cfg.hidden_size, device, seed + 1)
    mods = [srv.layer]
    for a in range(0, length, chunk):
        _step_fill(srv, x[a:min(length, a + chunk)], mods)
    ref = LayerReference(srv, srv.layer, x)
    out = []
    for cls in classes:
        if (srv.done[0] + 1) % 4 == 0:                  # a step closing an entry would overwrite the newest one
            _forward(srv, x[srv.done[0]:srv.done[0] + 1])
        p = srv.done[0]
        n = (p + 1) // 4
        j = needle_entry(cls, p, cfg.sliding_window)
        ref.prepare([p])
        saved, value = _plant(ref, p, j, n)
        cap = Capture(srv.layer, [p])
        try:
            y = _forward(srv, x[p:p + 1])
        finally:
            cap.close()
        row = cap.rows[p]
        row["y"] = y["c4a"][0].float().cpu()
        tk = row["topk"]
        chosen = [int(v) for v in tk[tk >= 0].tolist()]
        o = row["o"][:cfg.local_heads].double()
        cos = float((o @ value.double() / (o.norm(dim=1) * value.double().norm()).clamp_min(1e-30)).min())
        rc_ = check_row(ref, p, row, ["needle: " + cls], planted={j})
        _restore(ref, saved)
        bad = [k for k, v in rc_.errs.items() if not v <= tolerance(k if k != "comp_fp4" else k, device)]
        out.append(dict(cls=cls, length=length, pos=p, entry=j, selected=j in chosen, min_cos=cos,
                        attn_err=rc_.errs["attn"], errs=rc_.errs,
                        ok=(j in chosen) and cos >= NEEDLE_COS and not bad, failed=bad))
    return out


def format_needles(rows: List[dict]) -> str:
    lines = [f"{'needle class':18s} {'length':>7s} {'query':>7s} {'entry':>6s} {'in top-k':>8s} {'min cos':>8s} "
             f"{'attn err':>9s}  ok"]
    for r in rows:
        lines.append(f"{r['cls']:18s} {r['length']:7d} {r['pos']:7d} {r['entry']:6d} {str(r['selected']):>8s} "
                     f"{r['min_cos']:8.5f} {r['attn_err']:9.2e}  {'ok' if r['ok'] else 'FAILED ' + ','.join(r['failed'])}")
    return "\n".join(lines)


# ---- drift -----------------------------------------------------------------------------------------
def drift(cfg: AttentionConfig, kind: str, length: int, steps: int, device="cpu", every: int = 100,
          chunk: int = FILL_CHUNK, seed: int = 0) -> dict:
    """Prefill ``length`` tokens, decode ``steps`` steps; the rows of the first three, every ``every``-th
    and the last three steps checked (``check_row``). Returns the per-step errors and whether the last
    steps are within the tolerances as the first are."""
    max_len = length + steps + 1
    srv = _server(cfg, kind, max_len, device, None, seed)
    x = hidden_states(max_len, cfg.hidden_size, device, seed + 1)
    mods = _modules(srv)
    for a in range(0, length, chunk):
        _step_fill(srv, x[a:min(length, a + chunk)], mods)
    offs = sorted(set(range(3)) | set(range(0, steps, every)) | set(range(max(0, steps - 3), steps)))
    want = [length + o for o in offs]
    key = srv.layer_type.value
    cap = Capture(srv.layer, want)
    ys = {}
    t0 = time.perf_counter()
    try:
        for p in range(length, length + steps):
            y = _forward(srv, x[p:p + 1])[key]
            if p in cap.want:
                ys[p] = y[0].float().cpu()
        _sync(device)
    finally:
        cap.close()
    t_run = time.perf_counter() - t0
    ref = LayerReference(srv, srv.layer, x)
    ref.prepare(want)
    for p in want:
        cap.rows[p]["y"] = ys[p]
    _reference_outputs(ref, cap.rows, want)
    ref._want_keys = (max(want) + 1) // 4
    checks = []
    for p in want:
        row = cap.rows[p]
        checks.append(check_row(ref, p, row, ["drift"]))
    first, last = checks[0], checks[-1]
    keys = list(first.errs)
    ok = all(c.errs[k] <= tolerance(k, device) for c in checks for k in c.errs)
    return dict(kind=kind, length=length, steps=steps, checked=len(checks), seconds=t_run,
                first={k: first.errs[k] for k in keys}, last={k: last.errs.get(k) for k in keys},
                worst={k: max(c.errs.get(k, 0.0) for c in checks) for k in keys}, ok=ok)


def format_drift(rows: List[dict]) -> str:
    lines = [f"{'drift':8s} {'length':>7s} {'steps':>6s} {'checked':>7s} {'check':8s} {'first':>9s} {'last':>9s} "
             f"{'worst':>9s}  ok"]
    for r in rows:
        for k in r["first"]:
            lines.append(f"{r['kind']:8s} {r['length']:7d} {r['steps']:6d} {r['checked']:7d} {k:8s} "
                         f"{r['first'][k]:9.2e} {r['last'][k]:9.2e} {r['worst'][k]:9.2e}  {'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


# ---- the main job's --long preset ----------------------------------------------------------------------
def _ints(text: str) -> List[int]:
    return [int(t) for t in str(text).split(",") if t.strip()]


@contextlib.contextmanager
def _kernel(which: str, device):
    """The sparse-attention kernel of a pass (``--long-kernels``): "default" (what the platform runs: the
    warp-specialized kernel on Hopper) or "portable" (the Triton kernel AMD runs); yields its name."""
    from . import ops
    if ops.backend_for("sparse_mla_decode", torch.device(device)) != "triton":
        yield ops.backend_for("sparse_mla_decode", torch.device(device))
        return
    from .platform import detect
    from .triton.attention import sparse_mla_decode as D
    if which == "portable":
        with D.portable_kernel():
            yield "triton"
        return
    yield {"ws": "hopper-ws", "triton": "triton"}[D.default_kernel(detect(torch.device(device)).arch)]


def long_job(a) -> int:
    """``python -m dsv4_rocm run --long``: the check table of every V4.0 layer kind (``--layers``) and every
    V4.1 layer kind of the stack (``--long-v41-records``: the first at each length of ``--long-lengths``, the
    others at the longest) at each length, for each sparse-attention kernel of ``--long-kernels`` (the second
    at the longest length; the V4.1 stack on the first), the needle at ``--long-needle-lengths`` and the drift run.
    Prints the tables (last), writes them to ``--long-out`` (text and JSON); exit status 1 if a check failed."""
    import json
    import os
    device = a.device
    cfg = get_config(a.config)
    cfg = cfg.with_tp(cfg.num_heads // a.heads)
    v41 = cfg if cfg.is_v41 else get_config("tiny-v4.1" if a.config == "tiny" else "v4.1-flash")
    v41 = v41.with_tp(max(1, v41.num_heads // a.heads))
    kinds = [] if cfg.is_v41 else [k for k in a.layers.split(",") if k in V40_KINDS]
    records = [] if a.long_v41_records == "none" else [r for r in a.long_v41_records.split(",") if r]
    lengths, needles = _ints(a.long_lengths), _ints(a.long_needle_lengths)
    kernels = [k for k in a.long_kernels.split(",") if k]
    t_start = time.perf_counter()
    log = []

    if a.long_out:
        os.makedirs(a.long_out, exist_ok=True)
        progress = open(os.path.join(a.long_out, "long_context_progress.jsonl"), "w")

    def note(line, *records):
        """A progress line, and (with --long-out) the rows so far, so that a run cut short keeps them."""
        log.append(line)
        print(line, flush=True)
        if a.long_out:
            for r in records:
                progress.write(json.dumps(r, default=str) + "\n")
            progress.flush()
    note(f"dsv4_rocm run --long: {cfg.name} ({cfg.local_heads} local heads) and {v41.name}, device {device}, "
         f"lengths {lengths}, decode steps {a.long_decode_steps}")
    rows: List[dict] = []
    seen = set()
    for kern in kernels:
        with _kernel(kern, device) as attn:
            if attn in seen:        # off Hopper both passes would run the same kernel
                continue
            seen.add(attn)
            # a second kernel runs the same code at every length: the longest context (largest offsets) covers it
            for length in (lengths if kern == kernels[0] else lengths[-1:]):
                for kind in kinds:
                    res, (tr, tf) = check_context(cfg, kind, length, device, decode_steps=a.long_decode_steps)
                    new = [r for label, checks in res.items()
                           for r in summarize(f"{label} [{attn}]", length, "V40_584", checks, device)]
                    rows += new
                    note(f"  {kind} {length}: run {tr:.1f} s, reference {tf:.1f} s ({attn})"
                         + ("" if all(r["ok"] for r in new) else " FAILED"), *new)
                if kern != kernels[0]:
                    continue        # the V4.1 stack on the first kernel only
                for rec in records:
                    if rec != records[0] and length != lengths[-1]:
                        continue    # the other records at the longest context only (same kernels, other formats)
                    res, (tr, tf) = check_context(v41, "stack", length, device, rec, decode_steps=a.long_decode_steps)
                    new = [r for label, checks in res.items()
                           for r in summarize(f"{label} [{attn}]", length, rec, checks, device)]
                    rows += new
                    note(f"  v4.1 stack {rec} {length}: run {tr:.1f} s, reference {tf:.1f} s ({attn})"
                         + ("" if all(r["ok"] for r in new) else " FAILED"), *new)
    nd = []
    if "c4a" in kinds:
        for length in needles:
            new = needle(cfg, length, device)
            nd += new
            note(f"  needle {length}: " + ("ok" if all(r["ok"] for r in new) else "FAILED"), *new)
    dr = []
    if a.long_drift_steps and kinds:
        for kind in [k for k in a.long_drift_kinds.split(",") if k in kinds]:
            dr.append(drift(cfg, kind, a.long_drift_length, a.long_drift_steps, device))
            note(f"  drift {kind} {a.long_drift_length} x {a.long_drift_steps} steps: {dr[-1]['seconds']:.1f} s "
                 + ("ok" if dr[-1]["ok"] else "FAILED"), dr[-1])
    ok = all(r["ok"] for r in rows) and all(r["ok"] for r in nd) and all(r["ok"] for r in dr)
    text = "\n\n".join(t for t in (format_table(rows), format_needles(nd) if nd else "",
                                   format_drift(dr) if dr else "") if t)
    text += "\n\n" + format_summary(rows)
    text += f"\n\nlong-context check: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t_start:.0f} s"
    if a.long_out:
        progress.close()
        with open(os.path.join(a.long_out, "long_context.txt"), "w") as f:
            f.write("\n".join(log) + "\n\n" + text + "\n")
        with open(os.path.join(a.long_out, "long_context.json"), "w") as f:
            json.dump(dict(device=str(device), config=cfg.name, rows=rows, needle=nd, drift=dr, ok=ok), f, indent=1,
                      default=str)
    print("\n" + text)
    return 0 if ok else 1
