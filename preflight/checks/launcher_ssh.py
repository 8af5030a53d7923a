"""Passwordless SSH from the first host to every host by hostfile name, as DeepSpeed's pdsh launcher needs it, the
launcher's own program on the first host (no pdsh: "launcher 'pdsh' not installed.", runner.py:582-583), and the
environment it gives every rank: the launch shell's NCCL* variables and .deepspeed_env (hostside/launchenv.py).

Runs ``ssh -o BatchMode=yes -o PasswordAuthentication=no -o ConnectTimeout=N [-p PORT] HOST hostname`` on the
first host, PORT being the launcher's (``--launcher-ssh-port``, else ``--ssh-port``, as DeepSpeed's ``--ssh_port``
passes ``-p`` to pdsh's ssh), and classifies ssh's rc and stderr, e.g.::

    root@node03: Permission denied (publickey,password).                 -> key refused
    Host key verification failed.                                        -> unknown or changed host key
    ssh: Could not resolve hostname node09: Name or service not known    -> name does not resolve
    ssh: connect to host node04 port 22: Connection timed out            -> network / firewall

It also looks for the launcher's own program on the first host, where ``deepspeed`` runs: DeepSpeed's runner raises
``RuntimeError: launcher 'pdsh' not installed.`` when ``runner.backend_exists()`` is false
(deepspeed/launcher/runner.py:582-583; PDSHRunner.backend_exists is ``shutil.which('pdsh')``,
deepspeed/launcher/multinode_runner.py:70-71), before any rank starts.

Thresholds: [launcher_ssh] in launcher_ssh.toml beside this module (``launcher``: which DeepSpeed launcher).
"""
from __future__ import annotations

import math
import os
import shlex
import re
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..hostside import launchenv
from ..hostside.fixes import FIREWALL_CALL, firewall_fix
from ..hostside.seams import CheckSpec, ClusterView, HostContext
from ..hostside.outcome import BlockedBy, Finding, Outcome, Status, combine, error, limits, skip
from ..hostside.proc import sh

NAME = "launcher_ssh"
CLUSTER = "*"  # the cluster row's host (results.CLUSTER; a check never imports the coordinator)

STDERR_KEEP = 600  # characters of ssh's stderr kept per host: enough for the message, small in the report

# The program each DeepSpeed launcher's backend_exists() looks for on PATH of the host running `deepspeed`
# (deepspeed/launcher/multinode_runner.py, DeepSpeed 0.19.8): PDSHRunner :70-71 pdsh, OpenMPIRunner :139-141
# ompi_info, MPICHRunner :200-202 and IMPIRunner :272-274 mpirun, SlurmRunner :357-358 sinfo, MVAPICHRunner
# :450-463 mpiname (whose output must also name MVAPICH2-GDR).
LAUNCHER_PROGRAMS = {"pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun",
                     "slurm": "sinfo", "mvapich": "mpiname"}


def ssh_argv(host: str, connect_timeout: int, port: Optional[int] = None) -> List[str]:
    # The check DeepSpeed's runner itself makes (ssh -o PasswordAuthentication=no [-p ssh_port] HOST hostname),
    # plus BatchMode so that nothing can prompt, and the user's own ~/.ssh/config and known_hosts as pdsh would use
    # them. Without a port, ssh's own choice (the config's Port, else 22), as DeepSpeed without --ssh_port.
    # `--`: a host name can never become an ssh option (a hostfile name '-Eadvlog' would be ssh's -E log file).
    # After `hostname`, the host's own environment for an SSH command (what pdsh's ssh gets there, before the
    # launcher's exports): launchenv.parse_host_env reads it. ssh joins the words into one remote command line.
    return ["ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no",
            "-o", f"ConnectTimeout={max(1, int(connect_timeout))}", "-x"] + \
        (["-p", str(int(port))] if port else []) + ["--", host, "hostname", "&&", "echo", launchenv.ENV_MARK, "&&",
                                                    "env"]


# --- pure classification ---------------------------------------------------------------------

