"""One scheduler step as vLLM's metadata builders hand it to the attention layers, and the index sets all
the layers of a step share.

The batch follows vLLM's conventions: requests are ordered decode-first; the first ``num_decodes``
requests are decode requests with ``num_decode_tokens // num_decodes`` tokens each (1, or 1 + speculative
tokens), the rest are prefill (or chunked-prefill) requests; padding tokens have slot -1. With
``uniform_decode=False`` the decode requests' query lengths differ (speculative decode with a draft length
per request, as vLLM's scheduler makes them): every per-token index set is unchanged, only the layer's
indexer then scores those rows the way it scores prefill rows. Positions are
absolute. Block tables are vLLM's: the SWA cache in 64-token blocks, the compressed caches in blocks of 256
token positions (64 entries of C4, 2 of C128; the indexer-K cache shares the C4 table), the compressor
state in blocks of 4 (C4) or 8 (C128) token positions.

``StepMetadata.build`` computes the index sets once per step (what vLLM's builders do), into tensors whose
shapes depend only on the batch shape, so a decode step builds and runs inside a CUDA/HIP graph. On a GPU
that is one kernel launch (dsv4_rocm/triton/metadata/step_index_sets.py); ``build_from_ops`` composes the same sets
from the public metadata ops, the reference the kernel is tested against. Padding tokens (slot -1, or past
the last request's query range) get token_to_req -1 where outside every request, lengths 0 and rows of
-1. The host integers (request and token counts) come from the scheduler, never from device tensors.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from . import layout as L
from . import ops
from .reference import metadata_v41 as _rm41
from .reference.compressor import state_block_size
from .reference.compressor_v41 import RING_CAPACITY
from .reference.metadata import slot_mapping_from_block_table

V41_RATIOS = (1, 2)               # DeepSeek-V4.1's compressed layers (ratio 0 is the sliding window alone)
V41_COMPRESSED_BLOCK = 64         # V4.1 compressed / indexer-K entries a page (vLLM: cache block_size entries)


@dataclass(frozen=True)
class CacheBounds:
    """What the caches of one layer let a step index, as ``StepMetadata.validate`` checks it; each cache class
    describes itself (``LayerCache.bounds`` in dsv4_rocm/kv_cache.py, for V4.0 and V4.1 caches alike), so one
    validation serves every model version.

    ``swa_pages``: SWA pages (64 slots each), which slot_mapping and swa_block_table index. ``ratio``: the key
    of the step's built sets the layer reads (compressed_slots[ratio], state_slots[ratio], ...); 0 for a
    layer with the sliding window alone. ``compressed``: (pages, entries a page, name) of each cache that
    compressed_block_table and compressed_slots[ratio] index; ``state``: (blocks, rows a block, name) of each
    cache that state_block_table and state_slots[ratio] index. ``ring``: state slots are rows of a ring
    (block state_block_table[b, 0], row position % rows) rather than position-paged (block position // rows
    of the row). ``index_ratio``: an indexer reads entries 0 .. seq_len // index_ratio - 1 of each request
    through its compressed_block_table row (``index_block`` entries a page), bounded by the built length
    field ``index_lens`` (0: no indexer reads the tables)."""
    swa_pages: int
    ratio: int = 0
    compressed: tuple = ()
    state: tuple = ()
    ring: bool = False
    index_ratio: int = 0
    index_block: int = 64
    index_lens: str = ""


@dataclass
class StepMetadata:
    query_start_loc: torch.Tensor          # int32 [B + 1]
    seq_lens: torch.Tensor                 # int32 [B]: tokens of each request after this step
    positions: torch.Tensor                # int64 [T]
    slot_mapping: torch.Tensor             # int64 [T]: SWA cache slot of each token, -1 = padding
    swa_block_table: torch.Tensor          # int32 [B, *]
    compressed_block_table: Optional[torch.Tensor]   # int32 [B, *]; None when no compressed ratio is built
    state_block_table: Optional[torch.Tensor]        # int32 [B, *]; None likewise
    num_decodes: int                       # decode requests (first in the batch)
    num_decode_tokens: int                 # their tokens (first in the batch)
    max_model_len: int
    window: int = 128
    query_start_loc_cpu: Optional[torch.Tensor] = None   # host copies the scheduler has (prefill planning)
    seq_lens_cpu: Optional[torch.Tensor] = None
    uniform_decode: bool = True            # False: decode requests of different query lengths
    # built once per step by ``build`` (shared by every layer of the step)
    token_to_req: Optional[torch.Tensor] = None        # int32 [T]
    is_valid_token: Optional[torch.Tensor] = None      # bool [T]
    swa_indices: Optional[torch.Tensor] = None         # int32 [T, window]: SWA cache slots of each token
    swa_lens: Optional[torch.Tensor] = None            # int32 [T]
    compressed_slots: Dict[int, torch.Tensor] = field(default_factory=dict)  # ratio -> int64 [T]
    state_slots: Dict[int, torch.Tensor] = field(default_factory=dict)       # ratio -> int64 [T]
    c128_indices: Optional[torch.Tensor] = None        # int32 [T, Kmax]: C128 cache slots of each token
    c128_lens: Optional[torch.Tensor] = None           # int32 [T]
    indexer_lens: Optional[torch.Tensor] = None        # int32 [T]: compressed entries each token sees (C4)
    # DeepSeek-V4.1 (ratios 1, 2): compressed_slots[r] as above (64 entries a page), state_slots[2] the
    # compressor ring's slots, v41_lens[r] the entries each token sees (dsv4_rocm/reference/metadata_v41.py)
    v41_lens: Dict[int, torch.Tensor] = field(default_factory=dict)       # ratio -> int32 [T]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_query_len(self) -> int:
        """Query length of every decode request; 0 when there is none or their lengths differ."""
        if not self.num_decodes or not self.uniform_decode:
            return 0
        return self.num_decode_tokens // self.num_decodes

    def build(self, ratios=(4, 128), *, caches=None) -> "StepMetadata":
        """Fill the shared index sets for the layer ratios of the model (no host sync): one launch of the
        step's index-set kernel (dsv4_rocm/triton/metadata/step_index_sets.py) where the metadata ops run Triton,
        else ``build_from_ops``. The results are the same; the kernel writes into the buffers of the
        previous build when the step's shape is unchanged (a captured graph keeps their addresses).
        ``caches`` (a LayerCache, or several): the step is validated against them first (``validate``),
        and a step whose tables or slots point past them is a ValueError before any field is written."""
        ratios = self._check(ratios)
        if caches is not None:
            self.validate(caches)
        if ops.backend_for("compute_swa_indices_and_lens", self.positions.device) == "triton":
            return self.build_fused(ratios)
        return self.build_from_ops(ratios)

    def build_fused(self, ratios=(4, 128)) -> "StepMetadata":
        """``build`` in one kernel launch (a GPU, or CPU tensors under TRITON_INTERPRET=1)."""
        from .triton.metadata.step_index_sets import step_index_sets
        ratios, v41 = _split(self._check(ratios))
        T, dev = self.num_tokens, self.positions.device

        def buf(old, shape, dtype):
            if old is not None and tuple(old.shape) == shape and old.dtype == dtype and old.device == dev:
                return old
            return torch.empty(shape, dtype=dtype, device=dev)
        self.token_to_req = buf(self.token_to_req, (T,), torch.int32)
        self.is_valid_token = buf(self.is_valid_token, (T,), torch.bool)
        self.swa_indices = buf(self.swa_indices, (T, self.window), torch.int32)
        self.swa_lens = buf(self.swa_lens, (T,), torch.int32)
        for r in ratios:
            self.compressed_slots[r] = buf(self.compressed_slots.get(r), (T,), torch.int64)
            self.state_slots[r] = buf(self.state_slots.get(r), (T,), torch.int64)
        c4 = c128 = None
        if 4 in ratios:
            self.indexer_lens = buf(self.indexer_lens, (T,), torch.int32)
            c4 = (self.compressed_slots[4], self.state_slots[4], self.indexer_lens)
        if 128 in ratios:
            self.c128_indices = buf(self.c128_indices, (T, c128_max_entries(self.max_model_len)), torch.int32)
            self.c128_lens = buf(self.c128_lens, (T,), torch.int32)
            c128 = (self.compressed_slots[128], self.state_slots[128], self.c128_indices, self.c128_lens)
        # without a compressed ratio the kernel reads neither table: the SWA table stands in for absent ones
        comp_bt = self.compressed_block_table if self.compressed_block_table is not None else self.swa_block_table
        state_bt = self.state_block_table if self.state_block_table is not None else self.swa_block_table
        step_index_sets(self.query_start_loc, self.seq_lens, self.positions, self.slot_mapping, self.swa_block_table,
                        comp_bt, state_bt, self.token_to_req, self.is_valid_token, self.swa_indices, self.swa_lens,
                        c4, c128)
        return self._build_v41(v41, ops)

    def build_from_ops(self, ratios=(4, 128), impl=ops) -> "StepMetadata":
        """``build`` as a composition of the public metadata ops (``impl``: dsv4_rocm.ops, or the oracle
        module dsv4_rocm.reference.metadata, which skips the ops' value checks) and torch: the reference
        the one-launch kernel is tested against. A token outside every request's query range has
        token_to_req -1; a state slot whose request, position, column or page is invalid is -1."""
        ratios, v41 = _split(self._check(ratios))
        T, R, dev = self.num_tokens, self.num_requests, self.positions.device
        req = torch.searchsorted(self.query_start_loc, torch.arange(T, device=dev, dtype=torch.int32), right=True,
                                 out_int32=True) - 1
        self.token_to_req = req.masked_fill(req == R, -1)
        self.is_valid_token = self.slot_mapping >= 0
        self.swa_indices = torch.empty(T, self.window, dtype=torch.int32, device=dev)
        self.swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
        impl.compute_swa_indices_and_lens(self.swa_indices, self.swa_lens, self.window, self.query_start_loc,
                                          self.seq_lens, self.token_to_req, self.is_valid_token, self.swa_block_table,
                                          L.SWA_BLOCK_SIZE)
        for r in ratios:
            slots = impl.get_compressed_slot_mapping(T, self.query_start_loc, self.seq_lens,
                                                     self.compressed_block_table, L.compressed_block_size(r), r)
            self.compressed_slots[r] = slots.masked_fill(~self.is_valid_token, -1)
            state = slot_mapping_from_block_table(self.positions, self.token_to_req, self.state_block_table,
                                                  state_block_size(r))
            self.state_slots[r] = state.masked_fill(~self.is_valid_token, -1)
        if 4 in ratios:
            seen = self.is_valid_token & (self.positions >= 0)
            self.indexer_lens = torch.where(seen, (self.positions + 1) // 4, 0).to(torch.int32)
        if 128 in ratios:
            kmax = c128_max_entries(self.max_model_len)
            self.c128_indices = torch.empty(T, kmax, dtype=torch.int32, device=dev)
            self.c128_lens = torch.empty(T, dtype=torch.int32, device=dev)
            # every token attends from the pages (decode and prefill alike): global slots for all of them
            impl.build_c128a_topk_metadata(self.positions, 128, T, self.token_to_req, self.compressed_block_table,
                                           L.compressed_block_size(128), self.slot_mapping, self.c128_indices,
                                           self.c128_lens, self.c128_indices[:0], kmax)
        return self._build_v41(v41, impl)

    def _build_v41(self, ratios, impl) -> "StepMetadata":
        """The DeepSeek-V4.1 sets of ``ratios`` (1, 2) in one launch of step_index_sets_v41 (the oracle
        module's function when ``impl`` is not dsv4_rocm.ops), into the buffers of the previous build when
        the step's shape is unchanged."""
        if not ratios:
            return self
        T, dev = self.num_tokens, self.positions.device

        def buf(d, r, dtype):
            old = d.get(r)
            if old is None or old.shape != (T,) or old.dtype != dtype or old.device != dev:
                d[r] = torch.empty(T, dtype=dtype, device=dev)
            return d[r]
        outs = {r: (buf(self.compressed_slots, r, torch.int64), buf(self.v41_lens, r, torch.int32))
                + ((buf(self.state_slots, r, torch.int64),) if r == 2 else ()) for r in ratios}
        fn = impl.step_index_sets_v41 if impl is ops else _rm41.step_index_sets_v41
        fn(self.positions, self.token_to_req, self.is_valid_token, self.compressed_block_table, self.state_block_table,
           V41_COMPRESSED_BLOCK, RING_CAPACITY, outs.get(1), outs.get(2))
        return self

    def _check(self, ratios) -> tuple:
        """Structure of the step (ValueError naming the argument before any write); returns the ratios."""
        ratios = tuple(ratios)
        for r in ratios:
            if r not in (4, 128) + V41_RATIOS or isinstance(r, bool):
                raise ValueError(f"ratios: compress ratios are 4 and 128 (DeepSeek-V4), 1 and 2 (V4.1), got {r!r}")
        if self.uniform_decode and self.num_decodes and self.num_decode_tokens % self.num_decodes:
            raise ValueError(f"num_decode_tokens {self.num_decode_tokens} is not a multiple of num_decodes "
                             f"{self.num_decodes}: decode requests of different query lengths need "
                             f"uniform_decode=False")
        T, R = self.num_tokens, self.num_requests
        for name, t, dtype, shape in (("query_start_loc", self.query_start_loc, torch.int32, (R + 1,)),
                                      ("seq_lens", self.seq_lens, torch.int32, (R,)),
                                      ("positions", self.positions, torch.int64, (T,)),
                                      ("slot_mapping", self.slot_mapping, torch.int64, (T,))):
            if t.dtype != dtype or tuple(t.shape) != shape or (t.numel() > 1 and t.stride(0) != 1):
                raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        tables = ("swa_block_table", "compressed_block_table", "state_block_table")
        for name in tables[1:]:
            if ratios and getattr(self, name) is None:
                raise ValueError(f"{name} is None: the compressed ratios {ratios} need it")
        tables = tuple(name for name in tables if getattr(self, name) is not None)
        for name in tables:
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != R or (t.shape[1] > 1 and t.stride(1) != 1):
                raise ValueError(f"{name} must be an int32 [{R}, blocks] tensor with contiguous rows (one row per "
                                 f"request), got {t.dtype} {tuple(t.shape)}")
        for name in ("query_start_loc", "seq_lens", "slot_mapping") + tables:
            if getattr(self, name).device != self.positions.device:
                raise ValueError(f"{name} is on {getattr(self, name).device}, positions on {self.positions.device}")
        return ratios


    # ---- whole-step validation (docs/conventions.md, "Argument checks") --------------------------------
    def validate(self, caches, built: bool = False) -> None:
        """Check the whole step against the caches of the layers that run it (a LayerCache,
        or several; or their ``bounds()``, a ``CacheBounds`` each, which a layer computes once) before any of
        them writes: a ValueError naming the table, slot or field, so that a rejected step changes no byte of
        any cache. Structure always; values where ``ops.value_checks`` allows (CPU tensors; GPU tensors
        under ``ops.validation("full")``, a host sync; never in a graph capture):

          * the batch: query_start_loc non-decreasing from >= 0 up to at most the step's tokens, seq_lens at
            least the query lengths and at most max_model_len; a token with a slot (slot_mapping >= 0) inside a
            request at the position its request implies (seq_len - query_len + its place);
          * slot_mapping below the SWA cache's slots; every entry >= 0 of each block table below the blocks of
            the caches it indexes (SWA; compressed and indexer-K; compressor state or ring), negative = padding;
          * where an indexer reads a request's compressed entries through its table row (a C4 layer; every
            compressed V4.1 layer, whose kv source's indexer-K cache its index source reads): the row has the
            columns they need, and a prefill request has no negative entry among them;
          * ``built``: the index sets exist for every cache's ratio with the step's rows, the compressed and
            state slots lie inside their caches (a state slot only for a token inside a request, at a
            position >= 0 its table row covers), the lengths within their index widths (the indexer's
            entries within seq_len // ratio).

        The metadata ops treat such lookups as padding; a layer instead refuses a step whose tables point
        past its caches, before its first write."""
        one = isinstance(caches, CacheBounds) or hasattr(caches, "bounds")
        bounds = [c if isinstance(c, CacheBounds) else c.bounds() for c in ([caches] if one else caches)]
        T, R = self.num_tokens, self.num_requests
        ratios = sorted({b.ratio for b in bounds if b.ratio})
        # structure: once per step object and set of fields (every layer of a step sees the same tensors;
        # a field assigned anew, or other caches, checks again)
        key = (built, tuple(bounds), self.num_decodes, self.num_decode_tokens, self.window, self.max_model_len,
               *map(id, (self.query_start_loc, self.seq_lens, self.positions, self.slot_mapping, self.swa_block_table,
                         self.compressed_block_table, self.state_block_table)),
               *((id(self.token_to_req), id(self.swa_indices), id(self.swa_lens), id(self.indexer_lens),
                  id(self.c128_indices), id(self.c128_lens),
                  *(id(d.get(r)) for r in ratios for d in (self.compressed_slots, self.state_slots, self.v41_lens)))
                 if built else ()))
        if self.__dict__.get("_structure_checked") != key:
            self._check(())
            if not 0 <= self.num_decodes <= R or not 0 <= self.num_decode_tokens <= T:
                raise ValueError(f"num_decodes / num_decode_tokens ({self.num_decodes} / {self.num_decode_tokens}) "
                                 f"must lie within the step's {R} requests / {T} tokens")
            for b in bounds:
                for name, parts in (("compressed_block_table", b.compressed), ("state_block_table", b.state)):
                    if parts and getattr(self, name) is None:
                        raise ValueError(f"{name} is None: the {parts[0][2]} of a ratio-{b.ratio} layer needs it")
            if built:
                self._check_built(bounds)
            self._structure_checked = key
        if not (T or R) or not ops.value_checks(self.positions):
            return
        cpu = {k: getattr(self, k).cpu().long() for k in (
            "query_start_loc", "seq_lens", "positions", "slot_mapping", "swa_block_table", "compressed_block_table",
            "state_block_table") if getattr(self, k) is not None}
        qsl, seq, pos, slot = cpu["query_start_loc"], cpu["seq_lens"], cpu["positions"], cpu["slot_mapping"]
        ql = qsl[1:] - qsl[:-1]
        if int(qsl[0]) < 0 or bool((ql < 0).any()) or int(qsl[-1]) > T:
            raise ValueError(f"query_start_loc must be non-decreasing from >= 0 up to at most the {T} tokens, got "
                             f"{qsl.tolist() if R < 16 else '...'}")
        if bool((seq < ql).any()):
            b = int(torch.nonzero(seq < ql)[0])
            raise ValueError(f"seq_lens[{b}] = {int(seq[b])} is below its query length {int(ql[b])}")
        if bool((seq > self.max_model_len).any()):
            b = int(torch.nonzero(seq > self.max_model_len)[0])
            raise ValueError(f"seq_lens[{b}] = {int(seq[b])} exceeds max_model_len {self.max_model_len}")
        t = torch.arange(T)
        req = torch.searchsorted(qsl[1:], t, right=True)
        inside = (req < R) & (t >= qsl[0])
        r = req.clamp(max=max(R - 1, 0))
        want = seq[r] - ql[r] + (t - qsl[r]) if R else t
        bad = inside & (slot >= 0) & (pos != want)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"positions[{i}] = {int(pos[i])}, but its request {int(r[i])} puts it at {int(want[i])} "
                             "(seq_lens - query length + its place)")
        for b in bounds:
            self._check_tables(b, cpu, ql, seq)
        if built:
            self._check_built_values(bounds, cpu, inside, r, seq)

    def _check_tables(self, bounds: CacheBounds, cpu, ql, seq):
        """Value checks of slot_mapping and the block tables against one layer's caches."""
        def table_within(name, blocks, what):
            t = cpu[name]
            if t.numel() and int(t.max()) >= blocks:
                raise ValueError(f"{name} names block {int(t.max())}, past the {blocks} blocks of the {what}")
        swa_pages = bounds.swa_pages
        if self.slot_mapping.numel() and int(cpu["slot_mapping"].max()) >= swa_pages * L.SWA_BLOCK_SIZE:
            raise ValueError(f"slot_mapping: slot {int(cpu['slot_mapping'].max())} is outside the SWA cache "
                             f"({swa_pages} pages x {L.SWA_BLOCK_SIZE})")
        table_within("swa_block_table", swa_pages, "SWA cache")
        for pages, _, what in bounds.compressed:
            table_within("compressed_block_table", pages, what)
        for blocks, _, what in bounds.state:
            table_within("state_block_table", blocks, what)
        k = bounds.index_ratio
        if k and self.num_requests:
            # the indexer's logits read entries 0 .. seq_len // k - 1 of each request through its table row
            bt = cpu["compressed_block_table"]
            need = (seq.clamp(min=0) // k + bounds.index_block - 1) // bounds.index_block
            if int(need.max()) > bt.shape[1]:
                b = int(torch.argmax(need))
                raise ValueError(f"compressed_block_table has {bt.shape[1]} columns; request {b} (seq_lens "
                                 f"{int(seq[b])}) has compressed entries in {int(need[b])}")
            pf = torch.arange(self.num_requests) >= self.num_decodes
            used = torch.arange(bt.shape[1]).unsqueeze(0) < need.unsqueeze(1)
            if bool((pf.unsqueeze(1) & used & (ql.unsqueeze(1) > 0) & (bt < 0)).any()):
                raise ValueError("compressed_block_table has a negative entry where a prefill request's indexer "
                                 "reads its compressed entries")

    def _built(self, name: str):
        """A built field by name: ``swa_lens``, or ``compressed_slots[4]`` for a per-ratio one."""
        if "[" not in name:
            return getattr(self, name)
        return getattr(self, name[:name.index("[")]).get(int(name[name.index("[") + 1:-1]))

    def _check_built(self, bounds):
        """Structure of the index sets a layer reads: built for its ratios, with the step's rows."""
        T, dev, i32 = self.num_tokens, self.positions.device, torch.int32
        ratios = tuple(sorted({b.ratio for b in bounds if b.ratio}))
        need = [("token_to_req", (T,), i32), ("is_valid_token", (T,), torch.bool),
                ("swa_indices", (T, self.window), i32), ("swa_lens", (T,), i32)]
        need += [("c128_indices", (T, None), i32), ("c128_lens", (T,), i32)] if 128 in ratios else []
        for b in bounds:
            need += [(f"compressed_slots[{b.ratio}]", (T,), torch.int64)] if b.compressed else []
            need += [(f"state_slots[{b.ratio}]", (T,), torch.int64)] if b.state else []
            need += [(b.index_lens, (T,), i32)] if b.index_lens else []
        for name, shape, dtype in need:
            t = self._built(name)
            if t is None or t.dtype != dtype or t.device != dev or len(t.shape) != len(shape) or \
                    any(s is not None and s != n for s, n in zip(shape, t.shape)) or (t.dim() == 2 and t.stride(1) != 1):
                raise ValueError(f"{name}: the step is not built for ratios {ratios} with its {T} tokens "
                                 f"(want {dtype} {shape} on {dev}; call step.build(ratios) first)")

    def _check_built_values(self, bounds, cpu, inside, r, seq):
        """Value checks of the built index sets a layer writes through (slots) or bounds by (lengths)."""
        pos = cpu["positions"]
        t2r = self.token_to_req.cpu().long()
        if bool((t2r != torch.where(inside, r, -1)).any()):
            raise ValueError("token_to_req does not name each token's request (-1 outside every request)")
        lens = self.swa_lens.cpu()
        if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > self.window):
            raise ValueError(f"swa_lens must lie in [0, {self.window}] (the window)")
        for b in bounds:
            rr = b.ratio
            if b.compressed:
                ks = self.compressed_slots[rr].cpu()
                for pages, per, what in b.compressed:
                    cap = pages * per
                    if ks.numel() and int(ks.max()) >= cap:
                        raise ValueError(f"compressed_slots[{rr}]: slot {int(ks.max())} is outside the {what} "
                                         f"({cap} slots)")
            if b.state:
                ss = self.state_slots[rr].cpu()
                for blocks, rows, what in b.state:
                    cap = blocks * rows
                    if ss.numel() and int(ss.max()) >= cap:
                        raise ValueError(f"state_slots[{rr}]: slot {int(ss.max())} is outside the {what} ({cap} slots)")
                live = ss >= 0
                cols = cpu["state_block_table"].shape[1]
                past = (cols < 1) if b.ring else (pos // b.state[0][1] >= cols)
                if bool((live & (~inside | (pos < 0) | past)).any()):
                    raise ValueError(f"state_slots[{rr}] has a slot for a token outside every request, at a negative "
                                     "position, or past its state_block_table row")
            if b.index_lens:
                il = self._built(b.index_lens).cpu().long()
                cap = torch.where(inside, seq[r] // b.index_ratio, 0) if seq.numel() else torch.zeros_like(il)
                if bool(((il < 0) | (inside & (il > cap))).any()):
                    raise ValueError(f"{b.index_lens} must lie in [0, seq_lens // {b.index_ratio}] for the tokens of "
                                     "a request")
            if rr == 128:
                cl = self.c128_lens.cpu()
                if cl.numel() and (int(cl.min()) < 0 or int(cl.max()) > self.c128_indices.shape[1]):
                    raise ValueError(f"c128_lens must lie in [0, {self.c128_indices.shape[1]}] (the C128 indices)")


def _split(ratios) -> tuple:
    """(V4.0 ratios, V4.1 ratios) of a checked ratio tuple."""
    return tuple(r for r in ratios if r not in V41_RATIOS), tuple(r for r in ratios if r in V41_RATIOS)


def c128_max_entries(max_model_len: int) -> int:
    """Kmax = round_up(ceil(max_model_len / 128), 128): the C128 index width vLLM sizes its buffers with."""
    return -(-(-(-max_model_len // 128)) // 128) * 128
