"""Shared pytest fixtures."""

import contextlib

import pytest

from .netcluster import NetCluster


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
    """The documented defaults (preflight/defaults.toml), as evaluate() gets them without --config."""
    from preflight.config import load_defaults
    return load_defaults()
