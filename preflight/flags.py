"""The run's inputs, declared once: the shared option groups (hosts, checks, the job, SSH, Slurm), each check's own
``CheckSpec.options`` and ``--set CHECK.KEY=VALUE``; and what is generated from them: the options of ``run``,
``node-check`` and ``rehearse``, the pytest plugin's ``--preflight-`` options, the thresholds with every override
applied (a floor is read through ``limits()`` only), and each check's ``cluster.options.inputs``.
Sample: ``preflight run --min-busbw 20 --set nvme.min_write_gbps=1.5`` -> thresholds allreduce.min_busbw = 20.0
and nvme.min_write_gbps = 1.5, both held to their keys' rule lines before any host is contacted.
"""
from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from preflight import checks as registry
from preflight import transport as transports
from preflight.hostside.seams import CheckOptions, Option, positive

if TYPE_CHECKING:
    from preflight.transport import SSHOptions

Parser = Any  # an argparse parser or argument group: what add_argument is called on

# Upper bounds keep every deadline representable (time.time() + inf overflows) and every run finite.
seconds = positive(float, "a number of seconds", 86400.0)
connect_seconds = positive(float, "a number of seconds", 3600.0)
positive_int = positive(int, "an integer", 100000)
count = positive(float, "a number", 1e15)
_port_number = positive(int, "an integer", 65535)


def port(text: str) -> int:
    value: int = _port_number(text)
    return value


def master_addr(text: str) -> str:
    """An IP address or a host name (what DeepSpeed's --master_addr takes), one word."""
    value = text.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:_%-]{0,252}", value):
        raise argparse.ArgumentTypeError(f"expected an IP address or a host name, got {text[:60]!r}")
    return value


# --- the shared groups ----------------------------------------------------------------------------------------

HOSTFILE = Option("--hostfile", "DeepSpeed hostfile ('host slots=N'; node[01-04] ranges ok). Without it the cluster "
                  "is this machine alone, run without SSH", metavar="FILE")
SLOTS = Option("--slots", "GPUs (ranks) per host: overrides the hostfile's slots and, without a hostfile, the visible "
               "GPUs of this machine (--num_gpus: DeepSpeed's spelling of the same option)", positive_int, "N",
               aliases=("--num_gpus",))
NUM_NODES = Option("--num_nodes", "check the first N hosts of the hostfile, the ones DeepSpeed's --num_nodes N runs on",
                   positive_int, "N", aliases=("--num-nodes",))
INCLUDE = Option("--include", "DeepSpeed syntax: 'host1:0,1@host2'", metavar="SPEC", default="", aliases=("-i",))
EXCLUDE = Option("--exclude", "DeepSpeed syntax: 'host1:0,1@host2'", metavar="SPEC", default="", aliases=("-e",))
PYTHON = Option("--python", "interpreter on the hosts: the job's environment (default: python3)", metavar="PATH",
                default="python3")
HOSTS = (HOSTFILE, SLOTS, NUM_NODES, INCLUDE, EXCLUDE, PYTHON)

CHECKS = Option("--checks", "run only these checks (see `preflight list`)", metavar="A,B")
SKIP = Option("--skip", "do not run these checks", metavar="A,B", default="")
CONFIG = Option("--config", "thresholds TOML (`preflight config --defaults` prints them all)", metavar="FILE")
SET = Option("--set", "override one threshold for this run, after --config: CHECK.KEY=VALUE with a TOML value (e.g. "
             "--set nvme.min_write_gbps=1.5); held to the key's rules like --config (repeatable)",
             metavar="CHECK.KEY=VALUE", default=(), action="append", commands=("run", "node-check"))
TIMEOUT = Option("--timeout", "deadline of each check on a host (default 120)", seconds, "S", 120.0)
PARALLEL = Option("--parallel", "hosts connected to at once (default 32); waiting on hosts is not limited "
                  "(docs/ssh.md)", positive(int, "an integer", 4096), "N", 32)
SELECTION = (CHECKS, SKIP, CONFIG, SET, TIMEOUT, PARALLEL)

# The job's own settings several checks read: CheckOptions' shared fields (ports, the all-reduce, the launch).
MASTER_PORT = Option("--master-port", "torch.distributed master port to check (default 29500, DeepSpeed's default)",
                     port, "PORT", CheckOptions.master_port)
