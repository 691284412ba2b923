"""The benchmark report as a PNG: per case, the fraction of the measured floor it reaches (left) and, where
a peer was timed in the same run, the speed ratio to that peer (right, log scale; > 1 means faster than
the peer). A report of several devices (a torchrun run, ``bench --merge``) has a bar per device in each
case: time in us, fraction of floor, and the ratio between devices. Reads only the JSON report
(``bench.run``), so a report from a GPU machine can be plotted anywhere. matplotlib is optional
(``pip install 'dsv4_rocm[plot]'``)."""
import math

INSTALL_HINT = "pip install matplotlib (or the package's 'plot' extra)"


def series(report: dict):
    """(labels, fractions of floor, peer ratios or None) in report row order."""
    rows = report["rows"]
    labels = [f"{r['case']} [{r['config']}]" if r.get("config") else r["case"] for r in rows]
    fracs = [float(r["frac_floor"]) for r in rows]
    ratios = [None if r.get("ratio") is None else float(r["ratio"]) for r in rows]
    return labels, fracs, ratios


def render(report: dict, path: str):
    """Write the PNG; raises ImportError when matplotlib is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels, fracs, ratios = series(report)
    n = max(len(labels), 1)
    fig = Figure(figsize=(13, 1.2 + 0.28 * n))
    FigureCanvasAgg(fig)
    ax_f, ax_r = fig.subplots(1, 2, sharey=True, gridspec_kw=dict(width_ratios=[3, 2]))
    y = list(range(len(labels)))
    ax_f.barh(y, [100 * f for f in fracs], color="tab:blue")
    for i, f in enumerate(fracs):
        ax_f.text(100 * f, i, f" {100 * f:.0f}%", va="center", fontsize=6)
    ax_f.axvline(100, color="gray", lw=0.8)
    ax_f.set_xlabel("% of measured floor (max of bytes / copy bandwidth, FLOP / matmul rate)")
    ax_f.set_yticks(y, labels, fontsize=7)
    ax_f.invert_yaxis()
    have = [(i, r) for i, r in enumerate(ratios) if r is not None and r > 0 and math.isfinite(r)]
    if have:
        # bars grow from 1x: right of it we are faster than the peer, left of it slower
        span = max(2.0, *(max(r, 1 / r) for _, r in have)) * 1.6
        ax_r.set_xscale("log")
        ax_r.set_xlim(1 / span, span)
        ax_r.barh([i for i, _ in have], [r - 1 for _, r in have], left=1,
                  color=["tab:green" if r >= 1 else "tab:red" for _, r in have])
        ticks = [t for t in (0.1, 0.25, 0.5, 1, 2, 4, 10) if 1 / span <= t <= span]
        ax_r.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax_r.minorticks_off()
        ax_r.axvline(1.0, color="gray", lw=0.8)
        for i, r in have:
            peer = report["rows"][i].get("peer") or "peer"
            ax_r.text(r, i, f" {r:.2f}x {peer} ", va="center",
                      ha="left" if r >= 1 else "right", fontsize=6)
    else:
        ax_r.text(0.5, 0.5, "no peer timed in this run", ha="center", va="center", transform=ax_r.transAxes)
    ax_r.set_xlabel("peer time / our time (> 1: faster than the peer)")
    fig.suptitle(f"dsv4_rocm bench: {report.get('device', '?')} ({report.get('arch', '?')}), "
                 f"{report.get('date', '')}; copy {report.get('copy_TBps', 0):.2f} TB/s, "
                 f"bf16 mm {report.get('bf16_TFLOPs', 0):.0f} TFLOP/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def render_devices(report: dict, path: str):
    """A several-device report (``merge.py``): per case and configuration a bar per device, in three panels
    sharing the cases: time in us (log scale), % of the device's measured floor, and time on the reference
    device / time on this one (log scale, > 1: faster than the reference; cases timed on several devices)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    devices = [d["id"] for d in report["devices"]]
    keys = list(dict.fromkeys((r["case"], r.get("config")) for r in report["rows"]))
    nd, h = len(devices), 0.8 / len(devices)
    fig = Figure(figsize=(15, 1.6 + 0.12 * len(keys) * (nd + 1)))
    FigureCanvasAgg(fig)
    ax_us, ax_f, ax_r = fig.subplots(1, 3, sharey=True, gridspec_kw=dict(width_ratios=[2, 2, 2]))
    ratios = []
    for r in report["rows"]:
        j = devices.index(r["device_id"])
        y = keys.index((r["case"], r.get("config"))) - 0.4 + (j + 0.5) * h
        color = f"C{j % 10}"
        ax_us.barh(y, r["us"], height=h, color=color)
        ax_f.barh(y, 100 * float(r["frac_floor"]), height=h, color=color)
        if r.get("dev_ratio") is not None and r.get("dev_ref") != r["device_id"]:
            ratios.append((y, float(r["dev_ratio"]), color))
    ax_us.set_xscale("log")
    ax_us.set_xlabel("time (us, log scale)")
    ax_us.set_yticks(range(len(keys)), [f"{c} [{g}]" if g else c for c, g in keys], fontsize=7)
    ax_us.invert_yaxis()
    from matplotlib.patches import Patch
    ax_us.legend([Patch(color=f"C{j % 10}") for j in range(nd)], [f"{d['id']}: {d['device']} ({d['arch']})" for d in report["devices"]], fontsize=6,
                 loc="lower right")
    ax_f.axvline(100, color="gray", lw=0.8)
    ax_f.set_xlabel("% of the device's measured floor")
    if ratios:
        span = max(2.0, *(max(r, 1 / r) for _, r, _ in ratios if r > 0)) * 1.6
        ax_r.set_xscale("log")
        ax_r.set_xlim(1 / span, span)
        ax_r.barh([y for y, _, _ in ratios], [r - 1 for _, r, _ in ratios], left=1, height=h,
                  color=[c for _, _, c in ratios])
        ax_r.axvline(1.0, color="gray", lw=0.8)
        for y, r, _ in ratios:
            ax_r.text(r, y, f" {r:.2f}x ", va="center", ha="left" if r >= 1 else "right", fontsize=6)
    else:
        ax_r.text(0.5, 0.5, "no case timed on several devices\n(bench --every-case compares GPUs)", ha="center",
                  va="center", transform=ax_r.transAxes)
    ax_r.set_xlabel("time on the first device that timed the case / time here (> 1: faster)")
    fig.suptitle(f"dsv4_rocm bench: {nd} devices, {report.get('date', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_plot(report: dict, path: str):
    """Render the plot (a panel per device of a several-device report), or say in one line why it was
    skipped; returns the path or None."""
    try:
        if "devices" in report and len(report["devices"]) > 1:
            render_devices(report, path)
        elif "devices" in report:
            render(dict(report["devices"][0], rows=report["rows"]), path)
        else:
            render(report, path)
    except ImportError:
        print(f"plot skipped: matplotlib is not installed ({INSTALL_HINT})")
        return None
    print(f"plot: {path}")
    return path
