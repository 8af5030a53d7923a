"""The Slurm coordinator-share model: least-squares lines through measured per-node costs, summed at N nodes.

Pure functions over the numbers bench/slurm_scale.py measures (bench/results/slurm-scale.json); no I/O. E.g.:

    fit_line([8, 16, 32, 64], [0.21, 0.30, 0.52, 0.93])
    -> Fit(fixed=0.107, per_unit=0.0129, residuals=(0.00, -0.01, 0.00, 0.00), r2=0.999)

The submit host's share of a run through one shared srun step is three parts: the coordinator process (one Python
process: connect, requests, parsing each node's frames and JSON, the verdict), the srun client's own per-node
work (launch, one I/O connection per node, its output fan-in), and the srun client's stdin broadcast: with
``--input=all`` every request the coordinator writes for one node is written by srun to every node, so a run's
requests cost it (request bytes per node x N) x N bytes of socket writes, quadratic in N, plus the code once to each
node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence, Tuple


@dataclass(frozen=True)
class Fit:
    """y = fixed + per_unit * x, from ordinary least squares; residuals are observed minus fitted, per point."""
    fixed: float
    per_unit: float
    residuals: Tuple[float, ...]
    r2: float

    def at(self, x: float) -> float:
        return self.fixed + self.per_unit * x

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """Least-squares line through (xs, ys). Needs two distinct xs; r2 is 1.0 when every y is equal and fitted."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs for {len(ys)} ys")
    if len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct sizes")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    residuals = tuple(y - (icpt + slope * x) for x, y in zip(xs, ys))
    ss_res = sum(r * r for r in residuals)
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Fit(icpt, slope, residuals, r2)


@dataclass(frozen=True)
class Broadcast:
    """What the srun client pays for its stdin (--input=all), as fitted over the probes' sizes: per byte read in full
    messages (the bulk probe), ``per_byte`` fixed plus ``per_byte_node`` for each node it is written to; per line
    read alone as a message of its own (the paced probe), ``per_line`` plus ``per_line_node``. A run's requests lie
    between the two: srun reads what has arrived, so lines that come faster than it forwards them share a message
    (``coalesced``, the bulk cost), lines that come one by one do not (the per-line cost, the bound)."""
    per_byte: float
    per_byte_node: float
    per_line: float
    per_line_node: float

    def seconds(self, nodes: float, code_bytes: float, request_bytes_per_node: float, lines_per_node: float,
                coalesced: bool = True, steps: int = 1) -> float:
        """Every node's requests and the code, each written to every node of its step: N nodes' requests to the
        N/steps nodes of their step is N^2/steps; the code goes once to each node, i.e. once per step."""
        steps = max(1, steps)
        per_step = nodes / steps
        if coalesced:
            requests = request_bytes_per_node * nodes * (self.per_byte + self.per_byte_node * per_step)
        else:
            requests = lines_per_node * nodes * (self.per_line + self.per_line_node * per_step)
        return requests + code_bytes * steps * (self.per_byte + self.per_byte_node * per_step)


def srun_linear(nodes: Sequence[float], srun_cpu_s: Sequence[float], bcast: Broadcast, code_bytes: Sequence[float],
                request_bytes_per_node: Sequence[float], lines_per_node: Sequence[float],
                coalesced: bool = True, steps: int = 1) -> Fit:
    """The srun clients' CPU in the measured runs (through `steps` steps) less their broadcast (from the probes),
    fitted as fixed + per node: what remains is launch, the I/O connection per node and the fan-in of every node's
    output."""
    rest = [cpu - bcast.seconds(n, c, b, k, coalesced, steps)
            for n, cpu, c, b, k in zip(nodes, srun_cpu_s, code_bytes, request_bytes_per_node, lines_per_node)]
    return fit_line(nodes, rest)


@dataclass(frozen=True)
class Workload:
    """What one run sends through the shared step, measured: the agent's code (once to every node) and each node's
    requests (bytes and lines), per node."""
    code_bytes: float
    request_bytes_per_node: float
    lines_per_node: float


def steps_for(nodes: float, step_nodes: int = 0) -> int:
    """How many shared steps serve `nodes` when a step holds at most step_nodes (0: one step for all)."""
    return max(1, -(-int(nodes) // step_nodes)) if step_nodes else 1


def coordinator_share(nodes: float, coordinator: Fit, srun_rest: Fit, bcast: Broadcast, work: Workload,
                      coalesced: bool = True, step_nodes: int = 0) -> Dict[str, float]:
    """Submit-host CPU seconds of one run at `nodes`: the coordinator process's line, the srun clients' per-node
    line (its fixed part once per step) and their broadcast term, with steps of at most step_nodes nodes (0: one
    step). ``serial_s`` is their sum (one core does it all); ``parallel_s`` is the larger of the coordinator and the
    srun clients together (each on a core of its own)."""
    steps = steps_for(nodes, step_nodes)
    coord = coordinator.at(nodes)
    rest = srun_rest.per_unit * nodes + srun_rest.fixed * steps
    broadcast = bcast.seconds(nodes, work.code_bytes, work.request_bytes_per_node, work.lines_per_node, coalesced,
                              steps)
    return {"nodes": nodes, "steps": steps, "coordinator_s": coord, "srun_per_node_s": rest,
            "srun_broadcast_s": broadcast, "srun_s": rest + broadcast, "serial_s": coord + rest + broadcast,
            "parallel_s": max(coord, rest + broadcast)}


def nodes_within(budget_s: float, coordinator: Fit, srun_rest: Fit, bcast: Broadcast, work: Workload,
                 coalesced: bool = True, step_nodes: int = 0, limit: int = 1_000_000) -> int:
    """The largest node count whose serial share stays within budget_s (0 if none; the share must grow with N)."""
    def share(n: int) -> float:
        return coordinator_share(n, coordinator, srun_rest, bcast, work, coalesced, step_nodes)["serial_s"]
    if share(1) > budget_s:
        return 0
    lo, hi = 1, limit
    if share(hi) <= budget_s:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if share(mid) <= budget_s else (lo, mid)
    return lo
