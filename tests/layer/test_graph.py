"""A decode step captured into a CUDA graph (dsv4_rocm.graph) replays exactly as the eager step runs."""
import pytest
import torch

from dsv4_rocm.config import LayerType, tiny_config
from dsv4_rocm.serving import SyntheticServer

CFG = tiny_config()


def test_graph_needs_a_gpu():
    from dsv4_rocm.graph import DecodeGraph
    s = SyntheticServer(CFG, LayerType.SWA, 1, 64)
    with pytest.raises(ValueError, match="needs a GPU"):
        DecodeGraph([s.layer], 1, 1, 1, 1, 1, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("lt", list(LayerType))
def test_decode_graph_replays_like_eager_steps(lt, gpu):
    """Two servers with the same weights prefill the same prompts; then one decodes eagerly and the other
    through one captured graph. Outputs and every cache byte must be identical after each step."""
    from dsv4_rocm.graph import DecodeGraph
    B, max_len, prompts = 6, 512, [130, 7, 300, 64, 1, 257]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(max_len, CFG.hidden_size, generator=g).bfloat16().to(gpu) for _ in range(B)]
    eager, graphed = (SyntheticServer(CFG, lt, B, max_len, device=str(gpu)) for _ in range(2))
    for s in (eager, graphed):
        s.step({b: xs[b][:prompts[b]] for b in range(B)})
    dg = DecodeGraph([graphed.layer], B, 1, graphed.swa_bt.shape[1], graphed.comp_bt.shape[1],
                     graphed.state_bt.shape[1], max_len, ratios=graphed.ratios())
    for k in range(5):
        tok = {b: xs[b][prompts[b] + k:prompts[b] + k + 1] for b in range(B)}
        want = eager.step(tok)
        st = graphed.make_step({b: 1 for b in range(B)})
        x = torch.cat([tok[b] for b in st.order])
        y = dg.replay(x, st.positions, st.query_start_loc, st.seq_lens, st.slot_mapping, st.swa_block_table,
                      st.compressed_block_table, st.state_block_table)[0]
        for b in range(B):
            graphed.done[b] += 1
        got = torch.cat([want[b] for b in st.order])
        assert torch.equal(y, got), f"step {k}: graph replay output differs from the eager step"
        for name in ("swa", "comp", "idx", "comp_state", "idx_state"):
            a, c = getattr(eager.cache, name), getattr(graphed.cache, name)
            assert (a is None and c is None) or torch.equal(a, c), f"step {k}: {name} differs"
