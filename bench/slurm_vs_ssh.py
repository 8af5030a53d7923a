"""Benchmark: the same host-light gate over SSH (paramiko, hostfile) and over srun job steps, on the same nodes.

Each size builds one Slurm test bed (tests/slurmcluster.py: a real slurmctld, one slurmd and one sshd per
namespace node, a shared munged) and allocates all its nodes once (`salloc --no-shell -N n`, outside the
timing). Then `preflight run --checks interfaces,memlock` runs over each transport, interleaved (ssh, srun,
ssh, srun, ...; a slow minute on this shared machine hits both alike), and the medians of 3 are reported:

- wall_s: the CLI's wall time, timed from the outside;
- coord_ms_per_host: CPU of the coordinator's Python process itself, per host;
- submit_ms_per_host: CPU of the whole submit host side per host: the coordinator plus the srun clients it
  starts (one per node; SSH has none), i.e. what the machine running preflight pays;
- first_host_s: when the first host was connected (its agent said hello), from the progress lines;
- ratio: srun over ssh for wall time and submit-host CPU.

Every "node" shares this machine's cores with slurmctld, the slurmds and the coordinator, so wall times are an
upper bound of what separate machines would show; CPU per host is the comparable figure. Needs root and the
Slurm packages (tests/install-deps.sh). Run it under the machine-wide lock, from the repository root:

    flock /work/issues/bench.lock nice -n 5 python3 bench/slurm_vs_ssh.py --sizes 16 64 \\
        --out bench/results/slurm_vs_ssh.json

Sample output:

    hosts  transport  wall_s  coord_ms_per_host  submit_ms_per_host  first_host_s  exit  load
       16        ssh    5.10              60.00               60.00          0.40     0  2.1
       16       srun    4.20              20.00               55.00          0.30     0  2.3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, median, table, write_json  # noqa: E402

from tests.slurmcluster import SlurmCluster, slurm_unavailable_reason  # noqa: E402

CHECKS = "interfaces,memlock"  # host facts read from /proc and /sys: no torch import, no compiler, no traffic
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


def _load() -> float:
    return os.getloadavg()[0]


def _run(cluster: SlurmCluster, transport: str, workdir: Path, env: Dict[str, str]) -> Dict[str, Any]:
    cpu_file, report = workdir / f"cpu-{transport}.json", workdir / f"report-{transport}.json"
    for f in (cpu_file, report):
        f.unlink(missing_ok=True)
    py = sys.executable
    args = ["run", "--python", py, "--checks", CHECKS, "--json", str(report), "--parallel", "64"]
    if transport == "ssh":
        hostfile = cluster.net.hostfile(workdir / "hostfile", names=cluster.names)
        args += ["--hostfile", str(hostfile), "--transport", "ssh", "--ssh-config", str(cluster.net.ssh_config),
                 "--ssh-key", str(cluster.net.user_key), "--known-hosts", str(cluster.net.known_hosts)]
    load = _load()
    start = time.monotonic()
    proc = subprocess.run([py, "-c", _WRAPPER, str(cpu_file), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    cpu = json.loads(cpu_file.read_text()) if cpu_file.exists() else {"self": float("nan"), "children": 0.0}
    data = json.loads(report.read_text()) if report.exists() else {}
    summary = data.get("summary", {})
    first = _FIRST.search(proc.stderr)
    problems = [f"{r['host']}::{r['check']} {r['status']}: {r['message'][:200]}"
                for r in data.get("results", []) if r["status"] not in ("pass", "skip")]
    return {"wall_s": wall, "coord_cpu_s": cpu["self"], "submit_cpu_s": cpu["self"] + cpu["children"],
            "first_host_s": float(first[1]) if first else float("nan"), "exit": proc.returncode, "load": load,
            "summary": {k: summary.get(k) for k in ("pass", "warn", "fail", "skip", "error")},
            "problems": problems[:10], "stderr_tail": "" if data else proc.stderr[-1500:]}


def _step_fanout(cluster: SlurmCluster, job: str, reps: int) -> Dict[str, float]:
    """`true` on every node: one srun step per node (what the transport does) vs one step over all nodes
    (`srun -N n --ntasks-per-node=1`), wall time and submit-host CPU, medians of reps."""
    n = len(cluster.names)
    base = ["srun", "--overlap", f"--jobid={job}", "--unbuffered"]
    per_node = [[*base, "-N1", "-n1", f"--nodelist={name}", "true"] for name in cluster.names]
    one = [[*base, f"-N{n}", "--ntasks-per-node=1", "true"]]
    out: Dict[str, list] = {"per_node_wall_s": [], "per_node_cpu_s": [], "one_step_wall_s": [], "one_step_cpu_s": []}
    for _ in range(reps):
        for key, argvs in (("per_node", per_node), ("one_step", one)):
            t = os.times()
            cpu0, start = t.children_user + t.children_system, time.monotonic()
            procs = [subprocess.Popen(a, env=cluster.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for a in argvs]
            for p in procs:
                p.wait(timeout=600)
            t = os.times()
            out[f"{key}_wall_s"].append(time.monotonic() - start)
            out[f"{key}_cpu_s"].append(t.children_user + t.children_system - cpu0)
    return {k: round(median(v), 3) for k, v in out.items()}


def measure(n: int, reps: int, workdir: Path) -> List[Dict[str, Any]]:
    built = time.monotonic()
    with SlurmCluster(n, ready_timeout=900.0) as cluster:
        build_s = time.monotonic() - built
        alloc = cluster.client(["salloc", "--no-shell", f"-N{n}"], timeout=300).stderr
        job = re.search(r"Granted job allocation (\d+)", alloc)
        assert job, alloc
        nodelist = cluster.client(["squeue", "-h", "-j", job[1], "-o", "%N"]).stdout.strip()
        ssh_env = dict(cluster.env)
        srun_env = dict(cluster.env, SLURM_JOB_ID=job[1], SLURM_JOB_NODELIST=nodelist,
                        SLURM_TASKS_PER_NODE=f"1(x{n})")
        samples: Dict[str, list] = {"ssh": [], "srun": []}
        for rep in range(reps):
            for transport, env in (("ssh", ssh_env), ("srun", srun_env)):  # interleaved
                s = _run(cluster, transport, workdir, env)
                samples[transport].append(s)
                print(f"{n} nodes {transport} rep {rep}: {s['wall_s']:.1f} s, coordinator {s['coord_cpu_s']:.2f} "
                      f"CPU-s, submit host {s['submit_cpu_s']:.2f} CPU-s, exit {s['exit']}, load {s['load']:.1f}"
                      f" {s['problems'][:2]}{s['stderr_tail']}", file=sys.stderr, flush=True)
        steps = _step_fanout(cluster, job[1], reps)
        cluster.client(["scancel", job[1]], check=False)
    rows = []
    for transport, runs in samples.items():
        med = {k: round(median([r[k] for r in runs]), 3)
               for k in ("wall_s", "coord_cpu_s", "submit_cpu_s", "first_host_s", "load")}
        rows.append({"hosts": n, "transport": transport, **med,
                     "coord_ms_per_host": round(1000 * med["coord_cpu_s"] / n, 1),
                     "submit_ms_per_host": round(1000 * med["submit_cpu_s"] / n, 1),
                     "exit": max(r["exit"] for r in runs), "bed_build_s": round(build_s, 1), "runs": runs})
    ssh, srun = rows
    srun["step_fanout"] = steps
    srun["wall_ratio"] = round(srun["wall_s"] / ssh["wall_s"], 2)
    srun["submit_cpu_ratio"] = round(srun["submit_cpu_s"] / ssh["submit_cpu_s"], 2)
    srun["coord_cpu_ratio"] = round(srun["coord_cpu_s"] / ssh["coord_cpu_s"], 2)
    return rows


def extrapolate(rows: List[Dict[str, Any]], targets=(1000, 4000)) -> List[Dict[str, Any]]:
    """Least-squares line through (hosts, value) per transport: fixed cost + per-host cost, evaluated at targets."""
    out = []
    for transport in ("ssh", "srun"):
        pts = [(r["hosts"], r) for r in rows if r["transport"] == transport]
        if len(pts) < 2:
            continue
        xs = [float(n) for n, _ in pts]
        for key in ("wall_s", "submit_cpu_s", "coord_cpu_s"):
            ys = [r[key] for _, r in pts]
            slope, icpt = statistics.linear_regression(xs, ys)
            out.append({"transport": transport, "metric": key, "fixed": round(icpt, 2),
                        "per_host_ms": round(slope * 1000, 1),
                        **{f"at_{t}": round(icpt + slope * t, 1) for t in targets}})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/slurm_vs_ssh.json)")
    args = parser.parse_args(argv)
    if reason := slurm_unavailable_reason():
        sys.exit(f"cannot build the Slurm test bed here: {reason}")
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pf-slurm-bench-") as tmp:
        for n in args.sizes:
            rows += measure(n, args.reps, Path(tmp))
            write_json("slurm_vs_ssh", {"checks": CHECKS, "reps": args.reps, "rows": rows,
                                        "extrapolation": extrapolate(rows)}, args.out)
    print(table(["hosts", "transport", "wall_s", "coord_ms/host", "submit_ms/host", "first_host_s", "exit",
                 "load", "wall_ratio", "cpu_ratio"],
                [[r["hosts"], r["transport"], r["wall_s"], r["coord_ms_per_host"], r["submit_ms_per_host"],
                  r["first_host_s"], r["exit"], r["load"], r.get("wall_ratio", ""), r.get("submit_cpu_ratio", "")]
                 for r in rows]))
    print()
    print(table(["hosts", "per_node_wall_s", "per_node_cpu_s", "one_step_wall_s", "one_step_cpu_s"],
                [[r["hosts"], *(r["step_fanout"][k] for k in ("per_node_wall_s", "per_node_cpu_s",
                                                              "one_step_wall_s", "one_step_cpu_s"))]
                 for r in rows if "step_fanout" in r]))
    ex = extrapolate(rows)
    if ex:
        print()
        print(table(["transport", "metric", "fixed", "per_host_ms", "at_1000", "at_4000"],
                    [[e["transport"], e["metric"], e["fixed"], e["per_host_ms"], e["at_1000"], e["at_4000"]]
                     for e in ex]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