_RULES: List[Tuple[str, "re.Pattern[str]"]] = [
    ("no_client", re.compile(r"^ssh: command not found", re.M)),
    ("host_key_changed", re.compile(r"REMOTE HOST IDENTIFICATION HAS CHANGED|Host key for \S+ has changed")),
    ("host_key_unknown", re.compile(r"Host key verification failed|No \S+ host key is known for")),
    ("perms", re.compile(r"Bad owner or permissions on|UNPROTECTED PRIVATE KEY FILE")),
    ("auth", re.compile(r"Permission denied|Too many authentication failures|"
                        r"No more authentication methods to try")),
    ("unresolved", re.compile(r"Could not resolve hostname|Name or service not known|"
                              r"Temporary failure in name resolution|nodename nor servname")),
    ("refused", re.compile(r"Connection refused")),
    ("unreachable", re.compile(r"No route to host|Network is unreachable")),
    ("timeout", re.compile(r"Connection timed out|Operation timed out|timed out after")),
    ("closed", re.compile(r"Connection closed by|Connection reset by|kex_exchange_identification|"
                          r"banner exchange")),
]


def classify(rc: int, stderr: str) -> str:
    """ssh's failure kind from its rc and stderr; 'ok' for rc 0, 'other' when nothing matches."""
    if rc == 0:
        return "ok"
    if rc == 127:
        return "no_client"
    for kind, pattern in _RULES:
        if pattern.search(stderr or ""):
            return kind
    if rc == 124:
        return "timeout"
    return "other"


def _auth_methods(stderr: str) -> str:
    m = re.search(r"Permission denied \(([^)]*)\)", stderr or "")
    return m.group(1) if m else ""


def q(host: str) -> str:
    # A host name inside a printed command is one shell word (the hostfile parser refuses '-'-leading names).
    return shlex.quote(host)


def ssh_port_of(stderr: str, port: Optional[int]) -> int:
    """The port ssh used: the one given, else the one its error names ("connect to host X port 2222: ..."), else
    22 (ssh's default; a Port in ~/.ssh/config shows in that error)."""
    if port:
        return int(port)
    m = re.search(r" port (\d+): ", stderr or "")
    return int(m.group(1)) if m else 22


def explain(kind: str, host: str, master: str, stderr: str, port: Optional[int] = None,
            firewall: Optional[Dict[str, Any]] = None, sources: Sequence[Any] = ()) -> Tuple[str, str]:
    """(why, fix) for a failure kind, naming the target host, the first host and the SSH port (the launcher's
    port when given, else what ssh used). Each command in a fix is pasteable on the first host as it is."""
    last = next((ln.strip() for ln in reversed((stderr or "").splitlines()) if ln.strip()), "").rstrip(".")
    p = ssh_port_of(stderr, port)
    dash_p = "" if p == 22 else f"-p {p} "
    # OpenSSH records a host off port 22 as [host]:port; ssh-keyscan -p writes that form, ssh-keygen -R needs it.
    entry = q(host) if p == 22 else q(f"[{host}]:{p}")
    # The first host's own known_hosts, recorded once: ssh-keygen -F skips the scan when the entry is there.
    scan = f"ssh-keygen -F {entry} >/dev/null || ssh-keyscan -H {dash_p}{q(host)} >> ~/.ssh/known_hosts"
    m = re.search(r"No (\w+) host key is known", stderr or "")
    key_type = m.group(1).lower() if m else "ed25519"
    pub = f"/etc/ssh/ssh_host_{key_type}_key.pub"
    on_port = "" if p == 22 else f" for port {p}"
    if kind == "auth":
        methods = _auth_methods(stderr)
        asks = " (it would ask for a password)" if "password" in methods or "keyboard" in methods else ""
        return (f"the key was refused: {last or 'Permission denied'}{asks}",
                f"on {master}: ssh-copy-id {dash_p}{q(host)} (or append {master}'s ~/.ssh/id_*.pub to "
                f"{host}:~/.ssh/authorized_keys, mode 600, ~/.ssh mode 700)")
    if kind == "host_key_unknown":
        return (f"{host}'s host key{on_port} is not in {master}'s known_hosts (Host key verification failed)",
                f"on {master}, after comparing the key with the host's own (ssh-keygen -lf {pub} on {host}):"
                f"\n  {scan}")
    if kind == "host_key_changed":
        return (f"{host}'s host key{on_port} CHANGED since {master} recorded it",
                f"if {host} was reinstalled (compare the new key with ssh-keygen -lf {pub} there), on {master}, "
                f"in order:\n  ssh-keygen -R {entry}\n  {scan}")
    if kind == "unresolved":
        return (f"the name {host} does not resolve on {master} ({last})",
                f"make the hostfile name resolvable on {master}: /etc/hosts or DNS (DeepSpeed uses the hostfile "
                "names)")
    if kind == "refused":
        return (f"connection to port {p} refused: no sshd listening ({last})",
                f"start sshd on {host} (systemctl start ssh) listening on port {p}, or pass the port sshd listens on "
                "(--launcher-ssh-port, and DeepSpeed's --ssh_port)")
    if kind in ("timeout", "unreachable"):
        return (f"{master} cannot reach {host}'s SSH port {p} ({last or 'timed out'})",
                f"check that the hostfile name {host} maps to the cluster network (routing), then "
                + firewall_fix(host, firewall, sources, str(p)).replace("from the cluster", f"from {master}", 1))
    if kind == "closed":
        return (f"sshd on {host} closed the connection ({last})",
                f"check sshd on {host}: MaxStartups, AllowUsers/DenyUsers, TCP wrappers (journalctl -u ssh)")
    if kind == "perms":
        return (f"ssh on {master} refuses its own files: {last}",
                f"on {master}: chmod 700 ~/.ssh; chmod 600 ~/.ssh/id_* ~/.ssh/config ~/.ssh/authorized_keys")
    if kind == "no_client":
        return (f"no ssh client on {master}", f"install it on {master}: apt-get install openssh-client pdsh")
    return (f"ssh failed: {last or 'no error output'}",
            f"run on {master}: ssh -v {dash_p}{q(host)} hostname")


