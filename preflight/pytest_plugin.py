"""pytest plugin: ``pytest --preflight-hostfile FILE`` runs preflight once and reports each (host, check) as a test.

Loaded through the ``pytest11`` entry point in every pytest session where preflight is installed, so without
``--preflight-hostfile`` (or ``--preflight-local``) it does nothing at all. With it:

- the checks run once per session, on the controller (``pytest_sessionstart``), before collection;
- one item per result of the report, with the matrix's ids: ``node01::libaio``, ``cluster::ports``;
- ``-k`` selects the checks that run, not only the items shown: ``pytest -k libaio`` runs libaio (and the
  connection every check needs) on the hosts, the check of each id the expression can keep (``keyword_checks``);
- PASS passes; FAIL fails (message + fix); ERROR is an error at setup; SKIP skips with its reason; WARN passes
  with a ``PreflightWarning`` (and fails with ``--preflight-strict``, like ``preflight run --strict``);
- under pytest-xdist the controller passes the JSON report to the workers, which only read it.

Options are mapped onto ``preflight run``'s argv and go through the CLI's own parser and ``build_options``, so
defaults, validation and error messages are the CLI's, with the flags renamed to their ``--preflight-`` form.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, List, Optional, Sequence, Tuple

import pytest

from preflight import render
from preflight.hostside.outcome import Status
from preflight.results import CLUSTER, CLUSTER_NAME, Report, Result
from preflight.text import plain, xml_safe

if TYPE_CHECKING:
    from preflight.runner import RunOptions

# The CLI, runner and renderers (paramiko, rich) are imported only in a preflight session: this module is
# imported by every pytest session on a machine where preflight is installed (preflight.render itself is light).

VALUE, REPEAT, SWITCH = "value", "repeat", "switch"
PREFIX = "--preflight-"
LOCAL = PREFIX + "local"
CLUSTER_ID = CLUSTER_NAME       # the id's first part for a cluster-wide result (host "*" in the model)
LOCAL_LOCATION = "localhost"    # the location shown for results of a --preflight-local run (no hostfile)
WORKER_REPORT = "preflight_report"  # xdist workerinput key: path of the controller's JSON report
QUIET_VERBOSITY = -2            # pytest -qq (or quieter) hides the progress lines, as `preflight run -q` does
MAX_PROPERTY_CHARS = 200        # longer metrics stay out of the JUnit properties (they are in --preflight-json)


@dataclass(frozen=True)
class Flag:
    """One ``preflight run`` option offered as ``--preflight-<name>``."""

    cli: str
    help: str
    kind: str = VALUE
    metavar: Optional[str] = None

    @property
    def option(self) -> str:
        return PREFIX + self.cli[2:]

    @property
    def dest(self) -> str:
        return "preflight_" + self.cli[2:].replace("-", "_")


STRICT = Flag("--strict", "a WARN fails its test (like `preflight run --strict`)", SWITCH)
# A CLI flag inside a message, not the tail of a longer flag (--json inside --preflight-json).
_CLI_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


class PreflightFailure(Exception):
    """A cell that is not a pass: its text (message, then the fix) is the whole failure report."""


class PreflightWarning(UserWarning):
    """A WARN cell: works, but slower or riskier than it should be (``-W error::...`` makes it fail)."""


# ------------------------------------------------------------------------------------------- options

def run_flags() -> Tuple[Flag, ...]:
    """The run's own options as --preflight- options, generated from their one declaration (preflight/flags.py:
    the shared groups the plugin offers, and every check's ``CheckSpec.options``)."""
    from preflight import flags as declared

    kinds = {"store": VALUE, "append": REPEAT, "store_true": SWITCH}
    return tuple(Flag(o.flag, declared.PLUGIN_HELP.get(o.flag, o.help), kinds[o.action], o.metavar)
                 for o in declared.plugin_options())


def flags() -> Tuple[Flag, ...]:
    """Every --preflight- option: the run's, the outputs the plugin offers (read from the renderer registry when
    pytest asks, so a renderer registered before pytest collects options is offered too), and --preflight-strict."""
    outputs = tuple(Flag(output.flag, output.pytest_help or "", metavar=output.metavar)
                    for output in render.pytest_outputs())
    return run_flags() + outputs + (STRICT,)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("preflight", "preflight: check the cluster's hosts, one test per (host, check)")
    for flag in flags():
        if flag.kind == SWITCH:
            group.addoption(flag.option, dest=flag.dest, action="store_true", default=False, help=flag.help)
        else:
            group.addoption(flag.option, dest=flag.dest, action="append" if flag.kind == REPEAT else "store",
                            default=None, metavar=flag.metavar, help=flag.help)
    group.addoption(LOCAL, dest="preflight_local", action="store_true", default=False,
                    help="run preflight on this machine alone, without SSH (like `preflight run` without "
                         "--hostfile)")


