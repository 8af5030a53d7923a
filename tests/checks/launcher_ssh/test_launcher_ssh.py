"""launcher_ssh: ssh stderr classification, evaluate on recorded facts, the host-side probe with a stand-in ssh,
and the real thing from node01 of a namespace cluster (healthy; a refused key and an unknown host key)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.checks import launcher_ssh as ls
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_thresholds
from tests.netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[3]
THRESHOLDS = load_thresholds()

# stderr of OpenSSH 9.2 clients (rc 255 unless noted), as recorded from real failures.
SAMPLES = {
    "auth": "root@node03: Permission denied (publickey).",
    "auth_password": "deploy@gpu-7: Permission denied (publickey,password).",
    "host_key_unknown": "No ED25519 host key is known for node02 and you have requested strict checking.\r\n"
                        "Host key verification failed.",
    "host_key_changed": (
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
        "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
        "IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\n"
        "Host key for node04 has changed and you have requested strict checking.\n"
        "Host key verification failed."),
    "unresolved": "ssh: Could not resolve hostname node09: Name or service not known",
    "unresolved_dns": "ssh: Could not resolve hostname gpu-12: Temporary failure in name resolution",
    "refused": "ssh: connect to host 198.18.0.5 port 22: Connection refused",
    "timeout": "ssh: connect to host 198.18.0.6 port 22: Connection timed out",
    "unreachable": "ssh: connect to host 10.1.0.7 port 22: No route to host",
    "closed": "kex_exchange_identification: Connection closed by remote host\r\n"
              "Connection closed by 198.18.0.8 port 22",
    "perms": "Bad owner or permissions on /root/.ssh/config",
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_classify_recorded_stderr(name):
    assert ls.classify(255, SAMPLES[name]) == name.split("_password")[0].split("_dns")[0]


def test_classify_rc_only_cases():
    assert ls.classify(0, "Warning: Permanently added 'node02' (ED25519) to the list of known hosts.") == "ok"
    assert ls.classify(127, "ssh: command not found") == "no_client"
    assert ls.classify(124, "\nssh: timed out after 20s") == "timeout"
    assert ls.classify(255, "something new and strange") == "other"


def test_explain_names_host_master_and_the_fix():
    why, fix = ls.explain("auth", "node03", "node01", SAMPLES["auth_password"])
    assert "Permission denied (publickey,password)" in why and "ask for a password" in why
    assert "ssh-copy-id node03" in fix and fix.startswith("on node01")
    why, fix = ls.explain("host_key_unknown", "node02", "node01", SAMPLES["host_key_unknown"])
    assert "node02" in why and "ssh-keyscan -H node02 >> ~/.ssh/known_hosts" in fix
    assert "ssh-keygen -R node04" in ls.explain("host_key_changed", "node04", "node01", "")[1]
    assert "/etc/hosts" in ls.explain("unresolved", "node09", "node01", SAMPLES["unresolved"])[1]
    for kind in ("refused", "timeout", "unreachable", "closed", "perms", "no_client", "other"):
        why, fix = ls.explain(kind, "nodeX", "node01", SAMPLES.get(kind, ""))
        assert why and fix


# Facts of launcher_ssh.coordinate recorded on a 3-host namespace cluster where node01's known_hosts lacked
# node02 and node01's ssh config gave node03 a key node03 does not accept.
RECORDED = json.loads(r"""
{"master": "node01", "targets": ["node01", "node02", "node03"], "error": null,
 "client": "OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL 3.0.19 27 Jan 2026", "pdsh": null, "user": "root",
 "results": {
  "node02": {"rc": 255, "hostname": "", "duration_s": 0.175,
             "stderr": "No ED25519 host key is known for node02 and you have requested strict checking.\r\nHost key verification failed."},
  "node03": {"rc": 255, "hostname": "", "duration_s": 0.315, "stderr": "root@node03: Permission denied (publickey)."},
  "node01": {"rc": 0, "hostname": "node01", "stderr": "", "duration_s": 0.563}}}
