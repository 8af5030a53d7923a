"""Cross-host torch.distributed all-reduce (NCCL on GPUs, gloo on CPUs): bus bandwidth per size, and who breaks it.

One process per slot runs a message-size sweep; the verdict names the rank, host and cause of a failure, e.g.
``ranks 1, 2 on node02, node03 could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s``. Thresholds: the
``[allreduce]`` section of thresholds.toml in this package. The files say where their code runs:

- ``orchestrate.py`` on the coordinator: plan the ranks, run the sweep on every host, localize a failure (pairwise);
- ``supervisor.py``   on each host, in the agent: ``probe`` (torch, GPUs, interface) and ``run`` (that host's ranks);
- ``rank.py``         in each torch rank process: rendezvous, init_process_group, the timed sweep;
- ``verdict.py``      pure: facts in, outcomes out;
- ``stragglers.py``   pure: the straggler rounds' per-link timings in, slow hosts (robust z, hard floors) out;
- ``common.py``       pure pieces all of them share (sizes, bus bandwidth, failure kinds);
- ``html.py``         on the coordinator, in the HTML report: the busbw plot (``SPEC.html``).
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence

from .common import NAME
from .html import TITLE, render as render_html
from .orchestrate import coordinate
from .verdict import evaluate
from ...hostside.seams import CheckSpec, HtmlSection, Option, PromSample, number


__all__ = ["NAME", "SPEC", "coordinate", "evaluate"]


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: the bus and algorithm bandwidth at the largest message size, and each host's best pair's
    busbw from the straggler rounds (GB/s, as the report prints them)."""
    out: List[PromSample] = []
    for r in results:
        m = r.get("metrics") or {}
        if r["host"] != "*":
            continue
        for key, name in (("busbw_GBps", "busbw"), ("algbw_GBps", "algbw")):
            if isinstance(m.get(key), (int, float)):
                out.append(PromSample(f"preflight_allreduce_{name}_gigabytes_per_second", f"all-reduce {name} at the "
                                      "largest message size of the sweep", "gauge", {}, float(m[key])))
        for host, rate in sorted(((m.get("stragglers") or {}).get("hosts") or {}).items()):
            if isinstance((rate or {}).get("busbw_GBps"), (int, float)):
                out.append(PromSample("preflight_allreduce_pair_busbw_gigabytes_per_second", "all-reduce busbw of "
                                      "the host's fastest pair in the straggler rounds", "gauge", {"host": host},
                                      float(rate["busbw_GBps"])))
    return out


# --min-busbw overrides [allreduce] min_busbw (thresholds.toml, with its range rule): read through limits() only.
MIN_BUSBW = Option("--min-busbw", "all-reduce bus bandwidth below this (GB/s) fails", number, "GBPS",
                   threshold="min_busbw")


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="torch.distributed all-reduce across all hosts, one process per slot: busbw per message size",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    # Compared with the same hosts' past runs (preflight/history/): the bus bandwidth of the largest message.
    baseline={"busbw_GBps": "higher"},
    options=(MIN_BUSBW,),
    # python's rank_view and gpu's GPUs (what the ranks will see), the hosts ports and iperf3 proved unreachable,
    # iperf3's chosen network and its stragglers.
    reads=("python", "gpu", "ports", "iperf3"),
    # The agent imports torch once before the host checks when a selected check uses it (agent.py, preload).
    uses_torch=True,
    # Its busbw is the network's, the ranks' reduction the cores' (gloo) or the GPUs' (NCCL): it runs alone.
    measures=("cpu", "gpu", "network"),
    loads=("cpu", "gpu", "network"),
    html=HtmlSection(TITLE, render_html),
    prom_metrics=prom_metrics,
)
