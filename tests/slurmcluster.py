"""Throwaway Slurm cluster on a NetCluster: one slurmctld host and one slurmd per namespace host.

Every daemon is Debian's own (slurmctld, slurmd, munged; Slurm 22.05). Each node is a NetCluster host, so it has
its own hostname (= NodeName), network, mounts and /tmp; slurmctld runs in one more host named ``ctld``. Sample of
the slurm.conf this writes (paths under the cluster's state dir, ``%n`` = the node's name):

    SlurmctldHost=ctld(198.18.0.1)
    SlurmdSpoolDir=/run/pfnc-…/slurm/nodes/%n/spool
    NodeName=slm1 NodeAddr=198.18.0.2 CPUs=4 State=UNKNOWN
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

from .netcluster import NetCluster, NetClusterError, SetupCommand, _which

__all__ = ["SlurmCluster", "slurm_unavailable_reason"]

CTLD = "ctld"
DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "salloc", "sbatch", "scontrol", "sinfo", "squeue")
# slurmd 22.05 initialises its cgroup plugin even with proctrack/linuxproc and task/none, and `ip netns exec`
# gives each host a fresh /sys without /sys/fs/cgroup.  Mount a v1 layout there (a tmpfs with the freezer
# hierarchy, which joins the machine's existing one): cgroup.conf pins cgroup/v1, so no systemd is needed.
_CGROUP_SETUP = ("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/freezer "
                 "&& mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer")


def slurm_unavailable_reason() -> str | None:
    """Why this machine cannot build a SlurmCluster, or None when it can."""
    if reason := NetCluster.unavailable_reason():
        return reason
    missing = [d for d in DAEMONS if not _which(d)]
    if missing:
        return f"Slurm test bed needs {', '.join(missing)} (tests/install-deps.sh installs slurmctld slurmd " \
               "slurm-client munge)"
    return None


class SlurmCluster:
    """n Slurm nodes (default slm1..slmN) and a controller, on namespace hosts. Use as a context manager.

    ``env`` is the environment for Slurm client commands (salloc, srun, sinfo) run by the test process, which
    acts as the submit host from the root namespace.
    """

    def __init__(self, n: int = 3, names: Sequence[str] | None = None,
                 setup: Mapping[str, Sequence[SetupCommand]] | None = None, cpus: int = 4,
                 ready_timeout: float = 90.0, inactive_limit: int = 0):
        self.names = list(names) if names is not None else [f"slm{i + 1}" for i in range(n)]
        node_setup = {name: [_CGROUP_SETUP, *(setup or {}).get(name, ())] for name in self.names}
        self._munged: subprocess.Popen | None = None
        self._closed = False
        self.net = NetCluster(len(self.names) + 1, names=[CTLD, *self.names],
                              setup={CTLD: [_CGROUP_SETUP], **node_setup})
        try:
            self.dir = self.net.dir / "slurm"
            self.conf = self.dir / "slurm.conf"
            self.munge_socket = self.dir / "munge" / "munge.socket"
            self._write_files(cpus, inactive_limit)
            self._start_munged()
            self.ctld_proc = self._start(CTLD, ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            self.slurmd_procs = {name: self._start(name, ["slurmd", "-D", "-f", str(self.conf)], "slurmd")
                                 for name in self.names}
            self.wait_idle(ready_timeout)
        except BaseException:
            self.close()
            raise

    # -- files and daemons ----------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # A Slurm job's variables in the test's own environment would make a client think it is inside a job.
        for key in [k for k in env if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
            del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_files(self, cpus: int, inactive_limit: int) -> None:
        (self.dir / "munge").mkdir(parents=True, mode=0o700)
        (self.dir / "state").mkdir(mode=0o700)
        for name in self.names:
            (self.dir / "nodes" / name / "spool").mkdir(parents=True)
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        ctld = self.net.host(CTLD)
        d = self.dir
        nodes = "".join(f"NodeName={h} NodeAddr={self.net.host(h).addresses[0]} CPUs={cpus} State=UNKNOWN\n"
                        for h in self.names)
        self.conf.write_text(f"""# Slurm test bed of NetCluster {self.net.id}