""")


def test_evaluate_recorded_failures_per_target_host():
    out = ls.evaluate(RECORDED, THRESHOLDS)
    # node01 reached itself, but these facts were recorded on a first host without pdsh (issue 24: a FAIL now,
    # on node01, where deepspeed runs); the SSH result stays in its message.
    assert out["node01"].status == Status.FAIL and out["node01"].metrics["hostname"] == "node01"
    assert "launcher 'pdsh' not installed" in out["node01"].message
    assert "passwordless SSH node01 -> node01 ok" in out["node01"].message
    assert out["node02"].status == Status.FAIL and "node02" in out["node02"].message
    assert "Host key verification failed" in out["node02"].message and "ssh-keyscan" in out["node02"].fix
    assert out["node03"].status == Status.FAIL and "Permission denied (publickey)" in out["node03"].message
    assert "from node01 to node03" in out["node03"].message and "ssh-copy-id node03" in out["node03"].fix
    assert out["node03"].metrics["kind"] == "auth"


def test_evaluate_healthy_single_host_missing_and_agent_failures():
    healthy = json.loads(json.dumps(RECORDED))
    healthy["pdsh"] = "/usr/bin/pdsh"  # a healthy first host has the launcher (issue 24)
    for h in ("node02", "node03"):
        healthy["results"][h] = {"rc": 0, "hostname": h, "stderr": "", "duration_s": 0.2}
    assert all(o.status == Status.PASS for o in ls.evaluate(healthy, THRESHOLDS).values())

    empty = json.loads(json.dumps(healthy))
    empty["results"]["node02"]["hostname"] = ""
    assert ls.evaluate(empty, THRESHOLDS)["node02"].status == Status.FAIL

    missing = json.loads(json.dumps(healthy))
    del missing["results"]["node03"]
    out = ls.evaluate(missing, THRESHOLDS)
    assert out["node03"].status == Status.ERROR and "time budget" in out["node03"].message

    single = ls.evaluate({"master": "solo", "targets": ["solo"], "single_host": True}, THRESHOLDS)
    assert single["solo"].status == Status.SKIP and "locally" in single["solo"].message

    failed = ls.evaluate({"master": "node01", "targets": ["node01", "node02"],
                          "error": "the probe on node01 failed: timed out"}, THRESHOLDS)
    assert {o.status for o in failed.values()} == {Status.ERROR}

    noclient = ls.evaluate({"master": "node01", "targets": ["node01", "node02"], "client": None,
                            "client_error": "ssh: command not found", "results": {}}, THRESHOLDS)
    assert noclient["node01"].status == Status.FAIL and "no ssh client on node01" in noclient["node01"].message
    assert "openssh-client" in noclient["node01"].fix and noclient["node02"].status == Status.ERROR


def test_ssh_argv_takes_the_launchers_port_before_the_host():
    env = ["&&", "echo", "@@preflight-env@@", "&&", "env"]  # then the host's own environment for an SSH command
    assert ls.ssh_argv("node02", 5) == ["ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no",
                                        "-o", "ConnectTimeout=5", "-x", "--", "node02", "hostname"] + env
    argv = ls.ssh_argv("node02", 5, 2222)
    assert argv[argv.index("-p"):] == ["-p", "2222", "--", "node02", "hostname"] + env


def test_explain_names_the_port_the_launcher_uses():
    refused = "ssh: connect to host node02 port 2222: Connection refused"
    why, fix = ls.explain("refused", "node02", "node01", refused, 2222)
    assert "port 2222" in why and "port 22 " not in why + " " and "2222" in fix
    # Without a port given, the one ssh's error names (a Port in node01's ~/.ssh/config), else 22.
    assert "port 2200" in ls.explain("refused", "node02", "node01", refused.replace("2222", "2200"))[0]
    assert "port 22 " in ls.explain("refused", "node02", "node01", "Connection refused")[0] + " "
    why, fix = ls.explain("timeout", "node02", "node01", "", 2222, None, ["198.18.0.1"])
    assert "SSH port 2222" in why and "on node02 allow TCP 2222 from node01 in the firewall" in fix, fix
    assert "  iptables -I INPUT -p tcp -s 198.18.0.1 --dport 2222 -j ACCEPT" in fix.splitlines(), fix
    why, fix = ls.explain("host_key_unknown", "node02", "node01", SAMPLES["host_key_unknown"], 2222)
    assert "for port 2222" in why
    (scan,) = [line.strip() for line in fix.splitlines()[1:]]
    assert scan == ("ssh-keygen -F '[node02]:2222' >/dev/null || ssh-keyscan -H -p 2222 node02 "
                    ">> ~/.ssh/known_hosts")
    assert "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub" in fix
    why, fix = ls.explain("host_key_changed", "node04", "node01", SAMPLES["host_key_changed"], 2222)
    remove, scan = [line.strip() for line in fix.splitlines()[1:]]
    assert remove == "ssh-keygen -R '[node04]:2222'" and "ssh-keyscan -H -p 2222 node04" in scan
    assert "ssh-copy-id -p 2222 node03" in ls.explain("auth", "node03", "node01", SAMPLES["auth"], 2222)[1]
    assert "ssh -v -p 2222 node03 hostname" in ls.explain("other", "node03", "node01", "", 2222)[1]


def test_a_blocked_ssh_port_gets_the_firewall_lines_of_the_tool_the_host_runs():
    """node02's SSH port times out from node01: its firewall is read there (only there: node03 answered) and the
    fix is the ufw line for node01's address. Before the follow-up to issue 30 it said "allow TCP 22 from node01 to
    node02 (firewall, routing)"."""
    from preflight.config import load_thresholds
    from preflight.hostside.fixes import FIREWALL_CALL
    from preflight.testing import FakeCluster
    results = {"node01": {"rc": 0, "hostname": "node01", "stderr": "", "duration_s": 0.1},
               "node02": {"rc": 255, "hostname": "", "duration_s": 5.0,
                          "stderr": "ssh: connect to host 198.18.0.2 port 22: Connection timed out"},
               "node03": {"rc": 0, "hostname": "node03", "stderr": "", "duration_s": 0.1}}
    probe = {"client": "OpenSSH_9.2p1", "pdsh": "/usr/bin/pdsh", "user": "root", "results": results,
             "launcher": {"pdsh": "/usr/bin/pdsh"}}
    ufw = {"root": True, "firewalld": {"running": False}, "ufw": {"active": True, "error": None},
           "nft": {"read": False, "error": "nft: not installed"}}
    iface = {"interfaces": {"interfaces": [{"name": "lo", "ipv4": ["127.0.0.1/8"]},
                                           {"name": "eth0", "ipv4": ["198.18.0.1/24"]}]}}
    cluster = FakeCluster(3, thresholds=load_thresholds(), facts={"node01": iface},
                          handlers={"launcher_ssh.probe": lambda h, p, t: dict(probe),
                                    FIREWALL_CALL: lambda h, p, t: ufw})
    out = ls.evaluate(ls.coordinate(cluster), cluster.thresholds)
    assert [(c.host, c.params) for c in cluster.calls if c.func == FIREWALL_CALL] == \
        [("node02", {"addresses": ["198.18.0.2"]})]
    fix = out["node02"].fix
    assert out["node02"].status == Status.FAIL and "(firewall, routing)" not in fix, fix
    assert [x[2:] for x in fix.splitlines() if x.startswith("  ")] == \
        ["ufw allow from 198.18.0.1 proto tcp to any port 22"], fix
    assert out["node03"].status == Status.PASS


