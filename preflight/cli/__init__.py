"""Command line: ``preflight run``, ``preflight list``, ``preflight config --defaults``, ``preflight --version``.

Exit codes: 0 no FAIL/ERROR (warnings allowed); 1 any FAIL or ERROR (or WARN with --strict);
2 usage or input error (nothing was run); 130 interrupted (after cleaning up on the hosts).

The parser and its argument types are in parser.py, what is checked before any host is contacted in validate.py,
and each command in its own module (run.py, listing.py, config.py, hostfile.py, node_check.py, history.py);
this module dispatches, and re-exports what callers import from ``preflight.cli``.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from preflight.cli.config import cmd_config_defaults
from preflight.cli.history import cmd_history, history_path
from preflight.cli.hostfile import cmd_hostfile
from preflight.cli.listing import cmd_list
from preflight.cli.node_check import cmd_node_check
from preflight.cli.parser import (DEFAULT_TRANSPORT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE,
                                  TRANSPORT_CHOICES, VERSION_LINE, UsageError, build_parser, did_you_mean,
                                  drop_stdout)
from preflight.cli.run import build_options, cmd_run, in_slurm
from preflight.cli.validate import (KERNEL_FILESYSTEMS, check_input_file, check_output_path, merge_params,
                                    params_from_options, select_checks)

__all__ = [
    "DEFAULT_TRANSPORT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "KERNEL_FILESYSTEMS",
    "TRANSPORT_CHOICES", "VERSION_LINE", "UsageError", "build_options", "build_parser", "check_input_file",
    "check_output_path", "cmd_config_defaults", "cmd_history", "cmd_hostfile", "cmd_list", "cmd_node_check", "cmd_run",
    "did_you_mean", "drop_stdout", "entry", "history_path", "in_slurm", "main", "merge_params", "params_from_options",
    "select_checks",
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser, so the hint points at `preflight run --help`
        parser = args._commands.get(args.command, parser)
        parser.unrecognized(extra)
    if args.command == "list":
        return cmd_config_defaults(sys.stdout, sys.stderr) if args.thresholds else cmd_list(sys.stdout)
    if args.command == "config":
        return cmd_config_defaults(sys.stdout, sys.stderr)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "hostfile":
        return cmd_hostfile(args, sys.stdout, sys.stderr)
    if args.command == "version":
        print(VERSION_LINE)
        return EXIT_OK
    if args.command == "node-check":
        return cmd_node_check(args)
    if args.command in ("history", "diff"):
        return cmd_history(args)
    if args.command == "rehearse":
        from preflight import rehearse
        return rehearse.main(args)
    parser.print_help()
    return EXIT_USAGE


def entry() -> None:
    sys.exit(main())
