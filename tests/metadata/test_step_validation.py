"""Whole-step validation (dsv4_rocm.step.StepMetadata.validate; docs/conventions.md, "Argument checks"): the
layer checks the whole step against its caches before its first write, so a rejected step changes no byte
of any cache or compressor state, and StepMetadata.build(caches=...) rejects the same steps before writing
any field. Hypothesis property tests over random bad steps (config tiny and tiny-v4.1, reference backend,
small caches): every DeepSeek-V4 layer type, and every DeepSeek-V4.1 layer kind in a stack that shares
caches as the model does (the kv sources' compressed, indexer-K and ring caches, the shared top-k and
candidate buffers)."""
import functools
from typing import NamedTuple, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4_rocm import ops
from dsv4_rocm.config import LayerType, tiny_config, tiny_v41_config
from dsv4_rocm.serving import SyntheticServer

CFG = tiny_config()
V41_CFG = tiny_v41_config()
TYPES = {"swa": LayerType.SWA, "c4": LayerType.C4, "c128": LayerType.C128}
V41_LAYERS = tuple(range(8))        # every kind (tiny_v41_config): swa, r2 source / reader, r1 source / readers ...
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])
V41_PROPERTY = settings(PROPERTY, max_examples=80)


@functools.lru_cache(maxsize=None)
def server(kind):
    """One small layer per type: 3 requests of up to 256 tokens (12 SWA and compressed pages)."""
    return SyntheticServer(CFG, TYPES[kind], num_requests=3, max_model_len=256)


@functools.lru_cache(maxsize=None)
def v41_stack():
    """Every V4.1 layer kind over shared caches: 3 requests of up to 256 tokens (12 pages a cache, 3 ring
    blocks)."""
    return SyntheticServer(V41_CFG, None, 3, 256, layers=V41_LAYERS)


class Limits(NamedTuple):
    """What a layer's cache tensors hold, read from the tensors (not from the code under test): SWA pages;
    the compressed cache's pages and entries a page, the state cache's (V4.0) or ring's (V4.1) blocks and
    rows (None where the layer has none); the key of the step's sets it reads; the ratio at which an indexer
    reads the compressed table (0: none) and the built field bounding it."""
    swa_pages: int
    comp_pages: Optional[int]
    comp_entries: int
    state_blocks: Optional[int]
    state_rows: int
    ratio: int
    index_ratio: int
    index_lens: str


class Target(NamedTuple):
    server: object            # the SyntheticServer that makes the steps
    layer: object             # the module under test
    lim: Limits
    tensors: dict             # every cache and shared buffer of the server, by name


def v40_target(kind):
    s = server(kind)
    c = s.cache
    state = c.comp_state
    lim = Limits(c.swa.shape[0], c.comp.shape[0] if c.comp is not None else None,
                 c.compressed_block_size if c.comp is not None else 0,
                 state.shape[0] if state is not None else None, state.shape[1] if state is not None else 0,
                 c.ratio if c.ratio > 1 else 0, 4 if c.ratio == 4 else 0, "indexer_lens" if c.ratio == 4 else "")
    tensors = {k: getattr(c, k) for k in ("swa", "comp", "idx", "comp_state", "idx_state") if getattr(c, k) is not None}
    return Target(s, s.layer, lim, tensors)


def v41_target(layer):
    s = v41_stack()
    c = s.caches[layer]
    r = c.ratio
    lim = Limits(c.swa.shape[0], c.comp.shape[0] if r else None, 64, c.ring.shape[0] if c.ring is not None else None,
                 c.ring.shape[1] if c.ring is not None else 0, r, r, f"v41_lens[{r}]" if r else "")
    tensors = {}
    for x, lc in s.caches.items():               # each layer's SWA cache; the kv sources' caches, held by id once
        for name in ("swa", "comp", "idx", "ring"):
            t = getattr(lc, name)
            if t is not None and all(t is not u for u in tensors.values()):
                tensors[f"layer {x} {name}"] = t
    tensors["shared top-k"] = s.shared.topk
    tensors["shared candidates"] = s.shared.candidates
    return Target(s, s.modules[layer], lim, tensors)


