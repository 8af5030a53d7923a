#!/bin/bash
# Device check for preflight's GPU paths (run from the repo root on the device machine).
# Needs the runtime wheels the device image lacks, in .whl/ (gitignored via .git/info/exclude), made here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_34_x86_64 --platform any -d .whl paramiko cryptography bcrypt pynacl cffi \
#     pycparser invoke hjson ClusterShell
# and run there as `bash bench/device_check.sh` (device tool: carry [".whl"]). Results: bench/results/device-h200/.
cd "$(dirname "$0")/.."  # the repo root
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,name --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
t0=$(date +%s)
timeout 240 python3 -m preflight run --python python3 --json $OUT/run.json --html $OUT/run.html --env-file $OUT/deepspeed_env > $OUT/run.txt 2>&1; echo "run rc=$? in $(( $(date +%s) - t0 ))s"
tail -45 $OUT/run.txt
t0=$(date +%s)
timeout 100 python3 -m preflight node-check --python python3 -v > $OUT/nodecheck.txt 2>&1; echo "node-check rc=$? in $(( $(date +%s) - t0 ))s"
cat $OUT/nodecheck.txt
t0=$(date +%s)
timeout 120 python3 -m preflight run --python python3 --slots 2 --checks driver_cuda,gpu,allreduce --json $OUT/run2.json > $OUT/run2.txt 2>&1; echo "slots=2 run rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "FAILED|ERROR|passed" $OUT/run2.txt | cut -c1-400
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/checks/gpu/test_gpu.py tests/checks/driver_cuda/test_driver_cuda.py tests/checks/python/test_python_check.py tests/checks/compute/test_compute.py > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
tail -15 $OUT/pytest.txt
PREFLIGHT_STRICT_SKIPS=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/checks/gpu/test_gpu_device.py > $OUT/pytest-gpu.txt 2>&1; echo "gpu pytest rc=$?"; tail -25 $OUT/pytest-gpu.txt  # GPU paths asserted (issue 26)
