"""The statistics hold their error rate: the t distribution and Holm's adjustment against known values, a fast subset
of bench/calibration.py's grid (the checks' real evaluate on simulated fleets), and 3 healthy runs of 6 namespace
hosts whose links and CPU quotas differ by 3% naming nobody (bench/healthy_fleet.py runs 10)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from preflight.hostside import stats
from tests.netcluster import NetCluster

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


# --- the distribution ----------------------------------------------------------------------------------------------

# scipy.stats.t.cdf(t, df), recorded (scipy is no dependency of preflight).
T_CDF = [((-8.6, 10), 3.1078688894149657e-06), ((-2.0, 2), 0.09175170953613698), ((-38.0, 1), 0.008374643104305376),
         ((-1.0, 30), 0.1626543077130151), ((3.0, 5), 0.9849503760512687), ((-4.5, 1000), 3.7965355132491246e-06),
         ((-0.1, 3.5), 0.46290220984344604)]


@pytest.mark.parametrize("args,expected", T_CDF)
def test_t_cdf_matches_scipy(args, expected):
    assert stats.t_cdf(*args) == pytest.approx(expected, rel=1e-9)


def test_holm_and_the_effect_floor():
    assert stats.holm([0.001, 0.04, 0.03]) == pytest.approx([0.003, 0.06, 0.06])
    c = stats.compare(82.0, [100, 101, 99, 100, 98, 102, 100], prior_spread=0.02, prior_df=4)
    assert c.peers == 7 and c.df == 10 and c.ratio == pytest.approx(0.82) and c.p < 1e-5
    assert stats.effect_text(c) == "82% of the median of 7 peers (100)"
    stats.adjust([c])
    assert stats.named(c, 0.01, 0.05) and not stats.named(c, 0.01, 0.2)  # 18% slower, not 20%
    assert stats.compare(50.0, [100.0], 0.02, 4) is None  # one peer: no peer verdict


def test_leave_one_out_in_one_pass_is_the_same_test():
    values, noises = [91.0, 95.5, 88.0, 97.0, 60.0, 93.0], [0.01, 0.02, 0.005, 0.03, 0.01, 0.0]
    fast = stats.compare_all(values, 0.02, 4, noises, 0.01)
    for i, v in enumerate(values):
        others = values[:i] + values[i + 1:]
        slow = stats.compare(v, others, 0.02, 4, noises[i], sorted(noises[:i] + noises[i + 1:])[2], 0.01)
        assert fast[i].t == pytest.approx(slow.t) and fast[i].median == pytest.approx(slow.median)


def test_adjust_is_holm_of_the_p_values_computed_lazily():
    """adjust() computes p's in ascending order and stops at the first adjusted p of 1: the same numbers as holm()
    of every p, whatever the mix of degrees of freedom (iperf3's hosts differ in peers) and ties."""
    import random
    rng = random.Random(3)
    for trial in range(20):
        cs = [stats.Comparison(1.0, 1.0, 1.0, 5, rng.choice([-6.0, -3.5, 0.0]) if trial % 5 == 0 else
                               rng.gauss(-1.0, 2.0), rng.choice([4.0, 7.0, 30.0]), None, 0.01) for _ in range(60)]
        expected = stats.holm([c.p for c in cs])
        fresh = [stats.Comparison(c.value, c.median, c.ratio, c.peers, c.t, c.df, None, c.sigma) for c in cs]
        assert stats.adjust(fresh + [None]) == 60
        assert [c.p_adj for c in fresh] == pytest.approx(expected, rel=1e-12)
        assert sum(c._p is not None for c in fresh) < 60 or trial % 5 == 0  # most p's were never needed


def test_the_prior_adds_the_measured_noise_to_its_spread():
    """The prior speaks of the host-to-host spread; each value's measured noise comes on top of it, so that noisy
    peers do not shrink the spread a host is judged by towards the prior alone."""
    quiet = stats.compare(95.0, [100.0, 100.5, 99.5], 0.03, 4, 0.0, 0.0)
    noisy = stats.compare(95.0, [100.0, 100.5, 99.5], 0.03, 4, 0.02, 0.02)
    assert noisy.sigma ** 2 == pytest.approx(quiet.sigma ** 2 + 0.02 ** 2 * 4 / 6 * (1 + 1 / 3), rel=1e-9)


# --- simulated fleets: the real evaluate() ---------------------------------------------------------------------------

def test_a_reduced_calibration_run_names_the_slow_host_and_not_the_healthy_ones():
    """The fast tier's check on the detectors: 25 runs a setting of two cells. The seeds are fixed, so the figures
    are the code's, not chance's; a detector that names everyone, no one, or the wrong host fails."""
    pytest.importorskip("numpy")
    from bench import calibration
    for check, n, spread in (("compute-cpu", 8, 0.03), ("allreduce", 12, 0.02)):
        c = calibration.cell((check, n, spread, 0.005, 25, 30 + n))
        assert c["false_alarm"] <= 1 / 25 and c["power_80"] >= 0.95 and c["power_50"] == 1.0, c


def test_a_fast_subset_of_the_calibration_grid_meets_the_targets():
    np = pytest.importorskip("numpy")
    del np
    from bench import calibration
    cells = [calibration.cell((check, n, spread, 0.01, runs, 11 + n))
             for check, n, spread, runs in (("compute-cpu", 8, 0.02, 150), ("compute-cpu", 4, 0.03, 150),
                                            ("allreduce", 16, 0.02, 150), ("iperf3", 16, 0.02, 60),
                                            ("compute-cpu", 3, 0.02, 100))]
    for c in cells:
        # 1% of healthy runs at most is the target; 3 of 150 (2%) bounds a sample of it
        assert c["false_alarm"] <= 0.02, c
        assert c["power_50"] >= 0.95, c
        if c["hosts"] >= 4:
            assert c["power_80"] >= 0.95, c
    committed = json.loads((REPO / "bench" / "results" / "calibration.json").read_text())
    assert len(committed["commit"]) == 40 and committed["cells"]


def test_the_iperf3_core_names_what_evaluate_names():
    """Above 16 hosts the bench judges iperf3 by mesh.find_stragglers and the link-rate floor (evaluate's per-host
    rows scan every link); on fleets where both run they name the same hosts, slow or healthy, the floor included."""
    np = pytest.importorskip("numpy")
    from bench import calibration
    rng = np.random.default_rng(30)
    named = 0
    for n, spread, slow in ((8, 0.03, None), (8, 0.02, 0.9), (12, 0.03, 0.8), (6, 0.02, 0.5), (16, 0.05, None)):
        for links, names, net in calibration.iperf3_fleets(rng, n, spread, 0.01, slow, 15):
            core, full = calibration.iperf3_core(links, names, net), calibration.iperf3_evaluate(links, names, net)
            assert core == sorted(full), (n, spread, slow, core, full)
            named += bool(core)
    assert named >= 25  # the slow hosts were named (the comparison is not of empty lists only)


# --- healthy namespace hosts, 3% apart ------------------------------------------------------------------------------

needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))
# 3 runs here (one per ~40 s on 2 cores); bench/healthy_fleet.py runs the full 10 with the same hosts and config.
RUNS = 3


@needs_cluster
def test_healthy_runs_of_six_hosts_3_percent_apart_name_nobody(netcluster_factory, tmp_path):
    from bench import healthy_fleet
    cluster = netcluster_factory(healthy_fleet.HOSTS)
    seen = []
    healthy_fleet.shape(cluster)
    try:
        for run in range(RUNS):
            named, _, error, fleet = healthy_fleet.one_run(cluster, tmp_path, run)
            assert not error, error
            assert fleet == [], fleet  # 3 runs: too few for the history's judgement to start (min_runs 5)
            seen.append(named)
    finally:
        healthy_fleet.unshape(cluster)
    assert seen == [[]] * RUNS, seen