def refill(tg, g):
    """Random bytes in every cache (not in the shared buffers, whose entries a layer reads as indices): a
    write before a rejection shows even where an earlier example wrote the same bytes there."""
    for name, t in tg.tensors.items():
        if not name.startswith("shared"):
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def snapshot(tg):
    return {k: v.clone() for k, v in tg.tensors.items()}


def changed(tg, before):
    """The names of the tensors whose bytes differ from ``before``."""
    return [k for k, v in tg.tensors.items() if not torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))]


def valid_step(s, g):
    """A consistent step of the server's 3 requests: some decode (1 token), some prefill, random history."""
    s.done = [int(torch.randint(0, 200, (), generator=g)) for _ in range(3)]
    lens = {}
    for b in range(3):
        k = int(torch.randint(0, 3, (), generator=g))
        if k:
            lens[b] = 1 if k == 1 else int(torch.randint(2, 30, (), generator=g))
    lens = lens or {0: 1}
    return s.make_step(lens)


# what each bad kind does to a step (before build) or to its built sets (after); "past" kinds point a table or
# a slot past the layer's caches and must be rejected
def _poke(t, g, value):
    t = t.clone()
    if t.numel():
        t.view(-1)[int(torch.randint(0, t.numel(), (), generator=g))] = value
    return t


def _real_token(st, g):
    real = torch.nonzero(st.slot_mapping >= 0).flatten()
    return int(real[int(torch.randint(0, real.numel(), (), generator=g))]) if real.numel() else None


def bad_step(lim, st, kind, g):
    """Apply ``kind`` to ``st`` (before build); returns whether the layer of ``lim`` must reject it."""
    if kind == "swa table past the cache":
        st.swa_block_table = _poke(st.swa_block_table, g, lim.swa_pages + int(torch.randint(0, 9, (), generator=g)))
    elif kind == "compressed table past the cache":
        n = lim.comp_pages if lim.comp_pages is not None else lim.swa_pages
        st.compressed_block_table = _poke(st.compressed_block_table, g, n + int(torch.randint(0, 9, (), generator=g)))
        return lim.comp_pages is not None
    elif kind == "state table past the cache":
        n = lim.state_blocks if lim.state_blocks is not None else 10 ** 6
        st.state_block_table = _poke(st.state_block_table, g, n + int(torch.randint(0, 9, (), generator=g)))
        return lim.state_blocks is not None
    elif kind == "slot past the SWA cache":
        i = _real_token(st, g)
        if i is None:
            return False
        st.slot_mapping = st.slot_mapping.clone()
        st.slot_mapping[i] = lim.swa_pages * 64 + int(torch.randint(0, 99, (), generator=g))
    elif kind == "position off its request":
        i = _real_token(st, g)
        if i is None:
            return False
        st.positions = st.positions.clone()
        st.positions[i] += int(torch.randint(1, 40, (), generator=g)) * (1 if torch.rand((), generator=g) < 0.5 else -1)
    elif kind == "seq_lens below the query":
        ql = st.query_start_loc[1:] - st.query_start_loc[:-1]
        b = int(torch.argmax(ql))
        st.seq_lens = st.seq_lens.clone()
        st.seq_lens[b] = ql[b] - 1
    elif kind == "query_start_loc not monotone":
        if st.num_requests < 2 or st.query_start_loc[1] == st.query_start_loc[2]:
            return False
        st.query_start_loc = st.query_start_loc.clone()
        st.query_start_loc[1] = st.query_start_loc[2] + 1
    elif kind == "short compressed table":
        st.compressed_block_table = st.compressed_block_table[:, :int(torch.randint(0, 1, (), generator=g))].clone()
        return bool(lim.index_ratio) and bool((st.seq_lens >= lim.index_ratio).any())
    elif kind == "random garbage":                       # anything: only "rejected => unchanged" is asserted
        name = ["swa_block_table", "compressed_block_table", "state_block_table", "slot_mapping", "positions",
                "seq_lens"][int(torch.randint(0, 6, (), generator=g))]
        setattr(st, name, _poke(getattr(st, name), g, int(torch.randint(-3, 300, (), generator=g))))
        return False
    return True


