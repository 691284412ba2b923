"""The GPU tests that do not run under a compute-sanitizer tool (gpu/sanitize.sh), by name, with the reason.

Keys are test node ids without the parameter set (``file::function``); values map a tool (``memcheck``,
``racecheck``, ``initcheck``, or ``*`` for every tool) to the reason. ``pytest --sanitizer TOOL`` skips each
listed test with its reason. Separately, under ``--sanitizer`` any CUDA graph capture skips the test that
attempts it (tests/conftest.py): the pass runs with torch's caching allocator off, and a capture needs it
(an allocation inside a capture is a cudaMalloc, which a capturing stream refuses).
"""

_STRESS = ("a timing stress test (dozens of launches with pauses at the hand-offs): a tool serializes and slows "
           "the kernel, so the pauses test nothing there; the same kernel's accesses run under every tool in "
           "test_ws_decode_v41_528_matches_reference and test_flash_mla_api.py")

_LONG_RACECHECK = ("contexts of 32K tokens and more through the Hopper decode kernel: racecheck's reports on its "
                   "named-barrier hand-offs (ordered by the mbarrier protocol, see sparse_mla_decode_ws.py and "
                   "gpu/racecheck_control.py) grow with the tiles and kept one case past ten minutes; the kernel's "
                   "shared-memory accesses repeat per 64-key tile whatever the context, and run under racecheck in "
                   "test_sparse_mla.py, test_graph.py and test_step_validation.py")
_DRIFT = ("1024 decode steps of a 64K-token C4 layer: the launches of test_long_context_on_gpu (run under memcheck "
          "and initcheck, no finding) a thousand times over; under a tool it outlasts a ten-minute call")

SKIPS = {
    "tests/attention/test_sparse_mla.py::test_ws_hand_offs_hold_under_random_stalls": {"*": _STRESS},
    "tests/attention/test_sparse_mla.py::test_ws_prefill_hand_offs_hold_under_random_stalls": {"*": _STRESS},
    "tests/layer/test_long_context.py::test_long_context_on_gpu": {"racecheck": _LONG_RACECHECK},
    "tests/layer/test_long_context.py::test_needle_on_gpu": {"racecheck": _LONG_RACECHECK},
    "tests/layer/test_long_context.py::test_drift_on_gpu": {"*": _DRIFT},
}

GRAPH_CAPTURE = ("CUDA graph capture needs torch's caching allocator, which the sanitizer pass turns off "
                 "(PYTORCH_NO_CUDA_MEMORY_CACHING=1: a cudaMalloc inside a capture is refused)")


def reason(nodeid: str, tool: str):
    """Why ``nodeid`` (with or without its parameter set) does not run under ``tool``; None if it does."""
    base = nodeid.split("[")[0]
    entry = SKIPS.get(base, {})
    return entry.get(tool) or entry.get("*")
