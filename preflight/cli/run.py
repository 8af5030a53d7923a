"""``preflight run``: the options turned into a RunOptions (hosts, checks, SSH, transport), the run, the reports.
Sample: ``preflight run --hostfile hf --json out.json`` prints the verdict and writes out.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from preflight import flags
from preflight import render
from preflight import transport as transports
from preflight.cli.history import history_path
from preflight.cli.parser import DEFAULT_TRANSPORT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, drop_stdout
from preflight.cli.validate import (check_input_file, check_output_path, merge_params, params_from_options,
                                    select_checks)
from preflight.config import ConfigError
from preflight.hostfile import (HostfileError, HostSpec, apply_filters, first_nodes, load_hostfile, local_cluster,
                                with_slots)
from preflight.inputs import MAX_DEEPSPEED_CONFIG_BYTES, MAX_SSH_FILE_BYTES, InputError
from preflight.results import CLUSTER_NAME

if TYPE_CHECKING:
    from preflight.runner import RunOptions


def build_options(args: argparse.Namespace) -> "RunOptions":
    """The run's options from its arguments, every input checked (UsageError, HostfileError, ConfigError, InputError:
    one line, exit 2) before any host is contacted."""
    from preflight.runner import RunOptions
    _check_outputs(args)
    thresholds = flags.thresholds(args)  # the defaults, --config, --set, the checks' threshold options
    notes: List[str] = []  # warnings about the input, printed before the run (e.g. text DeepSpeed ignores)
    info: List[str] = []  # what preflight decided for the user (e.g. where the local slot count came from)
    if args.slots is not None and (args.include or args.exclude):
        # DeepSpeed: "Cannot specify num_nodes/gpus with include/exclude"
        raise UsageError("--slots cannot be combined with --include/--exclude (as DeepSpeed's --num_gpus)")
    if getattr(args, "num_nodes", None) is not None and (args.include or args.exclude):
        # DeepSpeed runner.py:462-464 raises the same for --num_nodes.
        raise UsageError("--num_nodes cannot be combined with --include/--exclude (DeepSpeed: \"Cannot specify "
                         "num_nodes/gpus with include/exclude\")")
    slurm_hosts, transport, host_source = _slurm_selection(args)
    hosts, local = _hosts(args, slurm_hosts, notes, info)
    if args.deepspeed_config:
        check_input_file("--deepspeed-config", args.deepspeed_config, MAX_DEEPSPEED_CONFIG_BYTES)
    check_options = flags.check_options(args, transport)
    if args.rehearse and not args.deepspeed_config:
        raise UsageError("--rehearse needs --deepspeed-config FILE: the launch is rehearsed with the job's config")
    from_options = params_from_options(check_options)
    checks = select_checks(args.checks, args.skip, check_options, thresholds, args.config)
    host_params: Dict[str, Any] = {}
    for name in checks:
        merge_params(host_params, from_options.get(name, {}))
    _check_ssh_inputs(args, local, transport, notes)
    return RunOptions(hosts=hosts, checks=checks, thresholds=thresholds, local=local, python=args.python,
                      ssh=flags.ssh_options(args), timeout=args.timeout, parallel=args.parallel, strict=args.strict,
                      transport=transport,
                      transport_options={o.dest: getattr(args, o.dest) for o in transports.options()},
                      host_params=host_params, host_source=host_source, info_notes=info,
                      input_notes=notes, check_options=check_options)


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file an output option names can be written, and at most one of them is stdout."""
    outputs = render.file_outputs()
    for output in outputs:
        check_output_path(output.flag, getattr(args, output.dest))
    if getattr(args, "write_hostfile", None) == render.STDOUT:
        raise UsageError("--write-hostfile -: give a file name (stdout holds the terminal report)")
    check_output_path("--write-hostfile", getattr(args, "write_hostfile", None))
    if [getattr(args, output.dest) for output in outputs].count(render.STDOUT) > 1:
        raise UsageError(f"only one of {'/'.join(o.flag for o in outputs)} can be '-' (stdout)")


