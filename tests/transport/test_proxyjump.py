"""ProxyJump and ProxyCommand on real sshd hosts the coordinator has no route to, and the ssh config read as `ssh -G`.

Topology (one NetCluster, 3 networks; the root namespace is the coordinator):

    net0 (routed)        : jump1
    net1 (unreachable)   : jump1, jump2, node1, node2
    net2 (unreachable)   : jump2, node3
    silentj (net0)       : accepts TCP on port 22, never sends a banner

node1/node2 are one hop away (ProxyJump jump1), node3 two (ProxyJump jump1,jump2). The root namespace has an
`unreachable` route for net1 and net2, so a connection that skips the jump host fails at once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from preflight import sshconfig
from preflight.transport import SSHOptions, SSHTransport, TransportError
from preflight.transport import jump
from tests.netcluster import NetCluster
from tests.cli.test_cli_cluster import ROOT, assert_nothing_left

NAMES = ["jump1", "jump2", "node1", "node2", "node3"]


@pytest.fixture(scope="module")
def topo():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(5, networks=3, names=NAMES) as cluster:  # closed (and its routes removed) even on failure
        jump1, jump2, node1, node2, node3 = cluster.hosts
        cluster.detach(jump1, 2)
        cluster.detach(jump2, 0)
        for h in (node1, node2):
            cluster.detach(h, 0)
            cluster.detach(h, 2)
        cluster.detach(node3, 0)
        cluster.detach(node3, 1)
        cluster.unroute(1)
        cluster.unroute(2)
        cluster.silent = cluster.add_silent("silentj")
        yield cluster


def write_config(cluster, path: Path, per_host: dict | None = None, extra: str = "") -> Path:
    """An ssh config naming every host by the address it has on its innermost network, plus per-host lines."""
    jump1, jump2, node1, node2, node3 = cluster.hosts
    where = {"jump1": jump1.addresses[0], "jump2": jump2.addresses[1], "node1": node1.addresses[1],
             "node2": node2.addresses[1], "node3": node3.addresses[2], "silentj": cluster.silent}
    blocks = []
    for name, address in where.items():
        lines = [f"Host {name}", f"    HostName {address}"]
        lines += [f"    {line}" for line in (per_host or {}).get(name, [])]
        blocks.append("\n".join(lines))
    path.write_text(extra + "\n".join(blocks) + f"""
Host *
    User root
    IdentityFile {cluster.user_key}
    UserKnownHostsFile {cluster.known_hosts}
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
""")
    return path


JUMPS = {"node1": ["ProxyJump jump1"], "node2": ["ProxyJump jump1"], "node3": ["ProxyJump jump1,jump2"]}


def run(cluster, tmp_path, config, *args, known_hosts=None, hosts=("node1", "node2", "node3"), timeout=240):
    hostfile = cluster.hostfile(tmp_path / "hostfile", names=list(hosts))
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable, "--hostfile", str(hostfile),
            "--ssh-config", str(config), "--known-hosts", str(known_hosts or cluster.known_hosts),
            "--json", str(report), *map(str, args)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {}
    if report.exists():
        cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    return proc, cells


def test_targets_reachable_only_through_jump_hosts(topo, tmp_path):
    config = write_config(topo, tmp_path / "cfg", JUMPS)
    proc, cells = run(topo, tmp_path, config, "--checks", "python,libaio")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    for name in ("node1", "node2", "node3"):
        assert cells[(name, "ssh")]["status"] == "pass", cells[(name, "ssh")]
        assert cells[(name, "ssh")]["metrics"]["hostname"] == name
        assert cells[(name, "python")]["status"] == "pass", cells[(name, "python")]
        assert cells[(name, "libaio")]["status"] != "error", cells[(name, "libaio")]
    assert "through jump host jump1, SSH round trip" in cells[("node1", "ssh")]["message"]
    assert "through jump hosts jump1, jump2, SSH round trip" in cells[("node3", "ssh")]["message"]
    assert_nothing_left(topo)
    # The same run without ProxyJump: the coordinator has no route to the targets.
    proc, cells = run(topo, tmp_path, write_config(topo, tmp_path / "direct"), "--checks", "python")
    assert proc.returncode == 1
    for name in ("node1", "node2", "node3"):
        cell = cells[(name, "ssh")]
        assert cell["status"] in ("error", "fail") and "No route to host" in cell["message"], cell
        assert "banner" not in cell["message"]


def test_chain_in_another_form_and_proxycommand(topo, tmp_path):
    """node3 through jump2, whose own Host block says ProxyJump jump1 (recursive, as ssh does); node1 through
    OpenSSH's own client as ProxyCommand."""
    jump_cfg = write_config(topo, tmp_path / "for-ssh")  # what the ProxyCommand's ssh reads
    config = write_config(topo, tmp_path / "cfg", {
        "jump2": ["ProxyJump jump1"], "node3": ["ProxyJump jump2"],
        "node1": [f"ProxyCommand ssh -F {jump_cfg} -W %h:%p jump1", "ProxyJump jump2"],  # first one wins
        "node2": ["ProxyCommand sh -c 'echo no way through >&2; exit 3'"]})
    route = sshconfig.load(str(config)).route("node3")
    assert [h.name for h in route] == ["jump1", "jump2", "node3"]
    proc, cells = run(topo, tmp_path, config, "--checks", "python", "--connect-timeout", "5")
    assert cells[("node3", "ssh")]["status"] == "pass", cells[("node3", "ssh")]
    assert cells[("node1", "ssh")]["status"] == "pass", cells[("node1", "ssh")]
    failed = cells[("node2", "ssh")]
    assert failed["status"] == "error" and "exited with status 3: no way through" in failed["message"], failed
    assert proc.returncode == 1
    assert_nothing_left(topo)


