"""The benchmark on several GPUs: ``bench`` under torchrun (each rank its share of the cases or every case,
rank 0 gathers and writes one JSON, table and PNG) and ``bench --merge`` of reports from several runs.

The torchrun run is two gloo ranks on the CPU running ``bench.run.run`` itself over stand-in suites
(tests/tooling/bench_ranks.py): the sharding, the gather, the merged report, the table and the plot are the code a
GPU cluster runs; only the timed kernels and the two ceilings are stand-ins."""
import json
import os
import subprocess
import sys
import zlib

import pytest

from dsv4_rocm.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [f"stand-in case {i}" for i in range(8)]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_ranks")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        os.path.join(ROOT, "tests", "tooling", "bench_ranks.py"), str(out)], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


def _rows(rep):
    return [(r["case"], r["device_id"]) for r in rep["rows"]]


def test_each_rank_times_its_share_and_rank_0_writes_one_report(cluster_run):
    out, stdout = cluster_run
    rep = json.loads((out / "shared.json").read_text())
    ids = [d["id"] for d in rep["devices"]]
    assert len(ids) == 2 and ids[0] != ids[1] and rep["ranks"] == 2 and rep["every_case"] is False
    assert sorted(c for c, _ in _rows(rep)) == sorted(CASES)                     # every case once
    for case, dev in _rows(rep):
        rank = zlib.crc32(case.encode()) % 2
        assert dev == ids[rank]
        row = next(r for r in rep["rows"] if r["case"] == case)
        assert row["us"] == pytest.approx(1e3 * 1e-3 * (CASES.index(case) + 1) * (rank + 1))
        assert row["dev_ratio"] is None
    assert len(rep["errors"]) == 1 and "failing: RuntimeError: out of memory" in rep["errors"][0] and ids[1] in rep["errors"][0]
    assert (out / "shared.png").read_bytes()[:4] == b"\x89PNG"
    table = [l for l in stdout.splitlines() if l.startswith("stand-in case")]
    assert len([l for l in table if ids[0] in l or ids[1] in l]) >= 8          # rank 0's table of both devices


def test_every_case_on_every_rank_gives_the_ratio_between_devices(cluster_run):
    out, _ = cluster_run
    rep = json.loads((out / "every.json").read_text())
    ids = [d["id"] for d in rep["devices"]]
    assert rep["every_case"] is True and sorted(_rows(rep)) == sorted((c, d) for c in CASES for d in ids)
    assert [r["case"] for r in rep["rows"][:4]] == [CASES[0], CASES[0], CASES[1], CASES[1]]   # case by case
    for r in rep["rows"]:
        assert r["dev_ref"] == ids[0]
        assert r["dev_ratio"] == pytest.approx(1.0 if r["device_id"] == ids[0] else 0.5)  # rank 1 takes 2x
    assert (out / "every.png").read_bytes()[:4] == b"\x89PNG"


def _single(device, host, us, cases=CASES[:3]):
    rows = [dict(case=c, config="cfg", us=us * (i + 1), tflops=1.0, tbps=1.0, floor_us=1.0,
                 frac_floor=1.0 / (us * (i + 1)), peer=None, peer_us=None, ratio=None) for i, c in enumerate(cases)]
    return dict(date="2026-11-25", device=device, arch={"MI355X": "gfx950"}.get(device, "sm_90"), host=host, gpu=0,
                copy_TBps=3.0, bf16_TFLOPs=700.0, rows=rows)


def test_merge_joins_reports_of_several_machines(cluster_run, tmp_path, capsys):
    out, _ = cluster_run
    a, b = tmp_path / "h100.json", tmp_path / "mi355.json"
    a.write_text(json.dumps(_single("H100", "nodeA", 10.0)))
    b.write_text(json.dumps(_single("MI355X", "nodeB", 8.0)))
    old = _single("H100", None, 20.0)                          # a report from before hosts were recorded
    del old["host"], old["gpu"]
    c = tmp_path / "old.json"
    c.write_text(json.dumps(old))
    js = tmp_path / "merged.json"
    assert main(["bench", "--merge", str(a), str(b), str(c), str(out / "every.json"), str(a), "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    ids = [d["id"] for d in rep["devices"]]
    assert ids[:3] == ["nodeA:cuda:0", "nodeB:cuda:0", "H100"] and ids[5] == "nodeA:cuda:0 (h100.json)"
    assert len(ids) == len(set(ids)) == 6
    mi = next(r for r in rep["rows"] if r["case"] == CASES[1] and r["device_id"] == "nodeB:cuda:0")
    assert mi["dev_ref"] == "nodeA:cuda:0" and mi["dev_ratio"] == pytest.approx(20.0 / 16.0)
    text = capsys.readouterr().out
    assert "nodeB:cuda:0: MI355X (gfx950)" in text and "1.25x" in text
    assert (tmp_path / "merged.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_names_a_bad_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cases": {}}))
    assert main(["bench", "--merge", str(bad), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json is not a bench report" in err and err.count("\n") == 1
    assert main(["bench", "--merge", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_slurm_job_script_runs_bench_under_torchrun():
    """gpu/bench_cluster.sbatch is valid bash and starts `python -m dsv4_rocm bench` through torchrun's
    rendezvous, with the arguments bench takes."""
    from dsv4_rocm.__main__ import _parser
    path = os.path.join(ROOT, "gpu", "bench_cluster.sbatch")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    line = next(l for l in open(path).read().replace("\\\n", " ").splitlines() if l.startswith("srun "))
    assert "python -m torch.distributed.run" in line and "--rdzv-backend c10d" in line
    assert '-m dsv4_rocm bench --json "$out/bench.json" ${extra[@]+"${extra[@]}"} "$@"' in line
    a = _parser().parse_args(["bench", "--json", "out/bench.json", "--every-case"])
    assert a.cmd == "bench" and a.every_case