# --- host side -------------------------------------------------------------------------------

def launcher_programs(launcher: Optional[str]) -> Dict[str, Any]:
    """{program: its path or None} for every launcher's program, as ``shutil.which`` finds it (DeepSpeed's own
    test), and for mvapich ``mpiname``'s output, which DeepSpeed requires to name MVAPICH2-GDR."""
    found: Dict[str, Any] = {prog: shutil.which(prog) for prog in sorted(set(LAUNCHER_PROGRAMS.values()))}
    if launcher == "mvapich" and found.get("mpiname"):
        res = sh(["mpiname"], timeout=5)
        found["mpiname_output"] = res.out.strip()[:200]
    return found


def probe(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """ssh to every host of ``hosts`` with at most ``parallel`` at once; all done before ctx.deadline."""
    hosts = [str(h) for h in params.get("hosts", [])]
    connect = int(params.get("connect_timeout", 10))
    port = int(params["port"]) if params.get("port") else None
    per_host = float(params.get("command_timeout", 20.0))
    end = min(ctx.deadline - 2.0, time.monotonic() + float(params.get("budget_s", 300.0)))
    version = sh(["ssh", "-V"], timeout=5)  # OpenSSH prints its version on stderr
    out: Dict[str, Any] = {"client": (version.err or version.out).strip()[:120] if version.rc != 127 else None,
                           "pdsh": shutil.which("pdsh"), "user": os.environ.get("USER") or str(os.getuid()),
                           "results": {}, "launcher_programs": launcher_programs(params.get("launcher"))}
    if version.rc == 127:
        out["client_error"] = version.err.strip()
        return out
    results: Dict[str, Dict[str, Any]] = {}
    lock = threading.Lock()
    queue = list(hosts)
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                host = queue.pop(0)
            left = end - time.monotonic()
            if left < 1.0:
                continue  # out of time: reported as not probed
            res = sh(ssh_argv(host, connect, port), timeout=min(per_host, left))
            head, mark, env_text = res.out.partition(launchenv.ENV_MARK)
            lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
            results[host] = {"rc": res.rc, "hostname": lines[-1] if lines else "",
                             "stderr": res.err.strip()[-STDERR_KEEP:], "duration_s": round(res.duration, 3)}
            if mark:
                results[host]["env"] = launchenv.parse_host_env(env_text)

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(max(1, min(int(params.get("parallel", 64)), len(hosts))))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, end + 1.0 - time.monotonic()))
    finally:
        stop.set()  # on Abort (deadline, Ctrl-C) no new ssh starts; the agent kills the running ones
    out["results"] = dict(results)
    return out


# --- coordinator -----------------------------------------------------------------------------

