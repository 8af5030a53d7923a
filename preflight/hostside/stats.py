"""Small-sample statistics for the straggler verdicts (compute, iperf3, all-reduce): pure, standard library only.

A value is compared with its peers (the other devices of its model, the other hosts) by a one-sided prediction test
in log space: is it lower than the peers' spread lets a healthy member be? The spread is the peers' sample variance
(host-to-host differences and the measurement noise together, both measured), moderated by a prior (Smyth 2004,
"linear models and empirical Bayes methods", the moderated t of limma): ``prior_df`` pseudo-observations at
``prior_spread`` (the host-to-host spread; the peers' measured noise is added to it), so that three peers that
happen to agree to 0.1% do not make 3% a certainty. Where a measurement squeezes the hosts above the median together
(a link runs at its slower host), the lower half's spread (``downside``) is the estimate when it says more, with the
degrees of freedom of half the peers. The statistic is
Student's t with ``prior_df + m - 1`` degrees of freedom (m peers), exact for a lognormal fleet; the host's own
measurement noise beyond the peers' typical one (from its repeated samples) widens it. Every p of a run's check is
then adjusted together (Holm 1979, step-down Bonferroni), so that "p < 0.05" is a statement about the run: the
chance that noise alone names anybody at all. A value is named only when its adjusted p is below ``max_p`` AND it
is at least ``min_deficit`` below its peers' median (an effect floor). Fewer than ``MIN_PEERS`` peers: no peer
verdict.

For example ``compare(82.0, [100, 101, 99, 100, 98, 102, 100], prior_spread=0.02, prior_df=4)`` ->
Comparison(ratio 0.82, peers 7, t -11.5, df 10, p 2e-07); ``holm([0.001, 0.04, 0.03])`` -> [0.003, 0.06, 0.06];
``effect_text(c)`` -> "82% of the median of 7 peers (100)".
"""
from __future__ import annotations

import bisect
import heapq
import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

