"""Whole-step validation (dsv4_rocm.step.StepMetadata.validate; docs/conventions.md, "Argument checks"): the
layer checks the whole step against its caches before its first write, so a rejected step changes no byte
of any cache or compressor state, and StepMetadata.build(caches=...) rejects the same steps before writing
any field. Hypothesis property tests over random bad steps (config tiny, reference backend, small caches)."""
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4_rocm import ops
from dsv4_rocm.config import LayerType, tiny_config
from dsv4_rocm.serving import SyntheticServer

CFG = tiny_config()
TYPES = {"swa": LayerType.SWA, "c4": LayerType.C4, "c128": LayerType.C128}
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


@functools.lru_cache(maxsize=None)
def server(kind):
    """One small layer per type: 3 requests of up to 256 tokens (12 SWA and compressed pages)."""
    return SyntheticServer(CFG, TYPES[kind], num_requests=3, max_model_len=256)


def all_caches(s):
    c = s.cache
    return {k: getattr(c, k) for k in ("swa", "comp", "idx", "comp_state", "idx_state") if getattr(c, k) is not None}


def snapshot(s):
    return {k: v.clone() for k, v in all_caches(s).items()}


def unchanged(s, before):
    return all(torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)) for k, v in all_caches(s).items())


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


def bad_step(s, st, kind, g):
    """Apply ``kind`` to ``st``: (before-build edits done, after-build edit function or None). Returns whether
    the kind must be rejected."""
    c = s.cache
    if kind == "swa table past the cache":
        st.swa_block_table = _poke(st.swa_block_table, g, c.swa.shape[0] + int(torch.randint(0, 9, (), generator=g)))
    elif kind == "compressed table past the cache":
        n = c.comp.shape[0] if c.comp is not None else c.swa.shape[0]
        st.compressed_block_table = _poke(st.compressed_block_table, g, n + int(torch.randint(0, 9, (), generator=g)))
        return c.comp is not None
    elif kind == "state table past the cache":
        n = c.comp_state.shape[0] if c.comp_state is not None else 10 ** 6
        st.state_block_table = _poke(st.state_block_table, g, n + int(torch.randint(0, 9, (), generator=g)))
        return c.comp_state is not None
    elif kind == "slot past the SWA cache":
        i = _real_token(st, g)
        if i is None:
            return False
        st.slot_mapping = st.slot_mapping.clone()
        st.slot_mapping[i] = c.swa.shape[0] * 64 + int(torch.randint(0, 99, (), generator=g))
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
        return s.cache.ratio == 4 and bool((st.seq_lens >= 4).any())
    elif kind == "random garbage":                       # anything: only "rejected => unchanged" is asserted
        name = ["swa_block_table", "compressed_block_table", "state_block_table", "slot_mapping", "positions",
                "seq_lens"][int(torch.randint(0, 6, (), generator=g))]
        setattr(st, name, _poke(getattr(st, name), g, int(torch.randint(-3, 300, (), generator=g))))
        return False
    return True


AFTER_BUILD = ["compressed slot past the cache", "state slot past the cache", "lengths past the index width",
               "token_to_req off its request", "random built garbage"]
BUILT = ["token_to_req", "is_valid_token", "swa_indices", "swa_lens", "indexer_lens", "c128_indices", "c128_lens"]


def bad_built(s, st, kind, g):
    """Edit the built sets of ``st`` (a hand-made or stale step); returns whether it must be rejected."""
    r = s.cache.ratio
    i = _real_token(st, g)
    if i is None:
        return False
    if kind == "compressed slot past the cache":
        if r == 1:
            return False
        st.compressed_slots[r] = st.compressed_slots[r].clone()
        st.compressed_slots[r][i] = s.cache.comp.shape[0] * s.cache.compressed_block_size + 3
    elif kind == "state slot past the cache":
        if r == 1:
            return False
        st.state_slots[r] = st.state_slots[r].clone()
        st.state_slots[r][i] = s.cache.comp_state.shape[0] * s.cache.comp_state.shape[1]
    elif kind == "lengths past the index width":
        st.swa_lens = st.swa_lens.clone()
        st.swa_lens[i] = st.window + 1
    elif kind == "token_to_req off its request":
        st.token_to_req = st.token_to_req.clone()
        st.token_to_req[i] = 7
    elif kind == "random built garbage":                 # only "rejected => unchanged" is asserted
        fields = [f for f in BUILT if getattr(st, f) is not None]
        fields += [f"compressed_slots[{r}]" for r in st.compressed_slots] + [f"state_slots[{r}]" for r in st.state_slots]
        f = fields[int(torch.randint(0, len(fields), (), generator=g))]
        v = int(torch.randint(-3, 5000, (), generator=g))
        if "[" in f:
            d, r = f.split("[")
            getattr(st, d)[int(r[:-1])] = _poke(getattr(st, d)[int(r[:-1])], g, v)
        else:
            t = getattr(st, f)
            setattr(st, f, _poke(t, g, bool(v % 2) if t.dtype == torch.bool else v))
        return False
    return True


