"""Benchmark: wall time of a default `preflight run` for 1, 4, 16 and 64 namespace hosts, and T(n)/T(1).

Every size gets a fresh namespace cluster (real sshd per host); the run is the real CLI with the default
checks (no --checks), timed from the outside. Besides the wall time, it reports the CPU seconds spent on the
hosts' side (every process in the hosts' namespaces: agents, iperf3, torch ranks) and by the coordinator,
because on one machine all "hosts" share its cores: a run whose hosts need 100 CPU-seconds cannot take less
than 50 s on 2 cores, however parallel the fan-out. `floor_s` is that bound, and `fanout_ratio` compares
T(n) - floor with T(1): what the coordinator adds as hosts are added. Needs root. From the repository root:

    python3 bench/scale.py                      # sizes 1 4 16 64
    python3 bench/scale.py --sizes 1 4 --out /tmp/scale.json
    python3 bench/scale.py --checks libaio,nvme,interfaces,versions,ports,launcher_ssh \
        --out bench/results/scale-light.json
    python3 bench/scale.py --versus --sizes 64 256 --out bench/results/scale-versus-64-256.json
    python3 bench/scale.py --versus --sizes 1000 --profile --out bench/results/scale-versus-1000.json
    python3 bench/scale.py --versus --sizes 256 --tools preflight,preflight@/tmp/old --out /tmp/ab.json

--versus is the host-light series against pdsh and ClusterShell (apt: pdsh, clustershell): on the same hosts,
each tool starts the hosts' bare Python once per host (preflight: connect, agent, the nvme check with no
path, clean-up; pdsh and clush: `python -c 'import platform'`), all with a fan-out of 32, interleaved
(preflight, pdsh, clush, repeated 3 times) and reported as medians, each with the machine's busy CPU over the
run (/proc/stat), the one count that also sees the agents that outlive their SSH session. Above 250 hosts
several namespace clusters are combined into one hostfile (one cluster holds at most 253 hosts), and the
coordinator's ARP table is raised (see _raise_neighbour_table). Each host gets an empty ~/.bashrc. --profile records one more
preflight run of the biggest size with py-spy (GIL-holding samples, raw stacks kept in
bench/results/profile-N.txt) and prints the top 10 functions by own time.

Sample output:

    hosts  wall_s  ratio  host_cpu_s  coord_cpu_s  floor_s  exit
        1    6.10   1.00        5.20         0.90     2.60     0
       64   90.00  14.75      160.00        12.00    80.00     1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, ROOT, NetCluster, median, preflight, require_netcluster, table, write_json  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
# Checks that cost the hosts little CPU (no torch import, no bulk traffic): what the coordinator's fan-out
# costs by itself, since on one machine the hosts' own work competes with it for the same cores.
LIGHT = "libaio,nvme,interfaces,versions,ports,launcher_ssh"


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the preflight CLI is one)."""
    t = os.times()
    return t.children_user + t.children_system