MASTER_ADDR = Option("--master-addr", "the job's master address (DeepSpeed's --master_addr), probed from every host on "
                     "the master port (default: the one DeepSpeed's launcher picks, the first of `hostname -I` on the "
                     "first host)", master_addr, "ADDR")
DEEPSPEED_CONFIG = Option("--deepspeed-config", "DeepSpeed config to validate against the cluster", metavar="FILE")
JOB = (MASTER_PORT, MASTER_ADDR, DEEPSPEED_CONFIG)

LAUNCHER_SSH_PORT = Option(
    "--launcher-ssh-port", "port DeepSpeed's launcher will ssh to from the first host (DeepSpeed's --ssh_port), which "
    "the launcher_ssh check probes (default: --ssh-port, else ssh's own: the Port of the first host's ~/.ssh/config, "
    "else 22)", port, "PORT")
SSH = (
    Option("--ssh-user", "user to log in as on every host; wins over the User of --ssh-config (default: that User, "
           "else your login name)", metavar="USER"),
    Option("--ssh-port", "sshd port on every host; wins over the Port of --ssh-config (default: that Port, else 22)",
           port, "PORT"),
    LAUNCHER_SSH_PORT,
    Option("--ssh-key", "private key (default: ssh-agent, ~/.ssh/config, ~/.ssh/id_*)", metavar="FILE"),
    Option("--ssh-config", "OpenSSH client config read for each host's HostName, User, Port, IdentityFile, ProxyJump "
           "(default ~/.ssh/config; /dev/null: none)", metavar="FILE", default="~/.ssh/config"),
    Option("--known-hosts", "known_hosts file the host keys are verified against (default ~/.ssh/known_hosts); an "
           "unknown or changed key fails the host's ssh check", metavar="FILE", default="~/.ssh/known_hosts"),
    Option("--accept-new-host-keys", "record unknown host keys in --known-hosts (like StrictHostKeyChecking="
           "accept-new); a changed key is always refused", action="store_true", default=False),
    Option("--connect-timeout", "TCP connect + SSH handshake deadline per host (default 10)", connect_seconds, "S",
           10.0),
)

SLURM = (
    Option("--slurm", "take the hosts from the Slurm allocation even if SLURM_JOB_ID is not set (inside a job this is "
           "automatic; --hostfile still wins)", action="store_true", default=False),
    Option("--gpus-per-node", "slots per allocated node (default: SLURM_GPUS_ON_NODE, else SLURM_TASKS_PER_NODE)",
           positive_int, "N"),
)
# --transport's choices: the registered transports that reach other hosts ("local" is the run without a hostfile).
TRANSPORT_CHOICES = [name for name in transports.names() if name != "local"]

# node-check's own spelling of the shared options: one node, the job's interpreter on it.
NODE_CHECK = (
    Option("--checks", "run only these per-host checks", metavar="A,B"),
    SKIP,
    Option("--config", "thresholds TOML, the same file `preflight run` takes", metavar="FILE"),
    SET,
    Option("--python", "the job's interpreter on this node (default: python3)", metavar="PATH", default="python3"),
    Option("--slots", "GPUs the job uses on this node (--num_gpus: DeepSpeed's spelling)", positive_int, "N", 1,
           aliases=("--num_gpus",)),
)

# What the pytest plugin offers as --preflight-<name> besides every check's own options; its own words where the
# CLI's would not fit a pytest session.
PLUGIN_SHARED = (HOSTFILE, INCLUDE, SLOTS, EXCLUDE, PYTHON, CHECKS, SKIP, CONFIG, SET, TIMEOUT, PARALLEL) + JOB + SSH
PLUGIN_HELP = {
    "--hostfile": "DeepSpeed hostfile: run preflight on its hosts and report each (host, check) as a test",
}


# --- generated: argparse ---------------------------------------------------------------------------------------

def add(parser: Parser, option: Option, **override: Any) -> None:
    """One Option as an argparse option (override: keyword arguments of add_argument that differ here)."""
    kwargs: Dict[str, Any] = {"dest": option.dest, "help": option.help, "default": option.default}
    if option.action == "store_true":
        kwargs["action"] = "store_true"
    else:
        kwargs["metavar"] = option.metavar
        if option.type is not str:
            kwargs["type"] = option.type
        if option.action == "append":
            kwargs.update(action="append", default=list(option.default or ()))
    kwargs.update(override)
    short = [a for a in option.aliases if not a.startswith("--")]
    long = [a for a in option.aliases if a.startswith("--")]
    parser.add_argument(*short, option.flag, *long, **kwargs)


