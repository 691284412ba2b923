"""The reference reproduces the golden vectors (tests/golden, made by `python -m dsv4_rocm parity
--write-golden`): bytes and integers exactly, floats within each case's tolerance."""
import json

import pytest

from dsv4_rocm import parity


@pytest.mark.parametrize("name", sorted(parity.CASES))
def test_golden_case_reproduces(name):
    res = parity.check_case(name, "cpu")
    bad = {k: v for k, v in res.items() if not v[0]}
    assert not bad, f"{name}: outputs differ from the golden vectors: {bad}"


def test_parity_report_and_compare(tmp_path):
    rep = parity.report("cpu")
    assert rep["all_ok"] and rep["golden"] == {n: parity.golden_sha256(n) for n in parity.CASES}
    a = tmp_path / "a.json"
    a.write_text(json.dumps(rep))
    assert parity.compare(rep, json.loads(a.read_text())) == []
    other = json.loads(a.read_text())
    other["cases"]["metadata"]["swa_idx"]["sha256"] = "0" * 64
    assert parity.compare(rep, other) == ["metadata.swa_idx: bytes differ"]


@pytest.mark.gpu
def test_gpu_matches_golden_vectors():
    rep = parity.report("cuda")
    bad = [(c, k) for c, outs in rep["cases"].items() for k, v in outs.items() if not v["ok"]]
    assert not bad, bad
