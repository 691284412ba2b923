import os
import shutil
import tempfile

import pytest
import torch

# The compile-matrix tests read rows that another process compiles while the rest of the suite runs
# (build_tools/compile_matrix.py, Background): it starts when they are collected and they run last, so on
# a two-core machine the compilers take the core the suite leaves idle instead of the suite's time. Under
# pytest-xdist the controller, which collects nothing, starts it before its workers and hands them its
# directory in DSV4_COMPILE_MATRIX_DIR; a run started by anything else is attached to the same way.
COMPILE_TESTS = ("test_compile_matrix.py", "test_hip_compile.py")
COMPILE_TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tooling")
MATRIX_DIR_VAR = "DSV4_COMPILE_MATRIX_DIR"
_MATRIX = pytest.StashKey()


def _is_compile_test(item):
    return os.path.basename(str(item.fspath)) in COMPILE_TESTS and hasattr(item, "callspec")


def _may_run_compile_tests(config):
    """Whether the paths pytest was given hold a compile test (before collection: -k may still drop them)."""
    for arg in config.args:
        path = os.path.abspath(str(arg).split("::")[0])
        if (os.path.isdir(path) and (COMPILE_TESTS_DIR + os.sep).startswith(path.rstrip(os.sep) + os.sep)) or \
                os.path.basename(path) in COMPILE_TESTS:
            return True
    return False


def pytest_addoption(parser):
    parser.addoption("--one-case", action="store_true",
                     help="run each test function once, with its first parameter set (the compute-sanitizer pass "
                          "of gpu/sanitize.sh: every test, at the cost of one case)")
    parser.addoption("--part", default=None, metavar="I/N",
                     help="keep the I-th of N interleaved parts of the selected tests (0 <= I < N): the sanitizer "
                          "pass splits its longest files this way")
    parser.addoption("--sanitizer", default=None, choices=("memcheck", "racecheck", "initcheck"),
                     help="the tests run under this compute-sanitizer tool (gpu/sanitize.sh): those listed in "
                          "tests/sanitizer_skips.py for it skip with their reason, and so does any test that "
                          "attempts a CUDA graph capture")


def _first_case_each(config, items):
    keep, drop, seen = [], [], set()
    for item in items:
        key = (str(item.fspath), getattr(item, "originalname", item.name))
        (drop if key in seen else keep).append(item)
        seen.add(key)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_configure(config):
    xdist_controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if xdist_controller and MATRIX_DIR_VAR not in os.environ and _may_run_compile_tests(config):
        from build_tools import compile_matrix as cm
        bg = cm.Background.start(tempfile.mkdtemp(prefix="dsv4_matrix_"), jobs=os.cpu_count() or 1)
        config.stash[_MATRIX] = bg
        os.environ[MATRIX_DIR_VAR] = bg.out_dir


@pytest.hookimpl(trylast=True)          # after -k / -m deselection: start only what the selected tests read
def pytest_collection_modifyitems(config, items):
    if config.getoption("--one-case"):
        _first_case_each(config, items)
    part = config.getoption("--part")
    if part:
        i, n = (int(x) for x in part.split("/"))
        drop = [item for j, item in enumerate(items) if j % n != i]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for j, item in enumerate(items) if j % n == i]
    tool = config.getoption("--sanitizer")
    if tool:
        import sanitizer_skips
        for item in items:
            why = sanitizer_skips.reason(item.nodeid, tool)
            if why:
                item.add_marker(pytest.mark.skip(reason=f"not under {tool}: {why}"))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a GPU (run with -m gpu on a GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    compile_items = [i for i in items if _is_compile_test(i)]
    if not compile_items:
        return
    items[:] = [i for i in items if not _is_compile_test(i)] + compile_items
    if MATRIX_DIR_VAR in os.environ:
        from build_tools import compile_matrix as cm
        config.stash[_MATRIX] = cm.Background.attach(os.environ[MATRIX_DIR_VAR])
    else:
        _start_matrix(config, compile_items)


def _start_matrix(config, compile_items):
    """The run of what the selected compile tests read, a job per CPU the suite leaves free."""
    from build_tools import compile_matrix as cm
    pairs = {(i.callspec.params.get("kernel") or i.callspec.params["source"], i.callspec.params["target"])
             for i in compile_items}
    names = sorted({n for n, _ in pairs})
    every = {k.name for k in cm.triton_kernels()} | set(cm.hip_sources())
    config.stash[_MATRIX] = cm.Background.start(
        tempfile.mkdtemp(prefix="dsv4_matrix_"), names=None if every <= set(names) else names,
        targets=sorted({t for _, t in pairs}), jobs=max(1, (os.cpu_count() or 1) - 1),
        triton=any(not n.endswith(".hip") for n in names), hip=any(n.endswith(".hip") for n in names))


@pytest.fixture(scope="session")
def compile_matrix(request):
    """The background compile-matrix run (``build_tools.compile_matrix.Background``) the compile tests read."""
    bg = request.config.stash.get(_MATRIX, None)
    if bg is None:
        pytest.fail("the compile matrix was not started at collection (tests/conftest.py)")
    return bg


def pytest_terminal_summary(terminalreporter, config):
    bg = config.stash.get(_MATRIX, None)
    if bg is None:
        return
    done = bg.done()
    cpu = sum(r["cpu_s"] for r in done)
    rows = [r for res in done for r in res["rows"] if "cpu_s" in r]
    costly = sorted(rows, key=lambda r: -r["cpu_s"])[:5]
    per_task = ", ".join("%s %.0f" % (r["task"], r["cpu_s"]) for r in done)
    top = ", ".join("%s %s %.1f" % (r["kernel"], r["target"], r["cpu_s"]) for r in costly)
    # under pytest-xdist the tests (and their waiting) ran in the workers
    waited = "" if getattr(config.option, "numprocesses", None) else f"; the tests waited {bg.waited:.0f} s for it"
    terminalreporter.write_line(
        f"compile matrix: {len(done)}/{len(bg.tasks)} tasks compiled in the background, {cpu:.0f} CPU s "
        f"({per_task}){waited}; costliest compiles (CPU s): {top}")


def pytest_unconfigure(config):
    bg = config.stash.get(_MATRIX, None)
    if bg is not None and bg.proc is not None:          # the process that started the run ends it
        bg.stop()
        shutil.rmtree(bg.out_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_graph_capture_under_sanitizer(request, monkeypatch):
    """Under --sanitizer a CUDA graph capture, wherever it starts (torch.cuda.graph, make_graphed_callables,
    a library's own capture), skips the test: every capture goes through CUDAGraph.capture_begin."""
    if not request.config.getoption("--sanitizer"):
        return
    import sanitizer_skips

    def refuse(*args, **kwargs):
        # torch.cuda.graph made its side stream current before capture_begin: back to the default stream
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())
        pytest.skip(sanitizer_skips.GRAPH_CAPTURE)
    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_begin", refuse)


@pytest.fixture
def gpu():
    return torch.device("cuda")
