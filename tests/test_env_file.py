"""--env-file on real namespace hosts: host-reported names can never put a command or a variable into the
.deepspeed_env. Each file is fed through DeepSpeed's own pdsh export builder and the result run in a shell."""
from __future__ import annotations

import json
import re
import subprocess

from preflight.recommend import OWNED_KEYS
from tests.hostile import deepspeed_exports, wrapper
from tests.test_cli_cluster import preflight

ODD = "$(touch${IFS}x)"  # 15 bytes: the kernel accepts it as an interface name
NEWLINE = "eth0\nLD_PRELOAD=/tmp/evil.so"  # the kernel refuses whitespace: only a lying host can report it


def run_exports(cluster, host, exports):
    """Run DeepSpeed's export string as pdsh would (a shell on the node), in an empty sandbox dir; returns
    (files the shell left in the sandbox, the environment it ended with)."""
    script = f"rm -rf /tmp/sbx && mkdir /tmp/sbx && cd /tmp/sbx && {exports} env; echo @@; ls -A /tmp/sbx; " \
        "rm -rf /tmp/sbx"
    out = cluster.exec(host, ["sh", "-c", script]).stdout
    env_text, files = out.split("@@\n", 1)
    return files.split(), env_text


def assert_env_file_safe(env_file, stdout):
    lines = env_file.read_text().splitlines()
    assert lines, "the env file is empty"
    for line in lines:
        key, value = line.split("=", 1)
        assert key in OWNED_KEYS, line
        assert not re.search(r'[$`"\\\s]', value), line
        assert f"export {line}" in stdout.splitlines()  # printed and written text are the same


def test_harness_catches_an_injected_value(tmp_path):
    """The check below can fail: the env file the old preflight wrote for this host did run `touch x`."""
    bad = tmp_path / "env"
    bad.write_text(f"NCCL_SOCKET_IFNAME=={ODD},eth0\n")
    exports = deepspeed_exports(bad)
    assert '"' in exports  # DeepSpeed quotes with "...", in which $(...) still runs
    subprocess.run(["sh", "-c", exports + "true"], cwd=tmp_path, check=True)
    assert (tmp_path / "x").exists()


def test_interface_named_like_a_command_on_a_real_host(netcluster_factory, tmp_path):
    q = ODD.replace("'", "")
    cluster = netcluster_factory(2, setup={"node02": [
        ["ip", "link", "set", "eth0", "down"], ["ip", "link", "set", "eth0", "name", q],
        ["ip", "link", "set", q, "up"]]})
    assert ODD in cluster.exec("node02", ["ip", "-br", "link"]).stdout
    env, report = tmp_path / "env", tmp_path / "r.json"
    proc = preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"), "--checks", "interfaces",
                     "--env-file", env, "--json", report)
    data = json.loads(report.read_text())
    cell = next(r for r in data["results"] if (r["host"], r["check"]) == ("node02", "interfaces"))
    assert cell["status"] == "fail" and repr(ODD) in cell["message"], cell
    assert proc.returncode == 1
    assert_env_file_safe(env, proc.stdout)
    assert ODD not in env.read_text() and "NCCL_SOCKET_IFNAME" not in env.read_text()
    files, shell_env = run_exports(cluster, "node02", deepspeed_exports(env))
    assert files == []
    assert "NCCL_DEBUG=WARN" in shell_env.splitlines()


def test_interface_name_with_a_newline_from_a_lying_host(netcluster_factory, tmp_path):
    cluster = netcluster_factory(2)
    python = wrapper(cluster.dir, "node02", f"""
        BAD = {NEWLINE!r}
        def mutate(payload):
            facts = payload.get("value", {{}}).get("interfaces", {{}}).get("facts")
            if not facts:
                return
            for itf in facts["interfaces"]:
                if itf["name"] == "eth0":
                    itf["name"] = BAD
            if facts.get("route_to_master"):
                facts["route_to_master"]["dev"] = BAD
        """)
    env, report = tmp_path / "env", tmp_path / "r.json"
    proc = preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"), "--checks", "interfaces",
                     "--env-file", env, "--json", report, "--python", python)
    data = json.loads(report.read_text())
    cell = next(r for r in data["results"] if (r["host"], r["check"]) == ("node02", "interfaces"))
    assert cell["status"] == "fail" and repr(NEWLINE) in cell["message"], cell
    assert cell["metrics"]["interfaces"][0]["name"] in (NEWLINE, "lo")  # JSON keeps the reported text, escaped
    assert_env_file_safe(env, proc.stdout)
    assert "LD_PRELOAD" not in env.read_text()
    files, shell_env = run_exports(cluster, "node02", deepspeed_exports(env))
    assert files == [] and "LD_PRELOAD" not in shell_env
