"""The index sets of a scheduler step (dsv4_rocm/step.py): the one-launch kernel
(dsv4_rocm/triton/metadata/step_index_sets.py) against the composition of the public metadata ops.

* ``build_from_ops`` on consistent random batches: the public ops (CPU: value checks on) and the oracle
  module compose the same sets, and the parts the composition owns (token_to_req, state slots, indexer
  lengths) equal per-token loops written here from the math;
* the kernel under TRITON_INTERPRET=1 (a subprocess, CPU) and on the GPU: every field equal, byte for
  byte, to the composition over the oracle on random steps (decode-only, mixed, prefill-only, padding
  tokens inside requests and past the last one, -1 block-table entries, tables shorter than the
  positions, garbage positions, empty batches), outputs poisoned first; buffers kept across builds of one
  shape; on the GPU also inside a captured CUDA graph replayed on new steps;
* structural errors name the argument and leave the step's fields untouched.
"""
import pytest
import torch

from helpers import patch_interpreter_scalars, run_file_interpreted

from dsv4_rocm import ops
from dsv4_rocm.reference import metadata as M
from dsv4_rocm.reference.compressor import state_block_size
from dsv4_rocm.step import StepMetadata, c128_max_entries

I32, I64 = torch.int32, torch.int64
POISON = -777
KINDS = ("decode", "mixed", "prefill")


# ------------------------------------------------------------------------------------------------ random steps
def random_step(seed, kind="mixed", *, num_decodes=None, num_prefills=None, max_reqs=6, max_q=9, max_prefix=700, decode_q=None, pad_reqs=None,
                tail=None, invalid=None, bad_pages=None, short=None, garbage=None, max_model_len=None,
                window=128, device="cpu"):
    """A StepMetadata (unbuilt) in vLLM's order, decode requests first. Unset options are drawn from the
    seed: padded requests (query 0), tokens past the last request (tail, slot -1, garbage positions),
    invalid tokens inside requests (slot -1, sometimes a garbage position), -1 entries in the block tables
    (bad_pages: also where valid tokens need them), tables with fewer columns than the positions need
    (short), and ``garbage``: positions and seq_lens unrelated to each other (negative ones too)."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g)

    def coin(p=0.5):
        return bool(torch.rand((), generator=g) < p)
    dq = decode_q if decode_q is not None else (1 if coin(0.7) else 2)
    nd = 0 if kind == "prefill" else int(ri(1 if kind == "decode" else 0, max_reqs + 1))
    npf = 0 if kind == "decode" else int(ri(1 if kind == "prefill" else 0, max_reqs + 1))
    nd, npf = num_decodes if num_decodes is not None else nd, num_prefills if num_prefills is not None else npf
    npad = pad_reqs if pad_reqs is not None else (int(ri(0, 3)) if coin(0.4) else 0)
    qlens = torch.cat([torch.full((nd,), dq), ri(1, max_q + 1, npf), torch.zeros(npad, dtype=I64)])
    R = nd + npf + npad
    seq = torch.cat([ri(0, max_prefix + 1, nd + npf) + qlens[:nd + npf], torch.zeros(npad, dtype=I64)])
    qsl = torch.cat([torch.zeros(1, dtype=I64), qlens.cumsum(0)])
    Treal = int(qsl[-1])
    ntail = tail if tail is not None else (int(ri(1, 5)) if coin(0.4) else 0)
    T = Treal + ntail
    t2r = torch.full((T,), -1, dtype=I64)
    t2r[:Treal] = torch.repeat_interleave(torch.arange(R), qlens)
    pos = ri(-3, 3, T)
    if Treal:
        r = t2r[:Treal]
        pos[:Treal] = seq[r] - qlens[r] + torch.arange(Treal) - qsl[r]
    frac = invalid if invalid is not None else (0.2 if coin(0.5) else 0.0)
    valid = torch.zeros(T, dtype=torch.bool)
    valid[:Treal] = torch.rand(Treal, generator=g) >= frac
    pos = torch.where(~valid & (torch.rand(T, generator=g) < 0.5), ri(-4, 5, T), pos)
    if coin(0.2) if garbage is None else garbage:       # a third each: negative, anywhere, as it was
        u, v = torch.rand(T, generator=g), torch.rand(R, generator=g)
        pos = torch.where(u < 1 / 3, ri(-300, 0, T), torch.where(u < 2 / 3, ri(0, max_prefix + 400, T), pos))
        seq = torch.where(v < 1 / 3, qlens - ri(1, 4, R), torch.where(v < 2 / 3, ri(-3, max_prefix + 10, R), seq))
    top = int(max(int(pos.max()) if T else 0, int(seq.max()) if R else 0)) + 1
    mml = max_model_len if max_model_len is not None else top + int(ri(0, 300))

    def table(bs):
        cols = -(-mml // bs) + int(ri(0, 2))
        if short if short is not None else coin(0.25):
            cols = int(ri(0, max(cols // 2, 1) + 1))
        t = torch.randperm(R * cols + 13, generator=g)[:R * cols].view(R, cols)
        p = bad_pages if bad_pages is not None else (0.15 if coin(0.4) else 0.0)
        return torch.where(torch.rand(R, cols, generator=g) < p, torch.full_like(t, -1), t).to(I32)
    slot = torch.where(valid, torch.randperm(T, generator=g) + ri(0, 1000), torch.full((T,), -1))
    st = StepMetadata(qsl.to(I32), seq.to(I32), pos, slot, table(64), table(256), table(4), num_decodes=nd,
                      num_decode_tokens=nd * dq, max_model_len=mml, window=window)
    return to_device(st, device)


def to_device(st, device):
    d = {k: None if getattr(st, k) is None else getattr(st, k).to(device) for k in INPUTS}
    return StepMetadata(**d, num_decodes=st.num_decodes, num_decode_tokens=st.num_decode_tokens,
                        max_model_len=st.max_model_len, window=st.window)


INPUTS = ("query_start_loc", "seq_lens", "positions", "slot_mapping", "swa_block_table", "compressed_block_table",
          "state_block_table")


def ratios_of(seed):
    return [(4, 128), (4,), (128,), ()][seed % 4]


def fields(st, ratios):
    """{name: tensor} of everything build writes for ``ratios``."""
    out = {k: getattr(st, k) for k in ("token_to_req", "is_valid_token", "swa_indices", "swa_lens")}
    for r in ratios:
        out[f"compressed_slots[{r}]"] = st.compressed_slots[r]
        out[f"state_slots[{r}]"] = st.state_slots[r]
    if 4 in ratios:
        out["indexer_lens"] = st.indexer_lens
    if 128 in ratios:
        out["c128_indices"], out["c128_lens"] = st.c128_indices, st.c128_lens
    return out


def poison(st, ratios):
    """Fill the step's output buffers (the shapes build_fused reuses) with values no field holds."""
    T, dev = st.num_tokens, st.positions.device
    st.token_to_req = torch.full((T,), POISON, dtype=I32, device=dev)
    st.is_valid_token = st.slot_mapping < 0                      # the negation of what must be written
    st.swa_indices = torch.full((T, st.window), POISON, dtype=I32, device=dev)
    st.swa_lens = torch.full((T,), POISON, dtype=I32, device=dev)
    for r in ratios:
        st.compressed_slots[r] = torch.full((T,), POISON, dtype=I64, device=dev)
        st.state_slots[r] = torch.full((T,), POISON, dtype=I64, device=dev)
    st.indexer_lens = torch.full((T,), POISON, dtype=I32, device=dev)
    st.c128_indices = torch.full((T, c128_max_entries(st.max_model_len)), POISON, dtype=I32, device=dev)
    st.c128_lens = torch.full((T,), POISON, dtype=I32, device=dev)


