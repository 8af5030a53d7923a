"""Benchmark: the same host-light gate over SSH (paramiko, hostfile) and over srun job steps, on the same nodes.

Each size builds one Slurm test bed (tests/slurmcluster.py: a real slurmctld, one slurmd and one sshd per
namespace node, a shared munged; every node's ~/.bashrc is /dev/null, as in bench/scale.py, so that SSH's
login shell does not pay root's pyenv init, which srun's directly exec'd tasks never run) and allocates all its
nodes once (`salloc --no-shell -N n`, outside the timing). Then `preflight run --checks interfaces,memlock`
runs over each transport, interleaved (ssh, srun, srun-per-node, ssh, ...; a slow minute on this shared machine
hits all alike), and the medians of --reps are reported. The transports: ssh (a hostfile), srun (every node's
agent in one shared step, the default) and srun-per-node (`--srun-steps per-node`: a step per node):

- wall_s: the CLI's wall time, timed from the outside;
- coord_ms_per_host: CPU of the coordinator's Python process itself, per host;
- submit_ms_per_host: CPU of the whole submit host side per host: the coordinator plus the srun clients it
  starts (one per node; SSH has none), i.e. what the machine running preflight pays;
- first_host_s: when the first host was connected (its agent said hello), from the progress lines;
- ctld_cpu_s: slurmctld's CPU (from /proc, its pid file) during the run;
- ratio: each srun mode over ssh for wall time and CPU; vs_per_node: the shared step over a step per node.

Then the per-host check phase alone, both ways, side by side (interleaved, medians of --reps), twice: with
`true` (launch only) and with the real agent running the same collect request (the agent code on stdin, kept
open as the lifeline until every host's result is in):

- per_node: one step per node, all at once, exactly as SrunTransport starts them
  (`srun --overlap --exact -N1 -n1 --unbuffered --nodelist=HOST`);
- one_step: one step over every node (`srun -N n --ntasks-per-node=1 --label --input=all`): stdin broadcast to
  every task, output split by the task label. Same request for every host (the checks here need no per-host
  parameter), which is what a routing layer over srun's one stdin would have to generalise.

Every "node" shares this machine's cores with slurmctld, the slurmds and the coordinator, so wall times are an
upper bound of what separate machines would show; CPU per host is the comparable figure. The bed is one /24
(tests/netcluster.py MAX_NAMESPACES = 253 hosts: the controller and 252 nodes), which caps a size at 252. Needs
root and the Slurm packages (tests/install-deps.sh). Run it under the machine-wide lock, from the repository root:

    flock /tmp/bench.lock nice -n 5 python3 bench/slurm_vs_ssh.py --sizes 16 64 128 \\
        --out bench/results/slurm_vs_ssh.json
    python3 bench/slurm_vs_ssh.py --report bench/results/slurm_vs_ssh.json bench/results/slurm_vs_ssh-max.json

Sample output (first table; bench/results/slurm_vs_ssh.txt has all three):

    hosts  transport  wall_s  coord_ms/host  submit_ms/host  first_host_s  ctld_ms/step  exit   load  wall_ratio ...
       16        ssh    1.54          31.90           31.90          0.60                   0  10.18
       16       srun    1.50          18.80           30.00          0.80          1.88     0  10.64        0.98 ...
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, median, table, write_json  # noqa: E402

from preflight.hostside.agent import BOOTSTRAP, RESULT  # noqa: E402
from preflight.remote import agent_code  # noqa: E402
from preflight.transport.srun import SrunTransport  # noqa: E402
from tests.slurmcluster import SlurmCluster, slurm_unavailable_reason  # noqa: E402

CHECKS = "interfaces,memlock"  # host facts read from /proc and /sys: no torch import, no compiler, no traffic
BASHRC = Path.home() / ".bashrc"
# One neighbour (ARP) table serves every namespace: the root namespace and the controller each hold an entry per
# node, and slurmd's tree fan-out adds node-to-node entries. Past gc_thresh2 (512) the kernel evicts entries
# that are in use, past gc_thresh3 (1,024) it drops packets ("neighbour table overflow", bench/scale.py at 1,000
# hosts). Raised from 64 nodes on, restored afterwards.
NEIGHBOUR = (("gc_thresh1", 1024), ("gc_thresh2", 4096), ("gc_thresh3", 8192))
# The coordinator runs in-process under this wrapper, which writes its own CPU and its reaped children's CPU
# (the srun clients) when it ends.
_WRAPPER = """
import json, os, sys
from preflight.cli import main
rc = 1
try:
    rc = main(sys.argv[2:])