AFTER_BUILD = ["compressed slot past the cache", "state slot past the cache", "lengths past the index width",
               "indexer entries past the request", "token_to_req off its request", "random built garbage"]
BUILT = ["token_to_req", "is_valid_token", "swa_indices", "swa_lens", "indexer_lens", "c128_indices", "c128_lens"]


def _get(st, name):
    """A built field by name (``swa_lens``, or ``v41_lens[1]`` for a per-ratio one)."""
    if "[" in name:
        d, r = name.split("[")
        return getattr(st, d)[int(r[:-1])]
    return getattr(st, name)


def _set(st, name, t):
    if "[" in name:
        d, r = name.split("[")
        getattr(st, d)[int(r[:-1])] = t
    else:
        setattr(st, name, t)


def bad_built(lim, st, kind, g):
    """Edit the built sets of ``st`` (a hand-made or stale step); returns whether it must be rejected."""
    r = lim.ratio
    i = _real_token(st, g)
    if i is None:
        return False
    if kind == "compressed slot past the cache":
        if lim.comp_pages is None:
            return False
        st.compressed_slots[r] = st.compressed_slots[r].clone()
        st.compressed_slots[r][i] = lim.comp_pages * lim.comp_entries + 3
    elif kind == "state slot past the cache":
        if lim.state_blocks is None:
            return False
        st.state_slots[r] = st.state_slots[r].clone()
        st.state_slots[r][i] = lim.state_blocks * lim.state_rows + int(torch.randint(0, 9, (), generator=g))
    elif kind == "lengths past the index width":
        st.swa_lens = st.swa_lens.clone()
        st.swa_lens[i] = st.window + 1
    elif kind == "indexer entries past the request":
        if not lim.index_ratio:
            return False
        lens = _get(st, lim.index_lens).clone()
        lens[i] = int(st.seq_lens[int(st.token_to_req[i])]) // lim.index_ratio + int(torch.randint(1, 9, (), generator=g))
        _set(st, lim.index_lens, lens)
    elif kind == "token_to_req off its request":
        st.token_to_req = st.token_to_req.clone()
        st.token_to_req[i] = 7
    elif kind == "random built garbage":                 # only "rejected => unchanged" is asserted
        fields = [f for f in BUILT if getattr(st, f) is not None]
        fields += [f"{d}[{r}]" for d in ("compressed_slots", "state_slots", "v41_lens") for r in getattr(st, d)]
        f = fields[int(torch.randint(0, len(fields), (), generator=g))]
        v = int(torch.randint(-3, 5000, (), generator=g))
        t = _get(st, f)
        _set(st, f, _poke(t, g, bool(v % 2) if t.dtype == torch.bool else v))
        return False
    return True


KINDS = ["swa table past the cache", "compressed table past the cache", "state table past the cache",
         "slot past the SWA cache", "position off its request", "seq_lens below the query",
         "query_start_loc not monotone", "short compressed table", "random garbage"]


def check_rejected_step(tg, seed, kind):
    """A bad step through the layer: rejected (a ValueError) before the first write, every byte of every cache
    and shared buffer identical; a step whose tables or slots point past the caches is always rejected."""
    g = torch.Generator().manual_seed(seed)
    s, lim = tg.server, tg.lim
    st = valid_step(s, g)
    with ops.use_backend("reference"):
        if kind in AFTER_BUILD:
            st.build(s.ratios())
            must = bad_built(lim, st, kind, g)
        else:
            must = bad_step(lim, st, kind, g)
            try:                                    # the step's own sets, as an engine builds them (the
                st.build(s.ratios())                # metadata ops' CPU checks may refuse a contradictory batch
            except ValueError:                      # part way: the layer gets a half-built step then)
                pass
        x = torch.randn(st.num_tokens, tg.layer.cfg.hidden_size, generator=g).bfloat16()
        refill(tg, g)
        before = snapshot(tg)
        try:
            tg.layer(st.positions, x, st)
        except ValueError:
            written = changed(tg, before)
            assert not written, f"{kind}: rejected after writing {written}"
            return
    assert not must, f"{kind}: the step was accepted"


