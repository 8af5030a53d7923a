"""``preflight hostfile FILE``: the hosts as DeepSpeed reads them (``   1  node01  8``), or --expand's ranges."""
from __future__ import annotations

import argparse
from typing import List, TextIO

from preflight.cli.parser import EXIT_OK, EXIT_USAGE, drop_stdout
from preflight.hostfile import HostfileError, expanded_text, load_hostfile


def cmd_hostfile(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``preflight hostfile FILE``: the hosts as parsed, one line each, and the totals; ``preflight hostfile --expand
    IN``: the hostfile with its ranges written out. Either on stdout, exit 0; a bad hostfile is one line, exit 2."""
    if bool(args.file) == bool(args.expand):
        print("preflight hostfile: error: give one hostfile: `preflight hostfile FILE` checks it and lists its "
              "hosts, `preflight hostfile --expand FILE` writes its ranges out", file=err)
        return EXIT_USAGE
    path = args.expand or args.file
    notes: List[str] = []
    try:
        hosts = load_hostfile(path, notes)
    except HostfileError as exc:
        print(f"preflight: error: {exc}", file=err)
        return EXIT_USAGE
    for note in notes:
        if not (args.expand and "ranges expanded" in note):  # expanding them is what --expand asks for
            print(f"preflight: warning: {note}", file=err)
    if args.expand:
        text = expanded_text(hosts, path)
    else:
        width = max(len("host"), *(len(h.name) for h in hosts))
        lines = [f"{'line':>5}  {'host':<{width}}  slots"]
        lines += [f"{h.line:>5}  {h.name:<{width}}  {h.slots}" for h in hosts]
        lines.append(f"{path}: {len(hosts)} host{'s' if len(hosts) != 1 else ''}, "
                     f"{sum(h.slots for h in hosts)} slots")
        text = "\n".join(lines) + "\n"
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:  # `preflight hostfile big.txt | head`
        drop_stdout()
    return EXIT_OK