def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    lim = limits(cluster.thresholds, NAME)
    names = [h.name for h in cluster.all_hosts]
    master = cluster.master.name
    port = cluster.options.launcher_ssh_port  # the launcher's port (--launcher-ssh-port, else --ssh-port)
    facts: Dict[str, Any] = {"master": master, "targets": names, "results": {}, "error": None, "limits": lim,
                             "port": port}
    if len(names) == 1:
        facts["single_host"] = True
        return facts
    if cluster.options.transport == "srun":
        facts["launcher"] = "srun"  # inside a Slurm allocation the job is launched by srun, not pdsh over SSH
        return facts
    # What the launcher exports to every rank: the launch shell's variables and .deepspeed_env, read here (where
    # preflight runs, taken as where deepspeed will run), and each host's interface and IB device names.
    facts["launch_env"] = launchenv.snapshot(os.environ, launchenv.read_deepspeed_env())
    facts["host_net"] = {h: _net_names((cluster.facts.get(h) or {}).get("interfaces")) for h in names}
    if master not in {h.name for h in cluster.hosts}:
        facts["error"] = f"the first host {master} is unreachable, so SSH from it could not be tested"
        return facts
    rounds = math.ceil(len(names) / max(1, int(lim["parallel"])))
    timeout = min(float(lim["max_total_s"]), rounds * (float(lim["command_timeout_s"]) + 1) + 10)
    try:
        value = cluster.call(master, NAME + ".probe",
                             {"hosts": names, "connect_timeout": int(lim["connect_timeout_s"]), "port": port,
                              "launcher": str(lim["launcher"]),
                              "command_timeout": float(lim["command_timeout_s"]),
                              "parallel": int(lim["parallel"]), "budget_s": timeout - 5}, timeout)
        facts.update(value)
    except Exception as exc:  # the agent failed: every target is unchecked, not failed
        facts["error"] = f"the probe on {master} failed: {exc}"
        return facts
    _read_firewalls(cluster, facts, master)
    return facts


def _addresses(iface: Any) -> List[str]:
    """A host's own non-loopback addresses from its interfaces facts (``"10.0.0.1/24"`` -> ``"10.0.0.1"``)."""
    if not isinstance(iface, dict):
        return []
    return sorted({str(a).split("/")[0] for i in iface.get("interfaces") or [] if isinstance(i, dict)
                   for a in (i.get("ipv4") or []) + (i.get("ipv6") or [])
                   if not str(a).startswith(("127.", "::1", "fe80:"))})


def _read_firewalls(cluster: ClusterView, facts: Dict[str, Any], master: str) -> None:
    """facts["firewalls"][host]: the firewall of each host whose SSH port the first host could not reach (its fix's
    commands come from it), read only there; facts["sources"]: the first host's addresses, the rules' source."""
    facts["sources"] = _addresses((cluster.facts.get(master) or {}).get("interfaces"))
    reachable = {h.name for h in cluster.hosts}
    blocked: Dict[str, Dict[str, Any]] = {}
    for h, r in (facts.get("results") or {}).items():
        if h in reachable and isinstance(r, dict) and classify(int(r.get("rc", 255)), r.get("stderr", "")) in (
                "timeout", "unreachable"):
            # The address ssh went to ("connect to host 198.18.0.6 port 22"): firewalld's zone is its interface's.
            m = re.search(r"connect to host (\S+) port", str(r.get("stderr", "")))
            blocked[h] = {"addresses": [m.group(1)] if m else []}
    if blocked:
        answers = cluster.call_all(FIREWALL_CALL, blocked, 30.0)
        facts["firewalls"] = {h: a if isinstance(a, dict) else {"error": str(a) or type(a).__name__}
                              for h, a in answers.items()}


def _net_names(iface: Any) -> Optional[Dict[str, Any]]:
    """The names the inherited environment may point at: interfaces and IB/RoCE ports (None: not collected)."""
    if not isinstance(iface, dict):
        return None
    return {"ifnames": [str(i.get("name")) for i in iface.get("interfaces") or [] if isinstance(i, dict)],
            "ib": [{"device": p.get("device"), "port": p.get("port"), "active": p.get("active") is True}
                   for p in iface.get("ib") or [] if isinstance(p, dict)]}


# --- evaluation ------------------------------------------------------------------------------

