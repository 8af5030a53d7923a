"""The printed SSH fixes, pasted as they are: on namespace hosts whose sshd listens on port 2222 only, each command
line of the unknown-key and changed-key fixes (the coordinator's, and launcher_ssh's on the first host) is run
verbatim with bash, and the next run passes.

Before issue 26 the unknown-key fix said ``ssh-keyscan [198.18.0.1]:2222 >> FILE``, which ssh-keyscan cannot
parse, and the changed-key fix ``ssh-keygen -R 198.18.0.2 -f FILE``, which removes nothing off port 22.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.hostside.outcome import Status
from tests.netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[2]
PORT = 2222


@pytest.fixture
def cluster():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(3, ssh_port=PORT) as built:
        yield built


def run(cluster, tmp_path, known):
    """preflight run -v on the cluster with --ssh-port 2222: (rc, stdout, {(host, check): cell})."""
    report = tmp_path / "r.json"
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(known), "--ssh-port", str(PORT), "--checks", "launcher_ssh", "--json", str(report),
            "-v"]  # every (host, check) line with its own fix; without -v hosts sharing a cause are one line
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    return proc.returncode, proc.stdout, cells


def commands(fix):
    """A fix's pasteable lines: those after its prose, each on a line of its own, indented by two spaces."""
    found = [line[2:] for line in fix.splitlines() if line.startswith("  ")]
    assert found, fix
    return found


def paste(command, cluster=None, host=None):
    """Run one printed command as a person pastes it: bash -c, here or on a host."""
    argv = ["bash", "-c", command]
    done = cluster.exec(host, argv, timeout=60) if cluster else subprocess.run(argv, capture_output=True, text=True,
                                                                                timeout=60)
    assert done.returncode == 0, (command, done.stdout, done.stderr)


def printed(command, stdout):
    # The report prints the fix as it is in the JSON: the same line a person copies from the terminal.
    assert command in stdout, (command, stdout)


def test_unknown_then_changed_host_key_fixes_pasted_verbatim(cluster, tmp_path):
    known = cluster.empty_known_hosts(tmp_path / "known_hosts")

    # 1. Nothing known: every host's ssh cell FAILs with the keyscan fix for port 2222.
    rc, stdout, cells = run(cluster, tmp_path, known)
    assert rc == 1
    for h in cluster.hosts:
        cell = cells[(h.name, "ssh")]
        assert cell["status"] == "fail" and "unknown SSH host key" in cell["message"], cell
        assert f"[{h.addresses[0]}]:{PORT}" in cell["message"] and "SHA256:" in cell["message"]
        (scan,) = commands(cell["fix"])
        assert f"ssh-keyscan -p {PORT} {h.addresses[0]} >> {known}" in scan, scan
        printed(scan, stdout)
        paste(scan)
    recorded = known.read_text()
    assert all(f"[{h.addresses[0]}]:{PORT} {h.host_key_line}" in recorded for h in cluster.hosts), recorded
    # Pasting it again appends nothing.
    for h in cluster.hosts:
        paste(commands(cells[(h.name, "ssh")]["fix"])[0])
    assert known.read_text() == recorded

    # 2. The next run passes: the coordinator's ssh, and launcher_ssh from node01 on port 2222.
    rc, stdout, cells = run(cluster, tmp_path, known)
    assert rc == 0, stdout
    for h in cluster.hosts:
        assert cells[(h.name, "ssh")]["status"] == "pass", cells[(h.name, "ssh")]
        launcher = cells[(h.name, "launcher_ssh")]
        assert launcher["status"] == "pass" and f"port {PORT} ok" in launcher["message"], launcher

    # 3. node02 is reinstalled: a new host key. The coordinator and node01 both have the old one.
    node02 = cluster.host("node02")
    cluster.rekey(node02)
    rc, stdout, cells = run(cluster, tmp_path, known)
    assert rc == 1
    ssh = cells[("node02", "ssh")]
    assert ssh["status"] == "fail" and "CHANGED" in ssh["message"] and "SHA256:" in ssh["message"], ssh
    remove, scan = commands(ssh["fix"])
    assert remove == f"ssh-keygen -R '[{node02.addresses[0]}]:{PORT}' -f {known}", remove
    printed(remove, stdout)
    printed(scan, stdout)
    # The other hosts are untouched, and node01 still reaches them on the launcher's port.
    assert all(cells[(n, "ssh")]["status"] == "pass" for n in ("node01", "node03"))
    assert cells[("node03", "launcher_ssh")]["status"] == "pass"
    launcher = cells[("node02", "launcher_ssh")]
    assert launcher["status"] == "fail" and "CHANGED" in launcher["message"], launcher
    launcher_remove, launcher_scan = commands(launcher["fix"])
    assert launcher_remove == f"ssh-keygen -R '[node02]:{PORT}'", launcher_remove
    assert f"ssh-keyscan -H -p {PORT} node02" in launcher_scan

    # 4. The removal alone: the entry is gone, so the next run finds the key unknown (not changed), and its
    # unknown-key fix is the same line as the changed-key fix's second one.
    paste(remove)
    rc, stdout, cells = run(cluster, tmp_path, known)
    ssh = cells[("node02", "ssh")]
    assert ssh["status"] == "fail" and "unknown SSH host key" in ssh["message"], ssh
    assert commands(ssh["fix"]) == [scan]
    paste(scan)

    # 5. launcher_ssh's fix, pasted on node01 (the first host, where the launcher runs) in its order.
    paste(launcher_remove, cluster, "node01")
    paste(launcher_scan, cluster, "node01")

    # 6. Everything passes again, with node02's new key recorded on both sides.
    rc, stdout, cells = run(cluster, tmp_path, known)
    assert rc == 0, stdout
    assert all(cell["status"] == "pass" for cell in cells.values()), cells
    assert f"[{node02.addresses[0]}]:{PORT} {node02.host_key_line}" in known.read_text()