def test_evaluate_names_the_port_in_pass_and_fail():
    facts = json.loads(json.dumps(RECORDED))
    facts["port"] = 2222
    facts["results"]["node03"] = {"rc": 255, "hostname": "", "duration_s": 0.01,
                                  "stderr": "ssh: connect to host node03 port 2222: Connection refused"}
    out = ls.evaluate(facts, THRESHOLDS)
    assert "node01 -> node01 port 2222 ok" in out["node01"].message and out["node01"].metrics["port"] == 2222
    assert out["node03"].status == Status.FAIL and "connection to port 2222 refused" in out["node03"].message
    assert "ssh-keyscan -H -p 2222 node02" in out["node02"].fix
    # No port given: ssh's own (22 here), and the message says which.
    plain = ls.evaluate(RECORDED, THRESHOLDS)
    assert plain["node01"].metrics["port"] == 22 and "port" not in plain["node01"].message


# --- host side with a stand-in ssh --------------------------------------------------------------

FAKE_SSH = r"""#!/bin/sh
# Stand-in for ssh: the host name (the argument before the command) decides what happens.
if [ "$1" = "-V" ]; then echo "OpenSSH_fake" >&2; exit 0; fi
for a; do [ "$a" = "hostname" ] && break; host=$a; done
echo "$@" >> "$FAKE_SSH_LOG"
case "$host" in
  good*) echo "$host"; echo "@@preflight-env@@"; env ;;
  denied*) echo "root@$host: Permission denied (publickey)." >&2; exit 255 ;;
  slow*) sleep 30 ;;
esac
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "ssh"
    script.write_text(FAKE_SSH)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "calls"))
    return tmp_path / "calls"


def test_probe_runs_concurrently_bounded_and_kills_slow_ssh(fake_ssh):
    hosts = [f"good{i}" for i in range(20)] + ["denied1", "slow1", "slow2"]
    ctx = HostContext(params={}, deadline=time.monotonic() + 30)
    start = time.monotonic()
    out = ls.probe({"hosts": hosts, "connect_timeout": 3, "command_timeout": 2.0, "parallel": 8}, ctx)
    assert time.monotonic() - start < 10  # 23 hosts, 8 at a time, slow ones cut at 2 s
    assert out["client"] == "OpenSSH_fake"
    res = out["results"]
    assert set(res) == set(hosts)
    assert all(res[f"good{i}"]["rc"] == 0 and res[f"good{i}"]["hostname"] == f"good{i}" for i in range(20))
    assert res["denied1"]["rc"] == 255 and "Permission denied" in res["denied1"]["stderr"]
    assert res["slow1"]["rc"] == 124 and ls.classify(124, res["slow1"]["stderr"]) == "timeout"
    calls = fake_ssh.read_text().splitlines()
    assert "-o BatchMode=yes -o PasswordAuthentication=no -o ConnectTimeout=3 -x -- good0 hostname && echo " \
        "@@preflight-env@@ && env" in calls


def test_probe_passes_the_port_to_ssh(fake_ssh):
    ctx = HostContext(params={}, deadline=time.monotonic() + 30)
    out = ls.probe({"hosts": ["good1"], "connect_timeout": 3, "port": 2222}, ctx)
    assert out["results"]["good1"]["rc"] == 0
    assert fake_ssh.read_text().splitlines() == [
        "-o BatchMode=yes -o PasswordAuthentication=no -o ConnectTimeout=3 -x -p 2222 -- good1 hostname && echo "
        "@@preflight-env@@ && env"]


def test_probe_respects_the_overall_deadline(fake_ssh):
    hosts = [f"slow{i}" for i in range(6)]
    ctx = HostContext(params={}, deadline=time.monotonic() + 5)
    start = time.monotonic()
    out = ls.probe({"hosts": hosts, "connect_timeout": 3, "command_timeout": 20.0, "parallel": 2}, ctx)
    assert time.monotonic() - start < 6
    # The first two are cut at the deadline; the rest never start and are reported missing (ERROR), not passed.
    assert len(out["results"]) < len(hosts)
    assert all(r["rc"] == 124 for r in out["results"].values())


def test_probe_without_an_ssh_client(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    out = ls.probe({"hosts": ["a", "b"]}, HostContext(params={}, deadline=time.monotonic() + 10))
    assert out["client"] is None and out["results"] == {}
    outcome = ls.evaluate(dict(out, master="a", targets=["a", "b"]), THRESHOLDS)
    assert outcome["a"].status == Status.FAIL and outcome["b"].status == Status.ERROR


# --- real hosts: from node01 of a namespace cluster over real SSH --------------------------------



def run_cli(cluster, tmp_path, *extra, timeout=120):
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "launcher_ssh", "--json", str(report), *extra]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    return proc, {r["host"]: r for r in data["results"] if r["check"] == "launcher_ssh"}


def test_real_healthy_cluster_passes(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3)
    proc, cells = run_cli(cluster, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(cells) == {"node01", "node02", "node03"}
    for name, cell in cells.items():
        assert cell["status"] == "pass", cell
        assert cell["metrics"]["hostname"] == name and cell["metrics"]["from"] == "node01"


def test_real_refused_key_and_unknown_host_key_fail_naming_the_host(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3)
    # Every sshd of the cluster reads one shared authorized_keys, and the coordinator uses the same key, so a
    # target cannot refuse node01's key alone. node01's side is per host: its ssh config gives node03 a key
    # nobody accepts, and its known_hosts forgets node02 (both files are node01's private /root/.ssh).
    cluster.exec("node01", ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", "/root/.ssh/unknown_key"],
                 check=True)
    config = cluster.exec("node01", ["cat", "/root/.ssh/config"], check=True).stdout
    cluster.exec("node01", ["sh", "-c", "cat > /root/.ssh/config"], check=True,
                 input="Host node03\n    IdentityFile /root/.ssh/unknown_key\n    IdentitiesOnly yes\n" + config)
    known = cluster.exec("node01", ["cat", "/root/.ssh/known_hosts"], check=True).stdout
    kept = "".join(line + "\n" for line in known.splitlines() if not line.split(",")[0].startswith("node02"))
    assert kept != known
    cluster.exec("node01", ["sh", "-c", "cat > /root/.ssh/known_hosts"], check=True, input=kept)

    proc, cells = run_cli(cluster, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert cells["node01"]["status"] == "pass", cells["node01"]
    assert cells["node02"]["status"] == "fail" and "to node02" in cells["node02"]["message"]
    assert "Host key verification failed" in cells["node02"]["message"]
    assert "ssh-keyscan -H node02" in cells["node02"]["fix"]
    assert cells["node03"]["status"] == "fail" and "to node03" in cells["node03"]["message"]
    assert "Permission denied (publickey)" in cells["node03"]["message"]
    assert "ssh-copy-id node03" in cells["node03"]["fix"]


@pytest.fixture
def cluster_2222():
    """Three namespace hosts whose sshd listens on port 2222 only (their ssh config and known_hosts say 2222)."""
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(3, ssh_port=2222) as cluster:
        yield cluster


def test_real_port_2222_probes_the_launchers_port(cluster_2222, tmp_path):
    """sshd on 2222 only: the probe uses --ssh-port (DeepSpeed's --ssh_port), or --launcher-ssh-port; without
    either, ssh from node01 tries port 22 and the message says so."""
    cluster = cluster_2222
    proc, cells = run_cli(cluster, tmp_path, "--ssh-port", "2222")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, cell in cells.items():
        assert cell["status"] == "pass" and "port 2222 ok" in cell["message"], cell
        assert cell["metrics"]["port"] == 2222 and cell["metrics"]["hostname"] == name

    # The coordinator reaches the hosts through its ssh config's Port 2222; the launcher would use 22.
    proc, cells = run_cli(cluster, tmp_path)
    assert proc.returncode == 1
    for cell in cells.values():
        assert cell["status"] == "fail" and "connection to port 22 refused" in cell["message"], cell
        assert cell["metrics"]["port"] == 22

    proc, cells = run_cli(cluster, tmp_path, "--launcher-ssh-port", "2222")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(c["status"] == "pass" and c["metrics"]["port"] == 2222 for c in cells.values()), cells

    # --launcher-ssh-port wins over --ssh-port: the launcher may use another port than the coordinator.
    proc, cells = run_cli(cluster, tmp_path, "--ssh-port", "2222", "--launcher-ssh-port", "2200")
    assert proc.returncode == 1
    assert all("port 2200" in c["message"] and c["metrics"]["port"] == 2200 for c in cells.values()), cells


# --- the launcher's own program on the first host (issue 24) --------------------------------------------------

def test_no_pdsh_on_the_first_host_fails_there_with_deepspeeds_words():
    facts = json.loads(json.dumps(RECORDED))
    for h in ("node02", "node03"):
        facts["results"][h] = {"rc": 0, "hostname": h, "stderr": "", "duration_s": 0.2}
    facts["launcher_programs"] = {"pdsh": None, "ompi_info": "/usr/bin/ompi_info", "mpirun": "/usr/bin/mpirun",
                                  "sinfo": None, "mpiname": None}
    out = ls.evaluate(facts, THRESHOLDS)
    first = out["node01"]
    assert first.status == Status.FAIL
    # DeepSpeed's own message (deepspeed/launcher/runner.py:583), on the first host, where deepspeed runs.
    assert "launcher 'pdsh' not installed." in first.message and "node01" in first.message
    assert "install pdsh on node01" in first.fix
    # The launchers whose program is there are offered, and how to make preflight check that one instead.
    assert "--launcher openmpi" in first.fix and "--launcher mpich" in first.fix and "--launcher slurm" not in first.fix
    assert "[launcher_ssh] launcher" in first.fix
    assert out["node02"].status == Status.PASS and out["node03"].status == Status.PASS
    assert "pdsh" not in out["node02"].message

    # pdsh present: the same facts pass everywhere.
    facts["launcher_programs"]["pdsh"] = "/usr/bin/pdsh"
    assert {o.status for o in ls.evaluate(facts, THRESHOLDS).values()} == {Status.PASS}

    # Another launcher is checked by its own program: openmpi's ompi_info is there, slurm's sinfo is not.
    other = {k: dict(v) for k, v in THRESHOLDS.items()}
    other["launcher_ssh"]["launcher"] = "openmpi"
    facts["launcher_programs"]["pdsh"] = None
    assert ls.evaluate(facts, other)["node01"].status == Status.PASS
    other["launcher_ssh"]["launcher"] = "slurm"
    slurm = ls.evaluate(facts, other)["node01"]
    assert slurm.status == Status.FAIL and "launcher 'slurm' not installed." in slurm.message
    assert "no sinfo on its PATH" in slurm.message

    # A single host launches locally, without pdsh (runner.py: multi_node_exec is false): never a FAIL.
    single = ls.evaluate({"master": "solo", "targets": ["solo"], "single_host": True, "pdsh": None}, THRESHOLDS)
    assert single["solo"].status == Status.SKIP


def test_launcher_setting_is_validated(tmp_path):
    from preflight.config import ConfigError, load_thresholds as load
    bad = tmp_path / "bad_launcher.toml"
    bad.write_text('[launcher_ssh]\nlauncher = "pdhs"\n')
    with pytest.raises(ConfigError, match="launcher"):
        load(str(bad))


def test_probe_records_the_launchers_programs(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("ssh", "#!/bin/sh\n[ \"$1\" = -V ] && echo OpenSSH_fake >&2\nexit 0\n"),
                       ("mpiname", "#!/bin/sh\necho 'MVAPICH2 2.3.7'\n")):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    out = ls.probe({"hosts": [], "launcher": "mvapich"}, HostContext(params={}, deadline=time.monotonic() + 10))
    assert out["launcher_programs"]["pdsh"] is None and out["pdsh"] is None
    assert out["launcher_programs"]["mpiname"] == str(bindir / "mpiname")
    assert out["launcher_programs"]["mpiname_output"] == "MVAPICH2 2.3.7"
    mv = {k: dict(v) for k, v in THRESHOLDS.items()}
    mv["launcher_ssh"]["launcher"] = "mvapich"
    facts = dict(out, master="a", targets=["a", "b"],
                 results={h: {"rc": 0, "hostname": h, "stderr": "", "duration_s": 0.1} for h in ("a", "b")})
    verdict = ls.evaluate(facts, mv)["a"]
    assert verdict.status == Status.FAIL and "not MVAPICH2-GDR" in verdict.message


def test_real_first_host_without_pdsh_fails_there(netcluster_factory, tmp_path):
    """node01 (the first host, where deepspeed runs) has no pdsh on PATH: its cell FAILs with DeepSpeed's
    words; node02 and node03, which have pdsh but are not the launch host, pass."""
    if not shutil.which("pdsh"):
        pytest.fail("pdsh is a test dependency (tests/install-deps.sh)")
    hide = f"mount --bind /dev/null {shutil.which('pdsh')}"  # node01's own mount namespace only
    cluster = netcluster_factory(3, setup={"node01": [hide]})
    assert cluster.exec("node01", "command -v pdsh").returncode != 0
    assert cluster.exec("node02", "command -v pdsh").returncode == 0
    proc, cells = run_cli(cluster, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    first = cells["node01"]
    assert first["status"] == "fail" and "launcher 'pdsh' not installed." in first["message"], first
    assert "install pdsh on node01" in first["fix"] and "--launcher" in first["fix"]
    assert cells["node02"]["status"] == "pass" and cells["node03"]["status"] == "pass", cells


# --- the inherited environment (issue 24) -----------------------------------------------------------------------

def _snap(shell=None, ds_vars=None, bad_lines=()):
    from preflight.hostside import launchenv
    ds_env = {"files": ["/job/.deepspeed_env"] if ds_vars or bad_lines else [], "vars": dict(ds_vars or {}),
              "bad_lines": list(bad_lines)}
    return launchenv.snapshot(dict(shell or {}), ds_env)


NET = {"node01": {"ifnames": ["lo", "eth0", "ib0"], "ib": [{"device": "mlx5_0", "port": 1, "active": True}]},
       "node02": {"ifnames": ["lo", "eth0", "ib0"], "ib": [{"device": "mlx5_0", "port": 1, "active": False}]},
       "node03": {"ifnames": ["lo", "ens1"], "ib": []}}


def test_what_the_pdsh_launcher_exports():
    snap = _snap({"NCCL_DEBUG": "WARN", "TORCH_NCCL_BLOCKING_WAIT": "1", "PYTHONPATH": "/x", "CUDA_HOME": "/c",
                  "HOME": "/root"}, {"NCCL_DEBUG": "INFO", "DS_SKIP_CUDA_CHECK": "1"})
    # NCCL* and PYTHON* from the shell (runner.py:36, the CUDA accelerator's NCCL), every .deepspeed_env line,
    # and a .deepspeed_env value wins over the shell's.
    assert snap["exported"] == {"NCCL_DEBUG": ["INFO", "/job/.deepspeed_env"], "PYTHONPATH": ["/x", "the launch shell"],
                                "DS_SKIP_CUDA_CHECK": ["1", "/job/.deepspeed_env"]}
    assert "HOME" not in snap["shell"] and snap["shell"]["CUDA_HOME"] == "/c"


def test_inherited_environment_findings():
    from preflight.hostside import launchenv
    found = launchenv.check(_snap({"TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_HOME": "/usr/local/cuda",
                                   "NCCL_ASYNC_ERROR_HANDLING": "1", "DS_ACCELERATOR": "gpu"},
                                  {"NCCL_TIMEOUT": "1800"}, ["/job/.deepspeed_env:3: NCCL_DEBUG"]), NET)
    def one(prefix, status):
        (f,) = [f for f in found if f.message.startswith(prefix) and f.status == status]
        return f
    bad_line = one("/job/.deepspeed_env:3:", Status.FAIL)
    assert "ValueError" in bad_line.message and "KEY=VALUE" in bad_line.fix
    assert "init_process_group(timeout" in one("NCCL_TIMEOUT=1800", Status.WARN).message
    # The legacy name at 1 restates torch's default: unset it (renaming would set what recommend calls not needed).
    assert one("NCCL_ASYNC_ERROR_HANDLING", Status.WARN).fix.startswith("unset NCCL_ASYNC_ERROR_HANDLING")
    accel = one("DS_ACCELERATOR=gpu (the launch shell) is not", Status.FAIL)
    assert "DS_ACCELERATOR must be one of" in accel.message and accel.hosts == ()  # cluster-wide
    # Set in the shell but not passed to the ranks: WARN with the .deepspeed_env fix; CUDA_HOME is each host's own.
    unpassed = one("TORCH_NCCL_BLOCKING_WAIT=1", Status.WARN)
    assert "does not pass it to the ranks" in unpassed.message
    assert "echo TORCH_NCCL_BLOCKING_WAIT=1 >> .deepspeed_env" in unpassed.fix
    assert not any(f.message.startswith("CUDA_HOME") for f in found)

    # Names each host must have: NCCL's filter semantics (prefix, '=' exact, '^' exclude).
    def ifname_hosts(value):
        (f,) = [f for f in launchenv.check(_snap({"NCCL_SOCKET_IFNAME": value}), NET)
                if f.message.startswith("NCCL_SOCKET_IFNAME")]
        return f.status, list(f.hosts)
    assert ifname_hosts("bogus0") == (Status.FAIL, ["node01", "node02", "node03"])
    assert ifname_hosts("eth") == (Status.FAIL, ["node03"])
    assert ifname_hosts("=eth") == (Status.FAIL, ["node01", "node02", "node03"])
    assert [f for f in launchenv.check(_snap({"NCCL_SOCKET_IFNAME": "^docker,lo"}), NET)] == []
    assert [f for f in launchenv.check(_snap({"NCCL_SOCKET_IFNAME": "eth,ens"}), NET)] == []
    (gloo,) = launchenv.check(_snap(ds_vars={"GLOO_SOCKET_IFNAME": "eth0"}), NET)
    assert gloo.status == Status.FAIL and list(gloo.hosts) == ["node03"]
    (hca,) = launchenv.check(_snap({"NCCL_IB_HCA": "=mlx5_1"}), NET)
    assert hca.status == Status.WARN and list(hca.hosts) == ["node01", "node02", "node03"]
    (ib,) = launchenv.check(_snap({"NCCL_IB_DISABLE": "0"}), NET)
    assert ib.status == Status.WARN and list(ib.hosts) == ["node02", "node03"] and "no active IB port" in ib.message
    assert launchenv.check(_snap({"NCCL_IB_DISABLE": "1"}), NET) == []


def test_evaluate_puts_the_environment_on_the_cluster_row_and_the_named_hosts():
    facts = json.loads(json.dumps(RECORDED))
    facts["pdsh"] = "/usr/bin/pdsh"
    for h in ("node02", "node03"):
        facts["results"][h] = {"rc": 0, "hostname": h, "stderr": "", "duration_s": 0.2}
    facts["launch_env"] = _snap({"NCCL_SOCKET_IFNAME": "eth"})
    facts["host_net"] = NET
    out = ls.evaluate(facts, THRESHOLDS)
    assert out["*"].status == Status.FAIL and "NCCL_SOCKET_IFNAME=eth" in out["*"].message
    assert out["node03"].status == Status.FAIL and "matches no interface on node03" in out["node03"].message
    assert "passwordless SSH node01 -> node03 ok" in out["node03"].message
    assert out["node01"].status == Status.PASS and out["node02"].status == Status.PASS
    # Nothing wrong: no cluster row; what the ranks inherit is in the first host's metrics.
    facts["launch_env"] = _snap({"NCCL_SOCKET_IFNAME": "eth,ens"})
    out = ls.evaluate(facts, THRESHOLDS)
    assert "*" not in out and out["node01"].metrics["launch_env"]["exported"] == ["NCCL_SOCKET_IFNAME"]


def test_real_inherited_environment_is_named(netcluster_factory, tmp_path):
    """A bogus NCCL_SOCKET_IFNAME in the launch shell, a TORCH_NCCL_ variable pdsh does not pass, and
    NCCL_TIMEOUT in the working directory's .deepspeed_env: launcher_ssh names each, the interface on every host."""
    cluster = netcluster_factory(3)
    work = tmp_path / "work"
    work.mkdir()
    (work / ".deepspeed_env").write_text("NCCL_TIMEOUT=1800\n")
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path), NCCL_SOCKET_IFNAME="bogus0",
               TORCH_NCCL_BLOCKING_WAIT="1")
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "interfaces,launcher_ssh", "--json", str(report)]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cells = {r["host"]: r for r in json.loads(report.read_text())["results"] if r["check"] == "launcher_ssh"}
    star = " | ".join(f["message"] for f in cells["*"]["metrics"]["findings"])
    assert "NCCL_SOCKET_IFNAME=bogus0 (the launch shell) matches no interface on node01, node02, node03" in star
    assert f"NCCL_TIMEOUT=1800 ({work / '.deepspeed_env'}) has no effect" in star, star
    assert "TORCH_NCCL_BLOCKING_WAIT=1 is set in the launch shell" in star
    assert cells["*"]["where"] == "launch shell"
    for h in ("node01", "node02", "node03"):
        assert cells[h]["status"] == "fail" and "NCCL_SOCKET_IFNAME=bogus0" in cells[h]["message"], cells[h]
        assert (cells[h]["blocked_by"], cells[h]["blocked_host"]) == ("launcher_ssh", "*"), cells[h]


