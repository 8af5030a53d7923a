"""Which hosts test against which: rounds of disjoint pairs, so a round's pairs can run at the same time.

The number of rounds grows at most linearly with hosts (never with pairs): a ring (2 or 3 rounds) plus
``extra`` random perfect matchings measures every host against several peers.
"""
from __future__ import annotations

import random
from typing import List, Sequence, Tuple

Pair = Tuple[int, int]
Round = List[Pair]


def ring_rounds(n: int) -> List[Round]:
    """The ring i -> i+1 (mod n) split into rounds of disjoint pairs: 2 rounds for even n, 3 for odd n."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    rounds: List[Round] = []
    for edge in edges:
        for rnd in rounds:
            if all(edge[0] not in p and edge[1] not in p for p in rnd):
                rnd.append(edge)
                break
        else:
            rounds.append([edge])
    return rounds


def random_matching(n: int, rng: random.Random) -> Round:
    order = list(range(n))
    rng.shuffle(order)
    return [(order[i], order[i + 1]) for i in range(0, n - 1, 2)]


def pair_rounds(n: int, extra: int = 2, seed: int = 0) -> List[Round]:
    """Ring rounds plus ``extra`` random matchings, skipping pairs already measured."""
    rounds = ring_rounds(n)
    seen = {frozenset(p) for rnd in rounds for p in rnd}
    rng = random.Random(seed)
    for _ in range(extra if n > 3 else 0):
        rnd = [p for p in random_matching(n, rng) if frozenset(p) not in seen]
        if rnd:
            seen.update(frozenset(p) for p in rnd)
            rounds.append(rnd)
    return rounds


def full_mesh_rounds(n: int) -> List[Round]:
    """Every pair exactly once, in n-1 (even n) or n (odd n) rounds: the circle method of round-robins."""
    if n < 2:
        return []
    players: List[int] = list(range(n)) + ([-1] if n % 2 else [])
    m = len(players)
    rounds: List[Round] = []
    for _ in range(m - 1):
        rnd = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([p for p in rnd if -1 not in p])
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def probe_targets(n: int, mesh_limit: int = 16, extra: int = 2, seed: int = 0) -> List[Tuple[int, int]]:
    """(source, destination) probes for reachability checks: full mesh up to mesh_limit hosts; above it,
    every host to the master (0) and back, plus the pairs of pair_rounds in both directions: O(n) probes."""
    if n <= mesh_limit:
        return [(a, b) for a in range(n) for b in range(n) if a != b]
    probes = {(i, 0) for i in range(1, n)} | {(0, i) for i in range(1, n)}
    for rnd in pair_rounds(n, extra, seed):
        for a, b in rnd:
            probes.update({(a, b), (b, a)})
    return sorted(probes)


def names(rounds: Sequence[Round], hosts: Sequence[str]) -> List[List[Tuple[str, str]]]:
    return [[(hosts[a], hosts[b]) for a, b in rnd] for rnd in rounds]
