"""The step's per-token index sets in one kernel (dsv4_rocm/triton/step_index_sets.py) against the torch path
(``step.index_sets_torch``): token -> request, validity, state slots of both ratios, the masked compressed
slots and the indexer lengths, exactly, on mixed decode / prefill batches with padding tokens; under the
Triton interpreter on CPU, and on a GPU through StepMetadata.build."""
import textwrap

import pytest
import torch

from helpers import run_interpreted


def batch(seed, device="cpu"):
    """(query_start_loc, seq_lens, positions, slot_mapping, state_block_table, compressed_block_table): a
    decode-first batch of mixed query lengths; a quarter of the tokens are padding (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 9, (), generator=g))
    qlen = torch.where(torch.rand(R, generator=g) < 0.5, torch.ones(R, dtype=torch.long),
                       torch.randint(1, 40, (R,), generator=g))
    prefix = torch.randint(0, 300, (R,), generator=g)
    seq = prefix + qlen
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)])
    pos = torch.cat([torch.arange(int(p), int(s)) for p, s in zip(prefix, seq)])
    T = pos.shape[0]
    slots = torch.randint(0, 10 ** 6, (T,), generator=g)
    slots[torch.rand(T, generator=g) < 0.25] = -1
    sbt = torch.randint(0, 5000, (R, 400 // 4 + 2), generator=g).to(torch.int32)
    cbt = torch.randint(0, 5000, (R, 8), generator=g).to(torch.int32)
    return tuple(t.to(device) for t in (qsl.to(torch.int32), seq.to(torch.int32), pos, slots, sbt, cbt))


_INTERPRETED = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()
    from test_step_index_sets import batch
    from dsv4_rocm import layout as L
    from dsv4_rocm.reference import metadata as rm
    from dsv4_rocm.step import index_sets_torch
    from dsv4_rocm.triton.step_index_sets import step_index_sets

    for seed in range(12):
        qsl, seq, pos, slots, sbt, cbt = batch(seed)
        for ratios in ((4, 128), (4,), (128,), ()):
            comp = {r: rm.get_compressed_slot_mapping(pos.shape[0], qsl, seq, cbt, L.compressed_block_size(r), r)
                    for r in ratios}
            a = {r: c.clone() for r, c in comp.items()}
            b = {r: c.clone() for r, c in comp.items()}
            ref = index_sets_torch(qsl, pos, slots, sbt, a)
            got = step_index_sets(qsl, pos, slots, sbt, b)
            same = all(torch.equal(x, y) for x, y in zip(ref[:2], got[:2]))
            same &= ref[2].keys() == got[2].keys() and all(torch.equal(ref[2][r], got[2][r]) for r in ratios)
            same &= (ref[3] is None and got[3] is None) or torch.equal(ref[3], got[3])
            same &= all(torch.equal(a[r], b[r]) for r in ratios)
            masked = all(bool((b[r][slots < 0] == -1).all()) for r in ratios)
            print(seed, ratios, int(same), int(masked))
""")


def test_kernel_equals_the_torch_path_under_the_interpreter(tmp_path):
    r = run_interpreted(_INTERPRETED, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = r.stdout.strip().splitlines()
    print("\n".join(rows))
    assert len(rows) == 48 and all(line.endswith(" 1 1") for line in rows)


@pytest.mark.gpu
def test_gpu_build_equals_the_cpu_build(gpu):
    """StepMetadata.build on the GPU (the kernel) and on the CPU (torch): every shared index set equal."""
    from dsv4_rocm.step import StepMetadata
    for seed in range(6):
        steps = []
        for dev in ("cpu", gpu):
            qsl, seq, pos, slots, sbt, cbt = batch(seed, dev)
            R = qsl.shape[0] - 1
            swa_bt = torch.arange(R * 8, dtype=torch.int32, device=dev).view(R, 8)
            st = StepMetadata(qsl, seq, pos, slots, swa_bt, cbt, sbt, num_decodes=0, num_decode_tokens=0,
                              max_model_len=400)
            steps.append(st.build((4, 128)))
        a, b = steps
        for name in ("token_to_req", "is_valid_token", "indexer_lens", "swa_indices", "swa_lens"):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), (seed, name)
        for r in (4, 128):
            assert torch.equal(a.state_slots[r], b.state_slots[r].cpu()), (seed, r)
            assert torch.equal(a.compressed_slots[r], b.compressed_slots[r].cpu()), (seed, r)
