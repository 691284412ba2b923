"""The compute-sanitizer pass over the GPU tests, file by file, several processes at once (gpu/sanitize.sh
says what it covers and how to run it).

Jobs are (tool, test file): ``compute-sanitizer --tool TOOL python -m pytest -m gpu --one-case --sanitizer TOOL
FILE``, each with its own log, run by a pool of processes under one wall-clock budget; before them a plain
pass (no tool, torch's caching allocator on) over the same files compiles every kernel into the shared
Triton caches and gives each file's result without a tool beside it. Last, a table per file and tool (tests
ran / passed / failed / skipped, the tool's findings, seconds) and the distinct finding sites, printed and
written to OUT_DIR (summary.txt, summary.json, findings_TOOL.txt, logs/).
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("memcheck", "racecheck", "initcheck")


def gpu_test_files():
    """Every test_*.py of tests/ and its stage folders (not tests/engines: the engine packages are not
    installed here) holding a test marked gpu."""
    out = []
    for d, subdirs, files in os.walk(os.path.join(ROOT, "tests")):
        subdirs[:] = sorted(s for s in subdirs if s not in ("engines", "golden", "__pycache__"))
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                text = open(os.path.join(d, name)).read()
                if re.search(r"pytest\.mark\.gpu|pytestmark\s*=.*\bgpu\b", text):
                    out.append(os.path.relpath(os.path.join(d, name), ROOT))
    return out


# seconds of each file's one-case tests under each tool, 15 processes at once on an H200 (2026-11-29; ">": cut
# at the budget then, so at least that); the jobs start longest first, and a file over SPLIT_S seconds
# under a tool runs as several interleaved parts (pytest --part) at once. Files not listed: from their size.
MEASURED = {
    "test_compressor.py": (115, 114, 114), "test_fp8_einsum.py": (21, 106, 22), "test_golden.py": (40, 60, 60),
    "test_layer.py": (39, 78, 45), "test_layer_v41.py": (97, 300, 300), "test_merge_attn_states.py": (53, 220, 71),
    "test_metadata.py": (66, 63, 72), "test_sparse_mla.py": (82, 204, 85), "test_step.py": (84, 87, 89),
    "test_top_k_per_row.py": (29, 74, 120), "test_cache_qkv_library.py": (42, 54, 60),
    "test_empty_steps.py": (45, 50, 48), "test_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert.py": (23, 28, 46),
}
SPLIT_S = 70

# a small program a tool runs beside the tests, whose code is right by construction: what the tool reports
# there is what it cannot see, and says how to read the same report in the tests
CONTROLS = {"racecheck": ("gpu/racecheck_control.py", "hand-offs correct by the mbarrier protocol"),
            "initcheck": ("gpu/initcheck_control.py", "tensors torch writes whole, then reads")}


def gpu_functions(path):
    """The gpu test functions of a file (at most that many parts)."""
    return len(re.findall(r"@pytest\.mark\.gpu", open(os.path.join(ROOT, path)).read()))


def cost(path, tool=None):
    """Expected seconds of a file's job under ``tool`` (the plain pass: a third of memcheck's)."""
    m = MEASURED.get(os.path.basename(path))
    if m:
        return m[TOOLS.index(tool)] if tool else m[0] / 3
    text = open(os.path.join(ROOT, path)).read()
    guess = 12 + 3 * len(re.findall(r"@pytest\.mark\.gpu", text))
    return guess if tool else guess / 3


def pytest_cmd(path, tool, one_case, xml, part=None):
    # -s: the tool's reports land in the log right after the name of the test that made them
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-s", "-rfEs", "-p", "no:cacheprovider",
           "-p", "no:benchmark", "--junitxml", xml]
    if one_case:
        cmd.append("--one-case")
    if tool:
        cmd += ["--sanitizer", tool]
    if part:
        cmd += ["--part", f"{part[0]}/{part[1]}"]
    return cmd + [path]


def sanitizer_cmd(tool):
    cmd = ["compute-sanitizer", "--tool", tool, "--target-processes", "all", "--error-exitcode", "9",
           "--print-limit", "200"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "analysis"]
    return cmd


class Job:
    def __init__(self, tool, path, part=None):
        self.tool, self.path, self.part = tool, path, part
        self.rc, self.seconds, self.status = None, 0.0, "not started"
        stem = os.path.basename(path)[:-3]
        self.name = f"{tool or 'plain'}__{stem}" + (f"__part{part[0]}of{part[1]}" if part else "")
        self.cost = cost(path, tool) / (part[1] if part else 1)


def run_job(job, out, one_case, deadline, env):
    left = deadline - time.time()
    if left < 20:
        return job
    log = os.path.join(out, "logs", job.name + ".log")
    xml = os.path.join(out, "logs", job.name + ".xml")
    cmd = [sys.executable, job.path] if job.path.startswith("gpu/") else pytest_cmd(job.path, job.tool, one_case, xml,
                                                                                   job.part)
    if job.tool:
        cmd = sanitizer_cmd(job.tool) + cmd
    e = dict(env)
    if job.tool:
        e["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    t0 = time.time()
    job.status = "running"
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            job.rc = p.wait(timeout=left)
            job.status = "done"
        except subprocess.TimeoutExpired:
            # pytest ends on SIGINT with what it has (its junit xml included); the tool passes it on
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            job.rc = p.returncode
            job.status = "budget"
    job.seconds = time.time() - t0
    return job


OUTCOME = re.compile(r"^(tests/\S+::\S+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def results(job, out):
    """{passed, failed, skipped, ran, failures: [(test, first line)], skips: [(test, reason)]} of a job."""
    r = dict(passed=0, failed=0, skipped=0, failures=[], skips=[])
    xml = os.path.join(out, "logs", job.name + ".xml")
    try:
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                r["failed"] += 1
                r["failures"].append((name, (bad.get("message") or "").splitlines()[0][:200] if bad.get("message")
                                      else ""))
            elif skip is not None:
                r["skipped"] += 1
                r["skips"].append((name, (skip.get("message") or "")[:200]))
            else:
                r["passed"] += 1
    except (OSError, ET.ParseError):        # no xml (killed): the -v lines of the log
        try:
            text = open(os.path.join(out, "logs", job.name + ".log"), errors="replace").read()
        except OSError:
            text = ""
        for test, what in OUTCOME.findall(text):
            key = {"PASSED": "passed", "XFAIL": "passed", "XPASS": "passed", "SKIPPED": "skipped"}.get(what, "failed")
            r[key] += 1
            if key == "failed":
                r["failures"].append((test, what))
    r["ran"] = r["passed"] + r["failed"]
    return r


SUMMARY = re.compile(r"(ERROR|RACECHECK|INITCHECK) SUMMARY: (\d+) (errors?|hazards?)")
SITE = re.compile(r"^=+\s+(?:Error: )?(Race reported between .*|Invalid .*|Uninitialized .*|Misaligned .*|"
                  r"Out-of-range .*|Warning: Race reported .*)$")
TEST = re.compile(r"^(tests/\S+::\S+|control case \S+)")
AT = re.compile(r"^=+\s+(?:at|and) (?:\w+ access at )?(.*?)(?:\+0x[0-9a-f]+)?(?: in (\S+:\d+))?(?: \[\d+ hazards?\])?$")


def findings(job, out):
    """(count, {site: number}) of a tool job's log: the summed summaries, and its reports by kind and place."""
    try:
        lines = open(os.path.join(out, "logs", job.name + ".log"), errors="replace").read().splitlines()
    except OSError:
        return None, {}
    total, seen, tests = None, {}, {}
    for line in lines:
        m = SUMMARY.search(line)
        if m:
            total = (total or 0) + int(m.group(2))
    test = "?"
    for i, line in enumerate(lines):
        t = TEST.match(line)
        if t:
            test = t.group(1)
        m = SITE.match(line)
        if not m:
            continue
        what = re.sub(r"0x[0-9a-f]+", "", m.group(1))
        what = re.sub(r"\s+", " ", what)
        places, block = [], [line]
        for nxt in lines[i + 1:i + 8]:        # the report's own lines, up to its blank line
            if re.match(r"^=+\s*$", nxt) or SITE.match(nxt):
                break
            block.append(nxt)
            a = AT.match(nxt)
            if a:       # the source line where there is one, else the function (templates cut short)
                places.append(a.group(2) or re.sub(r"^void ", "", a.group(1))[:90])
        key = what[:160] + (" @ " + " / ".join(places[:3]) if places else "")
        counts = [int(c) for c in re.findall(r"\[(\d+) hazards?\]", " ".join(block))]
        seen[key] = seen.get(key, 0) + (sum(counts) if counts else 1)
        tests.setdefault(key, [])
        if test not in tests[key]:
            tests[key].append(test)
    return total, {f"{k}  [in {', '.join(tests[k][:3])}{' ...' if len(tests[k]) > 3 else ''}]": v
                   for k, v in seen.items()}


