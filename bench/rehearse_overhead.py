"""What `preflight rehearse` costs over the bare launch it rehearses, on 3 namespace hosts.

Interleaved on one cluster, --reps times each (ZeRO-2 and AdamW, one rank per host, torch CPU over gloo):

- bare: `ssh node01 'cd DIR && deepspeed --hostfile hostfile --launcher pdsh preflight_rehearse.py
  --deepspeed_config C ...'` from this machine, the script already in DIR on every host (as a user who copied it);
  timed from the ssh's start to its exit;
- rehearse: `python -m preflight rehearse --hostfile H --deepspeed-config C` from this machine, timed from its
  start to its exit: connecting, writing the script, the same launch, stopping and the clean-up on every host.

With --cold, every launch starts from an empty torch extensions cache on every host (TORCH_EXTENSIONS_DIR in each
host's own /tmp, through ./.deepspeed_env for both), as a new user's first job meets it: the JIT build of
deepspeed_shm_comm (no optimizer section, so torch's AdamW and no other op) is part of both launches.

Prints a table and writes bench/results/rehearse-overhead.json (--cold: rehearse-overhead-cold.json). Run as root
from the repository root:
    python3 bench/rehearse_overhead.py --reps 3
    python3 bench/rehearse_overhead.py --cold --reps 1
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from preflight.hostside import rehearsal  # noqa: E402
from tests.netcluster import NetCluster  # noqa: E402

LAUNCHER = Path(sys.executable).parent / "deepspeed"
CONFIG = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
COLD_CONFIG = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 2}}
COLD_EXT = "/tmp/pf-bench-cold-ext"  # each host's own /tmp: every host builds, as on real hosts
COLD_ENV = f"TORCH_EXTENSIONS_DIR={COLD_EXT}\n"


def empty_caches(cluster: NetCluster) -> None:
    for h in cluster.hosts:
        ssh(cluster, h.name, f"rm -rf {COLD_EXT}", timeout=60)


def ssh(cluster: NetCluster, host: str, command: str, stdin: str = "",
        timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(cluster.ssh_config), host, command], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def bare(cluster: NetCluster, config: Path, rep: int, cold: bool = False) -> float:
    token = f"bench-bare-{os.getpid()}-{rep}"
    folder = "/tmp/" + token
    script = Path(rehearsal.__file__).read_text()
    for h in cluster.hosts:  # the user's copy of the script, before the clock starts
        ssh(cluster, h.name, f"mkdir -p {folder} && cat > {folder}/preflight_rehearse.py", script, 60)
    ssh(cluster, "node01", f"cat > {folder}/hostfile", "".join(f"{h.name} slots=1\n" for h in cluster.hosts), 60)
    if cold:
        ssh(cluster, "node01", f"cat > {folder}/.deepspeed_env", COLD_ENV, 60)
        empty_caches(cluster)
    command = f"cd {folder} && {shlex.quote(str(LAUNCHER))} --hostfile hostfile --launcher pdsh " \
              f"preflight_rehearse.py --deepspeed_config {config} --preflight-run {token}"
    started = time.monotonic()
    proc = ssh(cluster, "node01", command, timeout=1500)
    elapsed = time.monotonic() - started
    done = proc.stdout.count('"event": "done"')
    for h in cluster.hosts:
        ssh(cluster, h.name, f"rm -rf {folder}", timeout=60)
    if proc.returncode != 0 or done != len(cluster.hosts):
        raise SystemExit(f"bare launch failed (rc {proc.returncode}, {done} ranks done): "
                         f"{proc.stdout[-2000:] + proc.stderr[-2000:]}")
    return elapsed


def rehearse(cluster: NetCluster, config: Path, workdir: Path, cold: bool = False) -> float:
    argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(workdir / "hostfile")),
            "--deepspeed-config", str(config), "--ssh-config", str(cluster.ssh_config), "--ssh-key",
            str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--deepspeed", str(LAUNCHER),
            "--python", sys.executable, "-q"]
    env_file = workdir / ".deepspeed_env"
    if cold:
        env_file.write_text(COLD_ENV)
        empty_caches(cluster)
    elif env_file.exists():
        env_file.unlink()
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    elapsed = time.monotonic() - started
    if proc.returncode != 0:  # a cold build is a WARN: exit 0
        raise SystemExit(f"rehearse failed: {proc.stdout[-2000:] + proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="every launch from an empty torch extensions cache")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = "rehearse-overhead-cold.json" if args.cold else "rehearse-overhead.json"
    args.out = args.out or str(ROOT / "bench" / "results" / name)
    config_data = COLD_CONFIG if args.cold else CONFIG
    workdir = Path("/run") / (f"bench-rehearse-{os.getpid()}")
    workdir.mkdir()
    times = {"bare": [], "rehearse": []}
    try:
        with NetCluster(3, names=["node01", "node02", "node03"]) as cluster:
            config = cluster.dir / "ds_zero2.json"
            config.write_text(json.dumps(config_data))
            bare(cluster, config, -1)  # warm-up: page cache, the ops' cache in each host's home overlay
            for rep in range(args.reps):
                times["bare"].append(bare(cluster, config, rep, args.cold))
                times["rehearse"].append(rehearse(cluster, config, workdir, args.cold))
                print(f"rep {rep}: bare {times['bare'][-1]:.1f} s, rehearse {times['rehearse'][-1]:.1f} s", flush=True)
            if args.cold:
                empty_caches(cluster)
    finally:
        subprocess.run(["rm", "-rf", str(workdir)])
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["rehearse"] / medians["bare"]
    load = os.getloadavg()
    reps = "  ".join(f"rep{i}" for i in range(args.reps))
    print(f"{'':<9} {reps}  median")
    for name, values in times.items():
        row = "  ".join(f"{v:4.1f}" for v in values)
        print(f"{name:<9} {row}  {medians[name]:.1f} s")
    print(f"rehearse / bare: {ratio:.2f} (load average {load[0]:.1f})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({"commit": commit, "reps": args.reps, "hosts": 3, "config": config_data,
                                          "cold": args.cold,
                                          "seconds": times, "median_s": medians, "ratio": round(ratio, 3),
                                          "loadavg": load}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
