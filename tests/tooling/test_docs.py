"""The docs stay true: every python snippet of docs/integration.md and README.md runs as written (CPU, small
shapes), every link to a docs page and section resolves, code cites only files inside the repository, and
the README's install commands install what the package needs."""
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def python_blocks(text):
    """The fenced ```python blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def run_blocks(path, shared):
    """Run the python blocks of ``path``: in one namespace, in order (``shared``), or each on its own."""
    blocks = python_blocks(read(path))
    assert blocks, f"{path} has no python snippet"
    ns = {"__name__": "docs_snippet"}
    for i, code in enumerate(blocks):
        if not shared:
            ns = {"__name__": "docs_snippet"}
        exec(compile(code, f"{path}, python block {i + 1}", "exec"), ns)
    return len(blocks)


@pytest.fixture
def reference_backend():
    """The snippets' tensors are on the CPU, which runs the reference on every machine; keep a forced
    backend from the environment out of it."""
    from dsv4_rocm import ops
    with ops.use_backend("reference"):
        yield


def test_integration_guide_snippets_run(reference_backend):
    torch.manual_seed(0)
    assert run_blocks("docs/integration.md", shared=True) >= 8


def test_readme_snippets_run(reference_backend):
    assert run_blocks("README.md", shared=False) >= 1


# ---- links and citations -------------------------------------------------------------------------------
def slug(heading):
    """GitHub's anchor of a markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page):
    text = read("docs", page) if not page.endswith("README.md") else read(page)
    explicit = set(re.findall(r'<a id="([^"]+)"></a>', text))
    headings = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return explicit | headings


def source_files():
    """Every text file the project ships or runs (code, tests, CI, GPU tools, docs)."""
    out = [os.path.join(ROOT, f) for f in ("README.md", "BENCHMARKS.md", "setup.py", "pyproject.toml")]
    for top in ("dsv4_rocm", "hip_kernels", "build_tools", "tests", "ci", "gpu", "docs", ".ci"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(d, f) for f in files
                    if f.endswith((".py", ".md", ".h", ".hip", ".cpp", ".sh", ".cu")) or f == "run"]
    return [f for f in out if os.path.isfile(f)]


def test_docs_references_in_code_resolve():
    """A comment citing docs/<page>.md#<section> names a page that exists and a section it has."""
    cited = 0
    for path in source_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for page, anchor in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", text):
            cited += 1
            rel = os.path.relpath(path, ROOT)
            assert os.path.isfile(os.path.join(DOCS, page)), f"{rel} cites docs/{page}, which does not exist"
            if anchor:
                assert anchor in anchors(page), f"{rel} cites docs/{page}#{anchor}: no such section"
    assert cited > 20


def test_markdown_links_resolve():
    """Relative links between the docs pages (and from the README) reach a file and, with #, a section."""
    pages = [os.path.join("docs", p) for p in sorted(os.listdir(DOCS)) if p.endswith(".md")] + ["README.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            assert os.path.isfile(os.path.join(ROOT, path)), f"{page}: link to {target}: no file {path}"
            if anchor and path.endswith(".md"):
                where = path if path == "README.md" else os.path.basename(path)
                assert anchor in anchors(where), f"{page}: link to {target}: no such section"


FOREIGN = [re.escape(n) for n in ("DSV4" + "_SPEC", "PORTABILITY" + ".md", "PORTABILITY" + " §", "DESIGN" + ".md",
                                   "PERF" + "_NOTES", "VLLM" + "_CONTRACT", "/work/" + "shared")] + ["\u00a7"]


def test_code_cites_only_files_inside_the_repository():
    """No comment or doc points at a file that does not ship with the project (section signs included:
    they cite numbered sections of documents outside it)."""
    pattern = re.compile("|".join(FOREIGN))
    bad = []
    for path in source_files():
        if os.path.samefile(path, __file__):
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


# ---- the README's commands -------------------------------------------------------------------------
def test_install_commands_install_the_dependencies():
    """The README's commands and the scripts they run install the package with its dependencies (numpy
    among them): a `--no-deps` install left numpy out, and the tests and `parity --report` failed. The one
    exception is the GPU install (`--no-build-isolation`, into an environment that holds the GPU torch)."""
    for path in ("README.md", "ci/setup.sh", "ci/test.sh", "ci/run.sh", ".ci/run"):
        for line in read(path).splitlines():
            if "pip install" in line and "--no-deps" in line:
                assert "--no-build-isolation" in line, (path, line)
    deps = re.search(r"^dependencies = \[(.*?)\]", read("pyproject.toml"), re.M | re.S).group(1)
    names = {re.split(r"[<>=!~ ]", d.strip().strip('"'))[0] for d in deps.split(",") if d.strip()}
    assert {"torch", "triton", "numpy"} <= names
    setup = read("ci/setup.sh")
    assert re.search(r"pip install .*-e \"?\.", setup), "ci/setup.sh must install this package (editable)"


@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="checks the install-time message of a CPU torch (a GPU torch builds the extension)")
def test_install_says_why_the_hip_extension_is_skipped():
    """With a CPU torch the build compiles no extension and says so in one line, with the reason."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "HIP extension" in line]
    assert lines == [f"dsv4_rocm: HIP extension dsv4_rocm._C skipped: torch {torch.__version__} is a CPU build; "
                     "the reference and Triton backends need none (python -m dsv4_rocm info)"]


def test_skip_reason_without_torch(monkeypatch):
    """pip's isolated build environment has no torch: the reason says how to build the extension."""
    import sys
    from build_tools import extension
    monkeypatch.setitem(sys.modules, "torch", None)
    assert "no torch in the build environment" in extension.skip_reason()
    assert "--no-build-isolation" in extension.skip_reason()