def check_build_rejects(tg, caches, seed, kind):
    """StepMetadata.build(ratios, caches=...) on a bad step: a ValueError with no field written and no cache
    touched, or (for a step the layer may take) a build."""
    g = torch.Generator().manual_seed(seed)
    s = tg.server
    st = valid_step(s, g)
    must = bad_step(tg.lim, st, kind, g)
    before = snapshot(tg)
    with ops.use_backend("reference"):
        try:
            st.build(s.ratios(), caches=caches)
        except ValueError:
            assert st.token_to_req is None and st.swa_indices is None and not st.compressed_slots, kind
            assert not st.v41_lens and not changed(tg, before)
            return
    assert not must, f"{kind}: build accepted the step"


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(sorted(TYPES)),
       kind=st.sampled_from(KINDS + AFTER_BUILD))
def test_a_rejected_step_changes_no_byte_of_any_cache(seed, layer, kind):
    """DeepseekV4Attention.forward, every layer type. (The layer used to write the SWA cache and the compressor
    state before rejecting a compressed or state table past its cache.)"""
    check_rejected_step(v40_target(layer), seed, kind)


@V41_PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(V41_LAYERS), kind=st.sampled_from(KINDS + AFTER_BUILD))
def test_a_rejected_v41_step_changes_no_byte_of_any_cache(seed, layer, kind):
    """DeepseekV4Attention.forward of every V4.1 layer kind of a stack sharing caches: no byte of its own SWA
    cache, of any kv source's compressed, indexer-K or ring cache, or of the shared top-k / candidate buffers
    changes. (The layer used to write its SWA cache, and a kv source its compressor ring, before an op
    rejected a compressed slot past the cache or indexer entries past the request.)"""
    check_rejected_step(v41_target(layer), seed, kind)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(sorted(TYPES)), kind=st.sampled_from(KINDS))
def test_build_with_caches_rejects_the_same_steps_before_writing(seed, layer, kind):
    """StepMetadata.build(ratios, caches=...) validates against the caches first."""
    tg = v40_target(layer)
    check_build_rejects(tg, tg.server.cache, seed, kind)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(V41_LAYERS), kind=st.sampled_from(KINDS))
def test_build_with_v41_caches_rejects_the_same_steps_before_writing(seed, layer, kind):
    """The same with a V4.1 layer's caches (its own SWA cache, its kv source's)."""
    tg = v41_target(layer)
    check_build_rejects(tg, tg.server.caches[layer], seed, kind)


def test_valid_steps_pass_and_build_alike():
    """Consistent steps pass validation at the layer and at build, and build(caches=) = build()."""
    g = torch.Generator().manual_seed(1)
    for s, caches in [(server(k), server(k).cache) for k in sorted(TYPES)] + [(v41_stack(), list(
            v41_stack().caches.values()))]:
        for _ in range(3):
            a, b = valid_step(s, g), None
            b = s.make_step({k: 1 for k in range(3)})
            for st in (a, b):
                plain = s.make_step({k: 1 for k in range(3)}) if st is b else None
                st.build(s.ratios(), caches=caches)
                st.validate(caches, built=True)
                if plain is not None:
                    plain.build(s.ratios())
                    assert torch.equal(plain.swa_indices, st.swa_indices)
                    for r in plain.v41_lens:
                        assert torch.equal(plain.v41_lens[r], st.v41_lens[r])
                        assert torch.equal(plain.compressed_slots[r], st.compressed_slots[r])