def _given(config: pytest.Config) -> List[str]:
    """The --preflight- options on the command line (or in addopts)."""
    return [flag.option for flag in flags() if config.getoption(flag.dest) not in (None, False, [])]


def cli_argv(config: pytest.Config) -> List[str]:
    """The ``preflight run`` argv equivalent to this session's --preflight- options."""
    argv = ["run"]
    for flag in flags():
        value = config.getoption(flag.dest)
        if flag.kind == SWITCH:
            argv += [flag.cli] if value else []
        elif flag.kind == REPEAT:
            argv += [f"{flag.cli}={v}" for v in value or []]
        elif value is not None:
            argv.append(f"{flag.cli}={value}")  # the '=' form: a value may start with '-'
    return argv


def _rename(message: str) -> str:
    """The CLI's messages name its flags; the user typed the --preflight- ones."""
    renames = {flag.cli: flag.option for flag in flags()}
    return _CLI_FLAG.sub(lambda m: renames.get(m.group(0), m.group(0)), message)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The CLI's parser, whose errors (it prints usage and exits) become one UsageError line."""
    from preflight import cli

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return cli.build_parser().parse_args(list(argv))
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        message = lines[-1].split(": error: ", 1)[-1] if lines else "invalid option"
        raise pytest.UsageError(f"preflight: {_rename(message)}") from None


def build_run_options(config: pytest.Config) -> Tuple[argparse.Namespace, "RunOptions"]:
    """Validated run options, exactly as `preflight run` builds them; bad input is a UsageError naming it."""
    from preflight import cli
    from preflight.config import ConfigError
    from preflight.hostfile import HostfileError
    from preflight.inputs import InputError

    args = _parse(cli_argv(config))
    try:
        return args, cli.build_options(args)
    except (cli.UsageError, HostfileError, ConfigError, InputError) as exc:
        raise pytest.UsageError(f"preflight: {_rename(str(exc))}") from None


def pytest_configure(config: pytest.Config) -> None:
    hostfile, local = config.getoption("preflight_hostfile"), config.getoption("preflight_local")
    if config.getoption("help"):
        return
    if not hostfile and not local:
        if given := _given(config):
            raise pytest.UsageError(f"preflight: {given[0]} needs {PREFIX}hostfile (or {LOCAL})")
        return  # not asked for: this session is not a preflight session
    if hostfile and local:
        raise pytest.UsageError(f"preflight: {PREFIX}hostfile and {LOCAL} exclude each other")
    args, options = build_run_options(config)
    if any(spec.name == CLUSTER_ID for spec in options.hosts):
        raise pytest.UsageError(f"preflight: a host named {CLUSTER_ID!r} would share the ids of the cluster-wide "
                                f"results ({CLUSTER_ID}::<check>); rename it in the hostfile")
    workerinput = getattr(config, "workerinput", None)
    report = None
    if workerinput is not None:  # an xdist worker: the controller ran the checks, read its report
        with open(workerinput[WORKER_REPORT], encoding="utf-8") as fh:
            report = Report.from_dict(json.load(fh), strict=options.strict)
    config.pluginmanager.register(PreflightSession(config, args, options, report), "preflight-session")


# ------------------------------------------------------------------------------------------- session