# --- the firewall fix, for the firewall the host really runs (issue 30) ---------------------------------------

# A site's own nftables table (not `filter`): its input chain drops new TCP to high ports. Before issue 30 the fix
# said `nft insert rule inet filter input ...`, which fails here ("No such file or directory": no table `filter`),
# and an accept in a table of its own would not help: each base chain on the input hook decides on its own.
SITE_RULES = f"""
table inet site_fw {{
    chain inbound {{
        type filter hook input priority 0; policy accept;
        ct state established,related accept
        tcp dport {PORT} accept
        tcp dport 1024-65535 drop
    }}
}}
"""


def run_ports(cluster, tmp_path):
    """preflight run --checks ports on the cluster: (rc, stdout, {(host, check): cell})."""
    report = tmp_path / "ports.json"
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--ssh-port", str(PORT), "--checks", "ports",
            "--json", str(report), "-v"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    return proc.returncode, proc.stdout, cells


def test_firewall_fix_goes_in_the_hosts_own_nft_table_and_the_next_run_passes(cluster, tmp_path):
    cluster.exec("node03", ["nft", "-f", "-"], check=True, input=SITE_RULES)
    rc, stdout, cells = run_ports(cluster, tmp_path)
    assert rc == 1, stdout
    cell = cells[("node03", "ports")]
    assert cell["status"] == "fail" and "inbound TCP to node03:" in cell["message"], cell
    lines = commands(cell["fix"])
    # The chain that drops, in the table that holds it: nothing else (no iptables/ufw/firewalld alternatives).
    # (--checks ports alone: no interfaces facts, so the sources are the other hosts' addresses, not their subnet)
    sources = ", ".join(cluster.host(n).addresses[0] for n in ("node01", "node02"))
    assert lines == [f"nft insert rule inet site_fw inbound ip saddr {{ {sources} }} tcp dport 1024-65535 accept"], \
        cell["fix"]
    for line in lines:
        printed(line, stdout)
    # The old fix, pasted: fails on a host whose table is not named `filter`.
    old = cluster.exec("node03", ["bash", "-c", f"nft insert rule inet filter input ip saddr {cluster.subnets[0]} "
                                                "tcp dport 1024-65535 accept"])
    assert old.returncode != 0, old
    for line in lines:
        paste(line, cluster, "node03")
    rc, stdout, cells = run_ports(cluster, tmp_path)
    assert rc == 0, stdout
    assert all(cells[(h.name, "ports")]["status"] == "pass" for h in cluster.hosts), cells


