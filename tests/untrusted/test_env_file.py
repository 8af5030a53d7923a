"""--env-file on real namespace hosts: host-reported names can never put a command or a variable into the
.deepspeed_env. Each file is fed through DeepSpeed's own pdsh export builder and the result run in a shell."""
from __future__ import annotations

import json
import re
import subprocess

from preflight.recommend import OWNED_KEYS
from tests.hostile import deepspeed_exports, wrapper
from tests.cli.test_cli_cluster import preflight

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


# --- merging into the user's own file (issue 31) ----------------------------------------------------------------

USER_FILE = ("WANDB_PROJECT=llm-pretrain\n"
             "NCCL_SOCKET_IFNAME=eth0\n"
             "TORCH_EXTENSIONS_DIR=/local/torch_ext\n"
             "\n"
             "NCCL_DEBUG=WARN\n"
             "NCCL_SOCKET_IFNAME=eth9\n"
             "# the cluster's notes\n")


def test_merge_keeps_the_users_lines_and_says_what_changed():
    from preflight.render.env_file import merge_text
    text, said = merge_text(USER_FILE, {"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"})
    assert text.splitlines() == ["WANDB_PROJECT=llm-pretrain", "NCCL_SOCKET_IFNAME==eth1",
                                 "TORCH_EXTENSIONS_DIR=/local/torch_ext", "NCCL_DEBUG=WARN",
                                 "# the cluster's notes", "NCCL_IB_DISABLE=1"]
    assert "replaced 'NCCL_SOCKET_IFNAME=eth0' with NCCL_SOCKET_IFNAME==eth1 (line 2)" in said
    assert "removed line 6 ('NCCL_SOCKET_IFNAME=eth9'): a second NCCL_SOCKET_IFNAME, which would win over line 2" \
        in said
    assert "added NCCL_IB_DISABLE=1" in said and not any("NCCL_DEBUG" in s for s in said)  # unchanged: not said
    assert any(s.startswith("kept line 7 (\"# the cluster's notes\"), but DeepSpeed's launcher cannot read it")
               for s in said), said
    assert "dropped 1 empty line (the launcher raises ValueError on one, runner.py:610)" in said
    assert said[-1] == "kept 3 other lines of yours"
    # No file yet: the recommendation alone.
    text, said = merge_text(None, {"NCCL_DEBUG": "WARN"})
    assert text == "NCCL_DEBUG=WARN\n" and said == ["wrote 1 variable: NCCL_DEBUG"]


def test_the_merged_file_is_what_deepspeed_exports(tmp_path):
    """The merged file through DeepSpeed's own pdsh export builder, run in a shell: the user's variables and
    preflight's, each with the merged value."""
    from preflight.render.env_file import merge_text
    mine = "".join(line + "\n" for line in USER_FILE.splitlines() if line and not line.startswith("#"))
    text, _ = merge_text(mine, {"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_IB_DISABLE": "1"})
    (tmp_path / ".deepspeed_env").write_text(text)
    out = subprocess.run(["sh", "-c", deepspeed_exports(tmp_path / ".deepspeed_env") + " env"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=30, env={"PATH": "/usr/bin:/bin"}).stdout.splitlines()
    for line in ("WANDB_PROJECT=llm-pretrain", "TORCH_EXTENSIONS_DIR=/local/torch_ext", "NCCL_SOCKET_IFNAME==eth1",
                 "NCCL_IB_DISABLE=1", "NCCL_DEBUG=WARN"):
        assert line in out, (line, out)


def test_env_file_over_a_users_file_keeps_their_lines(netcluster_factory, tmp_path):
    """`preflight run --env-file .deepspeed_env` on real hosts, over a file with the user's own lines: they stay,
    only preflight's variables change, and stderr says what changed."""
    cluster = netcluster_factory(2)
    env = tmp_path / ".deepspeed_env"
    env.write_text("WANDB_PROJECT=llm-pretrain\nNCCL_DEBUG=INFO\nTORCH_EXTENSIONS_DIR=/local/torch_ext\n")
    proc = preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"), "--checks", "interfaces",
                     "--env-file", env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = env.read_text().splitlines()
    assert lines[0] == "WANDB_PROJECT=llm-pretrain" and lines[2] == "TORCH_EXTENSIONS_DIR=/local/torch_ext", lines
    assert lines[1] == "NCCL_DEBUG=WARN", lines
    assert f"preflight: --env-file {env}: replaced 'NCCL_DEBUG=INFO' with NCCL_DEBUG=WARN (line 2)" in proc.stderr
    assert f"preflight: --env-file {env}: kept 2 other lines of yours" in proc.stderr
    for line in lines[3:]:
        assert f"export {line}" in proc.stdout.splitlines() or line.split("=")[0] in proc.stdout, line