def main(argv):
    out = os.path.abspath(argv[0])
    tools = [t for t in (argv[1:] or TOOLS)]
    for t in tools:
        if t not in TOOLS:
            sys.exit(f"unknown tool {t!r}: one of {', '.join(TOOLS)}")
    budget = float(os.environ.get("SANITIZER_SECONDS", 470))
    jobs_n = int(os.environ.get("SANITIZER_JOBS", max(1, (os.cpu_count() or 2) - 1)))
    one_case = os.environ.get("SANITIZE_ALL_CASES", "") != "1"
    warm = os.environ.get("SANITIZE_PLAIN", "1") == "1"
    files = os.environ.get("SANITIZE_TESTS", "").split() or gpu_test_files()

    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")] +
                                          ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    t0 = time.time()
    deadline = t0 + budget
    print(f"== sanitizer pass: {len(files)} files x {', '.join(tools)}, {jobs_n} processes at once, "
          f"{'one parameter set per test function' if one_case else 'every parameter set'}, budget {budget:.0f} s",
          flush=True)
    plain = sorted([Job(None, f) for f in files] if warm else [], key=lambda j: -j.cost)
    tool_jobs = []
    for f in files:
        for t in tools:
            n = max(1, min(-int(-cost(f, t) // SPLIT_S), gpu_functions(f))) if one_case else 1
            tool_jobs += [Job(t, f, (i, n) if n > 1 else None) for i in range(n)]
    tool_jobs.sort(key=lambda j: -j.cost)
    lock = threading.Lock()
    done = []

    def go(job):
        run_job(job, out, one_case, deadline, env)
        with lock:
            done.append(job)
            if job.status != "not started":
                part = f" part {job.part[0]}/{job.part[1]}" if job.part else ""
                print(f"[{time.time() - t0:5.0f} s] {job.tool or 'plain':9s} {job.path + part:66s} rc={job.rc} "
                      f"{job.seconds:5.0f} s {job.status}", flush=True)
        return job

    # the controls: what the tool reports on code that is right (CONTROLS)
    controls = [Job(t, CONTROLS[t][0]) for t in tools if t in CONTROLS]
    # the plain pass first (it compiles the kernels the tool jobs then load), then the tool jobs, longest first;
    # no barrier between them
    with ThreadPoolExecutor(jobs_n) as pool:
        list(pool.map(go, controls + plain + tool_jobs))

    rows, status, sites = [], 0, {t: {} for t in tools}
    for f in sorted(files):
        row = dict(file=f)
        for key in ["plain"] * bool(plain) + list(tools):
            jobs = [j for j in plain + tool_jobs if j.path == f and (j.tool or "plain") == key]
            ran = [j for j in jobs if j.status != "not started"]
            if not ran:
                row[key] = dict(status="not started")
                if key != "plain":
                    status = 1
                continue
            # a file run as parts: counts and findings summed, seconds the longest part, status the worst
            cell = dict(status="budget" if any(j.status == "budget" for j in ran) else
                        "partly run" if len(ran) < len(jobs) else "done",
                        rc=max(j.rc or 0 for j in ran), seconds=round(max(j.seconds for j in ran)), parts=len(jobs),
                        passed=0, failed=0, skipped=0, ran=0, failures=[], skips=[])
            for j in ran:
                res = results(j, out)
                for k in ("passed", "failed", "skipped", "ran", "failures", "skips"):
                    cell[k] += res[k]
                if j.tool:
                    n, found = findings(j, out)
                    cell["findings"] = None if n is None or cell.get("findings", 0) is None else \
                        cell.get("findings", 0) + n
                    cell.setdefault("sites", {})
                    for k, v in found.items():
                        cell["sites"][k] = cell["sites"].get(k, 0) + v
                        sites[j.tool][k] = sites[j.tool].get(k, 0) + v
            row[key] = cell
            if key != "plain" and (cell["status"] != "done" or cell["failed"] or cell.get("findings")):
                status = 1
        rows.append(row)

    def fmt(c):
        if c is None or c["status"] == "not started":
            return "not run"
        s = f"{c.get('ran', 0):2d}/{c.get('passed', 0):2d}/{c.get('failed', 0):d}/{c.get('skipped', 0):d}"
        if "findings" in c:
            s += f" {'?' if c['findings'] is None else c['findings']:>4}"
        s += f" {c['seconds']:3d}s"
        if c["status"] != "done":
            s += " CUT"
        if c.get("parts", 1) > 1:
            s += f" ({c['parts']} parts)"
        return s
    cols = (["plain"] if plain else []) + tools
    head = f"{'file':52s} " + " ".join(f"{c + ' ran/ok/fail/skip' + (' finds' if c != 'plain' else '') + ' s':34s}"
                                       for c in cols)
    lines = [head]
    for r in rows:
        lines.append(f"{r['file'][6:]:52s} " + " ".join(f"{fmt(r.get(c)):34s}" for c in cols))
    for c in cols:
        cells = [r.get(c) for r in rows]
        run = [x for x in cells if x and x["status"] != "not started"]
        tot = {k: sum(x.get(k, 0) for x in run) for k in ("ran", "passed", "failed", "skipped")}
        fnd = sum(x.get("findings") or 0 for x in run)
        lines.append(f"TOTAL {c:9s}: {len(run)}/{len(cells)} files run ({sum(x['status'] != 'done' for x in run)} "
                     f"cut at the budget), {tot['ran']} tests ran, {tot['passed']} passed, {tot['failed']} failed, "
                     f"{tot['skipped']} skipped" + (f", {fnd} findings" if c != "plain" else ""))
    fails = []
    for r in rows:
        for c in cols:
            for test, msg in (r.get(c) or {}).get("failures", []):
                fails.append(f"  {c:9s} FAILED {test}: {msg}")
    skips = sorted({f"  {c:9s} SKIPPED {t}: {m}" for r in rows for c in cols
                    for t, m in (r.get(c) or {}).get("skips", []) if "not under" in m or "graph capture" in m})
    site_lines = []
    for t in tools:
        with open(os.path.join(out, f"findings_{t}.txt"), "w") as fh:
            for k, v in sorted(sites[t].items(), key=lambda kv: -kv[1]):
                fh.write(f"{v:7d}  {k}\n")
        for k, v in sorted(sites[t].items(), key=lambda kv: -kv[1])[:12]:
            site_lines.append(f"  {t:9s} {v:6d}  {k}")
    for control in controls:
        n, s = findings(control, out) if control.status != "not started" else (None, {})
        try:
            said = [line for line in open(os.path.join(out, "logs", control.name + ".log"))
                    if line.startswith(control.tool + " control")]
        except OSError:
            said = []
        site_lines.append(f"  control   {control.tool} over {CONTROLS[control.tool][1]} ({control.path}): "
                          f"rc={control.rc}, {n} reported")
        site_lines += [f"  control   {line.strip()}" for line in said] or ["  control   no result line"]
        site_lines += [f"  control   {v:6d}  {k}" for k, v in s.items()]
    text = "\n".join(
        ["", f"== sanitizer summary ({time.time() - t0:.0f} s; cells: tests ran/passed/failed/skipped, the tool's "
             "finding count, seconds; CUT: stopped at the budget)"] + lines +
        (["", "== failures"] + fails if fails else []) +
        (["", "== skipped by name or for graph capture"] + skips if skips else []) +
        (["", "== finding sites (top 12 a tool; all in findings_TOOL.txt)"] + site_lines if site_lines else []))
    with open(os.path.join(out, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(text, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
