"""Benchmark reports of several devices as one: the ranks of a torchrun run (gathered by rank 0) or the
JSON files of separate runs, machines or vendors (``bench --merge A.json B.json ...``).

A one-device report (``bench`` on one GPU) is ``{date, device, arch, host, gpu, copy_TBps, bf16_TFLOPs,
rows}``. The several-device form lists the devices and tags each row with its device's ``device_id``:

    {date, devices: [{id, device, arch, host, gpu, copy_TBps, bf16_TFLOPs, date}], rows: [...], errors: [...]}

Rows are ordered case by case (the order cases first appear in), then device by device. A case (and tile
configuration) timed on several devices gets, on each, ``dev_ratio`` = time on the reference device (the
first listed device that timed it) / time on this one: above 1 this device is faster.
"""
from collections import Counter
from typing import List, Optional

DEVICE_KEYS = ("device", "arch", "host", "gpu", "copy_TBps", "bf16_TFLOPs", "date")


def device_id(rep: dict) -> str:
    """``host:cuda:N`` for a GPU report, else ``host:device``; reports from before hosts were recorded use
    their device name."""
    where = f"cuda:{rep['gpu']}" if rep.get("gpu") is not None else rep.get("device", "?")
    return f"{rep['host']}:{where}" if rep.get("host") else str(rep.get("device", "?"))


def as_devices(rep: dict) -> dict:
    """The several-device form of a report (a copy; a several-device report is returned as a copy)."""
    if "devices" in rep:
        return dict(rep, devices=[dict(d) for d in rep["devices"]], rows=[dict(r) for r in rep["rows"]],
                    errors=list(rep.get("errors", [])))
    dev = {k: rep.get(k) for k in DEVICE_KEYS}
    dev["id"] = device_id(rep)
    return dict(date=rep.get("date"), devices=[dev], rows=[dict(r, device_id=dev["id"]) for r in rep["rows"]],
                errors=[f"{dev['id']}: {e}" for e in rep.get("errors", [])])


def merge(reports: List[dict], labels: Optional[List[str]] = None) -> dict:
    """One several-device report of ``reports`` (either form). Device ids that collide (the same GPU in
    two files) get the report's label (its file name) appended."""
    devices, rows, errors = [], [], []
    for i, rep in enumerate(reports):
        m = as_devices(rep)
        rename = {}
        for d in m["devices"]:
            new = d["id"]
            if any(x["id"] == new for x in devices):
                new = f"{new} ({labels[i] if labels else f'report {i + 1}'})"
            rename[d["id"]] = new
            devices.append(dict(d, id=new))
        rows += [dict(r, device_id=rename[r["device_id"]]) for r in m["rows"]]
        for e in m["errors"]:                   # "<device id>: <what failed>", under the id it has here
            old, _, what = e.partition(": ")
            errors.append(f"{rename[old]}: {what}" if old in rename else e)
    order = {d["id"]: i for i, d in enumerate(devices)}
    first = {}
    for r in rows:
        first.setdefault((r["case"], r.get("config")), len(first))
    rows.sort(key=lambda r: (first[r["case"], r.get("config")], order[r["device_id"]]))
    count = Counter((r["case"], r.get("config")) for r in rows)
    ref = {}
    for r in rows:
        key = (r["case"], r.get("config"))
        ref.setdefault(key, r)
        many = count[key] > 1
        r["dev_ratio"] = ref[key]["us"] / r["us"] if many and r["us"] else None
        r["dev_ref"] = ref[key]["device_id"] if many else None
    dates = [d.get("date") for d in devices if d.get("date")]
    return dict(date=max(dates) if dates else None, devices=devices, rows=rows, errors=errors)


def print_table(rep: dict) -> None:
    """The several-device table: per case and device, time, rates, fraction of floor, the ratio to a peer
    timed beside it, and the ratio between devices."""
    for d in rep["devices"]:
        print(f"{d['id']}: {d['device']} ({d['arch']}), copy {d['copy_TBps']:.2f} TB/s, "
              f"bf16 mm {d['bf16_TFLOPs']:.0f} TFLOP/s")
    w = max([len(d["id"]) for d in rep["devices"]] + [6])
    print(f"{'case':36s} {'config':10s} {'device':{w}s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} {'floor':>6s} "
          f"{'peer':>24s} {'vs device':>10s}")
    for r in rep["rows"]:
        peer = f"{r['ratio']:.2f}x {r['peer']} ({r['peer_us']:.1f}us)" if r.get("ratio") is not None else ""
        dev = f"{r['dev_ratio']:.2f}x" if r.get("dev_ratio") is not None and r["dev_ref"] != r["device_id"] else ""
        print(f"{r['case']:36s} {r['config'] or '':10s} {r['device_id']:{w}s} {r['us']:9.1f} {r['tflops']:8.1f} "
              f"{r['tbps']:6.2f} {r['frac_floor']:6.0%} {peer:>24s} {dev:>10s}")
    for e in rep.get("errors", []):
        print(f"error: {e}")