def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    master = facts.get("master", "?")
    targets: List[str] = facts.get("targets", [])
    if facts.get("single_host"):
        return {h: skip("single host: DeepSpeed launches locally, without SSH") for h in targets}
    if facts.get("launcher") == "srun":
        return {h: skip("the job runs inside a Slurm allocation and is launched by srun (deepspeed --launcher "
                        "slurm), not by pdsh over SSH: passwordless SSH between nodes is not needed") for h in targets}
    if facts.get("error"):
        return {h: error(f"not checked: {facts['error']}", f"rerun with -v; check {master}") for h in targets}
    if facts.get("client") is None:
        why, fix = explain("no_client", master, master, facts.get("client_error", ""))
        failed: Dict[str, Outcome] = {h: error(f"not checked: {why}", fix) for h in targets}
        failed[master] = Outcome(Status.FAIL, f"{why}: DeepSpeed's pdsh launcher cannot reach any host", fix)
        return failed
    out: Dict[str, Outcome] = {}
    results = facts.get("results", {})
    port = facts.get("port")  # the launcher's port; None: ssh's own (22, or the first host's ssh config)
    on_port = f" port {port}" if port else ""
    for h in targets:
        r: Optional[Dict[str, Any]] = results.get(h)
        if r is None:
            out[h] = error(f"not checked: ssh from {master} to {h} did not run within the time budget",
                           "raise [launcher_ssh] max_total_s or parallel")
            continue
        metrics = {"from": master, "hostname": r.get("hostname", ""), "rc": r.get("rc"),
                   "duration_s": r.get("duration_s"), "client": facts.get("client"), "pdsh": facts.get("pdsh"),
                   "port": ssh_port_of(r.get("stderr", ""), port)}
        kind = classify(int(r.get("rc", 255)), r.get("stderr", ""))
        metrics["kind"] = kind
        if kind == "ok" and r.get("hostname"):
            took = r.get("duration_s") or 0.0
            out[h] = Outcome(Status.PASS, f"passwordless SSH {master} -> {h}{on_port} ok "
                             f"(hostname {r['hostname']}, {took:.2f}s)", metrics=metrics)
        elif kind == "ok":
            out[h] = Outcome(Status.FAIL, f"ssh {h} hostname from {master} succeeded but printed nothing",
                             f"check {h}'s login shell and sshd ForceCommand for the user", metrics)
        else:
            why, fix = explain(kind, h, master, r.get("stderr", ""), port, (facts.get("firewalls") or {}).get(h),
                               facts.get("sources") or ())
            out[h] = Outcome(Status.FAIL, f"passwordless SSH from {master} to {h} fails: {why}; DeepSpeed's pdsh "
                             "launcher cannot start ranks there", fix, metrics)
    missing = _launcher_missing(facts, str(limits(thresholds, NAME)["launcher"]), master)
    if missing is not None and master in out:
        # The launch host's own row: its SSH result stays in the message, after the launcher's FAIL.
        mine = out[master]
        findings = [missing] + ([Finding(mine.status, mine.message, mine.fix)] if mine.status != Status.PASS else [])
        outcome = combine(findings, "", mine.metrics)
        if mine.status == Status.PASS:
            outcome.message += f"; {mine.message}"
        out[master] = outcome
    if isinstance(facts.get("launch_env"), dict):
        _add_env_findings(out, facts, targets)
    return out


def _host_envs(facts: Dict[str, Any], targets: List[str]) -> Dict[str, Optional[Dict[str, str]]]:
    """{host: its own environment for an SSH command from the first host, None where not read} (host data: only
    NAME=short value pairs of watched names are kept, launchenv.parse_host_env)."""
    out: Dict[str, Optional[Dict[str, str]]] = {}
    for h in targets:
        r = (facts.get("results") or {}).get(h)
        env = r.get("env") if isinstance(r, dict) else None
        out[h] = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else None
    return out if any(v is not None for v in out.values()) else {}


