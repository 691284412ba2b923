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

SKIPS = {
    "tests/attention/test_sparse_mla.py::test_ws_hand_offs_hold_under_random_stalls": {"*": _STRESS},
    "tests/attention/test_sparse_mla.py::test_ws_prefill_hand_offs_hold_under_random_stalls": {"*": _STRESS},
}

GRAPH_CAPTURE = ("CUDA graph capture needs torch's caching allocator, which the sanitizer pass turns off "
                 "(PYTORCH_NO_CUDA_MEMORY_CACHING=1: a cudaMalloc inside a capture is refused)")


def reason(nodeid: str, tool: str):
    """Why ``nodeid`` (with or without its parameter set) does not run under ``tool``; None if it does."""
    base = nodeid.split("[")[0]
    entry = SKIPS.get(base, {})
    return entry.get(tool) or entry.get("*")
