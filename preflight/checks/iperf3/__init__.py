"""TCP bandwidth between hosts over every shared IPv4 network, measured with real iperf3; finds stragglers.

Each host runs ``iperf3 -s`` and tests disjoint pairs in rounds with ``iperf3 -c ADDR -p PORT -J -t 2``; the verdict
names the slow or unreachable host, e.g. ``node03: median 95.1 Mbit/s over 3 links vs median of the other hosts
190.2 Mbit/s (50%) on 198.18.0.0/24 via eth0``. Thresholds: the ``[iperf3]`` section of thresholds.toml in this
package. The files say where their code runs:

- ``host.py``           on each host, in the agent: ``serve``, ``client`` (parses iperf3's JSON) and ``interfaces``,
  called as ``"iperf3.serve"``, ``"iperf3.client"``, ``"iperf3.interfaces"`` (re-exported here);
- ``orchestrate.py``    on the coordinator: ``coordinate`` (servers up per network, the rounds, confirm repeats);
- ``networks.py``       pure: the shared networks, their link-rate and link-type floors, the network chosen;
- ``verdict.py``        pure: facts in, outcomes out (``evaluate``);
- ``heatmap.py``        on the coordinator, in the HTML report: the heat map of the links (``SPEC.html``);
- ``recommendation.py`` pure: NCCL's network variables for the recommended environment (``SPEC.recommend``);
- ``common.py``         what they share (the name, the cluster row's key, the median of a network's links).

Stragglers: each host's median link against the median of the links without it, tested against the other hosts
by the moderated t prediction test of ``hostside/stats.py`` in Holm's step-down order (``mesh.find_stragglers``).
Floors: besides that comparison and the optional absolute ``min_gbps`` (FAIL), a host's median below
``link_rate_fraction`` of what its network's links report (/sys/class/net/IF/speed, the negotiated rate ethtool shows;
the slowest host's, capped at ``streams`` x ``stream_cap_gbps`` since one TCP stream is CPU-bound) is a WARN: a
healthy NIC gives iperf3 most of its line rate, so half of it means a duplex or speed mismatch, errors, or a leftover
rate limit. The default floor by link type (``link_type_min_gbps``: Ethernet 1 Gbit/s, InfiniBand 10 Gbit/s, times
the same fraction) applies with no configuration, also where a NIC reports no usable rate (virtio -1, IPoIB's IB
rate); a virtual NIC (veth) gets it only with ``virtual_link_type``.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence

from .common import CLUSTER, NAME, SERVER_READY_S, median, ok_links
from .heatmap import CELL_MIN_PX, HEATMAP_MAX_PX, html_section, measured_links, reference_median
from .host import client, interfaces, listening_ports, parse_client_json, serve
from .networks import (ARPHRD_INFINIBAND, choose, link_floor, link_rate_mbps, link_type, reaches_all,
                       shared_networks, type_floor)
from .orchestrate import AGENT_MARGIN_S, best_links, coordinate
from .recommendation import recommend
from .verdict import evaluate, fix_slow
from ...hostside.mesh import find_stragglers
from ...hostside.seams import CheckSpec, HtmlSection, Option, PromSample, number

# The names callers use as ``iperf3.X``; serve, client and interfaces are also what the agent resolves
# "iperf3.serve" etc. to (hostside/agent.py: _call imports this package and takes the attribute).
__all__ = ["AGENT_MARGIN_S", "ARPHRD_INFINIBAND", "CELL_MIN_PX", "CLUSTER", "HEATMAP_MAX_PX", "NAME",
           "SERVER_READY_S", "SPEC", "best_links", "choose", "client", "coordinate", "evaluate", "find_stragglers",
           "fix_slow", "html_section", "interfaces", "link_floor", "link_rate_mbps", "link_type", "listening_ports",
           "measured_links", "median", "ok_links", "parse_client_json", "reaches_all", "recommend",
           "reference_median", "serve", "shared_networks", "type_floor"]


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: every measured link's TCP rate (bits per second), by sender and receiver."""
    return [PromSample("preflight_iperf3_bits_per_second", "iperf3 TCP rate of the link from src to dst", "gauge",
                       {"src": src, "dst": dst}, float(ln["gbps"]) * 1e9)
            for (src, dst), ln in measured_links(results).items()
            if not ln.get("error") and isinstance(ln.get("gbps"), (int, float))]


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
# --iperf3-min-gbps overrides [iperf3] min_gbps (thresholds.toml, with its range rule): read through limits() only.
MIN_GBPS = Option("--iperf3-min-gbps", "TCP bandwidth floor (Gbit/s, iperf3): a host's median or the chosen network's "
                  "median below it fails (default: [iperf3] min_gbps, 0: the link-rate floor only)", number, "GBPS",
                  threshold="min_gbps")


SPEC = CheckSpec(
    name=NAME,
    description="TCP bandwidth between host pairs on every shared network (iperf3); names stragglers, picks the NIC",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    # Compared with the host's own past runs (preflight/history.py): its median link rate, and the network's.
    baseline={"median_gbps": "higher", "networks[*].median_gbps": "higher"},
    options=(MIN_GBPS,),
    html=HtmlSection("Host-to-host bandwidth (iperf3)", html_section),
    # interfaces: the candidate networks (and their facts, listed here when that check did not run); python and
    # driver_cuda: NCCL's version, for the recommended environment.
    reads=("python", "driver_cuda", "interfaces", "ports"),
    recommend=recommend,
    prom_metrics=prom_metrics,
    # It measures the network, and its streams keep a core each busy and the links full (runner.Schedule). It starts
    # beside the host checks (early): their imports take one core of a real host's many and no bandwidth, so the
    # rounds run while the hosts import torch and DeepSpeed; it lists the interfaces itself when their check has not
    # answered yet, and waits for ports' facts only at its end (waits), to say which end of a failed test is blocked.
    measures=("network",),
    loads=("cpu", "network"),
    early=True,
    waits=("ports",),
)