def test_unknown_jump_host_key_is_refused_then_accepted(topo, tmp_path):
    jump1 = topo.hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text("".join(h.known_hosts_line + "\n" for h in topo.hosts if h.name != "jump1"))
    config = write_config(topo, tmp_path / "cfg", JUMPS)
    proc, cells = run(topo, tmp_path, config, "--checks", "python", known_hosts=known, hosts=("node1", "node3"))
    assert proc.returncode == 1
    for name, hops in (("node1", 2), ("node3", 3)):
        message = cells[(name, "ssh")]["message"]
        assert cells[(name, "ssh")]["status"] == "fail"
        assert message.startswith(f"jump host jump1 (hop 1 of {hops} to {name}): unknown SSH host key for "
                                  f"{jump1.addresses[0]}"), message
    assert jump1.addresses[0] not in known.read_text()
    proc, cells = run(topo, tmp_path, config, "--checks", "python", "--accept-new-host-keys", known_hosts=known,
                      hosts=("node1", "node3"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{jump1.addresses[0]} {jump1.host_key_line.split()[0]}" in known.read_text()
    # A changed key on the second jump host: refused, and named.
    jump2 = topo.hosts[1]
    other = next(h for h in topo.hosts if h.name == "node1")
    text = known.read_text().replace(jump2.host_key_line, other.host_key_line)
    known.write_text(text)
    proc, cells = run(topo, tmp_path, config, "--checks", "python", known_hosts=known, hosts=("node3",))
    message = cells[("node3", "ssh")]["message"]
    assert message.startswith("jump host jump2 (hop 2 of 3 to node3): host key of "), message
    assert "CHANGED" in message
    # Behind jump1, the fix's commands run where jump2 is reachable: said in its prose line, and each command line
    # stays one command that bash parses (a note appended after it was a syntax error when pasted).
    prose, *commands = cells[("node3", "ssh")]["fix"].splitlines()
    assert "on a host that can reach it" in prose and commands, cells[("node3", "ssh")]["fix"]
    for command in commands:
        assert command.strip().startswith("ssh-keygen"), command
        assert subprocess.run(["bash", "-n", "-c", command], capture_output=True).returncode == 0, command


def test_silent_or_missing_jump_host_is_named_within_the_deadline(topo, tmp_path):
    nobody = topo.silent.rsplit(".", 1)[0] + ".250"  # on the coordinator's network, but no host has it
    config = write_config(topo, tmp_path / "cfg", {"node1": ["ProxyJump silentj"], "node2": ["ProxyJump silentj"],
                                                   "node3": [f"ProxyJump root@{nobody}"]})
    # A hang would run into the subprocess timeout; the messages say which deadline applied.
    proc, cells = run(topo, tmp_path, config, "--checks", "python", "--connect-timeout", "3", timeout=120)
    assert proc.returncode == 1
    for name in ("node1", "node2"):
        message = cells[(name, "ssh")]["message"]
        assert message.startswith(f"jump host silentj (hop 1 of 2 to {name}): {topo.silent}:22 accepted TCP but "
                                  "sent no SSH banner within 3s"), message
    message = cells[("node3", "ssh")]["message"]
    assert message.startswith(f"jump host {nobody} (hop 1 of 2 to node3): "), message
    assert "timed out after 3s" in message or "No route to host" in message, message
    assert "banner" not in message


def test_in_process_jump_reuse_and_nothing_leaks(topo, tmp_path):
    """Two targets share one jump1 connection; after close no jump connection, thread, descriptor or
    ProxyCommand process of ours is left."""
    config = write_config(topo, tmp_path / "cfg", {**JUMPS, "node2": [
        f"ProxyCommand ssh -F {write_config(topo, tmp_path / 'for-ssh')} -W %h:%p jump1"]})
    options = SSHOptions(config_path=str(config), known_hosts=str(topo.known_hosts), connect_timeout=10)

    def ours():
        return {t.ident for t in threading.enumerate() if t.name != "preflight-keepalive"}

    def children():
        found = set()
        for t in Path(f"/proc/{os.getpid()}/task").iterdir():
            try:
                found.update((t / "children").read_text().split())
            except FileNotFoundError:  # a thread that ended after the listing (seen in CI)
                pass
        return found

    def fds():
        found = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                found[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the listing's own descriptor
                pass
        return found

    warm = SSHTransport("jump1", options)  # paramiko's and cryptography's one-time set-up is not a leak
    warm.connect()
    warm.close()
    threads, before, kids = ours(), fds(), children()
    conns = [SSHTransport(name, options) for name in ("node1", "node3", "node2")]
    for conn in conns:
        conn.connect()
    try:
        assert conns[0]._jump is not None and conns[0]._jump is conns[1]._jump.parent  # one jump1 connection
        assert jump.JUMPS.open_count() == 2  # jump1, and jump2 through it
        for conn, name in zip(conns, ("node1", "node3", "node2")):
            assert conn.run(["uname", "-n"], timeout=20).stdout.strip() == name
        assert children() - kids  # node2's ProxyCommand runs
    finally:
        for conn in conns:
            conn.close()
    assert jump.JUMPS.open_count() == 0
    assert children() == kids
    deadline = time.monotonic() + 15  # paramiko's reader threads notice the close within their socket timeout
    while (ours() - threads or set(fds()) - set(before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours() - threads == set()
    assert {fd: target for fd, target in fds().items() if before.get(fd) != target} == {}
    # A jump host that cannot be reached: each target is told which hop failed, and nothing is kept either.
    bad = SSHTransport("node1", SSHOptions(config_path=str(write_config(topo, tmp_path / "bad", {
        "node1": ["ProxyJump root@jump1:2222"]})), known_hosts=str(topo.known_hosts), connect_timeout=5))
    with pytest.raises(TransportError, match=r"^jump host jump1 \(hop 1 of 2 to node1\): connection to "
                                             r".*:2222 refused"):
        bad.connect()
    # The jump host is fine but nothing listens where it should forward to: its sshd's answer, naming it.
    closed_port = SSHTransport("node1", SSHOptions(config_path=str(config), known_hosts=str(topo.known_hosts),
                                                   port=2222, connect_timeout=5))
    with pytest.raises(TransportError, match=r"^jump host jump1 could not connect to .*:2222: .*(refused|failed)"):
        closed_port.connect()
    assert jump.JUMPS.open_count() == 0


# ------------------------------------------------------------------------------------- ssh -G as the oracle

ORACLE_CONFIGS = {
    "plain": ("Host a\n  HostName 10.0.0.1\n  Port 2200\n  User alice\nHost *\n  User root\n", ["a", "b"]),
    "jump": ("Host t*\n  ProxyJump bob@j1:2222,j2\nHost j1\n  User carl\n  Port 23\n", ["t1", "j1"]),
    "jump-then-command": ("Host x\n  ProxyJump j1\n  ProxyCommand nc %h %p\n", ["x"]),
    "command-then-jump": ("Host x\n  ProxyCommand ssh -W %h:%p -p %p %r@%n j %%\n  ProxyJump j1\n", ["x"]),
    "command-none-first": ("Host x\n  ProxyCommand none\nHost *\n  ProxyJump j1\n", ["x", "y"]),
    "jump-none-first": ("Host x\n  ProxyJump none\nHost *\n  ProxyJump j1\n  ProxyCommand nc %h %p\n", ["x", "y"]),
    "command-then-none": ("Host x\n  ProxyCommand nc %h %p\n  ProxyCommand none\n", ["x"]),
    "uri-and-v6": ("Host x\n  ProxyJump ssh://u@j9:77,[fd00::1]:23\n", ["x"]),
    "tokens": ("Host x\n  HostName %h.example\n  ProxyJump %h-bastion\n", ["x"]),
    "match-host-before": ("Match host 10.*\n  Port 2022\nHost m\n  HostName 10.1.2.3\n", ["m", "n"]),
    "match-host-after": ("Host m\n  HostName 10.1.2.3\nMatch host 10.*\n  Port 2022\n", ["m", "n"]),
    "match-final": ("Match final host 10.*\n  Port 2022\nHost m\n  HostName 10.1.2.3\n", ["m", "n"]),
    "match-user": ("Host *\n  User eve\nMatch user eve\n  ProxyJump j5\n", ["m"]),
    "negation": ("Host * !skip\n  ProxyJump j1\n", ["skip", "other"]),
    "equals-and-case": ("host=x\n  proxyjump=j1\n  PORT=2201\n", ["x"]),
    "name-case": ("Host Foo\n  HostName BAR.Example\n  ProxyCommand nc %h %n\nHost foo\n  Port 2\nHost Qux\n  Port 3\n",
                  ["Foo", "foo", "Qux", "qux"]),
}


def ssh_g(config: Path, name: str, *flags: str) -> dict:
    out = subprocess.run(["ssh", "-G", "-F", str(config), *flags, name], capture_output=True, text=True,
                         check=True, stdin=subprocess.DEVNULL).stdout
    got = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("hostname", "port", "user", "proxyjump", "proxycommand"):
            got[key] = value
    return got


@pytest.mark.parametrize("case", sorted(ORACLE_CONFIGS))
@pytest.mark.parametrize("flags", [(), ("-l", "dora", "-p", "2345")], ids=["config", "cli-overrides"])
def test_resolution_matches_ssh_G(tmp_path, case, flags):
    text, names = ORACLE_CONFIGS[case]
    parsed = parse_config(tmp_path, text)
    config = tmp_path / "config"
    for name in names:
        expected = ssh_g(config, name, *flags)
        hop = parsed.resolve(name, user=flags[1] if flags else None, port=int(flags[3]) if flags else None)
        ours = {"hostname": hop.hostname, "port": str(hop.port), "user": hop.user}
        if hop.proxy_jump:
            ours["proxyjump"] = hop.proxy_jump
        if hop.proxy_command:
            ours["proxycommand"] = hop.proxy_command
        assert ours == expected, (case, name)


def parse_config(tmp_path, text: str) -> sshconfig.SSHConfigFile:
    config = tmp_path / "config"
    config.write_text(text)
    return sshconfig.load(str(config))


def test_proxy_values_are_expanded_like_openssh(tmp_path):
    parsed = parse_config(tmp_path, "Host x\n  HostName h.example\n  ProxyCommand ssh -W %h:%p -l %r %n %%p\n"
                            "Host y\n  ProxyJump %r@%h-bastion:%p\n  User u\n  Port 2200\n"
                            "Host z\n  ProxyCommand nc %h %p %Q\nHost w*\n  ProxyCommand nc %n %p\n")
    assert parsed.resolve("x", port=2022).command == "ssh -W h.example:2022 -l root x %p"
    assert parsed.resolve("y").jumps == (sshconfig.Jump("y-bastion", "u", 2200),)
    with pytest.raises(sshconfig.SSHConfigError, match="unknown token %Q"):
        parsed.resolve("z")
    # A hostfile name never reaches the shell with metacharacters in it (as OpenSSH 9.6 refuses them too).
    with pytest.raises(sshconfig.SSHConfigError, match="shell metacharacters"):
        parsed.resolve("w;touch /tmp/pwned")
    assert parsed.resolve("w-1.example").command == "nc w-1.example 22"


def test_route_honours_each_jump_hosts_own_block(tmp_path):
    parsed = parse_config(tmp_path, "Host t1\n  ProxyJump bob@j1:2222,j2\nHost t2\n  ProxyJump j2\n"
                            "Host j1\n  User carl\n  Port 23\n  IdentityFile ~/jkey\n"
                            "Host j2\n  HostName 10.0.0.2\n  ProxyJump zz\nHost loop\n  ProxyJump loop\n")
    j1, j2, t1 = parsed.route("t1", user="u", port=2200)
    # The ProxyJump spec wins over j1's block (ssh -l/-p), the rest of the block applies; -l/-p are the target's.
    assert (j1.name, j1.user, j1.port, j1.identity_files) == ("j1", "bob", 2222, (str(Path("~/jkey").expanduser()),))
    # j2 is reached through j1 (ssh -J j1 -W .. j2): its own ProxyJump zz does not apply ...
    assert (j2.hostname, j2.port, j2.user, j2.jumps) == ("10.0.0.2", 22, sshconfig._local_user(),
                                                         (sshconfig.Jump("j1", "bob", 2222),))
    assert (t1.user, t1.port) == ("u", 2200)
    # ... but with `ProxyJump j2` alone it does (ssh -W .. j2 reads j2's block).
    assert [h.name for h in parsed.route("t2")] == ["zz", "j2", "t2"]
    with pytest.raises(sshconfig.SSHConfigError, match="ProxyJump loop"):
        parsed.route("loop")


# ----------------------------------------------------------------------------- Match and Include warnings

def test_match_and_include_warn_once_per_line(topo, tmp_path):
    extra = ("Include ~/.ssh/config.d/*\n"
             "Match localnetwork 10.0.0.0/8 host node*\n    Port 2222\n"
             "Match exec \"true\"\n    User nobody\n"
             "Match host node*\n    ConnectTimeout 5\n    ProxyUseFdpass yes\n")
    config = write_config(topo, tmp_path / "cfg", JUMPS, extra=extra)
    proc, cells = run(topo, tmp_path, config, "--checks", "python", hosts=("node1", "node2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the ignored blocks would have broken the run
    warnings = [line for line in proc.stderr.splitlines() if "not supported by preflight" in line]
    assert warnings == [
        f"preflight: warning: {config}:1: 'Include' is not supported by preflight; ~/.ssh/config.d/* is not read",
        f"preflight: warning: {config}:2: 'Match localnetwork' is not supported by preflight; its block is ignored",
        f"preflight: warning: {config}:4: 'Match exec' is not supported by preflight; its block is ignored",
        f"preflight: warning: {config}:8: 'ProxyUseFdpass yes' is not supported by preflight; a ProxyCommand's "
        "stdin/stdout carry the connection",
    ], proc.stderr
    assert all(cells[(n, "ssh")]["status"] == "pass" for n in ("node1", "node2"))


def test_unparsable_ssh_config_is_a_usage_error(tmp_path):
    config = tmp_path / "cfg"
    config.write_text("Host a\n  HostName 10.0.0.1\n  ForwardAgent\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\n")
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile),
                           "--ssh-config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"preflight: error: --ssh-config {config}:3: cannot parse 'ForwardAgent' (expected 'Keyword value')"]
