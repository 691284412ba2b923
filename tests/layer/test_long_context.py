"""dsv4_rocm.long_context: the long-context check, the C4 needle and decode drift, at short contexts on the CPU
(the reference backend), and the same code at 32K-128K on a GPU (marked gpu). The tests of the tests plant
an off-by-one in the index path (a global index shifted by one entry, read from the next page, a dropped
index, a local top-k shifted by one, a C128 index shifted) and require the checks to fail."""
import pytest
import torch

from dsv4_rocm import long_context as LC
from dsv4_rocm import ops
from dsv4_rocm.config import get_config

TINY, TINY41 = get_config("tiny"), get_config("tiny-v4.1")


def _all_ok(res, device="cpu"):
    rows = [r for label, checks in res.items() for r in LC.summarize(label, 0, "-", checks, device)]
    return rows, all(r["ok"] for r in rows)


@pytest.mark.parametrize("kind", LC.V40_KINDS)
def test_every_v40_kind_at_every_position_class(kind):
    res, _ = LC.check_context(TINY, kind, 300, "cpu", decode_steps=6, chunk=128)
    rows, ok = _all_ok(res)
    assert ok, LC.format_table(rows)
    checks = res[kind]
    classes = {c for r in checks for c in r.classes}
    assert {"window edge", "block edge", "page wrap", "last prompt token", "decode", "last token"} <= classes
    want = {"q", "swa", "attn", "out"} | ({"comp"} if kind != "swa" else set()) | \
        ({"index-k", "top-k"} if kind == "c4a" else set())
    assert {r["check"] for r in rows} == want


@pytest.mark.parametrize("record", LC.V41_RECORDS)
def test_v41_kinds_over_every_record(record):
    res, _ = LC.check_context(TINY41, "stack", 264, "cpu", record, decode_steps=4, chunk=264, layers=(0, 1, 3, 5))
    rows, ok = _all_ok(res)
    assert ok, LC.format_table(rows)
    assert {r["check"] for r in rows if r["kind"].startswith("5 ")} >= {"top-k", "index-k", "attn"}


def test_fill_caches_leave_the_caches_of_forward():
    """The prefix written by fill_caches is byte for byte what forward writes (V4.0 C4 and a V4.1 stack)."""
    for cfg, kind, layers in ((TINY, "c4a", None), (TINY41, "stack", (0, 1, 3, 5))):
        x = LC.hidden_states(140, cfg.hidden_size, "cpu", 3)
        a = LC._server(cfg, kind, 141, "cpu", None, 0, layers)
        b = LC._server(cfg, kind, 141, "cpu", None, 0, layers)
        for lo, hi in ((0, 70), (70, 133), (133, 140)):
            LC._step_fill(a, x[lo:hi], LC._modules(a))
            LC._forward(b, x[lo:hi])
        for ma, mb in zip(LC._modules(a), LC._modules(b)):
            for name in ("swa", "comp", "idx", "comp_state", "idx_state", "ring"):
                ta, tb = getattr(ma.cache, name, None), getattr(mb.cache, name, None)
                if ta is not None:
                    assert torch.equal(ta.view(torch.uint8) if ta.dtype != torch.uint8 else ta,
                                       tb.view(torch.uint8) if tb.dtype != torch.uint8 else tb), (kind, name)


def test_needle_found_in_every_position_class():
    res = LC.needle(TINY, 700, "cpu", chunk=256)
    assert [r["cls"] for r in res] == list(LC.NEEDLE_CLASSES)
    assert all(r["ok"] for r in res), LC.format_needles(res)