def _hosts(args: argparse.Namespace, slurm_hosts: Optional[List[HostSpec]], notes: List[str],
           info: List[str]) -> Tuple[List[HostSpec], bool]:
    """(the hosts to check, whether the run is this machine alone) from --hostfile, the allocation or neither."""
    num_nodes = getattr(args, "num_nodes", None)
    if args.hostfile:
        hosts = apply_filters(load_hostfile(args.hostfile, notes), args.include, args.exclude)
        if num_nodes is not None:
            hosts = first_nodes(hosts, num_nodes, notes)
        if args.slots is not None:
            hosts = with_slots(hosts, args.slots)
        if any(h.name == CLUSTER_NAME for h in hosts):
            raise UsageError(f"{args.hostfile}: a host named {CLUSTER_NAME!r} would share the name of the "
                             "cluster-wide results in the reports; use another name for it (e.g. its address)")
        return hosts, False
    if slurm_hosts is not None:
        hosts = apply_filters(slurm_hosts, args.include, args.exclude)
        return (first_nodes(hosts, num_nodes, notes) if num_nodes is not None else hosts), False
    if args.include or args.exclude:
        raise UsageError("--include/--exclude need --hostfile")
    if num_nodes is not None and num_nodes > 1:
        # runner.py:476-477: "Num nodes is >1 but no extra nodes available via hostfile".
        raise UsageError(f"--num_nodes {num_nodes} needs a --hostfile: without one the cluster is this machine "
                         "(DeepSpeed: \"Num nodes is >1 but no extra nodes available via hostfile\")")
    if not shutil.which(args.python):
        raise UsageError(f"--python {args.python}: not found on this machine (without --hostfile the checks run "
                         "here); pass an existing interpreter")
    return local_cluster(args.slots, info), True


def _check_ssh_inputs(args: argparse.Namespace, local: bool, transport: str, notes: List[str]) -> None:
    """The SSH group's files: the key exists; ~/.ssh/config and known_hosts are bounded regular files if present;
    the config's lines parse (a Match/Include it cannot honour is a note)."""
    if args.ssh_key and not Path(args.ssh_key).expanduser().is_file():
        raise UsageError(f"--ssh-key {args.ssh_key}: no such file")
    for option, path in (("--ssh-config", args.ssh_config), ("--known-hosts", args.known_hosts)):
        # Optional files (a missing one means none), but an existing one is read whole: bounded, regular.
        if not local and path and os.path.lexists(os.path.expanduser(path)):
            check_input_file(option, path, MAX_SSH_FILE_BYTES)
    if not local and transports.kind(transport).READS_SSH_CONFIG:
        from preflight import sshconfig
        try:  # read once here: a line it cannot parse stops the run; Match/Include it cannot honour are warned about
            notes.extend(sshconfig.load(args.ssh_config).warnings)
        except sshconfig.SSHConfigError as exc:
            raise UsageError(f"--ssh-config {exc}") from None


def _slurm_selection(args: argparse.Namespace) -> Tuple[Optional[List[HostSpec]], str, str]:
    """(allocation's hosts or None, transport, one line saying where the hosts came from)."""
    from preflight import slurm

    env = os.environ
    inside = args.slurm or slurm.in_allocation(env)
    transport = args.transport or transports.default_kind(inside, bool(args.hostfile), DEFAULT_TRANSPORT)
    unusable = transports.kind(transport).unusable(env)
    if unusable:
        raise UsageError(unusable)
    if args.hostfile:
        note = f"hosts: --hostfile {args.hostfile}" + (" (wins over the Slurm allocation)" if inside else "")
        return None, transport, note + f"; transport: {transport}"
    if not inside:
        return None, transport, ""
    try:
        alloc = slurm.allocation(env, args.gpus_per_node)
    except slurm.AllocationError as exc:
        raise UsageError(str(exc)) from None
    return alloc.hosts, transport, f"{alloc.source}; transport: {transport}"