class PreflightSession:
    """The session's one run of preflight, and the collector of its results."""

    def __init__(self, config: pytest.Config, args: argparse.Namespace, options: "RunOptions",
                 report: Optional[Report]):
        self.config = config
        self.args = args  # the equivalent `preflight run` arguments
        self.options = options
        self.hostfile: Optional[str] = args.hostfile
        self.report = report
        self.is_worker = report is not None
        self._shared_json: Optional[str] = None  # the report as handed to xdist workers
        self._temp_json = False

    # -- running
    @pytest.hookimpl(tryfirst=True)  # before xdist starts its workers (trylast), which need the report
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.report is not None:
            return
        from preflight.render import terminal as rep
        from preflight.runner import Runner

        selected = keyword_checks(self.config.getoption("keyword") or "", self.options)
        shown = "" if selected == self.options.checks else \
            f" (-k selected {len(selected)} of {len(self.options.checks)} checks)"
        self.options = replace(self.options, checks=selected)
        capman = self.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            console = rep.stderr_console()
            quiet = self.config.get_verbosity() <= QUIET_VERBOSITY
            if not quiet:
                where = self.hostfile or "this machine"
                console.print(f"preflight: checking {len(self.options.hosts)} host(s) of {where}: "
                              f"{', '.join(['ssh'] + self.options.checks)}{shown}", highlight=False, soft_wrap=True)
            for note in self.options.input_notes:
                console.print(f"preflight: warning: {note}", highlight=False, soft_wrap=True, markup=False)
            try:
                self.report = Runner(self.options, rep.TerminalProgress(console, quiet=quiet)).run()
            except KeyboardInterrupt:
                console.print("preflight: interrupted; stopped the checks and cleaned up on the hosts")
                raise
        for output in render.pytest_outputs():
            path = getattr(self.args, output.dest)
            if path:
                try:
                    output.to_path(self.report, path)
                except OSError as exc:
                    raise pytest.UsageError(f"preflight: cannot write {path}: {exc.strerror}") from None

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist controller: hand each worker the report's JSON instead of letting it run the checks."""
        assert self.report is not None
        if self._shared_json is None:
            if self.args.json:  # written in pytest_sessionstart already
                self._shared_json = os.path.abspath(self.args.json)
            else:
                fd, self._shared_json = tempfile.mkstemp(prefix="preflight-", suffix=".json")
                os.close(fd)
                self._temp_json = True
                render.get("json").to_path(self.report, self._shared_json)
        node.workerinput[WORKER_REPORT] = self._shared_json

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._temp_json and self._shared_json:
            with contextlib.suppress(OSError):
                os.unlink(self._shared_json)

    # -- collecting
    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        """The session's top-level collectors get one more: the results, ahead of any test files."""
        report = yield
        if isinstance(collector, pytest.Session) and report.passed and self.report is not None:
            report.result.insert(0, PreflightCollector.from_parent(
                collector, name="preflight", nodeid="preflight", run=self))
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        """A cell's failure is its text, not a traceback into this plugin."""
        report = yield
        if isinstance(item, PreflightItem) and call.excinfo is not None and \
                isinstance(call.excinfo.value, (PreflightFailure, PreflightWarning)):
            report.longrepr = str(call.excinfo.value)
        return report

    # -- reporting
    def pytest_report_header(self, config: pytest.Config) -> List[str]:
        if self.report is None:
            return []
        return [header(self.report)]

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.report is None or self.is_worker:
            return
        verbose = config.get_verbosity() > 0
        if self.report.env:
            terminalreporter.write_sep("-", "preflight: recommended environment")
            for key, value in self.report.env.items():
                terminalreporter.write_line(plain(f"export {key}={value}"))
                if verbose and self.report.reasons.get(key):
                    terminalreporter.write_line(plain(f"    # {self.report.reasons[key]}"))
        for note in self.report.notes if verbose else []:
            terminalreporter.write_line(plain(f"note: {note}"))


# ------------------------------------------------------------------------------------------- -k

def keyword_checks(expression: str, options: "RunOptions") -> List[str]:
    """The checks of ``options.checks`` whose items ``-k expression`` can keep, before they are run.

    An item's -k names are those pytest's KeywordMatcher gives it: its id (``node01::libaio``, ``cluster::ports``
    for a cluster check's summary) and its collector's name (``preflight``), plus the ``skip`` mark of a SKIP
    result, not known before the run: an id is kept if the expression matches it with or without that mark. A
    check runs if one of its ids is kept; pytest then deselects the items as always. An expression pytest cannot
    parse is its usage error, before anything runs."""
    if not expression.strip():
        return list(options.checks)
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved its parser: run every check, -k still deselects the items
        return list(options.checks)
    try:
        compiled = Expression.compile(expression)
    except Exception as exc:  # SyntaxError (pytest >= 8.3), its own ParseError before
        raise pytest.UsageError(f"Wrong expression passed to '-k': {expression}: {exc}") from None
    from preflight import checks as registry

    hosts = [spec.name for spec in options.hosts]

    def matcher(*names: str) -> Callable[..., bool]:
        def match(sub: str, **kwargs: Any) -> bool:  # as KeywordMatcher: a case-insensitive substring of a name
            if kwargs:
                raise pytest.UsageError("Keyword expressions do not support call parameters.")
            return any(sub.lower() in name.lower() for name in names)
        return match

    def kept(nodeid: str) -> bool:
        return any(compiled.evaluate(matcher(nodeid, "preflight", *mark)) for mark in ((), ("skip",)))

    out = []
    for check in options.checks:
        ids = [f"{host}::{check}" for host in hosts]
        if registry.spec(check).scope == "cluster":
            ids.append(f"{CLUSTER_ID}::{check}")
        if any(kept(nodeid) for nodeid in ids):
            out.append(check)
    return out


