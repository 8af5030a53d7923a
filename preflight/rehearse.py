"""``preflight rehearse``: the job's launch for real. DeepSpeed's launcher starts a tiny training script on every slot
of the hostfile over pdsh, exactly as the job will start, and every failure is named on its host and rank.

    preflight rehearse --hostfile hostfile --deepspeed-config /shared/ds_zero2.json
    -> on node01 (the first host, where users run deepspeed), in a fresh launch directory on every host:
       deepspeed --hostfile hostfile --launcher pdsh preflight_rehearse.py --deepspeed_config /shared/ds_zero2.json ...
    -> node02::launch FAILED - rank 1 advertised the loopback address 127.0.1.1 to the other ranks ...; fix: ...

The script is preflight/hostside/rehearsal.py. Its ranks report each phase as a line on their stdout
(``@@PF-REHEARSE {json}``), which pdsh brings to the launch host and preflight's SSH channel here. The launcher reads
the ``.deepspeed_env`` files DeepSpeed's runner reads: the one of the directory preflight runs in is copied to the
launch directory, and ``~/.deepspeed_env`` of the launch host is its own. Bounded by --timeout (and each rank by its
init timeout and lifetime); at the end everything of the run is killed on every host, also after a timeout or Ctrl-C
(the launch host's supervisor when its lifeline closes, then pkill of the run's token over preflight's SSH to every
host), and the launch directories are removed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from preflight.checks.launch.drive import LaunchRun, script_source
from preflight.checks.launch.judge import (CHECK, ENV_FILE_NAME, GRACE_S, HOSTFILE, IFNAME_FIX, LAUNCHER_FAILED,
                                           LOCAL, MAX_EVENTS, MAX_LINE, MAX_LINES, NEVER_STARTED, REAP_S, SCRIPT,
                                           STOP_S, TOKEN_PREFIX, Context, EventLog, LaunchPlan, Outcomes, RankView,
                                           Slot, classify_error, expected_ranks, pattern_of, rank_views, verdict_of)
from preflight.hostside.outcome import Status
from preflight.hostside.proc import parallel_map
from preflight.results import CLUSTER, HostRecord, Report, Result
from preflight.transport import SSHOptions, Transport, TransportError

DEFAULT_ENV_NAME = ENV_FILE_NAME
# The verdicts and the run itself live in preflight/checks/launch/ (the ``launch`` check of ``preflight run`` uses
# them too); these names stay importable from here.
__all__ = ["CHECK", "DEFAULT_ENV_NAME", "GRACE_S", "HOSTFILE", "IFNAME_FIX", "LAUNCHER_FAILED", "LOCAL", "MAX_EVENTS",
           "MAX_LINE", "MAX_LINES", "NEVER_STARTED", "REAP_S", "SCRIPT", "STOP_S", "TOKEN_PREFIX", "Context",
           "EventLog", "Outcomes", "RankView", "RehearseOptions", "Rehearsal", "Slot", "classify_error",
           "expected_ranks", "main", "pattern_of", "rank_views", "script_source", "verdict_of"]


@dataclass
class RehearseOptions(LaunchPlan):
    """What ``preflight rehearse`` was asked: the launch (``LaunchPlan``), and how preflight reaches the hosts."""

    ssh: SSHOptions = field(default_factory=SSHOptions)
    transport: str = "ssh"


class Rehearsal(LaunchRun):
    """``preflight rehearse``'s run: its own connections to every host (and to this machine with --launch-from
    local), the launch (``LaunchRun``), and the report."""

    def __init__(self, options: RehearseOptions, progress: Any = None,
                 make_transport: Optional[Callable[[str], Transport]] = None) -> None:
        super().__init__(options, None, progress)
        self.options = options
        self._make = make_transport or self._transport
        self.transports: Dict[str, Transport] = {}  # type: ignore[assignment]  # a Transport is a HostShell

    def _transport(self, name: str) -> Transport:
        from preflight import transport as transports
        if name == LOCAL:
            return transports.create("local", name, self.options.ssh)
        return transports.create(self.options.transport, name, self.options.ssh)

    def connect(self) -> None:
        names = [h.name for h in self.o.hosts]
        if self.launch_host == LOCAL:
            names.append(LOCAL)
        if self.progress is not None:
            self.progress.phase("connecting", len(names))

        def one(name: str) -> None:
            transport = self._make(name)
            self.transports[name] = transport
            try:
                transport.connect()
            except TransportError as exc:
                self.unreachable.append(name)
                self.errors[name] = (f"preflight could not reach it to write the rehearsal script: {exc}",
                                     exc.fix or "check the host and the SSH options")
            if self.progress is not None:
                self.progress.advance(name)

        budget = max([self.options.ssh.connect_timeout * 3 + 10] + [0.0])
        for name, done in zip(names, parallel_map(one, names, max(1, self.o.parallel), budget)):
            if isinstance(done, BaseException) and name not in self.errors:
                self.errors[name] = (f"connecting did not finish: {done}", "check the host")

    def reap(self) -> None:
        super().reap()
        for transport in self.transports.values():
            try:
                transport.close()
            except Exception:
                pass

    def run(self, env_text: Optional[str], hostfile_text: str) -> Report:
        started_at = _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")
        t0 = time.monotonic()
        rows: Dict[str, Any] = {}
        try:
            try:
                self.connect()
            except KeyboardInterrupt:
                self.interrupted = True
                self.reap()
            else:
                rows = self.rehearse(env_text, hostfile_text)
        finally:
            if self.progress is not None:
                self.progress.done()
        results = [Result.from_outcome(h, CHECK, o, o.metrics.get("elapsed_s", 0.0) if h == CLUSTER else 0.0)
                   for h, o in rows.items() if h != CLUSTER]
        if CLUSTER in rows:
            o = rows[CLUSTER]
            results.append(Result.from_outcome(CLUSTER, CHECK, o, float(o.metrics.get("elapsed_s") or 0.0)))
        for host, left in self.survivors().items():
            # A process of the run that survived the clean-up is an ERROR of its host: nothing may be left behind.
            name = LOCAL if host == CLUSTER else host
            results.append(Result(host, CHECK + "_cleanup", Status.ERROR,
                                  f"processes of the rehearsal survived pkill -KILL on {name}: {left}",
                                  f"kill them by hand (pkill -KILL -f {self.pattern})"))
        hosts = [HostRecord(h.name, getattr(self.transports.get(h.name), "address", h.name), h.slots,
                            h.name not in self.errors) for h in self.o.hosts]
        return Report(started_at, time.monotonic() - t0, hosts, results, [CHECK], strict=self.o.strict)


# ------------------------------------------------------------------------------------------------- the CLI

def add_arguments(parser: argparse.ArgumentParser, outputs: Sequence[Any]) -> None:
    """``preflight rehearse``'s options: the launch's own, the SSH group shared with ``run`` (preflight/flags.py)
    but for --launcher-ssh-port (DeepSpeed's, passed as given), and the outputs."""
    from preflight import flags
    from preflight.flags import count, port, positive_int, seconds

    g = parser.add_argument_group("the launch")
    g.add_argument("--hostfile", metavar="FILE", required=True,
                   help="the job's DeepSpeed hostfile; the launcher reads this file's text on the launch host")
    g.add_argument("--deepspeed-config", metavar="FILE", required=True,
                   help="the job's DeepSpeed config: its path is passed to every rank, which opens it on its own host "
                        "(the batch sizes, ZeRO stage and optimizer come from it)")
    g.add_argument("-i", "--include", default="", metavar="SPEC", help="DeepSpeed's --include, passed as given")
    g.add_argument("-e", "--exclude", default="", metavar="SPEC", help="DeepSpeed's --exclude, passed as given")
    g.add_argument("--master-addr", metavar="ADDR",
                   help="DeepSpeed's --master_addr (default: the launcher's own choice, the first address of "
                        "`hostname -I` on the first host)")
    g.add_argument("--master-port", type=port, metavar="PORT", help="DeepSpeed's --master_port (default 29500)")
    g.add_argument("--launcher-ssh-port", type=port, metavar="PORT", help="DeepSpeed's --ssh_port, passed as given")
    g.add_argument("--launch-from", default="first", metavar="WHERE",
                   help="where `deepspeed` runs: first (the first host of the hostfile, default), local (this "
                        "machine, with its own ~/.ssh for pdsh) or a host of the hostfile")
    g.add_argument("--deepspeed", default=None, metavar="CMD",
                   help="the launcher command on the launch host (default: the deepspeed beside --python there, "
                        "else deepspeed on its PATH; the report names the one used and its interpreter)")
    g.add_argument("--python", default="python3", metavar="PATH",
                   help="the job's interpreter on the launch host: it runs the rehearsal's supervisor, and its "
                        "deepspeed is the launcher (default: python3)")
    g.add_argument("--rehearse-steps", type=positive_int, default=2, metavar="N",
                   help="optimizer steps each rank takes (default 2)")
    g.add_argument("--rehearse-model-params", type=count, default=1e6, metavar="N",
                   help="parameters of the stand-in model: 4 square Linear layers (default 1e6)")
    g.add_argument("--init-timeout", type=seconds, default=60.0, metavar="S",
                   help="each rank's init_process_group timeout (default 60)")
    g.add_argument("--timeout", type=seconds, default=300.0, metavar="S",
                   help="deadline of the whole launch (default 300), moved on by the time ranks spend JIT-building "
                        "ops; every rank is killed at the end")
    g.add_argument("--jit-build-budget", type=seconds, default=900.0, metavar="S",
                   help="how long a rank may JIT-build DeepSpeed's ops (default 900): a cold build is reported with "
                        "its time (WARN); only a failing build or one past this budget FAILs")
    g.add_argument("--workdir", default="/tmp", metavar="DIR",
                   help="where the launch directory is made on every host (default /tmp); removed at the end")
    g = parser.add_argument_group("SSH (preflight's own, to write the script and clean up)")
    flags.add_all(g, [o for o in flags.SSH if o is not flags.LAUNCHER_SSH_PORT])
    g = parser.add_argument_group("output")
    for output in outputs:
        g.add_argument(output.flag, metavar=output.metavar, help=output.help)
    g.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    g.add_argument("-q", "--quiet", action="store_true", help="print only the verdict and the summary line")
    g.add_argument("-v", "--verbose", action="store_true", help="print every result line, with tracebacks")


class UsageError(Exception):
    """Bad input to ``preflight rehearse``: one line, exit 2."""


def build_options(args: argparse.Namespace) -> Tuple[RehearseOptions, Optional[str], str]:
    """(options, the working directory's .deepspeed_env text or None, the hostfile's text); UsageError for bad
    input, before any host is contacted."""
    from preflight.hostfile import HostfileError, apply_filters, load_hostfile, read_hostfile
    from preflight.inputs import MAX_DEEPSPEED_CONFIG_BYTES, InputError, read_text_limited
    from preflight.results import CLUSTER_NAME

    try:
        hosts = apply_filters(load_hostfile(args.hostfile, []), args.include, args.exclude)
        hostfile_text = read_hostfile(args.hostfile)
    except HostfileError as exc:
        raise UsageError(str(exc)) from None
    if any(h.name == CLUSTER_NAME for h in hosts):
        raise UsageError(f"{args.hostfile}: a host named {CLUSTER_NAME!r} would share the name of the cluster-wide "
                         "result; use another name")
    where = f"--deepspeed-config {args.deepspeed_config}"
    try:
        text = read_text_limited(args.deepspeed_config, "--deepspeed-config", MAX_DEEPSPEED_CONFIG_BYTES)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file on this machine (the ranks open the same path on every host)") \
            from None
    except (OSError, UnicodeDecodeError, InputError) as exc:
        raise UsageError(f"{where}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: not JSON ({exc}); DeepSpeed's ranks would fail to read it") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: the top level must be a JSON object")
    names = [h.name for h in hosts]
    if args.launch_from not in ("first", "local") and args.launch_from not in names:
        first_names = ", ".join(names[:5])
        raise UsageError(f"--launch-from {args.launch_from}: not 'first', 'local' or a host of {args.hostfile} "
                         f"({first_names})")
    if args.deepspeed is not None and not shlex.split(args.deepspeed):
        raise UsageError("--deepspeed is empty; give the launcher command, e.g. deepspeed")
    if args.ssh_key and not os.path.isfile(os.path.expanduser(args.ssh_key)):
        raise UsageError(f"--ssh-key {args.ssh_key}: no such file")
    env_name = os.environ.get("DS_ENV_FILE", DEFAULT_ENV_NAME)
    env_text: Optional[str] = None
    if os.path.isfile(env_name):
        try:
            env_text = read_text_limited(env_name, "./" + env_name, 1 << 20)
        except (OSError, UnicodeDecodeError, InputError) as exc:
            raise UsageError(f"./{env_name}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    from preflight.flags import ssh_options
    ssh = ssh_options(args)
    launch_from = LOCAL if args.launch_from == "local" else args.launch_from
    options = RehearseOptions(
        hostfile=args.hostfile, hosts=hosts, deepspeed_config=os.path.abspath(args.deepspeed_config),
        include=args.include, exclude=args.exclude, master_addr=args.master_addr, master_port=args.master_port,
        launcher_ssh_port=args.launcher_ssh_port, launch_from=launch_from, deepspeed=args.deepspeed or "deepspeed",
        deepspeed_beside=args.deepspeed is None, build_budget=args.jit_build_budget,
        python=args.python, steps=args.rehearse_steps, model_params=args.rehearse_model_params,
        init_timeout=args.init_timeout, timeout=args.timeout, workdir=args.workdir,
        env_file=os.path.abspath(env_name) if env_text is not None else None, ssh=ssh, strict=args.strict)
    return options, env_text, hostfile_text


def main(args: argparse.Namespace) -> int:
    """``preflight rehearse``: exit 0 when every rank took its steps, 1 when any failed, 2 on bad input, 130 when
    interrupted (after the clean-up on every host)."""
    import sys

    from rich.text import Text

    from preflight import render
    from preflight.render import terminal as rep

    err = rep.stderr_console()
    try:
        options, env_text, hostfile_text = build_options(args)
    except UsageError as exc:
        err.print(Text(rep.plain(f"preflight: error: {exc}")), soft_wrap=True)
        return 2
    if not args.quiet:
        where = options.launch_from if options.launch_from != "first" else options.hosts[0].name
        env = f"with ./{os.path.basename(options.env_file)}" if options.env_file else "without ./.deepspeed_env"
        ranks, hosts = len(expected_ranks(options.hosts)), len(options.hosts)
        err.print(f"preflight: rehearsing the launch of {ranks} ranks on {hosts} hosts from {where} ({env})",
                  soft_wrap=True, highlight=False, markup=False)
    rehearsal = Rehearsal(options, rep.TerminalProgress(err, quiet=args.quiet))
    try:
        report = rehearsal.run(env_text, hostfile_text)
    except KeyboardInterrupt:  # a second Ctrl-C during the clean-up: the supervisor's lifeline closes with us
        rehearsal.interrupted = True
    if rehearsal.interrupted:
        err.print("preflight: interrupted; stopped the launch and cleaned up on the hosts")
        return 130
    for output in render.file_outputs():
        path = getattr(args, output.dest, None)
        if path:
            try:
                output.to_path(report, path)
            except OSError as exc:
                err.print(Text(rep.plain(f"preflight: error: cannot write {path}: {exc.strerror}")))
                return 2
    tty = sys.stdout.isatty() or "COLUMNS" in os.environ
    render.get("terminal").load()(report, sys.stdout, render.Settings(args.verbose, args.quiet, None if tty else 240))
    sys.stdout.flush()
    return report.exit_code
