"""``preflight node-check``: the per-host checks on this node, one line fit for a drain reason, exit 0/1.
Sample: ``node07: FAIL gpu: 7 of 8 GPUs visible``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any, Dict

from preflight import checks as registry
from preflight import flags
from preflight import render
from preflight.cli.history import history_path
from preflight.cli.parser import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from preflight.cli.validate import check_output_path, merge_params, params_from_options, select_checks
from preflight.config import ConfigError
from preflight.hostside.seams import CheckOptions
from preflight.hostfile import split_csv


def cmd_node_check(args: argparse.Namespace) -> int:
    from preflight import nodecheck

    try:
        thresholds = flags.thresholds(args)
        names = select_checks(args.checks, args.skip, None, thresholds, args.config)
        cluster_only = [n for n in split_csv(args.checks or "") if registry.load(n).SPEC.scope != "host"]
        if cluster_only:
            raise UsageError(f"node-check runs per-host checks only; {', '.join(cluster_only)} "
                             "need(s) `preflight run` across hosts")
        if args.prom_textfile == render.STDOUT:
            raise UsageError("--prom-textfile -: node-check prints its verdict on stdout; name a file")
        check_output_path("--prom-textfile", args.prom_textfile)
        from_options = params_from_options(CheckOptions(python=args.python,
                                                        inputs=flags.check_inputs(args, "node-check")), "node-check")
        host_params: Dict[str, Any] = {}
        for name in names:
            merge_params(host_params, from_options.get(name, {}))
    except (UsageError, ConfigError) as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    checks = [n for n in names if registry.load(n).SPEC.scope == "host"]
    options = nodecheck.NodeCheckOptions(
        checks=checks, thresholds=thresholds, python=args.python, deadline=args.deadline, timeout=args.deadline,
        slots=args.slots, strict=args.strict, drain=args.drain, node_name=args.node_name,
        host_params=host_params, history=history_path(args))
    verdict = nodecheck.run_checks(options)
    if args.prom_textfile:
        from preflight.render import prometheus
        try:  # the node's verdict stands either way: Slurm drains a node whose prolog fails, not for a metrics file
            prometheus.write_file(verdict.report(args.strict), args.prom_textfile, "node-check")
        except OSError as exc:
            print(f"preflight: error: cannot write {args.prom_textfile}: {exc.strerror or exc}", file=sys.stderr)
    if args.verbose:
        for check, outcome in verdict.outcomes:
            fix = f"; fix: {outcome.fix}" if outcome.fix and outcome.status.value != "pass" else ""
            print(f"{verdict.node}::{check} {outcome.status.word} - {outcome.message}{fix}")
    print(verdict.line)
    if args.drain:
        try:
            action = nodecheck.apply_drain(verdict)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"preflight: --drain: {exc}", file=sys.stderr)
            return EXIT_FAILED
        if action:
            print(f"preflight: node {verdict.node} {action}", file=sys.stderr)
    return EXIT_FAILED if verdict.failed else EXIT_OK