def test_v41_caches_validate_as_the_model_reads_them():
    """Compress ratio 1 is a compressed layer in V4.1 (the sliding window alone in V4.0): the ratio-1 kv
    source and the layers reading its caches refuse a compressed table past them, a sliding-window layer
    does not read that table; a ring slot past the ratio-2 source's ring is refused by the ratio-2 layers
    only."""
    s = v41_stack()
    s.done = [0, 0, 0]
    st = s.make_step({0: 1, 1: 5})
    st.build(s.ratios())
    st.compressed_block_table = st.compressed_block_table.clone()
    st.compressed_block_table[1, 0] = s.caches[3].comp.shape[0]
    for layer in (1, 2, 3, 4, 5, 6):
        with pytest.raises(ValueError, match="compressed_block_table names block 12, past the 12 blocks"):
            st.validate(s.caches[layer], built=True)
    st.validate(s.caches[0], built=True)
    st = s.make_step({0: 1, 1: 5})
    st.build(s.ratios())
    st.state_slots[2] = st.state_slots[2].clone()
    st.state_slots[2][0] = 3 * 8
    for layer in (1, 2):
        with pytest.raises(ValueError, match=r"state_slots\[2\]: slot 24 is outside the compressor ring \(24 slots\)"):
            st.validate(s.caches[layer], built=True)
    for layer in (0, 3, 4):
        st.validate(s.caches[layer], built=True)


def test_v41_layer_checks_its_decode_rows_and_shared_buffers_before_writing():
    """An index source's paged logits take at most MAX_NEXT_N decode rows a request, and every layer writes
    or reads its step's rows of the shared top-k and candidate buffers: steps past either are refused
    before the first write (they used to fail inside the indexer, after the SWA, compressed and ring
    writes)."""
    from dsv4_rocm.attention import DeepseekV4Attention, SharedBuffers
    from dsv4_rocm.ops.indexer import MAX_NEXT_N
    s = SyntheticServer(V41_CFG, None, 2, 256, layers=(0, 1), decode_query_len=MAX_NEXT_N + 1)
    tg = Target(s, None, None, {f"{x} {n}": getattr(c, n) for x, c in s.caches.items() for n in ("swa", "comp",
                                                                                                  "idx", "ring")
                                if getattr(c, n) is not None})
    g = torch.Generator().manual_seed(3)
    st = s.make_step({0: MAX_NEXT_N + 1, 1: MAX_NEXT_N + 1})
    st.build(s.ratios())
    x = torch.randn(st.num_tokens, V41_CFG.hidden_size, generator=g).bfloat16()
    refill(tg, g)
    before = snapshot(tg)
    with ops.use_backend("reference"), pytest.raises(ValueError, match=f"takes at most {MAX_NEXT_N}"):
        s.modules[1](st.positions, x, st)
    assert not changed(tg, before)
    s.modules[0](st.positions, x, st)                            # a sliding-window layer runs no indexer
    s = SyntheticServer(V41_CFG, None, 2, 256, layers=(3,))                # the candidate source
    tg = tg._replace(tensors={n: getattr(s.caches[3], n) for n in ("swa", "comp", "idx")})
    small = SharedBuffers(s.shared.topk, s.shared.candidates[:6])
    layer = DeepseekV4Attention(V41_CFG, 3, s.layer_weights[3], s.caches[3], 256, shared=small)
    st = s.make_step({0: 3, 1: 4})
    st.build(s.ratios())
    refill(tg, g)
    before = snapshot(tg)
    with pytest.raises(ValueError, match="the step has 7 tokens; the shared top-k / candidate buffers hold 6 rows"):
        layer(st.positions, x[:7], st)
    assert not changed(tg, before)


def test_structure_of_an_unbuilt_step_is_named():
    s = server("c128")
    st = s.make_step({0: 3})
    with pytest.raises(ValueError, match="not built"):
        s.layer(st.positions, torch.randn(3, CFG.hidden_size).bfloat16(), st)


# ------------------------------------------------------------------------------------------------ GPU
def guarded(cache, guard=2):
    """A copy of ``cache`` whose every tensor is the middle of an allocation with ``guard`` blocks of random
    bytes on each side (a kernel writing past a cache shows up there). Returns (cache, {name: (big, inner)})."""
    from dsv4_rocm.kv_cache import LayerCache
    parts, bands = {}, {}
    for name in ("swa", "comp", "idx", "comp_state", "idx_state"):
        t = getattr(cache, name)
        if t is None:
            continue
        big = torch.empty((t.shape[0] + 2 * guard, *t.shape[1:]), dtype=t.dtype, device=t.device)
        big.view(torch.uint8).copy_(torch.randint(0, 256, big.view(torch.uint8).shape, dtype=torch.uint8))
        inner = big[guard:guard + t.shape[0]]
        inner.copy_(t)
        parts[name], bands[name] = inner, (big, guard, t.shape[0])
    return LayerCache(**parts, ratio=cache.ratio), bands


