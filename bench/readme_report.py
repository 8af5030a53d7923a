"""The README's report excerpt, rerun: three namespace hosts, node03's link shaped to 400 Mbit/s and the others' to
1 Gbit/s, and the default gate printed as a user sees it. Needs root:

    python3 bench/readme_report.py --out bench/results/readme-report.txt

The text file holds the commit, the exit code and the terminal report; the README quotes its report part.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, NetCluster, require_netcluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/readme-report.txt"))
    args = parser.parse_args()
    require_netcluster()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp, NetCluster(3) as cluster:
        for host in cluster.hosts:
            cluster.shape(host, 400 if host.name == "node03" else 1000)
        hostfile = cluster.hostfile(Path(tmp) / "hostfile")
        argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", sys.executable,
                "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
                "--known-hosts", str(cluster.known_hosts)]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL)
    text = (f"commit {commit}\nexit {proc.returncode}\n"
            "argv preflight run --hostfile hostfile --python $(which python3) (+ the test bed's SSH files)\n\n"
            f"{proc.stdout}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
