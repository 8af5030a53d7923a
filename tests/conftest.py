"""Shared pytest fixtures, and CI's rule that a test may not skip for lack of root, namespaces or a tool."""

import contextlib
import os
import signal

import pytest

from .netcluster import NetCluster

# A suite started in the background by a non-interactive shell (`.ci/run &`, nohup) inherits SIGINT ignored, and
# every preflight it starts would too (Python installs its KeyboardInterrupt handler only over the default): the
# Ctrl-C tests would interrupt nothing. A Python handler here becomes the default again in each exec'd child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# preflight records every run in a history store (default ~/.local/share/preflight/history.db) and judges each host
# against its past runs: the suite's runs would pile up there and become baselines for later tests. Off for the
# suite and every CLI it starts; tests/test_history.py names its own stores.
os.environ["PREFLIGHT_HISTORY"] = "off"


def _skip_without_netcluster() -> None:
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)


@pytest.fixture
def netcluster_factory():
    """make(n=3, networks=1, setup=None, names=None) -> NetCluster; all are closed at teardown."""
    _skip_without_netcluster()
    with contextlib.ExitStack() as clusters:  # closes every cluster even if one close fails
        def make(n=3, networks=1, setup=None, names=None):
            return clusters.enter_context(NetCluster(n, networks=networks, setup=setup, names=names))
        yield make


@pytest.fixture(scope="module")
def cluster3():
    """Three hosts node01..node03 shared by a module; tests must undo what they change."""
    _skip_without_netcluster()
    with NetCluster(3, names=["node01", "node02", "node03"]) as cluster:
        yield cluster


@pytest.fixture
def thresholds():
    """The documented defaults (each check's TOML beside it, and preflight/defaults.toml), as evaluate() gets them
    without --config."""
    from preflight.config import load_defaults
    return load_defaults()


# With PREFLIGHT_STRICT_SKIPS=1 (set by .ci/run) a skip fails the test, unless its reason is one of these, which
# describe the machine rather than a missing install step. A namespace-cluster test that skips because CI lost
# root or a package would otherwise turn the suite green while testing nothing.
EXPECTED_SKIPS = (
    "DeepSpeed is installed on this machine",
    "a real NVIDIA driver is present",
    "this machine has an NVIDIA driver",
    "no NVIDIA GPU on this machine",  # tests/test_gpu_device.py, module-level
)


def _strict(report) -> None:
    """Turn an unexpected skip into a failure under PREFLIGHT_STRICT_SKIPS=1 (a test's, or a whole module's)."""
    if not report.skipped or os.environ.get("PREFLIGHT_STRICT_SKIPS") != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not any(expected in reason for expected in EXPECTED_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped under PREFLIGHT_STRICT_SKIPS=1 (CI must run every test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _strict(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip (or pytest.skip(allow_module_level=True)) skips at collection, where
    # no test report is made: without this, a missing package would silently drop a whole module under CI.
    outcome = yield
    _strict(outcome.get_result())