def _shift_global(monkeypatch, delta):
    orig = ops.compute_global_topk_indices_and_lens

    def shifted(*a, **k):
        idx, lens = orig(*a, **k)
        cap = 64 * (int(idx.max()) // 64 + 2)
        return torch.where(idx >= 0, (idx + delta) % cap, idx), lens
    monkeypatch.setattr(ops, "compute_global_topk_indices_and_lens", shifted)


def _shift_local_topk(monkeypatch):
    for name in ("top_k_per_row_decode", "top_k_per_row_prefill"):
        orig = getattr(ops, name)

        def shifted(logits, *a, _orig=orig, **k):
            _orig(logits, *a, **k)
            out = a[2] if name == "top_k_per_row_decode" else a[2]
            out.copy_(torch.where(out >= 0, out + 1, out))
        monkeypatch.setattr(ops, name, shifted)


@pytest.mark.parametrize("bug", ["global index + 1 entry", "next page", "local top-k + 1"])
def test_needle_fails_on_a_planted_index_bug(bug, monkeypatch):
    if bug == "global index + 1 entry":
        _shift_global(monkeypatch, 1)
    elif bug == "next page":
        _shift_global(monkeypatch, 64)
    else:
        _shift_local_topk(monkeypatch)
    res = LC.needle(TINY, 700, "cpu", classes=("compressed cache", "newest entry"), chunk=256)
    assert not any(r["ok"] for r in res), LC.format_needles(res)


@pytest.mark.parametrize("bug", ["dropped index", "global index + 1 entry", "c128 index + 1"])
# (a C128 index swapped with the other entry of its page would go unseen: a row attends every visible entry,
# and the set is the same; a shift reads an unwritten entry and loses the first)
def test_long_check_fails_on_a_planted_index_bug(bug, monkeypatch):
    kind = "c128a" if bug.startswith("c128") else "c4a"
    if bug == "dropped index":
        orig = ops.compute_global_topk_indices_and_lens

        def dropped(*a, **k):
            idx, lens = orig(*a, **k)
            return idx, (lens - 1).clamp_min(0)
        monkeypatch.setattr(ops, "compute_global_topk_indices_and_lens", dropped)
    elif bug == "global index + 1 entry":
        _shift_global(monkeypatch, 1)
    else:
        orig = ops.build_c128a_topk_metadata

        def shifted(positions, ratio, nd, t2r, bt, bs, slots, out_idx, out_lens, *a, **k):
            orig(positions, ratio, nd, t2r, bt, bs, slots, out_idx, out_lens, *a, **k)
            out_idx.copy_(torch.where(out_idx >= 0, out_idx + 1, out_idx))
        monkeypatch.setattr(ops, "build_c128a_topk_metadata", shifted)
    res, _ = LC.check_context(TINY, kind, 300, "cpu", decode_steps=4, chunk=128)
    rows, ok = _all_ok(res)
    assert not ok, LC.format_table(rows)


def test_short_decode_drift():
    r = LC.drift(TINY, "c4a", 150, 24, "cpu", every=8, chunk=150)
    assert r["checked"] >= 6 and r["ok"], LC.format_drift([r])


# ---- the same code at long contexts on a GPU --------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("length", [32768, 131072])
@pytest.mark.parametrize("kind", LC.V40_KINDS)
def test_long_context_on_gpu(kind, length, gpu):
    res, _ = LC.check_context(get_config("v4-flash"), kind, length, gpu)
    rows, ok = _all_ok(res, gpu)
    assert ok, LC.format_table(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [65536, 131072])
def test_needle_on_gpu(length, gpu):
    res = LC.needle(get_config("v4-flash"), length, gpu)
    assert all(r["ok"] for r in res), LC.format_needles(res)


@pytest.mark.gpu
def test_drift_on_gpu(gpu):
    r = LC.drift(get_config("v4-flash"), "c4a", 65536, 1024, gpu)
    assert r["ok"], LC.format_drift([r])


def test_main_job_long_preset_prints_and_writes_the_table(tmp_path, capsys):
    from dsv4_rocm.__main__ import main
    rc = main(["run", "--device", "cpu", "--config", "tiny", "--long", "--layers", "c4a", "--long-lengths", "300",
               "--long-decode-steps", "4", "--long-needle-lengths", "", "--long-drift-length", "150",
               "--long-drift-steps", "8", "--long-v41-records", "none", "--long-out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    tail = out.strip().splitlines()
    assert tail[-1].startswith("long-context check: ok")
    table = [ln.split() for ln in tail if ln.startswith("c4a [reference]")]
    assert {t[4] for t in table if len(t) == 9} == {"q", "swa", "comp", "index-k", "top-k", "attn", "out"}
    assert [t[-1] for t in table if len(t) == 8] == ["ok"]          # the summary line
    assert (tmp_path / "long_context.txt").read_text().rstrip().endswith(tail[-1])
    assert main(["run", "--device", "cpu", "--long", "--long-v41-records", "V41_999"]) == 2


def test_decode_vs_context_bench_case_runs_on_cpu():
    from dsv4_rocm.bench import decode_context as D
    srv, x = D.filled_server(TINY, "c4a", 300, "cpu", chunk=128)
    assert srv.done[0] == 300 and D.decode_ms(srv, x, "cpu") > 0
    assert D.step_bytes("c4a", 131072) > D.step_bytes("c4a", 4096) > D.step_bytes("swa", 4096)
