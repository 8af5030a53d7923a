"""``preflight history`` and ``preflight diff``: the recorded runs read back; and where a run's history store is."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from preflight.cli.parser import EXIT_OK, EXIT_USAGE, drop_stdout
from preflight.config import ConfigError, load_thresholds


def history_path(args: argparse.Namespace) -> Optional[Path]:
    from preflight import history
    return history.choose_path(getattr(args, "history", None), getattr(args, "no_history", False))


def cmd_history(args: argparse.Namespace) -> int:
    """``preflight history`` and ``preflight diff``: read the store; exit 0, or 2 with one line."""
    from preflight import history
    try:
        thresholds = load_thresholds(args.config)
    except ConfigError as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = history.choose_path(args.history)
    if path is None:
        print(f"preflight {args.command}: error: no history store: {history.ENV} is off; pass --history PATH",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "history":
            return history.main_history(path, args.host, args.check, args.since, args.prune, args.keep, sys.stdout,
                                        sys.stderr, thresholds)
        if len(args.runs) > 2:
            print("preflight diff: error: name at most two runs", file=sys.stderr)
            return EXIT_USAGE
        names = list(args.runs) + [None, None]
        return history.main_diff(path, names[0], names[1], args.against, sys.stdout, sys.stderr, thresholds)
    except BrokenPipeError:  # `preflight history | head`
        drop_stdout()
        return EXIT_OK