finally:
    t = os.times()
    with open(sys.argv[1], "w") as f:
        json.dump({"self": t.user + t.system, "children": t.children_user + t.children_system}, f)
sys.exit(rc)
"""
_FIRST = re.compile(r"\[\s*([\d.]+)s\] connecting: 1/")
_LABEL = re.compile(rb"^\s*(\d+): ?(.*)$", re.S)
_TICK = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _neighbour_table(n: int) -> Iterator[Dict[str, int]]:
    """NEIGHBOUR's values for the bed's lifetime (from 64 nodes on); yields what is in force."""
    saved: Dict[str, int] = {}
    try:
        for key, value in NEIGHBOUR:
            path = Path(f"/proc/sys/net/ipv4/neigh/default/{key}")
            saved[key] = int(path.read_text())
            if n >= 64 and saved[key] < value:
                path.write_text(f"{value}\n")
        yield {key: int(Path(f"/proc/sys/net/ipv4/neigh/default/{key}").read_text()) for key, _ in NEIGHBOUR}
    finally:
        for key, value in saved.items():
            Path(f"/proc/sys/net/ipv4/neigh/default/{key}").write_text(f"{value}\n")


def _machine() -> Dict[str, Any]:
    """What may cap the bed's size: available memory, kernel tasks (threads), load."""
    mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {"mem_available_mib": int(mem["MemAvailable"].split()[0]) // 1024,
            "tasks": int(Path("/proc/loadavg").read_text().split()[3].split("/")[1]), "load": round(_load(), 1)}


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _pidfile(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _daemon_cpu(cluster: SlurmCluster) -> Dict[str, float]:
    """CPU seconds so far of slurmctld and of every slurmd together (their own pid files)."""
    ctld = _proc_cpu(_pidfile(cluster.dir / "slurmctld.pid"))
    slurmd = sum(_proc_cpu(_pidfile(cluster.dir / "nodes" / name / "slurmd.pid")) for name in cluster.names)
    return {"ctld": ctld, "slurmd": slurmd}


def _ctld_log_size(cluster: SlurmCluster) -> int:
    try:
        return (cluster.dir / "slurmctld.log").stat().st_size
    except OSError:
        return 0


def _ctld_errors(cluster: SlurmCluster, since: int) -> Dict[str, int]:
    """slurmctld's error lines logged after byte offset since, counted by their text without numbers (a busy
    controller says so there: retries, timeouts, step-create failures)."""
    try:
        with open(cluster.dir / "slurmctld.log", "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    counts: Dict[str, int] = {}
    for line in text.splitlines():
        if "error" in line.lower():
            key = re.sub(r"\d+", "N", line.split("] ", 1)[-1])[:100]
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:5])


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def _load() -> float:
    return os.getloadavg()[0]