def check_fused(st, ratios, build=None):
    """The kernel's sets of ``st`` (poisoned first; written in place) equal the oracle composition on
    CPU copies, field by field."""
    want = fields(to_device(st, "cpu").build_from_ops(ratios, impl=M), ratios)
    poison(st, ratios)
    keep = fields(st, ratios)
    (build or st.build_fused)(ratios)
    got = fields(st, ratios)
    for name, w in want.items():
        x = got[name]
        assert x is keep[name], f"{name}: build_fused did not write the step's buffer in place"
        assert x.dtype == w.dtype and x.shape == w.shape, (name, x.dtype, x.shape, w.dtype, w.shape)
        assert torch.equal(x.cpu(), w), (name, x.cpu(), w)


# ------------------------------------------------------------------------------------------------ loops
def loop_token_to_req(qsl, T):
    out = [-1] * T
    for b in range(len(qsl) - 1):
        for t in range(max(int(qsl[b]), 0), min(int(qsl[b + 1]), T)):
            out[t] = b
    return out


def loop_state_slots(st, r):
    sbs, bt = state_block_size(r), st.state_block_table
    out = []
    for t, b in enumerate(loop_token_to_req(st.query_start_loc, st.num_tokens)):
        p = int(st.positions[t])
        ok = b >= 0 and int(st.slot_mapping[t]) >= 0 and p >= 0 and p // sbs < bt.shape[1]
        page = int(bt[b, p // sbs]) if ok else -1
        out.append(page * sbs + p % sbs if page >= 0 else -1)
    return out


def loop_indexer_lens(st):
    return [(int(p) + 1) // 4 if int(s) >= 0 and int(p) >= 0 else 0
            for p, s in zip(st.positions, st.slot_mapping)]


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("seed", range(24))
def test_composition_of_public_ops_equals_oracle_composition(seed):
    """Consistent batches (every page a valid token needs exists): the public ops, value checks on, and
    the oracle module compose the same sets; build() on CPU is that composition."""
    kind = KINDS[seed % 3]
    st = random_step(seed, kind, bad_pages=0.0, short=False, garbage=False)
    ratios = ratios_of(seed)
    a = fields(to_device(st, "cpu").build_from_ops(ratios), ratios)
    b = fields(to_device(st, "cpu").build_from_ops(ratios, impl=M), ratios)
    c = fields(to_device(st, "cpu").build(ratios), ratios)
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


@pytest.mark.parametrize("seed", range(30))
def test_composed_token_to_req_state_slots_and_indexer_lens_by_loops(seed):
    """The parts build_from_ops computes itself, against loops: token_to_req (-1 past the last request),
    state slots (-1 for padding, -1 pages, columns past the table, negative positions), indexer lens."""
    st = random_step(seed, KINDS[seed % 3]).build_from_ops((4, 128), impl=M)
    assert st.token_to_req.dtype == I32
    assert st.token_to_req.tolist() == loop_token_to_req(st.query_start_loc, st.num_tokens)
    assert st.is_valid_token.tolist() == (st.slot_mapping >= 0).tolist()
    for r in (4, 128):
        assert st.state_slots[r].tolist() == loop_state_slots(st, r), r
    assert st.indexer_lens.tolist() == loop_indexer_lens(st)


def test_step_with_tokens_past_the_last_request():
    """vLLM's padded token count: the tail tokens belong to no request and get -1 / 0 everywhere."""
    st = random_step(3, "decode", tail=4, invalid=0.0, bad_pages=0.0, short=False, garbage=False)
    st.build_from_ops((4, 128), impl=M)
    tail = slice(st.num_tokens - 4, None)
    assert (st.token_to_req[tail] == -1).all() and not st.is_valid_token[tail].any()
    for t in (st.swa_indices, st.c128_indices, st.compressed_slots[4], st.state_slots[128]):
        assert (t[tail] == -1).all()
    for t in (st.swa_lens, st.c128_lens, st.indexer_lens):
        assert (t[tail] == 0).all()


def _bad(st, **kw):
    for k, v in kw.items():
        setattr(st, k, v)
    return st


BAD_STEPS = {
    "ratios": (lambda st: st, (4, 64)),
    "query_start_loc": (lambda st: _bad(st, query_start_loc=st.query_start_loc[:-1]), (4,)),
    "seq_lens": (lambda st: _bad(st, seq_lens=st.seq_lens.long()), (4,)),
    "positions": (lambda st: _bad(st, positions=st.positions.int()), (4,)),
    "slot_mapping": (lambda st: _bad(st, slot_mapping=st.slot_mapping[:-1]), (4,)),
    "swa_block_table": (lambda st: _bad(st, swa_block_table=st.swa_block_table[:-1]), (4,)),
    "compressed_block_table": (lambda st: _bad(st, compressed_block_table=st.compressed_block_table.long()), (4,)),
    "state_block_table": (lambda st: _bad(st, state_block_table=st.state_block_table.t()), (128,)),
    "num_decode_tokens": (lambda st: _bad(st, num_decodes=2, num_decode_tokens=3), (4,)),
}


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
@pytest.mark.parametrize("how", ["build", "build_from_ops", "build_fused"])
def test_structural_errors_name_the_argument_and_write_nothing(name, how):
    make, ratios = BAD_STEPS[name]
    st = make(random_step(1, "mixed", num_decodes=2, num_prefills=2, pad_reqs=0, tail=1))
    sentinel = torch.full((3,), POISON)
    st.token_to_req = st.swa_lens = sentinel
    with pytest.raises(ValueError, match=name):
        getattr(st, how)(ratios)
    assert st.token_to_req is sentinel and st.swa_lens is sentinel and not st.compressed_slots


def huge_tables(st):
    """The step with its tables' pages moved near the int32 limits: SWA and state pages around 2**25 (block
    size 64 and 4/8: SWA slots past 2**31 in the int32 windows), compressed pages around 2**30 (C128's
    block size 2: its int32 indices pass 2**31 too; C4's int64 slots hold them)."""
    for name, base in (("swa_block_table", 2 ** 25 - 3), ("compressed_block_table", 2 ** 30 - 3),
                       ("state_block_table", 2 ** 25 - 3)):
        t = getattr(st, name)
        setattr(st, name, torch.where(t >= 0, t + base, t))
    return st


def test_slots_past_int32_are_minus_one_not_wrapped():
    """Pages whose slots pass 2**31 - 1: the int32 index sets (SWA windows, C128 indices) hold -1 there,
    never a wrapped (negative or other-page) id; the int64 slots hold the true slot."""
    st = huge_tables(random_step(5, "mixed", bad_pages=0.0, short=False, garbage=False, invalid=0.0))
    st.build_from_ops((4, 128))
    for t in (st.swa_indices, st.c128_indices):
        assert ((t >= 0) | (t == -1)).all()
    big = st.swa_block_table.max().long() * 64
    assert (st.swa_indices == -1).any() and big >= 2 ** 31
    assert int(st.compressed_slots[4].max()) >= 2 ** 31 or int(st.state_slots[4].max()) >= 2 ** 27


def test_empty_steps_on_cpu():
    for T, R in ((0, 0), (0, 2), (3, 0)):
        st = StepMetadata(torch.zeros(R + 1, dtype=I32), torch.zeros(R, dtype=I32), torch.zeros(T, dtype=I64),
                          torch.full((T,), -1, dtype=I64), *(torch.zeros(R, 2, dtype=I32),) * 3, num_decodes=0,
                          num_decode_tokens=0, max_model_len=64).build_from_ops((4, 128), impl=M)
        assert st.swa_indices.shape == (T, 128) and st.c128_indices.shape == (T, 128)
        assert st.token_to_req.tolist() == [-1] * T and (st.swa_indices == -1).all()


def test_window_sets_without_compressed_tables():
    """A step of the sliding-window cache alone (what an engine's SWA metadata builder has): no compressed or
    state table, the same window sets as with them; a compressed ratio then names the missing table."""
    import dataclasses
    for seed in range(4):
        st = random_step(seed)
        want = dataclasses.replace(st).build_from_ops((), impl=M)
        got = dataclasses.replace(st, compressed_block_table=None, state_block_table=None).build_from_ops((), impl=M)
        for f in ("token_to_req", "is_valid_token", "swa_indices", "swa_lens"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
        with pytest.raises(ValueError, match="compressed_block_table"):
            dataclasses.replace(st, compressed_block_table=None).build_from_ops((4,), impl=M)


# ------------------------------------------------------------------------------------------------ kernel
def kernel_cases():
    """(step, ratios): random steps of every kind and option, and the corner cases by name."""
    cases = []
    for seed in range(36):
        cases.append((random_step(seed, KINDS[seed % 3]), ratios_of(seed // 3)))
    cases.append((random_step(100, "decode", max_reqs=20, decode_q=1, tail=0, invalid=0.1), (4, 128)))
    cases.append((random_step(101, "prefill", max_prefix=40000, max_q=5, max_model_len=40000), (4, 128)))  # Kmax 384
    cases.append((random_step(102, "mixed", bad_pages=0.5, short=True), (4, 128)))
    cases.append((random_step(103, "mixed", garbage=True, tail=3), (4, 128)))
    cases.append((random_step(104, "mixed", window=5, max_q=12), (4, 128)))                          # W not 2^k
    cases.append((random_step(105, "prefill", max_reqs=1, pad_reqs=0, max_q=40, max_prefix=3), (4, 128)))
    cases.append((random_step(106, "mixed", max_reqs=70, max_q=3, max_prefix=50), (4, 128)))         # R > BLOCK_R
    cases.append((huge_tables(random_step(107, "mixed", bad_pages=0.1)), (4, 128)))                  # past int32
    for T, R in ((0, 0), (0, 2), (3, 0), (2, 3)):                                                    # empty batches
        cases.append((StepMetadata(torch.zeros(R + 1, dtype=I32), torch.zeros(R, dtype=I32),
                                   torch.arange(T, dtype=I64), torch.arange(T, dtype=I64),
                                   *(torch.zeros(R, 2, dtype=I32),) * 3, num_decodes=0, num_decode_tokens=0,
                                   max_model_len=64), (4, 128)))
    return cases


def interpreter_main():
    patch_interpreter_scalars()
    from dsv4_rocm.triton.metadata.step_index_sets import step_index_sets
    n = 0
    for st, ratios in kernel_cases():
        check_fused(st, ratios)
        n += 1
    # a second build of one shape writes the same buffers again (the graph path relies on it)
    st = random_step(7, "mixed")
    check_fused(st, (4, 128))
    keep = fields(st, (4, 128))
    st.build_fused((4, 128))
    assert all(keep[k] is v for k, v in fields(st, (4, 128)).items())
    # the sliding-window step alone (no compressed or state table), as an engine's SWA builder makes it
    st = random_step(11, "mixed")
    st.compressed_block_table = st.state_block_table = None
    check_fused(st, ())
    # every launch configuration the bench sweeps gives the same bytes
    for seed, cfg in enumerate([dict(BLOCK_T=1), dict(BLOCK_T=4, num_warps=1), dict(BLOCK_T=32, num_warps=8)]):
        st = random_step(200 + seed, KINDS[seed])

        def build(ratios, st=st, cfg=cfg):
            st._check(ratios)
            step_index_sets(st.query_start_loc, st.seq_lens, st.positions, st.slot_mapping, st.swa_block_table,
                            st.compressed_block_table, st.state_block_table, st.token_to_req, st.is_valid_token,
                            st.swa_indices, st.swa_lens, (st.compressed_slots[4], st.state_slots[4], st.indexer_lens),
                            (st.compressed_slots[128], st.state_slots[128], st.c128_indices, st.c128_lens), config=cfg)
        check_fused(st, (4, 128), build)
        n += 1
    print("interpreter steps equal to the composition:", n)


def test_kernel_under_interpreter():
    """The kernel's integer logic, run by TRITON_INTERPRET=1 (set before triton is imported, hence a
    subprocess), equals the composition over the oracle on every step of kernel_cases."""
    r = run_file_interpreted(__file__, timeout=900)
    assert r.returncode == 0 and "interpreter steps equal to the composition" in r.stdout


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_build_on_gpu_is_the_kernel_and_equals_the_composition(gpu):
    """build() on a GPU is one launch; it equals the oracle composition (CPU) and the public ops'
    composition on the GPU (their Triton kernels) on random steps, small and V4-sized."""
    assert ops.backend_for("compute_swa_indices_and_lens", gpu) == "triton"
    cases = [(to_device(st, gpu), r) for st, r in kernel_cases()]
    cases += [(random_step(300 + s, KINDS[s % 3], max_reqs=150, max_q=300, max_prefix=30000, device=gpu), (4, 128))
              for s in range(6)]
    cases.append((random_step(310, "decode", num_decodes=128, decode_q=1, max_prefix=8192, tail=0, invalid=0.05,
                              device=gpu), (4,)))
    cases.append((random_step(311, "prefill", max_reqs=2, max_q=2048, max_prefix=100, max_model_len=262144,
                              device=gpu), (4, 128)))                                             # Kmax 2048
    calls = []
    from dsv4_rocm import step as step_module
    real = step_module.StepMetadata.build_fused

    def counted(self, ratios=(4, 128)):
        calls.append(1)
        return real(self, ratios)
    for st, ratios in cases:
        st.build_fused = counted.__get__(st)
        check_fused(st, ratios, st.build)
        pub = fields(to_device(st, gpu).build_from_ops(ratios), ratios)
        for k, v in fields(st, ratios).items():
            assert torch.equal(v, pub[k]), k
    assert len(calls) == len(cases)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_build_in_a_cuda_graph_replays_new_steps(gpu):
    """A b=128 decode step (V4 sizes, both ratios) captured once on fixed buffers and replayed on new
    steps (new lengths, padding, -1 pages): every field equals the composition each time."""
    B = 128
    kw = dict(num_decodes=B, decode_q=1, tail=0, pad_reqs=0, max_prefix=8192, max_model_len=8193)
    fixed = to_device(random_step(0, "decode", **kw), gpu)
    fixed.build((4, 128))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fixed.build((4, 128))
    for s in range(1, 4):
        new = random_step(1000 + s, "decode", **kw, bad_pages=0.1)
        for k in INPUTS:
            src = getattr(new, k)
            dst = getattr(fixed, k)
            if src.shape != dst.shape:                       # tables: the capture's column count
                src = torch.nn.functional.pad(src, (0, dst.shape[1] - src.shape[1]), value=-1)[:, :dst.shape[1]]
            dst.copy_(src)
        graph.replay()
        want = fields(to_device(fixed, "cpu").build_from_ops((4, 128), impl=M), (4, 128))
        for k, v in fields(fixed, (4, 128)).items():
            assert torch.equal(v.cpu(), want[k]), (s, k)


if __name__ == "__main__":
    interpreter_main()