# ------------------------------------------------------------------------------------------- items

def header(report: Report) -> str:
    """The run's line in pytest's header: counts, and the victims with what blocked them (``2 blocked by
    node02::ssh``): any fault can block others, so the blocker is named, not assumed to be an unreachable host."""
    victims = report.victims()
    c = report.counts(victims)
    blockers = ", ".join(dict.fromkeys(cell_id(report.results[j]) for _, j in sorted(victims.items())))
    return (f"preflight: {len(report.hosts)} host(s), {len(report.results)} results in {report.duration_s:.1f}s "
            f"({c['fail']} failed, {c['error']} errors, {c['warn']} warned"
            + (f", {c['blocked']} blocked by {blockers}" if c["blocked"] else "") + ")")


def cell_id(result: Result) -> str:
    """``host::check``; ``cluster::check`` for a cluster-wide result."""
    return f"{CLUSTER_ID if result.host == CLUSTER else result.host}::{result.check}"


def _text(result: Result) -> str:
    """The failure/skip/warning text: host text, so shown with its controls escaped (plain)."""
    return plain(result.message + (f"\nfix: {result.fix}" if result.fix else ""))


def _properties(result: Result) -> List[Tuple[str, str]]:
    """For --junitxml: status, message, duration, and each metric whose JSON is short."""
    # xml_safe: a NUL or ESC from a host must not make pytest's XML ill-formed (values are host text).
    props = [("status", result.status.value), ("message", xml_safe(plain(result.message[:MAX_PROPERTY_CHARS]))),
             ("duration_s", f"{result.duration_s:.3f}")]
    for key, value in result.metrics.items():
        text = json.dumps(value, separators=(",", ":"), default=str)
        if len(text) <= MAX_PROPERTY_CHARS:
            props.append((xml_safe(f"metrics.{key}"), text))
    return props


class PreflightCollector(pytest.Collector):
    """The results of the session's run, in the report's order (hosts as in the hostfile, then the cluster)."""

    def __init__(self, *, run: PreflightSession, **kwargs: Any):
        super().__init__(**kwargs)
        self.run = run

    def collect(self) -> Iterator["PreflightItem"]:
        assert self.run.report is not None
        lines = {spec.name: spec.line for spec in self.run.options.hosts}
        where = self.run.hostfile or LOCAL_LOCATION
        for result in self.run.report.results:
            nodeid = cell_id(result)
            yield PreflightItem.from_parent(self, name=nodeid, nodeid=nodeid, result=result, where=where,
                                            host_line=lines.get(result.host, 0), strict=self.run.report.strict)


class PreflightItem(pytest.Item):
    """One cell of the matrix."""

    def __init__(self, *, result: Result, where: str, host_line: int, strict: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.result = result
        self.where = where
        self.host_line = host_line  # the host's line in the hostfile, 1-based; 0: cluster-wide or no hostfile
        self.strict = strict
        self.user_properties.extend(_properties(result))
        if result.status == Status.SKIP:
            # A skip mark, not pytest.skip() at run time: the summary then names the hostfile, not this plugin.
            self.add_marker(pytest.mark.skip(reason=plain(result.message)))

    def setup(self) -> None:
        if self.result.status == Status.ERROR:  # raised in setup: pytest reports an error, not a failure
            raise PreflightFailure(_text(self.result))

    def runtest(self) -> None:
        status = self.result.status
        if status == Status.FAIL or (status == Status.WARN and self.strict):
            raise PreflightFailure(_text(self.result))
        if status == Status.WARN:
            # Located at the host's hostfile line, which the warnings summary then quotes.
            warnings.warn_explicit(_text(self.result), PreflightWarning, self.where, self.host_line)

    def reportinfo(self) -> Tuple[Path, int, str]:
        host = self.result.host
        domain = f"{self.result.check} ({CLUSTER_ID})" if host == CLUSTER else f"{self.result.check} on {host}"
        # The line is 0-based here; a skip mark's location needs an int even for cluster-wide results.
        return Path(self.where), max(self.host_line - 1, 0), domain
