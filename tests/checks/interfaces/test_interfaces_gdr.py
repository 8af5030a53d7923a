"""interfaces: the GPUDirect RDMA module on GPU hosts with active IB/RoCE, on the recorded H100 host's files
(lsmod.txt, proc-driver-version.txt, uname.txt) with and without nvidia_peermem, and collect on this machine."""
from __future__ import annotations

import os
import shlex
import time

from preflight.checks import interfaces as itf
from preflight.config import load_defaults
from preflight.hostside import netinfo
from preflight.hostside.outcome import Status
from preflight.hostside.proc import read_text
from preflight.hostside.seams import HostContext
from tests.h100 import read as fixture
from tests.checks.interfaces.test_interfaces import h100_facts, ib_facts

T = load_defaults()
PEERMEM_LINE = "nvidia_peermem 16384 0 - Live 0xffffffffc1200000 (O)\n"
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"


def gpu_host(tmp_path, lsmod=None, driver_version=None, kernel=None, ports=({"dev": "mlx5_0", "port": 1},)):
    """The recorded H100 host's facts as collect builds them from its files, with IB ports added (it has none)."""
    facts = h100_facts(tmp_path)
    mods = itf.parse_modules(fixture("lsmod.txt") if lsmod is None else lsmod)
    facts["peermem"] = any(m in mods for m in itf.PEERMEM_MODULES)
    facts["peermem_module"] = next((m for m in itf.PEERMEM_MODULES if m in mods), None)
    facts["gpu_driver_loaded"] = "nvidia" in mods
    facts["nvidia_open_module"] = itf.parse_open_module(fixture("proc-driver-version.txt")
                                                        if driver_version is None else driver_version)
    facts["kernel"] = fixture("uname.txt").split()[2] if kernel is None else kernel
    facts["ib"] = ib_facts(tmp_path, [dict(p) for p in ports])
    return facts


def test_recorded_driver_files_parse():
    assert itf.parse_open_module(fixture("proc-driver-version.txt")) is True  # "NVIDIA UNIX Open Kernel Module"
    assert itf.parse_open_module(PROPRIETARY) is False
    assert itf.parse_open_module(None) is None
    assert netinfo.kernel_version(fixture("uname.txt").split()[2]) == (6, 18)
    assert "nvidia" in itf.parse_modules(fixture("lsmod.txt"))


def test_h100_with_peermem_passes_and_names_it(tmp_path):
    facts = gpu_host(tmp_path, lsmod=PEERMEM_LINE + fixture("lsmod.txt"))
    o = itf.evaluate(facts, T)
    assert o.status == Status.PASS, o.message
    assert "nvidia_peermem loaded" in o.message and o.metrics["gdr"] == "peermem"


def test_h100_without_peermem_on_proprietary_driver_warns(tmp_path):
    facts = gpu_host(tmp_path, driver_version=PROPRIETARY, ports=({"dev": "mlx5_0", "port": 1},
                                                                  {"dev": "mlx5_1", "port": 1}))
    o = itf.evaluate(facts, T)
    assert o.status == Status.WARN, o.message
    assert "GPU host with 2 active IB/RoCE ports (mlx5_0:1, mlx5_1:1)" in o.message
    assert "neither nvidia_peermem nor nv_peer_mem is loaded (expected one loaded)" in o.message
    assert "proprietary kernel module" in o.message and o.metrics["gdr"] == "none"
    assert o.fix.startswith("sudo modprobe nvidia_peermem && ")
    assert "/etc/modules-load.d/nvidia-peermem.conf" in o.fix
    shlex.split(o.fix.split("#")[0])  # pastes as a shell line


def test_h100_without_peermem_open_module_old_kernel_warns(tmp_path):
    o = itf.evaluate(gpu_host(tmp_path, kernel="5.4.0-150-generic"), T)
    assert o.status == Status.WARN and "kernel 5.4.0-150-generic is older than 5.12" in o.message


def test_h100_as_recorded_with_ib_relies_on_dmabuf(tmp_path):
    """The recorded host: open kernel module, kernel 6.18, no peermem: DMA-BUF carries GDR (NCCL >= 2.13), PASS."""
    o = itf.evaluate(gpu_host(tmp_path), T)
    assert o.status == Status.PASS, o.message
    assert "GPUDirect RDMA through DMA-BUF (open kernel module, kernel 6.18.44-fc-v657-gpu" in o.message
    assert o.metrics["gdr"] == "dmabuf"


def test_no_warning_without_active_ib_or_without_gpu(tmp_path):
    down = gpu_host(tmp_path, driver_version=PROPRIETARY,
                    ports=({"dev": "mlx5_0", "port": 1, "state": "1: DOWN", "phys": "3: Disabled"},))
    o = itf.evaluate(down, T)
    assert o.status == Status.FAIL and "mlx5_0:1 (InfiniBand) is DOWN" in o.message  # the port's own FAIL only
    assert o.metrics["gdr"] is None and "neither nvidia_peermem" not in o.message
    cpu = gpu_host(tmp_path / "cpu", lsmod="", driver_version=PROPRIETARY)
    cpu["gpu_driver_loaded"] = False
    o = itf.evaluate(cpu, T)
    assert o.status == Status.PASS and o.metrics["gdr"] is None
    # Facts recorded before gpu_driver_loaded existed say nothing about GDR: no WARN on them.
    old = gpu_host(tmp_path / "old", driver_version=PROPRIETARY)
    del old["gpu_driver_loaded"]
    assert itf.evaluate(old, T).status == Status.PASS


def test_host_reported_kernel_is_quoted(tmp_path):
    o = itf.evaluate(gpu_host(tmp_path, kernel="4.1\n$(reboot)"), T)
    assert o.status == Status.WARN and "older than 5.12" in o.message
    assert "\n" not in o.message and "kernel '4.1\\n$(reboot)'" in o.message  # quoted, its newline escaped


def test_collect_here_reports_the_driver_and_kernel():
    facts = itf.collect(HostContext({}, time.monotonic() + 60))
    mods = itf.parse_modules(read_text("/proc/modules") or "")  # absent on a kernel built without modules
    assert facts["gpu_driver_loaded"] == ("nvidia" in mods or os.path.exists(itf.NVIDIA_VERSION))
    assert facts["kernel"] == os.uname().release
    version = read_text(itf.NVIDIA_VERSION)
    assert facts["nvidia_open_module"] == (None if version is None else "Open Kernel Module" in version)
    assert facts["peermem"] == (any(m in mods for m in itf.PEERMEM_MODULES)
                                or any(os.path.exists(p) for p in itf.PEERMEM_PATHS))