def test_firewall_fix_names_every_dropping_base_chain(cluster, tmp_path):
    """Two tables drop on the input hook (the site's, and one at priority 10): an accept in one base chain does not
    override a drop in the other, so the fix inserts one rule in each, and pasting both makes the run pass."""
    cluster.exec("node03", ["nft", "-f", "-"], check=True, input=SITE_RULES + f"""
table ip later {{
    chain in_late {{
        type filter hook input priority 10; policy drop;
        ct state established,related accept
        iif "lo" accept
        tcp dport {PORT} accept
    }}
}}
""")
    rc, stdout, cells = run_ports(cluster, tmp_path)
    cell = cells[("node03", "ports")]
    assert rc == 1 and cell["status"] == "fail", stdout
    lines = commands(cell["fix"])
    assert sorted(line.split()[3:6] for line in lines) == [["inet", "site_fw", "inbound"], ["ip", "later", "in_late"]]
    paste(lines[0], cluster, "node03")  # one chain opened: the other still drops
    rc, _, cells = run_ports(cluster, tmp_path)
    assert rc == 1 and cells[("node03", "ports")]["status"] == "fail"
    for line in commands(cells[("node03", "ports")]["fix"]):
        paste(line, cluster, "node03")
    rc, stdout, cells = run_ports(cluster, tmp_path)
    assert rc == 0, stdout


# --- pip: the failing interpreter's own (issue 30) ------------------------------------------------------------

FAKE_TORCH = '__version__ = "2.13.0+cpu"\n\n\nclass version:  # noqa: N801 (torch.version)\n    cuda = None\n    hip = None\n'


