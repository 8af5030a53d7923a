"""bench/slurm_model.py, the Slurm coordinator-share model: the least-squares line recovers a known line and its
residuals, the shared step's broadcast grows with N^2 (and by 1/steps when split), and the node count that fits a
budget is the largest whose share stays within it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def m():
    spec = importlib.util.spec_from_file_location("bench_slurm_model", REPO / "bench" / "slurm_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_slurm_model"] = module  # dataclasses looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_slurm_model", None)


def test_fit_line_recovers_a_line_and_reports_residuals(m):
    xs = [8, 16, 32, 64]
    fit = m.fit_line(xs, [0.4 + 0.002 * x for x in xs])
    assert fit.fixed == pytest.approx(0.4)
    assert fit.per_unit == pytest.approx(0.002)
    assert fit.max_abs_residual == pytest.approx(0.0, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.at(4000) == pytest.approx(8.4)
    # One point off the line by +0.1: least squares spreads it, and the residuals (observed - fitted) sum to 0.
    noisy = m.fit_line(xs, [0.4 + 0.002 * x + (0.1 if x == 32 else 0.0) for x in xs])
    assert sum(noisy.residuals) == pytest.approx(0.0, abs=1e-12)
    assert noisy.residuals[2] > 0.05 and noisy.r2 < 1.0


def test_a_quadratic_shows_in_the_residuals(m):
    """What the report's residual column is for: a cost that grows with N^2 leaves a convex pattern (both ends
    above the line, the middle below), which a per-node line would hide at 4,000 nodes."""
    xs = [8, 16, 32, 64]
    fit = m.fit_line(xs, [1e-4 * x * x for x in xs])
    assert fit.residuals[0] > 0 and fit.residuals[-1] > 0 and min(fit.residuals[1:3]) < 0
    assert fit.at(4000) < 1e-4 * 4000 ** 2 / 10  # the line is far below the quadratic out there


def test_fit_line_refuses_what_has_no_line(m):
    with pytest.raises(ValueError):
        m.fit_line([64, 64], [1.0, 2.0])
    with pytest.raises(ValueError):
        m.fit_line([8, 16], [1.0])


def test_broadcast_is_quadratic_and_split_by_steps(m):
    b = m.Broadcast(per_byte=0.0, per_byte_node=5e-9, per_line=0.0, per_line_node=8e-6)
    at = [b.seconds(n, 0, 400, 3) for n in (1000, 2000)]
    assert at[1] == pytest.approx(4 * at[0])
    assert at[0] == pytest.approx(5e-9 * 400 * 1000 * 1000)
    assert b.seconds(1000, 0, 400, 3, coalesced=False) == pytest.approx(8e-6 * 3 * 1000 * 1000)
    assert b.seconds(1000, 0, 400, 3, steps=10) == pytest.approx(at[0] / 10)
    # The code goes once to each node: linear, and the same however many steps.
    assert b.seconds(2000, 1e5, 0, 0) == pytest.approx(2 * b.seconds(1000, 1e5, 0, 0))
    assert b.seconds(2000, 1e5, 0, 0, steps=8) == pytest.approx(b.seconds(2000, 1e5, 0, 0))
    # srun's read of a byte (or a line) is paid once, whatever the node count: linear in N.
    once = m.Broadcast(per_byte=1e-9, per_byte_node=0.0, per_line=2e-6, per_line_node=0.0)
    assert once.seconds(2000, 0, 400, 3) == pytest.approx(2 * once.seconds(1000, 0, 400, 3))
    assert once.seconds(1000, 0, 400, 3, coalesced=False) == pytest.approx(2e-6 * 3 * 1000)


def test_srun_linear_removes_the_broadcast_before_fitting(m):
    b = m.Broadcast(per_byte=1e-9, per_byte_node=5e-9, per_line=2e-6, per_line_node=8e-6)
    nodes = [8.0, 16.0, 32.0, 64.0]
    measured = [0.02 + 0.001 * n + b.seconds(n, 4e5, 400, 3) for n in nodes]
    rest = m.srun_linear(nodes, measured, b, [4e5] * 4, [400] * 4, [3] * 4)
    assert rest.fixed == pytest.approx(0.02)
    assert rest.per_unit == pytest.approx(0.001)


def test_coordinator_share_and_the_nodes_a_budget_holds(m):
    coord = m.Fit(0.5, 0.002, (), 1.0)
    rest = m.Fit(0.01, 0.001, (), 1.0)
    b = m.Broadcast(per_byte=0.0, per_byte_node=5e-9, per_line=0.0, per_line_node=8e-6)
    work = m.Workload(4e5, 400, 3)
    share = m.coordinator_share(4000, coord, rest, b, work)
    assert share["coordinator_s"] == pytest.approx(8.5)
    assert share["srun_broadcast_s"] == pytest.approx(5e-9 * (4e5 + 400 * 4000) * 4000)
    assert share["serial_s"] == pytest.approx(share["coordinator_s"] + share["srun_s"])
    n = m.nodes_within(120.0, coord, rest, b, work)
    assert m.coordinator_share(n, coord, rest, b, work)["serial_s"] <= 120.0
    assert m.coordinator_share(n + 1, coord, rest, b, work)["serial_s"] > 120.0
    assert m.nodes_within(120.0, coord, rest, b, work, step_nodes=128) > n
    # Steps of at most 128 nodes: 4,000 nodes take 32 steps, each writing its 125 nodes' requests to its 125 nodes.
    split = m.coordinator_share(4000, coord, rest, b, work, step_nodes=128)
    assert split["steps"] == 32
    assert split["srun_broadcast_s"] == pytest.approx(5e-9 * (4e5 * 4000 + 400 * 4000 * 125))
    assert split["srun_per_node_s"] == pytest.approx(0.001 * 4000 + 0.01 * 32)
    assert m.nodes_within(0.1, coord, rest, b, work) == 0
