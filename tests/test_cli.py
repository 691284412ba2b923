"""The command line: the main job runs end to end and reports; info and parity answer."""
import pytest

from dsv4_rocm.__main__ import main


def test_run_main_job_tiny(capsys):
    assert main(["run", "--config", "tiny", "--requests", "2", "--prompt-len", "40", "--decode-steps", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for layer in ("swa", "c4a", "c128a"):
        assert f"\n{layer} " in out
    assert "decode tok/s" in out


def test_run_rejects_bad_heads():
    with pytest.raises(ValueError, match="--heads"):
        main(["run", "--config", "tiny", "--heads", "3", "--device", "cpu"])


def test_info_and_backend_errors(capsys, monkeypatch):
    assert main(["info"]) == 0
    assert "backends" in capsys.readouterr().out
    from dsv4_rocm import ops
    monkeypatch.setenv("DSV4_BACKEND", "triton")
    with pytest.raises(ValueError, match="not available"):
        ops.backend_for("sparse_mla_decode", "cpu")
    monkeypatch.setenv("DSV4_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.backend_for("sparse_mla_decode", "cpu")
    monkeypatch.delenv("DSV4_BACKEND")
    with ops.use_backend("reference"):
        assert ops.backend_for("sparse_mla_decode", "cpu") == "reference"
    with pytest.raises(ValueError, match="unknown op"):
        ops.backend_for("flash_attn", "cpu")