def _add_env_findings(out: Dict[str, Outcome], facts: Dict[str, Any], targets: List[str]) -> None:
    """The inherited environment's findings, on the cluster row ("*"): a cause fixed in the launch shell (or its
    .deepspeed_env), where="launch shell", never on a host. A host row that the finding names is that cause's
    victim: it shows the finding and is blocked by the cluster row (one cause, not one per host), unless its own
    SSH failed too (then that is its own cause). Notes (a DeepSpeed-looking name nothing reads) go into the
    message of the cluster row, or of the first host's when nothing is wrong; what the ranks inherit is in the
    metrics."""
    found = launchenv.check(facts["launch_env"], facts.get("host_net") or {}, _host_envs(facts, targets))
    notes = [f.message for f in found if f.status == Status.PASS]
    found = [f for f in found if f.status != Status.PASS]
    env = {"exported": sorted((facts["launch_env"].get("exported") or {})),
           "deepspeed_env": (facts["launch_env"].get("deepspeed_env") or {}).get("files", [])}
    if notes:
        env["notes"] = notes
    master = facts.get("master")
    if not found:
        if master in out:
            out[master].metrics["launch_env"] = env
            if notes:
                out[master].message += "; " + "; ".join(f"note: {n}" for n in notes)
        return
    star = combine([Finding(f.status, f.message, f.fix) for f in found], "", {"launch_env": env})
    if notes:
        star.message += "; " + "; ".join(f"note: {n}" for n in notes)
    star.where = "launch shell"
    out["*"] = star
    own_ok = {h: out[h].status == Status.PASS for h in targets if h in out}  # before any finding is merged in
    for f in found:
        for h in f.hosts:
            if h in out and h in targets:
                mine = out[h]
                findings = [Finding(f.status, f.message, f.fix)] + (
                    [Finding(mine.status, mine.message, mine.fix)] if mine.status != Status.PASS else [])
                merged = combine(findings, "", mine.metrics)
                if mine.status == Status.PASS:
                    merged.message += f"; {mine.message}"
                # Its own SSH passed: only the inherited value fails here (a victim). Its SSH failed too: that is
                # a cause of its own, and the row stays one.
                merged.blocked_by = BlockedBy(CLUSTER, NAME) if own_ok.get(h) else None
                out[h] = merged


def _launcher_missing(facts: Dict[str, Any], launcher: str, master: str) -> Optional[Finding]:
    """A FAIL when the first host (where `deepspeed` runs) lacks the launcher's program, as DeepSpeed's runner
    tests it (runner.py:582-583: RuntimeError "launcher 'pdsh' not installed."); None when it is there or unknown
    (facts recorded before the probe looked)."""
    program = LAUNCHER_PROGRAMS.get(launcher, launcher)
    found = facts.get("launcher_programs")
    if not isinstance(found, dict):
        if launcher != "pdsh" or "pdsh" not in facts:
            return None
        found = {"pdsh": facts.get("pdsh")}
    if program not in found:
        return None
    others = ", ".join(f"--launcher {name}" for name, prog in LAUNCHER_PROGRAMS.items()
                       if name != launcher and found.get(prog))
    instead = (f"; or launch with one that is installed there ({others}) and set [launcher_ssh] launcher to it, so "
               "preflight checks that one" if others else
               "; or use another launcher (deepspeed --launcher openmpi/mpich/impi/mvapich/slurm) and set "
               "[launcher_ssh] launcher to it, so preflight checks that one")
    if launcher == "pdsh":
        install = f"install pdsh on {master} (apt-get install -y pdsh; dnf install -y pdsh pdsh-rcmd-ssh)"
    else:
        install = (f"install the {launcher} launcher's {program} on {master} (on the PATH of the shell that runs "
                   "deepspeed)")
    if not found.get(program):
        return Finding(Status.FAIL, f"DeepSpeed's {launcher} launcher is not installed on {master}, the first host, "
                       f"where deepspeed runs: no {program} on its PATH, so `deepspeed --launcher {launcher}` stops "
                       f"with \"launcher '{launcher}' not installed.\" before any rank starts",
                       install + instead)
    output = found.get("mpiname_output")
    if launcher == "mvapich" and output is not None and "MVAPICH2-GDR" not in output:
        return Finding(Status.FAIL, f"mpiname on {master} prints {output[:80]!r}, not MVAPICH2-GDR: DeepSpeed's "
                       "mvapich launcher stops with \"launcher 'mvapich' not installed.\"", install + instead)
    return None


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="passwordless SSH from the first host to every host, the launcher's program (pdsh) on the first "
                "host, and the NCCL/DeepSpeed variables the launcher passes to the ranks (DeepSpeed's pdsh launcher)",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    # Whether SSH works, not how fast: quiet. But the first host runs an SSH client (key exchange, a login shell) to
    # every host, and every host's sshd answers: CPU that grows with the hosts on the first one, which would show as
    # a slow host in compute's figures or a slow link in iperf3's: it loads "cpu" (runner.Schedule).
    quiet=True,
    loads=("cpu",),
    reads=("interfaces",),  # the hosts' interface and IB device names the inherited NCCL/Gloo variables name
)