def band_bytes(bands):
    """The guard bands' bytes (compared as bytes: random fp32 bytes hold NaNs)."""
    return {k: (big[:g].view(torch.uint8).clone(), big[g + n:].view(torch.uint8).clone())
            for k, (big, g, n) in bands.items()}


def new_bands(bands, seed):
    """Fresh random bytes in every guard band (the caches themselves untouched)."""
    gen = torch.Generator().manual_seed(seed)
    for big, g, n in bands.values():
        for part in (big[:g], big[g + n:]):
            b = part.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(TYPES))
def test_gpu_default_path_never_touches_memory_past_the_caches(layer, gpu):
    """On a GPU the layer checks values only under validation("full"): by default a step whose tables and
    slots point past the caches runs, and every kernel skips those entries (padding): the guard bytes around
    every cache and state are unchanged (nothing written past a cache), and the output and the caches are
    the same whatever the guard bytes hold (nothing read past a cache). Under validation("full") the same
    step is rejected with every byte unchanged."""
    from dsv4_rocm.attention import DeepseekV4Attention
    s = SyntheticServer(CFG, TYPES[layer], num_requests=3, max_model_len=256, device="cuda")
    lim = v40_target(layer).lim
    cache, bands = guarded(s.cache)
    lay = DeepseekV4Attention(CFG, CFG.first_layer_of(TYPES[layer]), s.weights, cache, 256, s.cos_sin, device=gpu)
    g = torch.Generator().manual_seed(0)
    for kind in KINDS[:4]:
        st = valid_step(s, g)
        if not bad_step(lim, st, kind, g):
            continue
        st.build(s.ratios())
        x = torch.randn(st.num_tokens, CFG.hidden_size, generator=g).bfloat16().to(gpu)
        start = {k: big[gd:gd + n].clone() for k, (big, gd, n) in bands.items()}
        runs = []
        for seed in (1, 2):                              # the same step over two different guard contents
            for k, (big, gd, n) in bands.items():
                big[gd:gd + n].copy_(start[k])
            new_bands(bands, seed)
            keep = band_bytes(bands)
            y = lay(st.positions, x, st)
            torch.cuda.synchronize()
            for k, (lo, hi) in band_bytes(bands).items():
                assert torch.equal(lo, keep[k][0]) and torch.equal(hi, keep[k][1]), (kind, k)
            runs.append((y.clone(), {k: big[gd:gd + n].view(torch.uint8).clone() for k, (big, gd, n) in bands.items()}))
        (y1, c1), (y2, c2) = runs
        assert y1.shape == x.shape and torch.equal(y1.view(torch.int16), y2.view(torch.int16)), kind
        assert all(torch.equal(c1[k], c2[k]) for k in c1), kind
        inner = {k: big[gd:gd + n].view(torch.uint8).clone() for k, (big, gd, n) in bands.items()}
        with ops.validation("full"), pytest.raises(ValueError):
            lay(st.positions, x, st)
        assert all(torch.equal(big[gd:gd + n].view(torch.uint8), inner[k]) for k, (big, gd, n) in bands.items()), kind


def test_a_field_replaced_after_a_layer_ran_is_checked_again():
    """The structure check runs once per step object and set of fields: a field assigned anew is checked."""
    s = server("c4")
    st = s.make_step({0: 1, 1: 1})
    st.build(s.ratios())
    st.validate(s.cache, built=True)
    st.validate(s.cache, built=True)
    st.state_slots[4] = st.state_slots[4][:1].clone()
    with pytest.raises(ValueError, match=r"state_slots\[4\]"):
        st.validate(s.cache, built=True)
    st.build(s.ratios())
    st.swa_lens = st.swa_lens.long()
    with pytest.raises(ValueError, match="swa_lens"):
        st.validate(s.cache, built=True)