def test_real_variable_left_in_the_launch_shell_is_one_warn_and_its_fix_works(netcluster_factory, tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL in the launch shell, no .deepspeed_env line: one WARN naming it, with the
    line to add; the fix pasted in the directory deepspeed runs from, the next run has no WARN."""
    cluster = netcluster_factory(3)
    work = tmp_path / "work"
    work.mkdir()
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path), TORCH_DISTRIBUTED_DEBUG="DETAIL")
    env.pop("DS_ENV_FILE", None)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "interfaces,launcher_ssh", "--json", str(report)]

    def run():
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert proc.returncode == 0, proc.stdout + proc.stderr  # a WARN: the job starts
        return proc, {r["host"]: r for r in json.loads(report.read_text())["results"] if r["check"] == "launcher_ssh"}

    proc, cells = run()
    star = cells["*"]
    (finding,) = [f for f in star["metrics"]["findings"] if f["status"] != "pass"]
    assert star["status"] == "warn" and star["where"] == "launch shell", star
    assert finding["message"].startswith("TORCH_DISTRIBUTED_DEBUG=DETAIL is set in the launch shell, but DeepSpeed's "
                                         "pdsh launcher does not pass it to the ranks"), finding
    assert "echo TORCH_DISTRIBUTED_DEBUG=DETAIL >> .deepspeed_env" in finding["fix"]
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in proc.stdout
    for h in ("node01", "node02", "node03"):
        assert cells[h]["status"] == "pass", cells[h]
    subprocess.run(["sh", "-c", finding["fix"].split(": ", 1)[1].split(" (or ", 1)[0]], cwd=work, check=True)
    _, cells = run()
    assert "*" not in cells, cells["*"]


def test_an_inherited_value_is_one_cause_in_the_launch_shell_and_the_hosts_its_victims():
    """NCCL_SOCKET_IFNAME=bogus0 from the launch shell: the cluster row is the cause (where "launch shell"); each
    host's row shows it and is blocked by that row; a host whose own SSH also failed stays a cause of its own."""
    from preflight.hostside.outcome import BlockedBy
    facts = json.loads(json.dumps(RECORDED))
    facts["pdsh"] = "/usr/bin/pdsh"
    for h in ("node01", "node02", "node03"):
        facts["results"][h] = {"rc": 0, "hostname": h, "stderr": "", "duration_s": 0.2}
    facts["launch_env"] = _snap({"NCCL_SOCKET_IFNAME": "bogus0"})
    facts["host_net"] = NET
    out = ls.evaluate(facts, THRESHOLDS)
    assert out["*"].status == Status.FAIL and out["*"].where == "launch shell" and out["*"].blocked_by is None
    for h in ("node01", "node02", "node03"):
        assert out[h].status == Status.FAIL and out[h].blocked_by == BlockedBy("*", "launcher_ssh"), out[h]
        assert out[h].where is None
    facts["results"]["node02"] = {"rc": 255, "hostname": "", "stderr": "Permission denied (publickey).",
                                  "duration_s": 0.1}
    out = ls.evaluate(facts, THRESHOLDS)
    assert out["node02"].blocked_by is None and "key was refused" in out["node02"].message
    # A note alone (nothing wrong): no cluster row, the note on the first host's row.
    facts["results"]["node02"] = facts["results"]["node01"]
    facts["launch_env"] = _snap({"DEEPSPEED_DEBUG": "1"})
    out = ls.evaluate(facts, THRESHOLDS)
    assert "*" not in out and out["node01"].status == Status.PASS
    assert "note: DEEPSPEED_DEBUG (the launch shell) is not a variable DeepSpeed 0.19.8 reads" in out["node01"].message


def test_the_probe_reads_each_hosts_own_environment(fake_ssh, monkeypatch):
    """The ssh command prints the host's environment after its name: the probe keeps the watched names, and a
    host whose own SSH environment sets the value is not named."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the fake ssh's `env` (this process's) has it
    ctx = HostContext(params={}, deadline=time.monotonic() + 30)
    out = ls.probe({"hosts": ["good1"], "connect_timeout": 3}, ctx)
    assert out["results"]["good1"]["hostname"] == "good1"
    assert out["results"]["good1"]["env"].get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
    assert "PATH" not in out["results"]["good1"]["env"]