def namespace_cpu(cluster: NetCluster) -> float:
    """CPU seconds consumed so far by the live processes in the hosts' namespaces, their dead children included.

    sshd forks a process per session; when a session ends its process is reaped by the host's sshd, whose
    cstime/cutime (fields 16, 17 of /proc/PID/stat) then hold it: the master sshd's own times cover them all.
    """
    total = 0
    for h in cluster.hosts:
        try:
            fields = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After ")" field 3 (state) is index 0: utime=14, stime=15, cutime=16, cstime=17 -> 11..14.
        total += sum(int(v) for v in fields[11:15])
    return total / TICKS


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy so far (/proc/stat: every state but idle and iowait).

    The namespace accounting above sees a process only once a process of the host has reaped it: an agent that
    outlives its SSH session (the coordinator closes the channel without waiting for the exit) is reparented
    outside the host's tree and never counted. On a machine that runs nothing else, the machine's busy CPU over a
    run is the whole bill: coordinator, sshd, the hosts' commands and the kernel's work for all of them.
    """
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICKS


def measure(n: int, workdir: Path, checks: str) -> dict:
    with NetCluster(n) as cluster:
        cpu0, ns0 = children_cpu(), namespace_cpu(cluster)
        run = preflight(cluster, workdir / f"n{n}", *(["--checks", checks] if checks else []))
        time.sleep(0.5)  # sshd reaps the session processes just after the channels close
        host_cpu = namespace_cpu(cluster) - ns0
        coord_cpu = children_cpu() - cpu0
    summary = run.report.get("summary", {})
    return {"hosts": n, "wall_s": run.wall_s, "exit_code": run.exit_code, "host_cpu_s": round(host_cpu, 2),
            "coordinator_cpu_s": round(coord_cpu, 2), "check_s": run.check_seconds(),
            "summary": {k: summary.get(k) for k in ("pass", "warn", "fail", "skip", "error")},
            "problems": run.problems()}


# --- the host-light series against pdsh and ClusterShell ---------------------------------------------------

FANOUT = 32
PER_CLUSTER = 250
BASHRC = Path.home() / ".bashrc"
TOOLS = ("preflight", "pdsh", "clush")


def _raise_neighbour_table(n: int) -> None:
    """Let the coordinator's ARP table hold every host at once.

    Linux keeps at most net.ipv4.neigh.default.gc_thresh3 neighbour entries (1,024 by default, and over
    gc_thresh2, 512, it starts evicting). preflight holds every host's connection open for the whole run, so at
    1,000 hosts on one L2 segment the table overflowed ("neighbour table overflow!" in dmesg) and 488 hosts
    failed with "No route to host" or TCP timeouts. pdsh and clush, 32 connections at a time, never hit it. A
    real coordinator of that many hosts on one segment needs the same settings.
    """
    for key, value in (("gc_thresh1", 1024), ("gc_thresh2", 4096), ("gc_thresh3", 8192)):
        path = Path(f"/proc/sys/net/ipv4/neigh/default/{key}")
        try:
            if int(path.read_text()) < value and n > 250:
                path.write_text(f"{value}\n")
        except (OSError, ValueError) as exc:
            print(f"cannot raise {path}: {exc}", file=sys.stderr)


def _clusters(n: int, stack) -> list:
    """Namespace clusters holding n hosts, each host with an empty login shell.

    root's ~/.bashrc here runs `pyenv init` (about 140 ms of CPU per SSH command, in every tool's sessions
    alike), which would bury the coordinators' own cost under the hosts' shell start-up: each host gets
    /dev/null bind-mounted over it in its own mount namespace (the real file is untouched).
    """
    _raise_neighbour_table(n)
    clusters = []
    for c in range(-(-n // PER_CLUSTER)):
        size = min(PER_CLUSTER, n - c * PER_CLUSTER)
        names = [f"c{c}-h{i:03d}" for i in range(size)]
        setup = {}
        if BASHRC.exists():
            setup = {name: [["mount", "--bind", "/dev/null", str(BASHRC)]] for name in names}
        started = time.monotonic()
        clusters.append(stack.enter_context(NetCluster(size, names=names, setup=setup, ready_timeout=600.0)))
        print(f"cluster of {size} hosts built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return clusters


def _combined_files(clusters: list, workdir: Path) -> dict:
    """One ssh_config, known_hosts and hostfile over several clusters (each keeps its own user key)."""
    workdir.mkdir(parents=True, exist_ok=True)
    known = workdir / "known_hosts"
    known.write_text("".join(c.known_hosts.read_text() for c in clusters))
    entries = "".join(f"Host {h.name}\n    HostName {h.addresses[0]}\n    IdentityFile {c.user_key}\n"
                      for c in clusters for h in c.hosts)
    config = workdir / "ssh_config"
    config.write_text(entries + f"Host *\n    User root\n    IdentitiesOnly yes\n    UserKnownHostsFile {known}\n"
                      "    GlobalKnownHostsFile /dev/null\n    StrictHostKeyChecking yes\n    BatchMode yes\n")
    names = [h.name for c in clusters for h in c.hosts]
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"{name} slots=1\n" for name in names))
    plain = workdir / "hosts"
    plain.write_text("".join(f"{name}\n" for name in names))
    return {"config": config, "known": known, "hostfile": hostfile, "plain": plain, "n": len(names)}


def _timed(argv: list, env: Optional[dict] = None, timeout: float = 1800, cwd: Path = ROOT) -> tuple:
    start = time.monotonic()
    cpu0 = children_cpu()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    return time.monotonic() - start, children_cpu() - cpu0, proc


def _tree(tool: str) -> Path:
    """The source tree a preflight tool runs from: this one, or DIR for ``preflight@DIR`` (another version of
    the code, e.g. ``common.checkout(REF, DIR)``: `git archive` of an older commit)."""
    return Path(tool.split("@", 1)[1]).resolve() if "@" in tool else ROOT


def _tool_argv(tool: str, files: dict, workdir: Path, profile: Optional[Path] = None) -> tuple:
    py = sys.executable
    if tool.startswith("preflight"):
        argv = [py, "-m", "preflight", "run", "--hostfile", str(files["hostfile"]), "--python", py,
                "--ssh-config", str(files["config"]), "--known-hosts", str(files["known"]), "--checks", "nvme",
                "--parallel", str(FANOUT), "--json", str(workdir / "report.json"), "-q"]
        if profile is not None:
            argv = [str(Path(py).parent / "py-spy"), "record", "--gil", "--format", "raw", "--rate", "50",
                    "-o", str(profile), "--"] + argv
        return argv, None
    command = [py, "-c", "import platform"]
    if tool == "pdsh":
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=f"-F {files['config']} -x -l%u %h")
        return ["pdsh", "-f", str(FANOUT), "-w", f"^{files['plain']}", *command], env
    return ["clush", "-f", str(FANOUT), "--hostfile", str(files["plain"]), "-o", f"-F {files['config']}",
            *command], None


def versus(sizes: list, workdir: Path, reps: int = 3, profile: bool = False, out: Optional[str] = None,
           tools: tuple = TOOLS) -> list:
    import contextlib
    rows = []
    for n in sizes:
        with contextlib.ExitStack() as stack:
            clusters = _clusters(n, stack)
            files = _combined_files(clusters, workdir / f"v{n}")
            samples: Dict[str, list] = {tool: [] for tool in tools}
            for rep in range(reps):
                for tool in samples:  # interleaved: a slow minute hits every tool alike
                    argv, env = _tool_argv(tool, files, workdir / f"v{n}")
                    ns0, busy0 = sum(namespace_cpu(c) for c in clusters), machine_cpu()
                    wall, coord, proc = _timed(argv, env, cwd=_tree(tool))
                    time.sleep(0.5)
                    host = sum(namespace_cpu(c) for c in clusters) - ns0
                    busy = machine_cpu() - busy0
                    ok = proc.returncode == 0
                    if tool.startswith("preflight"):
                        report = json.loads((workdir / f"v{n}" / "report.json").read_text())
                        errors = report["summary"]["error"] + report["summary"]["fail"]
                    else:
                        errors = 0 if ok else len([ln for ln in proc.stderr.splitlines() if ln.strip()])
                    samples[tool].append({"wall_s": wall, "coord_cpu_s": coord, "host_cpu_s": host,
                                          "machine_cpu_s": busy, "rc": proc.returncode, "errors": errors})
                    print(f"{n} hosts {tool} rep {rep}: {wall:.1f} s, coordinator {coord:.1f} CPU-s, "
                          f"rc {proc.returncode}, errors {errors}", file=sys.stderr)
            prof = None
            if profile and n == max(sizes):
                prof = workdir / "profile.txt"
                argv, _ = _tool_argv("preflight", files, workdir / f"v{n}", prof)
                wall, coord, proc = _timed(argv)
                print(f"{n} hosts preflight under py-spy: {wall:.1f} s, rc {proc.returncode}", file=sys.stderr)
                if prof.exists():  # the raw stacks stay beside the results (py-spy's collapsed format)
                    RESULTS.mkdir(parents=True, exist_ok=True)
                    (RESULTS / f"profile-{n}.txt").write_text(prof.read_text())
            for tool, runs in samples.items():
                med = {k: round(median([r[k] for r in runs]), 3)
                       for k in ("wall_s", "coord_cpu_s", "host_cpu_s", "machine_cpu_s")}
                rows.append({"hosts": n, "tool": tool, **med,
                             "coord_ms_per_host": round(1000 * med["coord_cpu_s"] / n, 2),
                             "host_ms_per_host": round(1000 * med["host_cpu_s"] / n, 2),
                             "machine_ms_per_host": round(1000 * med["machine_cpu_s"] / n, 2),
                             "errors": max(r["errors"] for r in runs), "runs": runs})
            if prof is not None and prof.exists():
                rows[-len(samples)]["profile_top10"] = top_functions(prof)
        write_json("scale-versus", {"fanout": FANOUT, "partial": n != sizes[-1], "rows": rows}, out)
    for row in rows:
        base = next((r for r in rows if r["hosts"] == row["hosts"] and r["tool"] == "pdsh"), None)
        row["wall_vs_pdsh"] = round(row["wall_s"] / base["wall_s"], 2) if base and base["wall_s"] else None
    return rows


def top_functions(raw: Path, limit: int = 10, inclusive: bool = False) -> list:
    """From py-spy's raw (collapsed) stacks: each function's share of the samples, by own time (the leaf
    frame) or inclusive (anywhere in the stack, once per sample). Samples with no Python frame at all
    (the GIL held in C: thread start-up, OpenSSL, the collector) are one entry, "(no Python frame)"."""
    counts: Dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f.strip()]
        if not frames:
            frames = ["(no Python frame)"]
        names = {f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" if " (" in f else f
                 for f in frames} if inclusive else {frames[-1]}
        for name in names:
            counts[name] = counts.get(name, 0) + n
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [{"function": name, "share": round(c / total, 3), "samples": c} for name, c in ranked]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--versus", action="store_true", help="host-light series against pdsh and clush")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="py-spy profile of the biggest preflight run")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help=f"with --versus: which of {','.join(TOOLS)}; preflight@DIR runs the preflight of the "
                             "source tree DIR as one more tool (A/B of two versions, interleaved)")
    parser.add_argument("--checks", default="", help="a --checks list instead of the default checks, e.g. the "
                        f"host-light set {LIGHT}")
    parser.add_argument("--out", help="JSON path (default bench/results/scale.json)")
    args = parser.parse_args()
    require_netcluster()
    cores = os.cpu_count() or 1
    if args.versus:
        with tempfile.TemporaryDirectory() as tmp:
            rows = versus(args.sizes, Path(tmp), args.reps, args.profile, args.out,
                          tuple(t for t in args.tools.split(",") if t))
        print(table(["hosts", "tool", "wall_s", "vs_pdsh", "coord_ms/host", "host_ms/host", "machine_ms/host",
                     "errors"],
                    [[r["hosts"], r["tool"], r["wall_s"], r["wall_vs_pdsh"], r["coord_ms_per_host"],
                      r["host_ms_per_host"], r["machine_ms_per_host"], r["errors"]] for r in rows]))
        for r in rows:
            for f in r.get("profile_top10", []):
                print(f"{f['share']:6.1%}  {f['function']}")
        write_json("scale-versus", {"cores": cores, "fanout": FANOUT, "rows": rows}, args.out)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.append(measure(n, Path(tmp), args.checks))
            print(f"{n} hosts: {rows[-1]['wall_s']:.1f} s", file=sys.stderr)
    base = rows[0]["wall_s"]
    for row in rows:
        row["ratio"] = round(row["wall_s"] / base, 2)
        # Everything the hosts and the coordinator burn shares this machine's cores.
        row["floor_s"] = round((row["host_cpu_s"] + row["coordinator_cpu_s"]) / cores, 2)
    print(table(["hosts", "wall_s", "ratio", "host_cpu_s", "coord_cpu_s", "floor_s", "exit"],
                [[r["hosts"], r["wall_s"], r["ratio"], r["host_cpu_s"], r["coordinator_cpu_s"], r["floor_s"],
                  r["exit_code"]] for r in rows]))
    checks = sorted({c for r in rows for c in r["check_s"]}, key=lambda c: -max(r["check_s"].get(c, 0) for r in rows))
    print("\nper check (s; cluster checks: their whole time)")
    print(table(["hosts", *checks], [[r["hosts"], *(r["check_s"].get(c, 0.0) for c in checks)] for r in rows]))
    write_json("scale", {"cores": cores, "checks": args.checks or "default", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
