"""What every part of the iperf3 check shares: its name, the cluster row's key, and the median of a network's links.

A network record, as ``orchestrate.coordinate`` builds it and the rest reads it::

    {"network": "198.18.0.0/24", "devices": {"node01": "eth0", ...}, "addresses": {"node01": "198.18.0.1", ...},
     "links": [{"src": "node01", "dst": "node02", "gbps": 0.19, "retransmits": 0, "error": None}, ...]}
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

NAME = "iperf3"

CLUSTER = "*"
SERVER_READY_S = 15.0     # iperf3 -s listens within milliseconds; the margin covers a loaded host


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def ok_links(network: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [ln for ln in network.get("links") or [] if not ln.get("error") and ln.get("gbps") is not None]
