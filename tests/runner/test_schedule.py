"""Pair scheduling: rounds are disjoint, cover the ring, and grow linearly with hosts."""
import pytest

from preflight.hostside.schedule import full_mesh_rounds, pair_rounds, probe_targets, ring_rounds


def assert_disjoint(rounds):
    for rnd in rounds:
        used = [h for pair in rnd for h in pair]
        assert len(used) == len(set(used)), rnd


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 17, 64])
def test_ring_rounds_are_disjoint_and_cover_the_ring(n):
    rounds = ring_rounds(n)
    assert_disjoint(rounds)
    edges = {frozenset(p) for rnd in rounds for p in rnd}
    assert edges == {frozenset((i, (i + 1) % n)) for i in range(n)}
    assert len(rounds) <= 3


@pytest.mark.parametrize("n", [4, 8, 16, 64, 128])
def test_pair_rounds_stay_linear_and_measure_each_host_several_times(n):
    rounds = pair_rounds(n, extra=2, seed=1)
    assert_disjoint(rounds)
    assert len(rounds) <= 5
    per_host = {h: 0 for h in range(n)}
    for rnd in rounds:
        for a, b in rnd:
            per_host[a] += 1
            per_host[b] += 1
    assert min(per_host.values()) >= 2


@pytest.mark.parametrize("n", [2, 3, 6, 7, 16])
def test_full_mesh_covers_every_pair_once(n):
    rounds = full_mesh_rounds(n)
    assert_disjoint(rounds)
    pairs = [frozenset(p) for rnd in rounds for p in rnd]
    assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2


def test_probe_targets_are_full_mesh_up_to_the_limit_then_linear():
    assert len(probe_targets(16)) == 16 * 15
    big = probe_targets(64)
    assert len(big) < 64 * 8
    assert all((i, 0) in big and (0, i) in big for i in range(1, 64))