def add_all(parser: Parser, options: Sequence[Option]) -> None:
    for option in options:
        add(parser, option)


def add_slurm(parser: Parser) -> None:
    """The Slurm group: --slurm, --transport (each registered transport's help line) and each transport's own
    flags (``Transport.OPTIONS``), --gpus-per-node."""
    add(parser, SLURM[0])
    parser.add_argument("--transport", choices=TRANSPORT_CHOICES, default=None,
                        help="how to reach the hosts: " + "; ".join(f"{name}: {transports.kind(name).HELP}"
                                                                   for name in TRANSPORT_CHOICES))
    for option in transports.options():  # each transport's own flags (Transport.OPTIONS)
        parser.add_argument(option.flag, dest=option.dest, choices=list(option.choices) or None,
                            default=option.default, help=option.help)
    add(parser, SLURM[1])


def add_check_options(parser: Parser, command: str) -> None:
    """Every check's own options the command offers (``CheckSpec.options``), in ORDER, each flag once."""
    for option, _ in registry.options(command):
        add(parser, option)


def plugin_options() -> List[Option]:
    """The options the pytest plugin offers as ``--preflight-<name>``: the shared ones and every check's own."""
    return list(PLUGIN_SHARED) + [option for option, _ in registry.options("run")]


# --- generated: what a command's arguments hand on -----------------------------------------------------------

def check_inputs(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """{Option.dest: value} of every check input the command offers (a threshold's goes to ``thresholds``)."""
    return {option.dest: getattr(args, option.dest, option.default) for option, _ in registry.options(command)
            if option.threshold is None}


def parse_set(text: str) -> Tuple[str, str, Any]:
    """(check, key, value) of one --set CHECK.KEY=VALUE; the value is read as TOML (a word that is not TOML is
    text: --set driver_cuda.minor_compat_status=fail). ConfigError naming the argument if it is not of that form."""
    from preflight.config import ConfigError, tomllib

    match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)\s*=(.*)", text, re.S)
    if not match:
        raise ConfigError(f"--set {text[:80]!r}: expected CHECK.KEY=VALUE, e.g. --set allreduce.min_busbw=20")
    section, key, raw = match.group(1), match.group(2), match.group(3).strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, ValueError):
        value = raw
    return section, key, value


def thresholds(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """The thresholds this run judges by: the defaults, --config, each --set, then each check's threshold option
    given (--min-busbw). Every value is held to its key's rules; ConfigError (one line naming the argument) if not."""
    from preflight import config

    result = config.load_thresholds(getattr(args, "config", None))
    for text in getattr(args, "set", None) or ():
        section, key, value = parse_set(text)
        config.override(result, section, key, value, f"--set {text}")
    for spec in registry.all_specs():
        for option in spec.options:
            value = getattr(args, option.dest, None) if option.threshold else None
            if value is not None:
                config.override(result, spec.name, str(option.threshold), value, option.flag)
    config.check_order("the thresholds with --set and the checks' options", result)
    return result


def check_options(args: argparse.Namespace, transport: str, command: str = "run") -> CheckOptions:
    """What the cluster checks read (``cluster.options``), from the run's arguments."""
    get: Callable[[str], Any] = lambda name: getattr(args, name, None)  # noqa: E731
    return CheckOptions(transport=transport, python=get("python"), hostfile=get("hostfile"),
                        master_port=get("master_port") or CheckOptions.master_port, master_addr=get("master_addr"),
                        launcher_ssh_port=get("launcher_ssh_port") or get("ssh_port"),
                        deepspeed_config=get("deepspeed_config"), inputs=check_inputs(args, command))


def ssh_options(args: argparse.Namespace) -> "SSHOptions":
    """The SSH group's arguments as the transport takes them (run and rehearse alike)."""
    from preflight.transport import SSHOptions
    return SSHOptions(user=args.ssh_user, port=args.ssh_port, key=args.ssh_key, config_path=args.ssh_config,
                      known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
                      connect_timeout=args.connect_timeout)


def given(options: Optional[CheckOptions], names: Sequence[str]) -> bool:
    """One of the named shared fields or inputs holds a value (an opt-in check's ``selected_by``)."""
    return options is not None and any(options.given(name) for name in names)
