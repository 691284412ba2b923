"""dsv4_rocm/triton/_compat.py: the entry a per-Triton table gives each version, and the Gluon names that
differ between Tritons resolving on this one."""
import pytest
import triton

from dsv4_rocm.triton import _compat
from dsv4_rocm.triton._compat import TRITON_VERSION, by_triton


def test_version_is_the_running_tritons():
    assert ".".join(map(str, TRITON_VERSION)) == ".".join(triton.__version__.split(".")[:2])


def test_by_triton_takes_the_newest_entry_not_newer_than_the_version():
    table = {(3, 6): "a", (3, 8): "b", (4, 0): "c"}
    assert [by_triton(table, v) for v in [(3, 5), (3, 6), (3, 7), (3, 8), (3, 9), (3, 12), (4, 0), (4, 1)]] == \
        ["a", "a", "a", "b", "b", "b", "c", "c"]
    assert by_triton({(3, 6): 1}) == 1


def test_gluon_barrier_is_the_cta_barrier_of_this_triton():
    gl = pytest.importorskip("triton.experimental.gluon.language")
    expected = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    assert _compat.thread_barrier is expected
    assert TRITON_VERSION < (3, 8) or not hasattr(gl, "thread_barrier")


def test_tables_keep_tritons_36_choices():
    """The Triton 3.6 configurations (the GPU-measured ones) are what the tables give 3.6 and 3.7."""
    from dsv4_rocm.triton.attention import sparse_mla_decode as d
    from dsv4_rocm.triton.indexer import top_k_per_row as t
    for v in [(3, 6), (3, 7)]:
        assert by_triton(d._NEWER_TRITON_TILES, v) == {}
        assert by_triton(d._SPLIT_SGPR_SPILLS, v) == "" and by_triton(d._SM100_SPILLS, v) == ""
    assert by_triton(d._NEWER_TRITON_TILES, (3, 8))["sm_90"] == dict(BLOCK_N=32)
    assert set(by_triton(d._SPLIT_SGPR_SPILLS, (3, 9))) == {"gfx942"}
    assert set(by_triton(d._SM100_SPILLS, (3, 8))) == {"sm_100a"}            # sm_90a's 32-key tile is clean there
    assert set(by_triton(d._SM100_SPILLS, (3, 9))) == {"sm_100a", "sm_90a"}
    if TRITON_VERSION < (3, 8):
        assert t._options("sm_90", 16) == dict(num_warps=16)
        assert d.default_config("sm_90", 64, "triton")["BLOCK_N"] == 64
    else:
        assert t._options("sm_90", 16) == dict(num_warps=16, maxnreg=128)


def test_hopper_gluon_kernel_is_offered_where_it_compiles():
    """3.6 to 3.8 compile the warp-specialized kernel (compile matrix); 3.9 does not, and Hopper then runs the
    Triton kernels, which the compile matrix then checks alone."""
    from dsv4_rocm.triton.attention import sparse_mla_decode as d, sparse_mla_prefill as p
    from dsv4_rocm.triton.hopper import sparse_mla_decode_ws as ws
    assert _compat.GLUON_WS == (TRITON_VERSION < (3, 9))
    if not _compat.GLUON_WS:
        assert d._ws is None and p._ws is None and ws.COMPILE_SPECS == []
        assert d.default_kernel("sm_90") == "triton"
        with pytest.raises(ValueError, match="GLUON_WS"):
            d.default_config("sm_90", 64, "ws")
    else:
        assert d._ws is not None and len(ws.COMPILE_SPECS) == 5