KINDS = ["swa table past the cache", "compressed table past the cache", "state table past the cache",
         "slot past the SWA cache", "position off its request", "seq_lens below the query",
         "query_start_loc not monotone", "short compressed table", "random garbage"]


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(sorted(TYPES)),
       kind=st.sampled_from(KINDS + AFTER_BUILD))
def test_a_rejected_step_changes_no_byte_of_any_cache(seed, layer, kind):
    """A bad step through DeepseekV4Attention.forward: rejected (a ValueError) before the first write, with every
    cache and compressor state byte-identical; a step whose tables or slots point past the caches is always
    rejected. (The layer used to write the SWA cache and the compressor state before rejecting a compressed
    or state table past its cache.)"""
    g = torch.Generator().manual_seed(seed)
    s = server(layer)
    st = valid_step(s, g)
    with ops.use_backend("reference"):
        if kind in AFTER_BUILD:
            st.build(s.ratios())
            must = bad_built(s, st, kind, g)
        else:
            must = bad_step(s, st, kind, g)
            try:                                    # the step's own sets, as an engine builds them (the
                st.build(s.ratios())                # metadata ops' CPU checks may refuse a contradictory batch
            except ValueError:                      # part way: the layer gets a half-built step then)
                pass
        x = torch.randn(st.num_tokens, CFG.hidden_size, generator=g).bfloat16()
        before = snapshot(s)
        try:
            s.layer(st.positions, x, st)
        except ValueError:
            assert unchanged(s, before), kind
            return
    assert not must, f"{kind}: the step was accepted"


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), layer=st.sampled_from(sorted(TYPES)), kind=st.sampled_from(KINDS))
def test_build_with_caches_rejects_the_same_steps_before_writing(seed, layer, kind):
    """StepMetadata.build(ratios, caches=...) validates against the caches first: a bad step is a ValueError
    with no field written (and no cache touched); a valid one builds the same sets as build() alone."""
    g = torch.Generator().manual_seed(seed)
    s = server(layer)
    st = valid_step(s, g)
    must = bad_step(s, st, kind, g)
    before = snapshot(s)
    with ops.use_backend("reference"):
        try:
            st.build(s.ratios(), caches=s.cache)
        except ValueError:
            assert st.token_to_req is None and st.swa_indices is None and not st.compressed_slots, kind
            assert unchanged(s, before)
            return
    assert not must, f"{kind}: build accepted the step"


def test_valid_steps_pass_and_build_alike():
    """Consistent steps pass validation at the layer and at build, and build(caches=) = build()."""
    g = torch.Generator().manual_seed(1)
    for layer in sorted(TYPES):
        s = server(layer)
        for _ in range(3):
            a, b = valid_step(s, g), None
            b = s.make_step({k: 1 for k in range(3)})
            for st in (a, b):
                plain = s.make_step({k: 1 for k in range(3)}) if st is b else None
                st.build(s.ratios(), caches=s.cache)
                st.validate(s.cache, built=True)
                if plain is not None:
                    plain.build(s.ratios())
                    assert torch.equal(plain.swa_indices, st.swa_indices)


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
    cache, bands = guarded(s.cache)
    lay = DeepseekV4Attention(CFG, CFG.first_layer_of(TYPES[layer]), s.weights, cache, 256, s.cos_sin, device=gpu)
    g = torch.Generator().manual_seed(0)
    for kind in KINDS[:4]:
        st = valid_step(s, g)
        if not bad_step(s, st, kind, g):
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
