"""Benchmark: the shared srun step against SSH from 8 to 64 Slurm nodes, and the model of 4,000 nodes from it.

Each size builds one Slurm test bed (tests/slurmcluster.py: real slurmctld, one slurmd and one sshd per namespace
node, one munged; every node's ~/.bashrc is /dev/null, as in bench/slurm_vs_ssh.py), allocates every node once
(`salloc --no-shell`, outside the timing), then per rep, interleaved:

- four runs of the real CLI, `preflight run --python /usr/bin/python3 --checks C`: over SSH (hostfile, paramiko)
  and over srun (one shared step, the default), for C = `python` (one request per node) and C = GATE (host
  checks plus the cluster checks `versions`, `clock`, `ports`, which talk to every node in rounds). The hosts'
  Python is the system's, without torch: the python check's torch import would cost every simulated node ~2 CPU-s
  on this 2-core machine and measure the machine, not the coordinator (it FAILs "torch not importable", which
  is a result like any other for the coordinator). Recorded per run: wall time; the coordinator process's CPU;
  its reaped children's CPU (the srun client and scontrol; SSH has none): together the coordinator's process tree,
  which excludes slurmctld, the slurmds and everything on the nodes; when the last node's agent said hello; and,
  counted in-process, the bytes the coordinator wrote to the shared step's stdin (the code once, the requests per
  node) and read back from it;
- three raw probes of one step over every node (srun's flags as SharedStep's): `true` (launch alone), a
  broadcast (PROBE_BYTES of 300-byte lines on stdin, `cat >/dev/null` on every node: srun's CPU per byte written
  to a node) and a fan-in (FANIN_LINES lines of 76 bytes from every node: srun's CPU per byte it forwards).

The model (bench/slurm_model.py, least squares, residuals reported): the coordinator process's CPU as fixed + per
node; the srun client's as fixed + per node plus the broadcast term, (code + requests per node x N) x N bytes at
the probe's cost per byte; their sum at 4,000 nodes is the coordinator's share. Needs root and the Slurm packages
(tests/install-deps.sh). From the repository root, under the machine-wide lock:

    flock /tmp/bench.lock nice -n 5 python3 bench/slurm_scale.py --sizes 8 16 32 64 --reps 2 \\
        --out bench/results/slurm-scale.json
    python3 bench/slurm_scale.py --report bench/results/slurm-scale.json   # tables and model, no run

Sample output (the model's table):

    what                          fixed_s  per_node_ms  max_resid_s    r2  at_4000_s
    srun python: coordinator CPU     0.41         1.93         0.03  0.99       8.1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, median, table, write_json  # noqa: E402
from slurm_model import Broadcast, Fit, Workload, coordinator_share, fit_line, nodes_within, srun_linear  # noqa: E402
from slurm_vs_ssh import BASHRC, _daemon_cpu, _neighbour_table, _pidfile, _rss_mib  # noqa: E402

from tests.slurmcluster import SlurmCluster, slurm_unavailable_reason  # noqa: E402

WORKLOADS = {"python": "python",
             "gate": "python,interfaces,memlock,ext_locks,versions,clock,ports"}
HOST_PYTHON = "/usr/bin/python3"
PROBE_BYTES = 4 << 20  # the bulk broadcast probe: 4 MiB in one write (srun forwards it in its own message size)
PROBE_LINES = 1500  # the line broadcast probe: 400-byte lines (a request's size), each written alone
PROBE_LINE_GAP_S = 0.001  # between two lines: srun reads each before the next comes, as one message
FANIN_LINES = 5000  # per node, 76 bytes each
TARGET = 4000
BUDGET_S = 120.0
# (label, requests coalesced into srun's full messages, most nodes per shared step or 0 for one step): srun reads
# each request line as a message of its own (what the runs' srun CPU matches best), or lines share its messages
# (the bulk probe's cost), through one step or through steps of at most 128 nodes (srun.STEP_NODES_MAX).
SPLIT = 4  # the gate also runs through this many shared steps: a measured check of the model's steps term
SCENARIOS = (("one step, a message per line", False, 0), ("one step, coalesced", True, 0),
             ("steps of 128, a message per line", False, 128), ("steps of 128, coalesced", True, 128))
_ALL_IN = re.compile(r"\[\s*([\d.]+)s\] connecting: (\d+)/(\d+)")
# The coordinator runs in-process under this wrapper: it counts what the shared step carries (SharedStep's stdin
# once, every send_to, and srun's output as the demultiplexer is fed) and writes that with its own CPU and its
# reaped children's (srun, scontrol) when it ends.
_WRAPPER = """
import json, os, sys
from preflight.transport import srun as s
if os.environ.get("PF_BENCH_STEPS"):  # the bench's split runs: this many shared steps of equal size
    n = int(os.environ["PF_BENCH_NODES"])
    s.STEP_NODES_MAX = -(-n // int(os.environ["PF_BENCH_STEPS"]))
io = {"code_bytes": 0, "sent_bytes": 0, "sent_lines": 0, "read_bytes": 0}
init, send_to, feed = s.SharedStep.__init__, s.SharedStep.send_to, s.StepOutput.feed
def _init(self, names, argv, stdin, job_id=""):
    io["code_bytes"] += len(stdin)
    init(self, names, argv, stdin, job_id)
def _send_to(self, name, data):
    lines = [line for line in data.splitlines() if line]
    io["sent_lines"] += len(lines)
    io["sent_bytes"] += sum(len(name) + 3 + len(line) for line in lines)
    send_to(self, name, data)
def _feed(self, data, is_err):
    io["read_bytes"] += len(data)
    feed(self, data, is_err)
s.SharedStep.__init__, s.SharedStep.send_to, s.StepOutput.feed = _init, _send_to, _feed
from preflight.cli import main
rc = 1
try:
    rc = main(sys.argv[2:])
finally:
    t = os.times()
    with open(sys.argv[1], "w") as f:
        json.dump({"self": t.user + t.system, "children": t.children_user + t.children_system, **io}, f)
sys.exit(rc)
"""


def _run(cluster: SlurmCluster, transport: str, checks: str, workdir: Path, env: Dict[str, str],
         steps: int = 0) -> Dict[str, Any]:
    """One `preflight run` under _WRAPPER, timed from the outside; with steps, through that many shared steps."""
    if steps:
        env = dict(env, PF_BENCH_STEPS=str(steps), PF_BENCH_NODES=str(len(cluster.names)))
    cpu_file, report = workdir / "cpu.json", workdir / "report.json"
    for f in (cpu_file, report):
        f.unlink(missing_ok=True)
    args = ["run", "--python", HOST_PYTHON, "--checks", checks, "--json", str(report)]
    if transport == "ssh":
        hostfile = cluster.net.hostfile(workdir / "hostfile", names=cluster.names)
        args += ["--hostfile", str(hostfile), "--transport", "ssh", "--ssh-config", str(cluster.net.ssh_config),
                 "--ssh-key", str(cluster.net.user_key), "--known-hosts", str(cluster.net.known_hosts)]
    daemons = _daemon_cpu(cluster)
    load = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, str(cpu_file), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    after = _daemon_cpu(cluster)
    cpu = json.loads(cpu_file.read_text()) if cpu_file.exists() else {"self": float("nan"), "children": float("nan")}
    data = json.loads(report.read_text()) if report.exists() else {}
    n = len(cluster.names)
    all_in = [float(m[1]) for m in _ALL_IN.finditer(proc.stderr) if int(m[2]) == int(m[3]) == n]
    statuses: Dict[str, int] = {}
    for r in data.get("results", []):
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    errors = sorted({f"{r['check']}: {r['message'][:160]}" for r in data.get("results", [])
                     if r["status"] == "error"})
    return {"wall_s": wall, "coord_cpu_s": cpu["self"], "children_cpu_s": cpu["children"],
            "tree_cpu_s": cpu["self"] + cpu["children"], "all_connected_s": all_in[0] if all_in else float("nan"),
            "code_bytes": cpu.get("code_bytes", 0), "sent_bytes": cpu.get("sent_bytes", 0),
            "sent_lines": cpu.get("sent_lines", 0), "read_bytes": cpu.get("read_bytes", 0),
            "ctld_cpu_s": after["ctld"] - daemons["ctld"], "slurmd_cpu_s": after["slurmd"] - daemons["slurmd"],
            "exit": proc.returncode, "load": load, "statuses": statuses, "errors": errors[:5],
            "stderr_tail": "" if data else proc.stderr[-1500:]}


def _probe(cluster: SlurmCluster, job: str, argv: Sequence[str], payload: Sequence[bytes],
           gap_s: float = 0.0) -> Dict[str, Any]:
    """One step over every node as SharedStep starts it, running argv; each payload chunk written alone (gap_s
    apart), then EOF. Returns wall time, the srun client's CPU (a reaped child of this process), the bytes it
    forwarded back, the daemons' CPU."""
    names = cluster.names
    step = ["srun", "--overlap", "--exact", "--ntasks-per-node=1", "--unbuffered", "--label", "--input=all",
            f"--nodes={len(names)}", f"--ntasks={len(names)}", f"--jobid={job}", f"--nodelist={','.join(names)}",
            "--", *argv]
    got = [0]
    t0, d0, start = os.times(), _daemon_cpu(cluster), time.monotonic()
    proc = subprocess.Popen(step, env=cluster.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

    def read() -> None:
        while chunk := proc.stdout.read1(1 << 16):
            got[0] += len(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    err = threading.Thread(target=proc.stderr.read, daemon=True)
    err.start()
    try:
        for chunk in payload:
            proc.stdin.write(chunk)
            proc.stdin.flush()
            if gap_s:
                time.sleep(gap_s)
        proc.stdin.close()
        proc.wait(timeout=300)
    except (subprocess.TimeoutExpired, OSError):
        cluster.kill_clients()
        raise
    wall = time.monotonic() - start
    reader.join(10)
    t1, d1 = os.times(), _daemon_cpu(cluster)
    return {"wall_s": wall, "srun_cpu_s": t1.children_user + t1.children_system - t0.children_user
            - t0.children_system, "read_bytes": got[0], "ctld_cpu_s": d1["ctld"] - d0["ctld"],
            "slurmd_cpu_s": d1["slurmd"] - d0["slurmd"], "exit": proc.returncode}


def _probes(cluster: SlurmCluster, job: str) -> Dict[str, Dict[str, Any]]:
    line = b"@x " + b"r" * 396 + b"\n"  # 400 bytes, a request line's size
    bulk = b"c" * PROBE_BYTES
    sink = ["sh", "-c", "cat >/dev/null"]
    return {"launch": _probe(cluster, job, ["true"], []),
            "bulk": {**_probe(cluster, job, sink, [bulk]), "stdin_bytes": len(bulk)},
            "lines": {**_probe(cluster, job, sink, [line] * PROBE_LINES, PROBE_LINE_GAP_S), "stdin_lines": PROBE_LINES},
            "fanin": _probe(cluster, job, ["sh", "-c", f"yes {'f' * 75} | head -n {FANIN_LINES}"], [])}


def measure(n: int, reps: int, workdir: Path) -> Dict[str, Any]:
    setup = {f"slm{i + 1}": [["mount", "--bind", "/dev/null", str(BASHRC)]] for i in range(n)}
    if not BASHRC.exists():
        setup = {}
    built = time.monotonic()
    with _neighbour_table(n), SlurmCluster(n, setup=setup, ready_timeout=600.0) as cluster:
        build_s = time.monotonic() - built
        print(f"{n} nodes: bed built in {build_s:.0f} s", file=sys.stderr, flush=True)
        tree_width = re.search(r"TreeWidth\s*=\s*(\d+)", cluster.client(["scontrol", "show", "config"]).stdout)
        alloc = cluster.client(["salloc", "--no-shell", f"-N{n}"], timeout=300).stderr
        job = re.search(r"Granted job allocation (\d+)", alloc)
        assert job, alloc
        nodelist = cluster.client(["squeue", "-h", "-j", job[1], "-o", "%N"]).stdout.strip()
        envs = {"ssh": dict(cluster.env), "srun": dict(cluster.env, SLURM_JOB_ID=job[1], SLURM_JOB_NODELIST=nodelist,
                                                         SLURM_TASKS_PER_NODE=f"1(x{n})")}
        runs: Dict[str, List[Dict[str, Any]]] = {}
        probes: Dict[str, List[Dict[str, Any]]] = {}
        for rep in range(reps):
            for wl, checks in WORKLOADS.items():
                # interleaved: a slow minute on this machine hits all alike
                for transport in ("ssh", "srun", f"srun{SPLIT}") if wl == "gate" else ("ssh", "srun"):
                    r = _run(cluster, transport, checks, workdir, envs[transport[:4]],
                             SPLIT if transport.endswith(str(SPLIT)) else 0)
                    runs.setdefault(f"{transport} {wl}", []).append(r)
                    print(f"{n} nodes rep {rep} {transport} {wl}: {r['wall_s']:.1f} s, coordinator "
                          f"{r['coord_cpu_s']:.2f} + children {r['children_cpu_s']:.2f} CPU-s, all connected "
                          f"{r['all_connected_s']} s, sent {r['sent_bytes']} B, exit {r['exit']}, load "
                          f"{r['load']:.1f} {r['statuses']} {r['errors']}{r['stderr_tail']}", file=sys.stderr,
                          flush=True)
            for name, p in _probes(cluster, job[1]).items():
                probes.setdefault(name, []).append(p)
            print(f"{n} nodes rep {rep} probes: " + ", ".join(
                f"{k} {v[-1]['wall_s']:.2f} s srun {v[-1]['srun_cpu_s']:.2f} CPU-s" for k, v in probes.items()),
                file=sys.stderr, flush=True)
        ctld_rss = _rss_mib(_pidfile(cluster.dir / "slurmctld.pid"))
        cluster.client(["scancel", job[1]], check=False)
    out: Dict[str, Any] = {"nodes": n, "bed_build_s": round(build_s, 1), "ctld_rss_mib": ctld_rss,
                           "tree_width": int(tree_width[1]) if tree_width else None, "runs": {}, "probes": {}}
    for key, samples in runs.items():
        med = {k: round(median([s[k] for s in samples]), 4) for k in samples[0] if isinstance(samples[0][k], float)}
        med.update({k: median([s[k] for s in samples]) for k in ("code_bytes", "sent_bytes", "sent_lines",
                                                                 "read_bytes")})
        out["runs"][key] = {**med, "exit": max(s["exit"] for s in samples), "samples": samples}
    for key, samples in probes.items():
        med = {k: round(median([s[k] for s in samples]), 4) for k in ("wall_s", "srun_cpu_s", "ctld_cpu_s",
                                                                      "slurmd_cpu_s")}
        out["probes"][key] = {**med, "read_bytes": median([s["read_bytes"] for s in samples]),
                              "exit": max(s["exit"] for s in samples), "samples": samples}
    out.update(probe_costs(out["probes"]))
    return out


def probe_costs(probes: Dict[str, Any]) -> Dict[str, float]:
    """The probes' srun CPU beyond the launch's, per byte and per line of stdin (written to every node of the
    step) and per byte of output forwarded back."""
    launch = probes["launch"]["srun_cpu_s"]
    bulk, lines, fanin = probes["bulk"], probes["lines"], probes["fanin"]
    return {"s_per_byte": (bulk["srun_cpu_s"] - launch) / bulk["samples"][0]["stdin_bytes"],
            "s_per_line": (lines["srun_cpu_s"] - launch) / lines["samples"][0]["stdin_lines"],
            "s_per_fanin_byte": (fanin["srun_cpu_s"] - launch) / max(1, fanin["read_bytes"])}


def _fit_dict(f: Fit, target: int = TARGET) -> Dict[str, Any]:
    return {"fixed": f.fixed, "per_node": f.per_unit, "residuals": list(f.residuals), "r2": f.r2,
            f"at_{target}": f.at(target)}


def model(sizes: List[Dict[str, Any]], target: int = TARGET, budget_s: float = BUDGET_S) -> Dict[str, Any]:
    """Lines through the medians per size; the coordinator's share at target nodes per workload (over srun)."""
    nodes = [float(s["nodes"]) for s in sizes]
    # srun's CPU per byte (bulk) and per line (paced) of stdin at each size, as fixed + per node it is written to.
    costs = [probe_costs(s["probes"]) for s in sizes]
    per_byte = fit_line(nodes, [c["s_per_byte"] for c in costs])
    per_line = fit_line(nodes, [c["s_per_line"] for c in costs])
    bcast = Broadcast(per_byte.fixed, per_byte.per_unit, per_line.fixed, per_line.per_unit)
    out: Dict[str, Any] = {"target_nodes": target, "budget_s": budget_s, "broadcast": vars(bcast), "lines": {},
                           "share": {}}
    out["lines"]["probe bulk|srun_s_per_byte"] = _fit_dict(per_byte, target)
    out["lines"]["probe lines|srun_s_per_line"] = _fit_dict(per_line, target)
    rests: Dict[Tuple[str, bool], Fit] = {}
    for key in [k for k in sizes[0]["runs"] if k.startswith("srun")]:  # first: the scenarios below use them all
        runs = [s["runs"][key] for s in sizes]
        code = [float(r["code_bytes"]) / _split(key) for r in runs]  # counted once per step, for each step's nodes
        req = [r["sent_bytes"] / s["nodes"] for r, s in zip(runs, sizes)]
        lines = [r["sent_lines"] / s["nodes"] for r, s in zip(runs, sizes)]
        for coalesced in (False, True):
            rests[key, coalesced] = srun_linear(nodes, [r["children_cpu_s"] for r in runs], bcast, code, req, lines,
                                                coalesced, _split(key))
    for key in sizes[0]["runs"]:
        runs = [s["runs"][key] for s in sizes]
        for metric in ("wall_s", "coord_cpu_s", "children_cpu_s", "tree_cpu_s", "all_connected_s"):
            out["lines"][f"{key}|{metric}"] = _fit_dict(fit_line(nodes, [r[metric] for r in runs]), target)
        if not key.startswith("srun"):
            continue
        code = [float(r["code_bytes"]) / _split(key) for r in runs]  # counted once per step, for each step's nodes
        req = [r["sent_bytes"] / s["nodes"] for r, s in zip(runs, sizes)]
        lines = [r["sent_lines"] / s["nodes"] for r, s in zip(runs, sizes)]
        work = Workload(code[-1], req[-1], lines[-1])  # what the largest size sent
        coord = fit_line(nodes, [r["coord_cpu_s"] for r in runs])
        out["lines"][f"{key}|srun_cpu_less_broadcast_s"] = _fit_dict(rests[key, False], target)
        if _split(key) > 1:
            continue
        for label, coalesced, steps in SCENARIOS:
            rest = rests[key, coalesced]
            split = rests.get((f"srun{SPLIT} gate", coalesced))
            if steps and split is not None:
                # What more steps cost srun beyond the broadcast (a client, a launch and an I/O setup each),
                # measured: the gate through SPLIT steps against one, per node.
                extra = max(0.0, split.per_unit - rests["srun gate", coalesced].per_unit)
                rest = Fit(rest.fixed, rest.per_unit + extra, rest.residuals, rest.r2)
            share = coordinator_share(target, coord, rest, bcast, work, coalesced, steps)
            out["share"][f"{key}, {label}"] = {
                **share, "code_bytes": work.code_bytes, "request_bytes_per_node": work.request_bytes_per_node,
                "lines_per_node": work.lines_per_node,
                "nodes_within_budget": nodes_within(budget_s, coord, rest, bcast, work, coalesced, steps)}
    for probe in sizes[0]["probes"]:
        for metric in ("wall_s", "srun_cpu_s", "ctld_cpu_s", "slurmd_cpu_s"):
            out["lines"][f"probe {probe}|{metric}"] = _fit_dict(
                fit_line(nodes, [s["probes"][probe][metric] for s in sizes]), target)
    return out


def print_tables(data: Dict[str, Any]) -> None:
    sizes = data["sizes"]
    rows = []
    for s in sizes:
        for key, r in s["runs"].items():
            ssh = s["runs"].get(f"ssh {key.split()[1]}")
            rows.append([s["nodes"], key, r["wall_s"], 1000 * r["coord_cpu_s"] / s["nodes"],
                         1000 * r["children_cpu_s"] / s["nodes"], 1000 * r["tree_cpu_s"] / s["nodes"],
                         r["all_connected_s"], r["sent_lines"] / s["nodes"], r["sent_bytes"] / s["nodes"],
                         r["read_bytes"] / s["nodes"], r["exit"],
                         round(r["wall_s"] / ssh["wall_s"], 2) if ssh and key.startswith("srun") else "",
                         round(r["tree_cpu_s"] / ssh["tree_cpu_s"], 2) if ssh and key.startswith("srun") else ""])
    print(table(["nodes", "run", "wall_s", "coord_ms/node", "children_ms/node", "tree_ms/node", "all_conn_s",
                 "lines/node", "sent_B/node", "read_B/node", "exit", "wall_vs_ssh", "tree_vs_ssh"], rows))
    print()
    print(table(["nodes", "tree_width", "launch_s", "launch_srun_s", "launch_ctld_s", "bulk_srun_s", "ns/byte",
                 "lines_srun_s", "us/line", "fanin_srun_s", "ns/fanin-byte", "build_s", "ctld_rss_mib"],
                [[s["nodes"], s["tree_width"], s["probes"]["launch"]["wall_s"], s["probes"]["launch"]["srun_cpu_s"],
                  s["probes"]["launch"]["ctld_cpu_s"], s["probes"]["bulk"]["srun_cpu_s"], 1e9 * c["s_per_byte"],
                  s["probes"]["lines"]["srun_cpu_s"], 1e6 * c["s_per_line"], s["probes"]["fanin"]["srun_cpu_s"],
                  1e9 * c["s_per_fanin_byte"], s["bed_build_s"], s["ctld_rss_mib"]]
                 for s, c in ((s, probe_costs(s["probes"])) for s in sizes)]))
    m = data["model"]
    target = m["target_nodes"]
    print(f"\nmodel (least squares over {[s['nodes'] for s in sizes]} nodes), not a measurement:")
    print(table(["what", "fixed_s", "per_node_ms", "residuals_s", "r2", f"at_{target}_s"],
                [[k, v["fixed"], 1000 * v["per_node"], " ".join(f"{r:+.3f}" for r in v["residuals"]), v["r2"],
                  v[f"at_{target}"]] for k, v in m["lines"].items()]))
    b = m["broadcast"]
    print(f"\ncoordinator share at {target} nodes (srun's stdin: {1e9 * b['per_byte']:.2f} + "
          f"{1e9 * b['per_byte_node']:.3f} x N ns per bulk byte, {1e6 * b['per_line']:.2f} + "
          f"{1e6 * b['per_line_node']:.3f} x N us per paced line):")
    print(table(["workload", "coordinator_s", "srun_per_node_s", "srun_broadcast_s", "serial_s", "parallel_s",
                 "lines/node", "request_B/node", "code_B", f"nodes_in_{m['budget_s']:.0f}s"],
                [[k, v["coordinator_s"], v["srun_per_node_s"], v["srun_broadcast_s"], v["serial_s"], v["parallel_s"],
                  v["lines_per_node"], v["request_bytes_per_node"], v["code_bytes"], v["nodes_within_budget"]]
                 for k, v in m["share"].items()]))
    print("\nmeasured srun CPU of the runs against the broadcast the probes predict for them (s):")
    print(table(["nodes", "run", "srun_cpu_s", "bcast_coalesced_s", "bcast_per_line_s"],
                [[s["nodes"], k, r["children_cpu_s"],
                  Broadcast(**b).seconds(s["nodes"], r["code_bytes"] / _split(k), r["sent_bytes"] / s["nodes"], 0,
                                         True, _split(k)),
                  Broadcast(**b).seconds(s["nodes"], r["code_bytes"] / _split(k), 0, r["sent_lines"] / s["nodes"],
                                         False, _split(k))]
                 for s in sizes for k, r in s["runs"].items() if k.startswith("srun")]))


def _split(key: str) -> int:
    """How many shared steps a run's key says it used ("srun4 gate": SPLIT; else 1)."""
    return SPLIT if key.split()[0].endswith(str(SPLIT)) else 1


NAMES = {"srun python|coord_cpu_s": "srun, python: coordinator process CPU",
         "srun gate|coord_cpu_s": "srun, gate: coordinator process CPU",
         "srun python|srun_cpu_less_broadcast_s": "srun, python: srun CPU less the broadcast (a message per line)",
         "srun gate|srun_cpu_less_broadcast_s": "srun, gate: srun CPU less the broadcast (a message per line)",
         "ssh python|coord_cpu_s": "SSH, python: coordinator process CPU",
         "ssh gate|coord_cpu_s": "SSH, gate: coordinator process CPU",
         "probe bulk|srun_s_per_byte": "srun CPU per stdin byte, bulk (probe)",
         "probe lines|srun_s_per_line": "srun CPU per stdin line, paced (probe)"}


def markdown(data: Dict[str, Any], cite: str, results: str = "bench/results/slurm-scale.json") -> str:
    """The tables of bench/README.md and docs/performance.md, each row citing `cite` (the results commit)."""
    sizes, m = data["sizes"], data["model"]
    end = f" | `{cite}` | `{results}` |"
    out = ["| nodes | checks | SSH wall s | srun wall s | srun / SSH wall | SSH coordinator ms/node | "
           "srun: coordinator ms/node | srun: srun client ms/node | srun / SSH coordinator tree CPU | commit | "
           "results |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for s in sizes:
        n = s["nodes"]
        for wl in WORKLOADS:
            for key in (f"srun {wl}", f"srun{SPLIT} {wl}"):
                r, ssh = s["runs"].get(key), s["runs"][f"ssh {wl}"]
                if r is None:
                    continue
                how = wl if key.startswith("srun ") else f"{wl}, {SPLIT} steps"
                out.append(f"| {n} | {how} | {ssh['wall_s']:.2f} | {r['wall_s']:.2f} | "
                           f"{r['wall_s'] / ssh['wall_s']:.2f} | "
                           f"{1000 * ssh['coord_cpu_s'] / n:.1f} | {1000 * r['coord_cpu_s'] / n:.1f} | "
                           f"{1000 * r['children_cpu_s'] / n:.1f} | {r['tree_cpu_s'] / ssh['tree_cpu_s']:.2f}" + end)
    out += ["", "| nodes | launch s | srun CPU ms, launch | srun CPU ns per stdin byte (bulk) | "
            "srun CPU us per stdin line (paced) | srun CPU ns per output byte | slurmctld CPU s per step | commit | "
            "results |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for s in sizes:
        c, p = probe_costs(s["probes"]), s["probes"]
        out.append(f"| {s['nodes']} | {p['launch']['wall_s']:.2f} | {1000 * p['launch']['srun_cpu_s']:.0f} | "
                   f"{1e9 * c['s_per_byte']:.0f} | {1e6 * c['s_per_line']:.0f} | {1e9 * c['s_per_fanin_byte']:.1f} | "
                   f"{p['launch']['ctld_cpu_s']:.2f}" + end)
    out += ["", "| line (least squares over the sizes) | fixed | per node | largest residual | r2 | commit | results |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    units = {"probe bulk|srun_s_per_byte": (1e9, "ns per byte"), "probe lines|srun_s_per_line": (1e6, "us per line")}
    for key in ("srun python|coord_cpu_s", "srun gate|coord_cpu_s", "srun python|srun_cpu_less_broadcast_s",
                "srun gate|srun_cpu_less_broadcast_s", "ssh python|coord_cpu_s", "ssh gate|coord_cpu_s",
                "probe bulk|srun_s_per_byte", "probe lines|srun_s_per_line"):
        f = m["lines"][key]
        scale, unit = units.get(key, (1.0, "s"))
        per = f"{scale * f['per_node']:.3f} {unit}" if unit != "s" else f"{1000 * f['per_node']:.2f} ms"
        out.append(f"| {NAMES.get(key, key)} | {scale * f['fixed']:.2f} {unit} | {per} | "
                   f"{scale * max(abs(r) for r in f['residuals']):.3f} {unit} | {f['r2']:.3f}" + end)
    out += ["", f"| {m['target_nodes']:,} nodes | coordinator s | srun: per node s | srun: broadcast s | "
            f"share s (one core) | nodes within {m['budget_s']:.0f} s | commit | results |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for key, v in m["share"].items():
        out.append(f"| {key.replace('srun ', '', 1)} | {v['coordinator_s']:.1f} | {v['srun_per_node_s']:.1f} | "
                   f"{v['srun_broadcast_s']:.1f} | **{v['serial_s']:.0f}** | {v['nodes_within_budget']:,}" + end)
    out += ["", "| nodes | run | srun CPU s, measured | broadcast predicted, coalesced | "
            "broadcast predicted, a message per line | commit | results |",
            "| ---: | --- | ---: | ---: | ---: | --- | --- |"]
    b = Broadcast(**m["broadcast"])
    for s in sizes:
        for k, r in s["runs"].items():
            if k.startswith("srun"):
                n = s["nodes"]
                code, steps = r["code_bytes"] / _split(k), _split(k)
                out.append(f"| {n} | {k} | {r['children_cpu_s']:.2f} | "
                           f"{b.seconds(n, code, r['sent_bytes'] / n, 0, True, steps):.2f} | "
                           f"{b.seconds(n, code, 0, r['sent_lines'] / n, False, steps):.2f}" + end)
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/slurm_scale.json)")
    parser.add_argument("--report", metavar="JSON", help="print the tables and the model of a results file (no run)")
    parser.add_argument("--markdown", metavar="COMMIT",
                        help="with --report: the Markdown tables instead, citing COMMIT")
    parser.add_argument("--add", action="store_true", help="add the sizes measured to --out's sizes (an earlier run "
                        "of the same commit) instead of starting a new file")
    args = parser.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        data["model"] = model(data["sizes"])
        if args.markdown:
            print(markdown(data, args.markdown, args.report))
        else:
            print_tables(data)
        return 0
    if len(set(args.sizes)) < 2 and not args.add:
        sys.exit("--sizes: the model needs at least two sizes")
    if bad := [n for n in args.sizes if not 2 <= n <= 252]:
        sys.exit(f"--sizes: {bad[0]} is outside 2..252 (one /24 holds the controller and 252 nodes)")
    if reason := slurm_unavailable_reason():
        sys.exit(f"cannot build the Slurm test bed here: {reason}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "preflight"],
                                capture_output=True, text=True).stdout.strip())
    data: Dict[str, Any] = {"commit": commit, "preflight_dirty": dirty, "cores": os.cpu_count(),
                            "workloads": WORKLOADS, "host_python": HOST_PYTHON, "reps": args.reps, "sizes": []}
    if args.add:
        if not args.out or not Path(args.out).exists():
            sys.exit("--add needs --out FILE, an earlier results file")
        data = json.loads(Path(args.out).read_text())
        changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", str(data.get("commit")), "HEAD", "--",
                                  "preflight"], capture_output=True).returncode
        if changed or dirty:
            sys.exit(f"--add: {args.out} measured {str(data.get('commit'))[:7]}, and preflight/ has changed since: "
                     "measure every size anew")
        data["added"] = {**data.get("added", {}), **{str(n): commit for n in args.sizes}}
        data["sizes"] = [s for s in data["sizes"] if s["nodes"] not in args.sizes]
    with tempfile.TemporaryDirectory(prefix="pf-slurm-scale-") as tmp:
        for n in sorted(args.sizes):
            data["sizes"].append(measure(n, args.reps, Path(tmp)))
            data["sizes"].sort(key=lambda s: s["nodes"])
            if len(data["sizes"]) >= 2:
                data["model"] = model(data["sizes"])
            write_json("slurm_scale", data, args.out)
    print_tables(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