ClusterName=pf{self.net.id}
SlurmctldHost={CTLD}({ctld.addresses[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d / 'state'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdSpoolDir={d / 'nodes' / '%n' / 'spool'}
SlurmdPidFile={d / 'nodes' / '%n' / 'slurmd.pid'}
SlurmdLogFile={d / 'nodes' / '%n' / 'slurmd.log'}
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=20
InactiveLimit={inactive_limit}
KillWait=2
MinJobAge=30
SlurmctldDebug=info
SlurmdDebug=info
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munged(self) -> None:
        d = self.dir / "munge"
        with open(d / "munged.out", "wb") as out:
            self._munged = subprocess.Popen(
                [_which("munged") or "munged", "-F", "--force", f"--socket={self.munge_socket}",
                 f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
                 f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}", "--num-threads=4"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise NetClusterError(f"munged did not start: {self._tail(d / 'munged.out')} "
                                      f"{self._tail(d / 'munged.log')}")
            time.sleep(0.02)

    def _start(self, host: str, argv: list[str], what: str) -> subprocess.Popen:
        log = self.dir / f"{what}-{host}.out"
        with open(log, "wb") as out:
            return self.net.popen(host, [_which(argv[0]) or argv[0], *argv[1:]], stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def wait_idle(self, timeout: float, nodes: Sequence[str] | None = None) -> None:
        """Block until every node (or the given ones) is idle in sinfo; fail fast when a daemon died."""
        want = set(nodes or self.names)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            dead = [f"{what} on {host}" for host, (what, proc) in self._daemons().items() if proc.poll() is not None]
            if dead:
                raise NetClusterError(f"{', '.join(dead)} exited: {self.logs()}")
            proc = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=20)
            states = dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)
            if all(states.get(n, "").rstrip("*") == "idle" for n in want):
                return
            if time.monotonic() > deadline:
                raise NetClusterError(f"nodes not idle after {timeout}s: {states or proc.stderr.strip()}; "
                                      f"{self.logs()}")
            time.sleep(0.3)

    def _daemons(self) -> dict[str, tuple[str, subprocess.Popen]]:
        out = {CTLD: ("slurmctld", self.ctld_proc)}
        out.update({h: ("slurmd", p) for h, p in self.slurmd_procs.items()})
        return out

    def daemon_pids(self) -> set[int]:
        """pids of sshd, slurmctld and slurmd on every host: what may run on a node between jobs."""
        return {h.pid for h in self.net.hosts} | {p.pid for _, p in self._daemons().values()}

    def logs(self) -> str:
        parts = [f"{p.name}: {self._tail(p)}" for p in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log"))]
        parts += [f"{p.parent.name}/slurmd.log: {self._tail(p)}" for p in sorted(self.dir.glob("nodes/*/slurmd.log"))]
        return " | ".join(parts)

    @staticmethod
    def _tail(path: Path, chars: int = 1500) -> str:
        try:
            return path.read_text(errors="replace").strip()[-chars:] or "(empty)"
        except OSError:
            return "(none)"

    # -- using it -------------------------------------------------------------

    def client(self, argv: Sequence[str], check: bool = True, timeout: float = 60,
               **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, scontrol, salloc ...) from the submit host (root namespace).

        On timeout every process this cluster's clients started is killed (salloc's command and the sruns it
        started run in sessions of their own, so killing salloc alone would leave them)."""
        try:
            proc = subprocess.run([_which(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True,
                                  timeout=timeout, env=kwargs.pop("env", self.env), stdin=subprocess.DEVNULL,
                                  **kwargs)
        except subprocess.TimeoutExpired:
            self.kill_clients()
            raise
        if check and proc.returncode:
            raise NetClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def client_pids(self) -> list[int]:
        """Processes of the submit host (root namespaces) that use this cluster: salloc, srun, coordinators."""
        mine = f"SLURM_CONF={self.conf}".encode()
        root_net = os.stat("/proc/self/ns/net")
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (root_net.st_dev, root_net.st_ino) and mine in env:
                found.append(int(entry))
        return found

    def kill_clients(self) -> None:
        """SIGKILL every client_pids() process, until none is left (a dying salloc may still fork)."""
        for _ in range(20):
            pids = self.client_pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def node_exec(self, node: str, argv: Sequence[str] | str, timeout: float = 60,
                  env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv on a node itself, as slurmd's HealthCheckProgram or a prolog would be run."""
        cmd = ["env", f"SLURM_CONF={self.conf}", *(f"{k}={v}" for k, v in (env or {}).items())]
        cmd += ["sh", "-c", argv] if isinstance(argv, str) else list(argv)
        return self.net.exec(node, cmd, timeout=timeout)

    def node_processes(self, node: str) -> dict[int, str]:
        """{pid: command line} of every process in the node's namespaces, except its daemons."""
        target = os.stat(f"/proc/{self.net.host(node).pid}/ns/net")
        keep = self.daemon_pids()
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in keep:
                continue
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino) and state not in ("Z", "X"):
                found[int(entry)] = cmdline.strip()
        return found

    def remove_ssh_keys(self) -> None:
        """No SSH keys anywhere: nobody may log in to a node, and nodes hold no key to log in elsewhere."""
        self.net.authorized_keys.write_text("")
        for name in [CTLD, *self.names]:
            dot_ssh = self.net.dir / "hosts" / name / "dot_ssh"
            for key in ("id_ed25519", "id_ed25519.pub", "authorized_keys"):
                (dot_ssh / key).unlink(missing_ok=True)

    def drain_reasons(self) -> dict[str, str]:
        """{node: reason} as `sinfo -R` prints them."""
        out = self.client(["sinfo", "-R", "-h", "-N", "-o", "%N|%E"]).stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Stop every daemon and job step, remove namespaces and files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        try:
            self.kill_clients()  # a failed test's salloc, srun or coordinator: they would hang on a gone slurmctld
        except Exception as exc:
            errors.append(f"killing the cluster's clients: {exc}")
        try:
            self.net.close()  # kills every process in the hosts: slurmctld, slurmd, slurmstepd, job steps
        except Exception as exc:  # munged must still go
            errors.append(str(exc))
        if self._munged is not None:
            try:
                os.killpg(self._munged.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._munged.wait(timeout=10)
        shutil.rmtree(self.net.dir, ignore_errors=True)
        if errors:
            raise NetClusterError("; ".join(errors))

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