# A peer comparison needs this many other members (a value and two peers: the smallest group with a spread).
MIN_PEERS = 2
# The name printed with every p.
TEST_NAME = "moderated t prediction test, Holm-adjusted"


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (df > 0; large df tends to the normal)."""
    if math.isinf(t):
        return 0.0 if t < 0 else 1.0
    if df > 1e7:
        return 0.5 * math.erfc(-t / math.sqrt(2))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t < 0 else 1.0 - tail


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values, in the input's order: the smallest p times m, the next times m - 1, ...,
    each at least the one before it, at most 1. Rejecting where adjusted p < alpha keeps the chance of any false
    rejection among all m below alpha, whatever their dependence."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


class Comparison:
    """One value against its peers: the effect (ratio to the peers' median), the moderated t and its p (computed when
    first read: a run of 1,024 hosts reads the p of a few; Holm's adjustment stops at the first adjusted p of 1)."""

    __slots__ = ("value", "median", "ratio", "peers", "t", "df", "_p", "p_adj", "sigma")

    def __init__(self, value: float, median: float, ratio: float, peers: int, t: float, df: float,
                 p: Optional[float], sigma: float) -> None:
        self.value, self.median, self.ratio, self.peers = value, median, ratio, peers
        self.t, self.df, self._p, self.sigma = t, df, p, sigma
        self.p_adj = 1.0 if p is None else p

    @property
    def p(self) -> float:
        """The one-sided p of t with df degrees of freedom."""
        if self._p is None:
            self._p = t_cdf(self.t, self.df)
        return self._p

    def as_dict(self) -> Dict[str, Any]:
        return {"value": self.value, "median": self.median, "ratio": round(self.ratio, 4), "peers": self.peers,
                "t": round(self.t, 2), "df": round(self.df, 1), "p": self.p, "p_adj": self.p_adj,
                "sigma": round(self.sigma, 5)}


def _posterior(prior_spread: float, prior_df: float, peer_noise: float, var: float, m: int) -> Tuple[float, float]:
    """(s^2, df): the peers' sample variance of logs (m peers) moderated by the prior. The prior speaks of the
    host-to-host spread only; the measurement noise comes on top of it, measured (the peers' typical relative standard
    error, from each value's repeated samples), so that noisy measurements do not make a 3% prior a tight one."""
    df = float(prior_df) + m - 1
    if df <= 0:
        return var, df
    return (float(prior_df) * (prior_spread ** 2 + peer_noise ** 2) + (m - 1) * var) / df, df


def compare(x: float, peers: Sequence[float], prior_spread: float, prior_df: float, noise: float = 0.0,
            peer_noise: float = 0.0, floor: float = 0.0) -> Optional[Comparison]:
    """x against its peers, or None with fewer than MIN_PEERS positive peers or x <= 0.

    In logs: t = (log x - mean log peers) / (s * sqrt(1 + 1/m)), s^2 = (prior_df * (prior_spread^2 + peer_noise^2) +
    (m - 1) * var(log peers)) / (prior_df + m - 1), at least floor^2 and the peers' typical measurement noise squared;
    the host's own relative noise beyond the peers' typical one (``noise`` > ``peer_noise``, both relative standard
    errors of the value) adds to the prediction's variance. df = prior_df + m - 1."""
    ys = [math.log(v) for v in peers if isinstance(v, (int, float)) and v > 0]
    m = len(ys)
    if m < MIN_PEERS or not x > 0:
        return None
    mean = math.fsum(ys) / m
    var = math.fsum((y - mean) ** 2 for y in ys) / (m - 1)
    s2, df = _posterior(prior_spread, prior_df, peer_noise, var, m)
    s2 = max(s2, floor ** 2, peer_noise ** 2, 1e-12)
    excess = max(0.0, noise ** 2 - peer_noise ** 2)
    sigma = math.sqrt(s2 * (1.0 + 1.0 / m) + excess)
    t = (math.log(x) - mean) / sigma
    med = statistics.median([v for v in peers if isinstance(v, (int, float)) and v > 0])
    return Comparison(float(x), med, float(x) / med, m, t, df, None, sigma)


def _median_but(ordered: List[float], v: float) -> float:
    """The median of the sorted list ``ordered`` without one copy of its element v."""
    i = bisect.bisect_left(ordered, v)
    n = len(ordered) - 1

    def nth(j: int) -> float:
        return ordered[j + 1 if j >= i else j]

    return nth((n - 1) // 2) if n % 2 else (nth(n // 2 - 1) + nth(n // 2)) / 2.0


def compare_all(values: Sequence[float], prior_spread: float, prior_df: float, noises: Optional[Sequence[float]] = None,
                floor: float = 0.0, floors: Optional[Sequence[float]] = None,
                exclude: Optional[Sequence[Sequence[int]]] = None) -> List[Optional[Comparison]]:
    """``compare`` of every value against all the others (leave-one-out), in O(n log n) instead of O(n^2): the
    same numbers, from running sums (1,024 hosts in a run). ``noises``: each value's relative standard error; the
    typical one of the others is their median. ``floors``: each value's peers' downside spread (see ``downside``):
    from 4 peers on, where it says more than their moderated variance, it is the estimate, with the degrees of
    freedom of half the peers (and the prior's); with fewer, a floor on the spread.
    ``exclude[i]``: the indices that are no peers of value i besides itself (an iperf3 host's partners, whose
    ratios its own slowness pulls down), left out while at least MIN_PEERS + 1 peers remain."""
    n = len(values)
    out: List[Optional[Comparison]] = [None] * n
    ok = [i for i, v in enumerate(values) if isinstance(v, (int, float)) and v > 0]
    if len(ok) < MIN_PEERS + 1:
        return out
    logs = {i: math.log(values[i]) for i in ok}
    center = math.fsum(logs.values()) / len(ok)
    dev = {i: logs[i] - center for i in ok}
    s1 = math.fsum(dev.values())
    s2 = math.fsum(d * d for d in dev.values())
    ordered = sorted(float(values[i]) for i in ok)
    noise = [float(noises[i]) if noises is not None and isinstance(noises[i], (int, float)) else 0.0 for i in range(n)]
    noise_sorted = sorted(noise[i] for i in ok)
    least = max(floor ** 2, 1e-12)
    for i in ok:
        d_i = dev[i]
        others = sorted({j for j in exclude[i] if j in dev and j != i}) if exclude is not None and exclude[i] else []
        if others and len(ok) - 1 - len(others) < MIN_PEERS + 1:
            others = []
        mi = len(ok) - 1 - len(others)
        sum1 = s1 - d_i - (math.fsum(dev[j] for j in others) if others else 0.0)
        sum2 = s2 - d_i * d_i - (math.fsum(dev[j] ** 2 for j in others) if others else 0.0)
        mean = sum1 / mi
        var = max(0.0, (sum2 - mi * mean * mean) / (mi - 1))
        peer_noise = _median_but(noise_sorted, noise[i])
        post, df = _posterior(prior_spread, prior_df, peer_noise, var, mi)
        own_floor = float(floors[i]) if floors is not None else 0.0
        if mi >= 4 and own_floor * own_floor > post:
            # The lower half's spread rests on half the peers: where it says more than the moderated variance of
            # all of them, it is the estimate, with the degrees of freedom of half the peers (and the prior's).
            post, df = own_floor * own_floor, float(prior_df) + mi // 2 - 1
        post = max(post, least, peer_noise * peer_noise, own_floor * own_floor if mi < 4 else 0.0)
        excess = max(0.0, noise[i] * noise[i] - peer_noise * peer_noise)
        sigma = math.sqrt(post * (1.0 + 1.0 / mi) + excess)
        value = float(values[i])
        med = _median_but(ordered, value)
        out[i] = Comparison(value, med, value / med, mi, (d_i - mean) / sigma, df, None, sigma)
    return out


def downside(values: Sequence[float], exclude: Optional[Sequence[Sequence[int]]] = None) -> List[float]:
    """Each value's leave-one-out downside spread: sqrt(2 x mean of the squared log deviations below the median) of
    the others. Where a measurement compresses the upper side (an iperf3 link runs at the slower of its two hosts,
    so every host above the median looks alike), the peers' plain variance understates how far a healthy host
    falls below them; the lower half says it."""
    logs = [math.log(v) if isinstance(v, (int, float)) and v > 0 else None for v in values]
    real = [x for x in logs if x is not None]
    if len(real) < 3:
        return [0.0] * len(values)
    med = statistics.median(real)
    terms = [((x - med) ** 2 if x is not None and x < med else 0.0) for x in logs]
    total = math.fsum(terms)
    out = []
    for i in range(len(values)):
        gone = {i} | {j for j in (exclude[i] if exclude is not None else ()) if 0 <= j < len(values)}
        if len(real) - len(gone) < MIN_PEERS + 1:
            gone = {i}
        out.append(math.sqrt(max(0.0, 2.0 * (total - math.fsum(terms[j] for j in gone)) /
                                 max(1, len(real) - len(gone) - 1))))
    return out


def adjust(comparisons: Sequence[Optional[Comparison]]) -> int:
    """Holm-adjust every comparison's p in place (None entries skipped); returns the family's size. The same numbers
    as ``holm`` of their p's, with the p's computed in ascending order only until the adjusted p reaches 1 (every
    later one is 1 too): within one df, ascending t is ascending p, so each df's smallest t is the next candidate."""
    real = [c for c in comparisons if c is not None]
    m = len(real)
    groups: Dict[float, List[Comparison]] = {}
    for c in real:
        groups.setdefault(c.df, []).append(c)
    heads: List[Tuple[float, int, float, int]] = []
    for k, (df, members) in enumerate(groups.items()):
        members.sort(key=lambda c: c.t)
        heapq.heappush(heads, (members[0].p, k, df, 0))
    running, rank = 0.0, 0
    while heads and running < 1.0:
        p, k, df, j = heapq.heappop(heads)
        running = max(running, min(1.0, (m - rank) * p))
        groups[df][j].p_adj = running
        rank += 1
        if j + 1 < len(groups[df]):
            heapq.heappush(heads, (groups[df][j + 1].p, k, df, j + 1))
    for _, _, df, j in heads:
        for c in groups[df][j:]:
            c.p_adj = 1.0
    return m


def named(c: Optional[Comparison], max_p: float, min_deficit: float) -> bool:
    """Significant after adjustment AND at least min_deficit below the peers' median; max_p >= 1 turns the
    significance requirement off (the effect floor alone decides)."""
    return c is not None and c.ratio < 1.0 - min_deficit and (max_p >= 1.0 or c.p_adj < max_p)


def p_text(p: float, max_p: float = 0.05) -> str:
    """A p as text, one significant digit, or more where one would round it across max_p (a significant finding
    never reads "p = 0.05"; an insignificant one never "0.04")."""
    if p < 1e-9:
        return "p < 1e-9"
    for digits in (1, 2, 3, 4):
        text = f"{p:.{digits}g}"
        if (float(text) < max_p) == (p < max_p):
            return "p = " + text
    return f"p < {max_p:g}" if p < max_p else f"p = {p:g}"


def confidence_text(c: Comparison, family: int, max_p: float) -> str:
    """``t -11.5, 10 df; adjusted p = 3e-06 over 12 comparisons (moderated t prediction test, Holm-adjusted)``"""
    return (f"t {c.t:.1f}, {c.df:.0f} df; adjusted {p_text(c.p_adj, max_p)} over {family} comparison"
            f"{'' if family == 1 else 's'} ({TEST_NAME})")


def effect_text(c: Comparison, what: str = "peers", fmt: Any = None) -> str:
    """``82% of the median of 7 peers (100)``"""
    med = fmt(c.median) if fmt else f"{c.median:.3g}"
    return f"{100 * c.ratio:.0f}% of the median of {c.peers} {what} ({med})"