def cmd_run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from preflight import launchable
    from preflight.render import terminal as rep
    from preflight.runner import Runner

    err = rep.stderr_console()
    try:
        options = build_options(args)
    except (UsageError, HostfileError, ConfigError, InputError) as exc:
        err.print(Text(rep.plain(f"preflight: error: {exc}")), soft_wrap=True)
        return EXIT_USAGE
    short = launchable.short_of_min_hosts(args.min_hosts or "", len(options.hosts))
    if short:  # no run can pass: said before any host is contacted, as the verdict (stdout) and its exit code
        try:
            print(short, flush=True)
        except BrokenPipeError:
            drop_stdout()
        return EXIT_FAILED
    if options.host_source and not args.quiet:
        err.print(f"preflight: {options.host_source}", soft_wrap=True, highlight=False, markup=False)
    for note in options.info_notes:
        err.print(f"preflight: {note}", soft_wrap=True, highlight=False, markup=False)
    for note in options.input_notes:
        err.print(f"preflight: warning: {note}", soft_wrap=True, highlight=False, markup=False)
    _tune_interpreter()
    runner = Runner(options, rep.TerminalProgress(err, quiet=args.quiet))
    try:
        result = runner.run()
    except KeyboardInterrupt:
        err.print("preflight: interrupted; stopped the checks and cleaned up on the hosts")
        return EXIT_INTERRUPTED
    from preflight import history  # each host's figures against its own past (WARNs), then the run recorded
    history.record_report(result, options.thresholds, history_path(args),
                          lambda text: err.print(Text(rep.plain(f"preflight: warning: {text}")), soft_wrap=True))
    return _report(args, result, err)


def _report(args: argparse.Namespace, result: Any, err: Any) -> int:
    """The files first (a terminal that goes away, `| head -1` or a closed ssh session, must not lose them), then
    the terminal report; the exit code."""
    from rich.text import Text

    from preflight import launchable
    from preflight.render import terminal as rep

    paths = {output.name: getattr(args, output.dest) for output in render.file_outputs()}
    for output in render.file_outputs():
        path = paths[output.name]
        if path:
            try:
                for change in output.to_path(result, path):  # what a merge changed (--env-file)
                    err.print(Text(rep.plain(f"preflight: {output.flag} {path}: {change}")), soft_wrap=True)
            except BrokenPipeError:
                drop_stdout()
            except OSError as exc:
                err.print(Text(rep.plain(f"preflight: error: cannot write {path}: {exc.strerror}")))
                return EXIT_USAGE
    if args.write_hostfile:  # the healthy hosts (preflight/launchable.py), named in the verdict's launch command
        try:
            render.write_atomic(args.write_hostfile, lambda fh: launchable.write(result, fh))
        except OSError as exc:
            err.print(Text(rep.plain(f"preflight: error: cannot write {args.write_hostfile}: {exc.strerror}")))
            return EXIT_USAGE
    if render.STDOUT in paths.values():
        stream, width = sys.stderr, None  # stdout holds the report file alone
    else:
        # Piped output (CI logs, files) gets a wide fixed width unless COLUMNS says otherwise.
        tty = sys.stdout.isatty() or "COLUMNS" in os.environ
        stream, width = sys.stdout, None if tty else 240
    context = launchable.Context(args.hostfile or "", args.write_hostfile or "", in_slurm(args),
                                 args.min_hosts or "")
    try:
        render.get("terminal").load()(result, stream, render.Settings(args.verbose, args.quiet, width, context))
        stream.flush()
    except BrokenPipeError:
        drop_stdout()
    exit_code: int = launchable.exit_code(result, args.min_hosts or "")
    return exit_code


def in_slurm(args: argparse.Namespace) -> bool:
    from preflight import slurm
    return bool(args.slurm or slurm.in_allocation(os.environ))


def _tune_interpreter() -> None:
    """Fewer garbage-collector passes for a run that holds a few hundred objects per host.

    The modules and configuration loaded so far are frozen out of the collector's scans (gc.freeze), and a
    young-generation pass runs every 20,000 net allocations instead of every 700: paramiko allocates a few
    messages per packet, and with the default thresholds the collector took 9% of the coordinator's
    GIL-holding samples (py-spy, 8 hosts, 120 connections). Cycles are still collected.
    The GIL is handed to a waiting thread every 50 ms instead of every 5 ms: with two reader threads per host
    (thousands at 1,000 hosts) most forced hand-offs only move the GIL between readers with little to do.
    A thread that blocks (a socket read, a lock) still gives the GIL up at once.
    Only the CLI does this: the pytest plugin runs inside someone else's process.
    """
    import gc
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    sys.setswitchinterval(0.05)