def fake_wheel(folder, name, version, module_text):
    """A stand-in package as a wheel, which pip installs offline (PIP_NO_INDEX, PIP_FIND_LINKS)."""
    import zipfile
    folder.mkdir(exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": module_text,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return folder


def fake_torch_wheel(folder):
    """A torch stand-in: torch.__version__ and torch.version.cuda are what the python check reads."""
    return fake_wheel(folder, "torch", "2.13.0+cpu", FAKE_TORCH)


def run_python_check(python, tmp_path):
    """preflight run --checks python on this machine (no hostfile) with --python ``python``: its cell."""
    report = tmp_path / "python.json"
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "preflight", "run", "--python", str(python), "--checks", "python",
            "--json", str(report)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    (cell,) = [r for r in json.loads(report.read_text())["results"] if r["check"] == "python"]
    return proc.returncode, proc.stdout, cell


def test_pip_fix_installs_into_the_failing_interpreter_not_the_first_pip_on_path(tmp_path):
    """A venv without torch, and another `pip` first on PATH (a decoy that records being run, as the system's pip
    would install into the system's Python): before issue 30 the fix said `pip install torch`, which ran the decoy
    and left the venv without torch. The printed `<venv python> -m pip install torch`, pasted with that PATH
    (pip offline, from a local wheel of a torch stand-in), makes the next run pass."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    wheels = fake_torch_wheel(tmp_path / "wheels")
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "pip").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'decoy.log'}\n")
    (decoy / "pip").chmod(0o755)

    rc, stdout, cell = run_python_check(python, tmp_path)
    assert rc == 1 and cell["status"] == "fail" and "torch is not importable" in cell["message"], cell
    (line,) = commands(cell["fix"])
    assert line == f"{python} -m pip install torch", cell["fix"]
    printed(line, stdout)
    env = dict(os.environ, PATH=f"{decoy}:{os.environ['PATH']}", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    # The old fix, as a user would paste it: the decoy ran, the venv still has no torch.
    subprocess.run(["bash", "-c", "pip install torch"], env=env, check=True, timeout=60)
    assert (tmp_path / "decoy.log").read_text() == "install torch\n"
    assert run_python_check(python, tmp_path)[2]["status"] == "fail"
    done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (line, done.stdout, done.stderr)
    assert (tmp_path / "decoy.log").read_text() == "install torch\n"  # the decoy was not run again
    rc, stdout, cell = run_python_check(python, tmp_path)
    assert rc == 0 and cell["status"] == "pass" and "torch 2.13.0+cpu" in cell["message"], cell


def test_pip_fix_quotes_an_odd_interpreter_path(tmp_path):
    """A venv under a directory whose name a shell would split or run: the printed command is still one word for
    it, and pasting it installs there."""
    from preflight.checks import python as python_check
    odd = tmp_path / "my envs;touch pwned"
    fix = python_check.evaluate({"python": "3.11.2", "executable": str(odd / "bin" / "python"), "torch": None},
                                {"python": {"min_version": "3.8", "require_torch": True}}).fix
    (line,) = commands(fix)
    assert shlex.split(line)[:4] == [str(odd / "bin" / "python"), "-m", "pip", "install"], line
    subprocess.run([sys.executable, "-m", "venv", str(odd)], check=True, timeout=300)
    wheels = fake_torch_wheel(tmp_path / "wheels")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels), PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, (line, done.stdout, done.stderr)
    assert not (tmp_path / "pwned").exists()
    check = subprocess.run([str(odd / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "2.13.0+cpu", check


# Each check's pip fix, from facts naming the job's interpreter (a venv): pasted offline from local stand-in wheels,
# every command line runs, and the package is then importable by that interpreter.
def _pip_cases(python):
    from tests.checks.driver_cuda.test_driver_cuda import healthy as driver_healthy
    ds = {"deepspeed": None, "torch": "2.13.0+cpu", "ops": {}, "ninja": False, "ninja_module": False,
          "ninja_binary": None, "shm_bytes": 8 * 1024 ** 3, "source": None, "installed": False,
          "import_error": "ModuleNotFoundError: No module named 'deepspeed'", "python": python, "api_error": None,
          "ds_report_error": "rc=127: ds_report: command not found", "tool_timeout": None, "required_ops": []}
    gpu_host = dict(driver_healthy.__wrapped__(), python=python, torch="2.13.0+cpu", torch_cuda=None,
                    cuda_available=False, torch_gpu_count=0, nccl=None)
    return {
        "python: torch fails to import": ("python", {"python": "3.11.2", "executable": python, "torch": None,
                                                     "torch_error": "ImportError: libc10.so"}, "torch"),
        "python: no torch": ("python", {"python": "3.11.2", "executable": python, "torch": None}, "torch"),
        "ds_report: no deepspeed": ("ds_report", ds, "deepspeed"),
        "ds_report: deepspeed fails to import": ("ds_report", dict(ds, installed=True), "deepspeed"),
        "driver_cuda: CPU-only torch on a GPU host": ("driver_cuda", gpu_host, "torch"),
    }


@pytest.fixture(scope="module")
def venv_and_wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipfix")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    wheels = fake_torch_wheel(root / "wheels")
    fake_wheel(wheels, "deepspeed", "0.19.8", '__version__ = "0.19.8"\n')
    return root / "venv" / "bin" / "python", wheels


def _paste_pip(fix, python, wheels):
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels), PIP_DISABLE_PIP_VERSION_CHECK="1")
    lines = commands(fix) if "\n" in fix else [fix]  # a fix that is one command and nothing else
    assert any(line.startswith(f"{python} -m pip install ") for line in lines), fix
    for line in lines:
        done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stdout, done.stderr)


def _uninstall(python, package):
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", package], capture_output=True, timeout=120)


@pytest.mark.parametrize("case", ["python: torch fails to import", "python: no torch", "ds_report: no deepspeed",
                                  "ds_report: deepspeed fails to import", "driver_cuda: CPU-only torch on a GPU host"])
def test_each_checks_pip_fix_pasted(case, venv_and_wheels):
    from preflight import checks
    from preflight.config import load_thresholds
    python, wheels = venv_and_wheels
    check, facts, package = _pip_cases(str(python))[case]
    _uninstall(python, package)
    if case == "ds_report: deepspeed fails to import":  # installed, broken: the fix reinstalls it, then imports it
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                        "deepspeed"], check=True, timeout=300)
    out = checks.spec(check).evaluate(facts, load_thresholds())
    assert out.status != Status.PASS and out.fix, out
    _paste_pip(out.fix, python, wheels)
    subprocess.run([str(python), "-c", f"import {package}"], check=True, timeout=60)


def test_versions_pip_fix_installs_the_majoritys_build_with_each_hosts_interpreter(venv_and_wheels):
    """torch 2.13.0+cpu on two hosts, another on the third: `<its python> -m pip install torch==2.13.0+cpu
    --index-url https://download.pytorch.org/whl/cpu`, pasted (offline: the index is replaced by the local
    wheels), leaves that interpreter with the majority's build; deepspeed likewise."""
    from preflight.checks import versions
    from preflight.config import load_thresholds
    python, wheels = venv_and_wheels
    hosts = {h: {"torch": "2.13.0+cpu", "deepspeed": "0.19.8", "python": "3.11"} for h in ("n1", "n2", "n3")}
    hosts["n3"].update(torch="2.12.0+cpu", deepspeed=None)
    facts = {"hosts": hosts, "executables": {"n1": "/usr/bin/python3", "n2": "/usr/bin/python3", "n3": str(python)}}
    out = versions.evaluate(facts, load_thresholds())["*"]
    assert out.status == Status.FAIL
    lines = commands(out.fix)
    assert lines == [f"{python} -m pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu",
                     f"{python} -m pip install deepspeed==0.19.8"], out.fix
    _uninstall(python, "torch")
    _uninstall(python, "deepspeed")
    _paste_pip(out.fix, python, wheels)
    got = subprocess.run([str(python), "-c", "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"],
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["2.13.0+cpu", "0.19.8"], got


def test_allreduce_no_torch_fix_names_each_hosts_interpreter(venv_and_wheels):
    from preflight.checks import allreduce
    from preflight.config import load_thresholds
    python, wheels = venv_and_wheels
    facts = {"status": "no_torch", "hosts_without_torch": ["n2"], "reason": "No module named 'torch'",
             "executables": {"n2": str(python)}, "hosts": ["n1", "n2"], "slots": {"n1": 1, "n2": 1}}
    out = allreduce.evaluate(facts, load_thresholds())["*"]
    assert out.status == Status.FAIL and commands(out.fix) == [f"{python} -m pip install torch"], out.fix
    _uninstall(python, "torch")
    _paste_pip(out.fix, python, wheels)
    subprocess.run([str(python), "-c", "import torch"], check=True, timeout=60)


def test_jit_no_ninja_fix_installs_into_the_jobs_interpreter(venv_and_wheels):
    """A JIT build blocked by no ninja (hostside/jit.py, shared by ds_report and ds_config): before the follow-up to
    issue 30 the fix said "python -m pip install ninja", whichever `python` is first on PATH. Now it names the job's
    interpreter, and pasting it installs ninja there; the nvcc fix's pre-build names that interpreter's pip too."""
    from preflight.hostside import jit
    python, wheels = venv_and_wheels
    fake_wheel(wheels, "ninja", "1.11.1", '__version__ = "1.11.1"\n')
    facts = {"python": str(python), "ninja_binary": None, "torch_cuda": "12.1", "nvcc": None, "cuda_home": None,
             "deepspeed": "0.19.8", "ops": {"fused_adam": {"installed": False, "compatible": True}}}
    found = {b.short: b for b in jit.blockers("fused_adam", facts)}
    assert commands(found["no ninja"].fix) == [f"{python} -m pip install ninja"], found["no ninja"].fix
    # A rebuild of the installed version: a plain install would answer "Requirement already satisfied".
    assert (f"DS_BUILD_FUSED_ADAM=1 {python} -m pip install --force-reinstall --no-deps --no-cache-dir deepspeed==0.19.8"
            in found["no nvcc"].fix), found["no nvcc"].fix
    _uninstall(python, "ninja")
    _paste_pip(found["no ninja"].fix, python, wheels)
    subprocess.run([str(python), "-c", "import ninja"], check=True, timeout=60)


# A stand-in DeepSpeed sdist (PyPI ships DeepSpeed as an sdist): its in-tree build backend compiles "the op" (writes
# deepspeed/built_cpu_adam into the wheel) only when DS_BUILD_CPU_ADAM=1 or DS_BUILD_OPS=1 is set, as setup.py does.
_FAKE_DS_BACKEND = '''
import os, zipfile
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, dist = "deepspeed-0.19.8-py3-none-any.whl", "deepspeed-0.19.8.dist-info"
    files = {"deepspeed/__init__.py": "__version__ = '0.19.8'\\n"}
    if "1" in (os.environ.get("DS_BUILD_CPU_ADAM"), os.environ.get("DS_BUILD_OPS")):
        files["deepspeed/built_cpu_adam"] = "built\\n"
    files[dist + "/METADATA"] = "Metadata-Version: 2.1\\nName: deepspeed\\nVersion: 0.19.8\\n"
    files[dist + "/WHEEL"] = "Wheel-Version: 1.0\\nGenerator: hand\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    files[dist + "/RECORD"] = "".join(p + ",,\\n" for p in files) + dist + "/RECORD,,\\n"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return name
'''


def _fake_deepspeed_sdist(folder):
    import io
    import tarfile
    folder.mkdir(exist_ok=True)
    files = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": _FAKE_DS_BACKEND,
             "PKG-INFO": "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n"}
    with tarfile.open(folder / "deepspeed-0.19.8.tar.gz", "w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"deepspeed-0.19.8/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder


def test_prebuild_fix_rebuilds_the_installed_deepspeed_where_a_plain_install_builds_nothing(tmp_path):
    """issue 30: `DS_BUILD_OPS=1 <python> -m pip install deepspeed` on a host that has DeepSpeed (always, when a
    pre-build is suggested) answers "Requirement already satisfied" and builds nothing; with --force-reinstall alone
    pip reuses the wheel it cached when it built the sdist without the op. prebuild_install's command, pasted, does
    build it. Real pip, offline, on a stand-in sdist whose build adds the op only under DS_BUILD_CPU_ADAM=1."""
    from preflight.hostside.fixes import prebuild_install
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    dists = _fake_deepspeed_sdist(tmp_path / "dists")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(dists), PIP_CACHE_DIR=str(tmp_path / "cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")

    def paste(line):
        done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        return done.stdout

    def has_op():
        probe = "import deepspeed, os; print(os.path.exists(os.path.join(os.path.dirname(deepspeed.__file__), " \
                "'built_cpu_adam')))"
        return subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip() == "True"

    paste(f"{python} -m pip install deepspeed")  # the host's DeepSpeed, built without the op (and cached)
    assert not has_op()
    said = paste(f"DS_BUILD_CPU_ADAM=1 {python} -m pip install deepspeed")  # the old fix
    assert "Requirement already satisfied" in said and not has_op(), said
    paste(f"DS_BUILD_CPU_ADAM=1 {python} -m pip install --force-reinstall --no-deps deepspeed==0.19.8")
    assert not has_op()  # the cached wheel, reinstalled: still without the op
    fix = prebuild_install(str(python), ["DS_BUILD_CPU_ADAM"], "0.19.8")
    assert fix == (f"DS_BUILD_CPU_ADAM=1 {python} -m pip install --force-reinstall --no-deps --no-cache-dir "
                   "deepspeed==0.19.8")
    paste(fix)
    assert has_op()