def _run(cluster: SlurmCluster, transport: str, workdir: Path, env: Dict[str, str]) -> Dict[str, Any]:
    cpu_file, report = workdir / f"cpu-{transport}.json", workdir / f"report-{transport}.json"
    for f in (cpu_file, report):
        f.unlink(missing_ok=True)
    py = sys.executable
    args = ["run", "--python", py, "--checks", CHECKS, "--json", str(report), "--parallel", "64"]
    if transport != "ssh":
        args += ["--srun-steps", "per-node" if transport == "srun-per-node" else "shared"]
    if transport == "ssh":
        hostfile = cluster.net.hostfile(workdir / "hostfile", names=cluster.names)
        args += ["--hostfile", str(hostfile), "--transport", "ssh", "--ssh-config", str(cluster.net.ssh_config),
                 "--ssh-key", str(cluster.net.user_key), "--known-hosts", str(cluster.net.known_hosts)]
    load = _load()
    daemons, log_mark = _daemon_cpu(cluster), _ctld_log_size(cluster)
    start = time.monotonic()
    proc = subprocess.run([py, "-c", _WRAPPER, str(cpu_file), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    after = _daemon_cpu(cluster)
    cpu = json.loads(cpu_file.read_text()) if cpu_file.exists() else {"self": float("nan"), "children": 0.0}
    data = json.loads(report.read_text()) if report.exists() else {}
    summary = data.get("summary", {})
    first = _FIRST.search(proc.stderr)
    problems = [f"{r['host']}::{r['check']} {r['status']}: {r['message'][:200]}"
                for r in data.get("results", []) if r["status"] not in ("pass", "skip")]
    return {"wall_s": wall, "coord_cpu_s": cpu["self"], "submit_cpu_s": cpu["self"] + cpu["children"],
            "first_host_s": float(first[1]) if first else float("nan"), "exit": proc.returncode, "load": load,
            "ctld_cpu_s": after["ctld"] - daemons["ctld"], "slurmd_cpu_s": after["slurmd"] - daemons["slurmd"],
            "ctld_errors": _ctld_errors(cluster, log_mark),
            "summary": {k: summary.get(k) for k in ("pass", "warn", "fail", "skip", "error")},
            "problems": problems[:10], "stderr_tail": "" if data else proc.stderr[-1500:]}


def _phase(cluster: SlurmCluster, argvs: Sequence[Sequence[str]], payload: Optional[bytes],
           per_proc: int, labelled: bool) -> Dict[str, Any]:
    """Start every argv at once. With a payload, each srun gets it on stdin, which stays open (the agents'
    lifeline) until that srun has brought per_proc RESULT lines back; then EOF ends the step. Returns wall time
    until the last srun exited, the first and last result's time, the srun clients' CPU (reaped children),
    slurmctld's and the slurmds' CPU, and the results by host name."""
    results: Dict[str, Dict[str, Any]] = {}
    times: List[float] = []
    lock = threading.Lock()
    t0, d0, log_mark, start = os.times(), _daemon_cpu(cluster), _ctld_log_size(cluster), time.monotonic()
    procs = [subprocess.Popen(a, env=cluster.env, stdin=subprocess.PIPE if payload else subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in argvs]
    srun_errors: Dict[str, int] = {}  # what the srun clients said on stderr (retries, timeouts), by text

    def drain(proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            key = re.sub(r"\d+", "N", line.decode(errors="replace").strip())[:100]
            with lock:
                srun_errors[key] = srun_errors.get(key, 0) + 1

    def pump(proc: subprocess.Popen) -> None:
        written = threading.Event()
        if payload:
            def write() -> None:
                try:
                    proc.stdin.write(payload)
                    proc.stdin.flush()
                except OSError:
                    pass
                written.set()
            threading.Thread(target=write, daemon=True).start()
        seen = 0
        pending: Dict[bytes, bytes] = {}  # task label -> the part of its RESULT line read so far
        for line in proc.stdout:
            if labelled:
                # With --unbuffered, srun labels every chunk it forwards and ends each with a newline, so one
                # long line of a task arrives as several labelled lines: join them again per label. A JSON line
                # has no newline inside, so this is exact here; the agent's binary frames could not be mended.
                m = _LABEL.match(line)
                if not m:
                    continue
                label, part = m[1], m[2].rstrip(b"\n")
                if part.startswith(RESULT.encode()):
                    pending[label] = part
                elif label in pending:
                    pending[label] += part
                line = pending.get(label, b"")
            if not line.startswith(RESULT.encode()):
                continue
            try:
                res = json.loads(line[len(RESULT):])
            except ValueError:
                continue
            if labelled:
                del pending[m[1]]
            with lock:
                times.append(time.monotonic() - start)
                results[str(res.get("host", {}).get("hostname"))] = res
            seen += 1
            if seen >= per_proc and payload:
                written.wait(60)
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    pumps = [threading.Thread(target=pump, args=(p,), daemon=True) for p in procs]
    pumps += [threading.Thread(target=drain, args=(p,), daemon=True) for p in procs]
    for t in pumps:
        t.start()
    try:
        for p in procs:
            p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        cluster.kill_clients()
        raise
    wall = time.monotonic() - start
    for t in pumps:
        t.join(10)
    t1, d1 = os.times(), _daemon_cpu(cluster)
    ok = sorted(h for h, r in results.items() if r.get("ok")
                and all("error" not in v for v in r.get("value", {}).values()))
    return {"wall_s": wall, "cpu_s": t1.children_user + t1.children_system - t0.children_user - t0.children_system,
            "ctld_cpu_s": d1["ctld"] - d0["ctld"], "slurmd_cpu_s": d1["slurmd"] - d0["slurmd"],
            "first_result_s": min(times) if times else float("nan"),
            "last_result_s": max(times) if times else float("nan"), "hosts_ok": ok,
            "exit": max(p.returncode for p in procs), "ctld_errors": _ctld_errors(cluster, log_mark),
            "srun_stderr": dict(sorted(srun_errors.items(), key=lambda kv: -kv[1])[:5])}


def _check_phase(cluster: SlurmCluster, job: str, reps: int) -> Dict[str, Any]:
    """The per-host check phase two ways, for `true` and for the agent's collect request: one step per node
    (SrunTransport's own argv) vs one step over every node with its output split by task label."""
    n, names = len(cluster.names), cluster.names
    addrs = [cluster.net.host(h).addresses[0] for h in names]
    token = "pf-bench-phase"
    agent = [sys.executable, "-c", BOOTSTRAP, token]
    code = agent_code()
    request = {"op": "collect", "checks": CHECKS.split(","), "timeout": 60.0,
               "params": {"slots": 1, "master": addrs[0], "master_name": names[0], "hosts": addrs}}
    payload = b"%d\n" % len(code) + code + json.dumps(request).encode() + b"\n"
    one = ["srun", "--overlap", "--exact", f"-N{n}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--unbuffered",
           "--label", "--input=all", f"--jobid={job}", "--"]
    workloads = {"true": (["true"], None), "check": (agent, payload)}
    out: Dict[str, Any] = {}
    for wl, (argv, data) in workloads.items():
        samples: Dict[str, List[Dict[str, Any]]] = {"per_node": [], "one_step": []}
        for _ in range(reps):  # interleaved, like the transports
            samples["per_node"].append(_phase(cluster, [SrunTransport(h, job).srun_argv(argv) for h in names],
                                              data, 1, False))
            samples["one_step"].append(_phase(cluster, [one + argv], data, n, True))
        for mode, runs in samples.items():
            steps = n if mode == "per_node" else 1
            med = {k: round(median([r[k] for r in runs]), 3)
                   for k in ("wall_s", "cpu_s", "ctld_cpu_s", "slurmd_cpu_s", "first_result_s", "last_result_s")}
            out[f"{wl}_{mode}"] = {**med, "steps": steps,
                                   "ctld_ms_per_step": round(1000 * med["ctld_cpu_s"] / steps, 2),
                                   "cpu_ms_per_host": round(1000 * med["cpu_s"] / n, 2),
                                   "hosts_ok": min(len(r["hosts_ok"]) for r in runs) if wl == "check" else None,
                                   "exit": max(r["exit"] for r in runs),
                                   "runs": [{k: v for k, v in r.items() if k != "hosts_ok"} for r in runs]}
        pn, os_ = out[f"{wl}_per_node"], out[f"{wl}_one_step"]
        out[f"{wl}_wall_ratio"] = round(os_["wall_s"] / pn["wall_s"], 2) if pn["wall_s"] else None
        out[f"{wl}_cpu_ratio"] = round(os_["cpu_s"] / pn["cpu_s"], 2) if pn["cpu_s"] else None
        print(f"{n} nodes check phase ({wl}): per-node steps {pn['wall_s']:.2f} s {pn['cpu_s']:.2f} CPU-s, "
              f"one step {os_['wall_s']:.2f} s {os_['cpu_s']:.2f} CPU-s, hosts ok {pn['hosts_ok']}/{os_['hosts_ok']}; "
              f"srun stderr {[r['srun_stderr'] for r in samples['per_node']]} / "
              f"{[r['srun_stderr'] for r in samples['one_step']]}; slurmctld errors "
              f"{[r['ctld_errors'] for r in samples['per_node'] + samples['one_step']]}", file=sys.stderr, flush=True)
    return out


TRANSPORTS = ("ssh", "srun", "srun-per-node")


def measure(n: int, reps: int, workdir: Path, transports: Sequence[str] = TRANSPORTS,
            phase: bool = True) -> List[Dict[str, Any]]:
    machine0 = _machine()
    built = time.monotonic()
    setup = {}
    if BASHRC.exists():
        setup = {f"slm{i + 1}": [["mount", "--bind", "/dev/null", str(BASHRC)]] for i in range(n)}
    with _neighbour_table(n) as neigh, SlurmCluster(n, setup=setup, ready_timeout=900.0) as cluster:
        build_s = time.monotonic() - built
        machine1 = _machine()
        ctld_pid = _pidfile(cluster.dir / "slurmctld.pid")
        taken = machine0["mem_available_mib"] - machine1["mem_available_mib"]
        print(f"{n} nodes: bed built in {build_s:.0f} s; {taken} MiB and "
              f"{machine1['tasks'] - machine0['tasks']} tasks taken", file=sys.stderr, flush=True)
        alloc = cluster.client(["salloc", "--no-shell", f"-N{n}"], timeout=300).stderr
        job = re.search(r"Granted job allocation (\d+)", alloc)
        assert job, alloc
        nodelist = cluster.client(["squeue", "-h", "-j", job[1], "-o", "%N"]).stdout.strip()
        ssh_env = dict(cluster.env)
        srun_env = dict(cluster.env, SLURM_JOB_ID=job[1], SLURM_JOB_NODELIST=nodelist,
                        SLURM_TASKS_PER_NODE=f"1(x{n})")
        samples: Dict[str, list] = {t: [] for t in transports}
        for rep in range(reps):
            for transport in transports:  # interleaved
                s = _run(cluster, transport, workdir, ssh_env if transport == "ssh" else srun_env)
                samples[transport].append(s)
                print(f"{n} nodes {transport} rep {rep}: {s['wall_s']:.1f} s, coordinator {s['coord_cpu_s']:.2f} "
                      f"CPU-s, submit host {s['submit_cpu_s']:.2f} CPU-s, slurmctld {s['ctld_cpu_s']:.2f} CPU-s, "
                      f"exit {s['exit']}, load {s['load']:.1f} {s['summary']} {s['problems'][:2]}{s['stderr_tail']} "
                      f"slurmctld errors {s['ctld_errors']}",
                      file=sys.stderr, flush=True)
        steps = _check_phase(cluster, job[1], reps) if phase else {}
        ctld_rss = _rss_mib(ctld_pid)
        cluster.client(["scancel", job[1]], check=False)
    bed = {"bed_build_s": round(build_s, 1), "neighbour_thresholds": neigh,
           "bed_mem_mib": machine0["mem_available_mib"] - machine1["mem_available_mib"],
           "bed_tasks": machine1["tasks"] - machine0["tasks"], "mem_available_mib": machine1["mem_available_mib"],
           "ctld_rss_mib": ctld_rss}
    rows = []
    for transport, runs in samples.items():
        med = {k: round(median([r[k] for r in runs]), 3)
               for k in ("wall_s", "coord_cpu_s", "submit_cpu_s", "first_host_s", "load", "ctld_cpu_s",
                         "slurmd_cpu_s")}
        rows.append({"hosts": n, "transport": transport, **med,
                     "coord_ms_per_host": round(1000 * med["coord_cpu_s"] / n, 1),
                     "submit_ms_per_host": round(1000 * med["submit_cpu_s"] / n, 1),
                     "exit": max(r["exit"] for r in runs), **bed, "runs": runs})
    by = {r["transport"]: r for r in rows}
    srun_rows = [r for r in rows if r["transport"] != "ssh"]
    if srun_rows and steps:
        srun_rows[0]["check_phase"] = steps
    for name, row in by.items():
        if name == "ssh":
            continue
        for base, prefix in (("ssh", ""), ("srun-per-node", "vs_per_node_")):
            other = by.get(base)
            if other is None or other is row:
                continue
            for key, label in (("wall_s", "wall_ratio"), ("submit_cpu_s", "submit_cpu_ratio"),
                               ("coord_cpu_s", "coord_cpu_ratio"), ("first_host_s", "first_host_ratio")):
                row[prefix + label] = round(row[key] / other[key], 2) if other[key] else None
    return rows


FITTED = ("wall_s", "coord_cpu_s", "submit_cpu_s", "first_host_s")


def extrapolate(rows: List[Dict[str, Any]], targets=(1000, 4000)) -> List[Dict[str, Any]]:
    """A model, not a measurement: least-squares line through (hosts, value) per transport (fixed cost +
    per-host cost), evaluated at targets; the per-host check phase's two modes get the same fit."""
    out = []
    series: Dict[str, List[tuple]] = {}
    for r in rows:
        for key in FITTED:
            series.setdefault(f"{r['transport']}|{key}", []).append((r["hosts"], r[key]))
        for mode in ("per_node", "one_step"):
            phase = r.get("check_phase", {}).get(f"check_{mode}")
            if phase:
                for key in ("wall_s", "cpu_s"):
                    series.setdefault(f"srun check phase {mode}|{key}", []).append((r["hosts"], phase[key]))
    for name, pts in series.items():
        if len({n for n, _ in pts}) < 2:
            continue
        what, key = name.split("|")
        slope, icpt = statistics.linear_regression([float(n) for n, _ in pts], [float(v) for _, v in pts])
        out.append({"transport": what, "metric": key, "fixed": round(icpt, 2), "per_host_ms": round(slope * 1000, 2),
                    **{f"at_{t}": round(icpt + slope * t, 1) for t in targets}})
    return out


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(table(["hosts", "transport", "wall_s", "coord_ms/host", "submit_ms/host", "first_host_s", "ctld_cpu_s",
                 "exit", "load", "wall_ratio", "coord_ratio", "submit_ratio", "first_ratio", "wall_vs_per_node",
                 "submit_vs_per_node"],
                [[r["hosts"], r["transport"], r["wall_s"], r["coord_ms_per_host"], r["submit_ms_per_host"],
                  r["first_host_s"], r.get("ctld_cpu_s", ""), r["exit"], r["load"], r.get("wall_ratio", ""),
                  r.get("coord_cpu_ratio", ""), r.get("submit_cpu_ratio", ""), r.get("first_host_ratio", ""),
                  r.get("vs_per_node_wall_ratio", ""), r.get("vs_per_node_submit_cpu_ratio", "")]
                 for r in rows]))
    print()
    phase_rows = []
    for r in rows:
        for wl in ("true", "check"):
            ph = r.get("check_phase", {})
            if f"{wl}_per_node" not in ph:
                continue
            pn, one = ph[f"{wl}_per_node"], ph[f"{wl}_one_step"]
            phase_rows.append([r["hosts"], wl, pn["wall_s"], one["wall_s"], ph[f"{wl}_wall_ratio"],
                               pn["cpu_ms_per_host"], one["cpu_ms_per_host"], ph[f"{wl}_cpu_ratio"],
                               pn["ctld_ms_per_step"], one["ctld_ms_per_step"], pn["last_result_s"],
                               one["last_result_s"],
                               f"{pn['hosts_ok']}/{one['hosts_ok']}" if wl == "check" else ""])
    print(table(["hosts", "work", "per_node_s", "one_step_s", "wall_ratio", "per_node_ms/host", "one_step_ms/host",
                 "cpu_ratio", "ctld_ms/step_pn", "ctld_ms/step_one", "last_result_pn", "last_result_one", "ok"],
                phase_rows))
    print()
    print(table(["hosts", "build_s", "bed_mem_mib", "bed_tasks", "mem_available_mib", "ctld_rss_mib"],
                [[r["hosts"], r["bed_build_s"], r["bed_mem_mib"], r["bed_tasks"], r["mem_available_mib"],
                  r["ctld_rss_mib"]] for r in rows if r["transport"] == "ssh"]))
    ex = extrapolate(rows)
    if ex:
        print()
        print("model (least squares, fixed + per host), not a measurement:")
        print(table(["what", "metric", "fixed", "per_host_ms", "at_1000", "at_4000"],
                    [[e["transport"], e["metric"], e["fixed"], e["per_host_ms"], e["at_1000"], e["at_4000"]]
                     for e in ex]))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--no-phase", action="store_true", help="skip the raw per-host check phase comparison")
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/slurm_vs_ssh.json)")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print the tables and the model of earlier "
                        "results files together (no run)")
    args = parser.parse_args(argv)
    if args.report:
        merged = [r for f in args.report for r in json.loads(Path(f).read_text())["rows"]]
        print_tables(sorted(merged, key=lambda r: (r["hosts"], TRANSPORTS.index(r["transport"])
                                                   if r["transport"] in TRANSPORTS else 9)))
        return 0
    if bad := [n for n in args.sizes if not 1 <= n <= 252]:
        sys.exit(f"--sizes: {bad[0]} is outside 1..252 (one /24 holds the controller and 252 nodes)")
    if reason := slurm_unavailable_reason():
        sys.exit(f"cannot build the Slurm test bed here: {reason}")
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pf-slurm-bench-") as tmp:
        for n in args.sizes:
            rows += measure(n, args.reps, Path(tmp), args.transports, not args.no_phase)
            write_json("slurm_vs_ssh", {"checks": CHECKS, "reps": args.reps, "cores": os.cpu_count(), "rows": rows,
                                        "extrapolation": extrapolate(rows)}, args.out)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
