"""What every side of the all-reduce check shares (pure): phase marker, failure kinds, sizes, bus bandwidth.

Bandwidths follow nccl-tests: algbw = bytes / time (GB/s, 1e9), busbw = algbw * 2(n-1)/n for n ranks, e.g.
``bandwidth_table([{"bytes": 8 << 20, "time_s": 0.5}], 3)`` -> algbw 0.0168, busbw 0.0224 GB/s. ``classify`` reads
torch/gloo/NCCL error text such as::

    The client socket has timed out after 30000ms while trying to connect to (198.18.0.1, 29500).
    Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.h:311] Connect timeout [none]
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any, Dict, List, Sequence

NAME = "allreduce"  # the check id, and the [allreduce] section of thresholds.toml beside this file
PHASE = "@@ALLREDUCE-PHASE"
# The order in which failure kinds are reported: the first is most likely the root cause.
KIND_ORDER = ["torch_missing", "no_gpu", "port_in_use", "rendezvous", "incomplete", "mesh", "hung", "oom", "nccl",
              "wrong_result", "collective_timeout", "other", "peer_died", "aborted", "stopped"]
_IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")


# --- pure helpers: sizes, bandwidths, error classification --------------------------------------------------------

def sweep_sizes(min_bytes: int, max_bytes: int) -> List[int]:
    """Doubling sizes from min to max, each a multiple of 4 (float32 elements)."""
    size = max(4, int(min_bytes) // 4 * 4)
    sizes = []
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes or [size]


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n: what each rank sends and receives per byte of the buffer."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


def bandwidth_table(sizes: Sequence[Dict[str, Any]], world_size: int) -> List[Dict[str, Any]]:
    rows = []
    for row in sizes:
        t = float(row["time_s"])
        algbw = row["bytes"] / t / 1e9 if t > 0 else 0.0
        rows.append({"bytes": int(row["bytes"]), "time_s": t, "iters": row.get("iters"),
                     "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(world_size)})
    return rows


def classify(text: str, phase: str) -> str:
    """A failure kind from torch/gloo/NCCL error text and the phase the rank was in."""
    low = (text or "").lower()
    if phase == "import" or "no module named 'torch'" in low:
        return "torch_missing"
    if "address already in use" in low or "eaddrinuse" in low:
        return "port_in_use"
    if "out of memory" in low:
        return "oom"
    if "duplicate gpu" in low or "invalid device ordinal" in low or "no cuda gpus are available" in low:
        return "no_gpu"
    if "wrong sum" in low:
        return "wrong_result"
    if "trying to connect to" in low or "failed to connect to any network address" in low \
            or "could not connect to master_addr" in low:
        return "rendezvous"
    if "clients joined" in low or "ranks joined" in low or "waiting for clients" in low \
            or ("wait timeout" in low and "keys:" in low):
        return "incomplete"  # the store is up but not every rank arrived
    if "connectfullmesh" in low or "connect timeout" in low or ("connection refused" in low and phase == "init"):
        return "mesh"
    if "connection reset" in low or "connection closed" in low or "broken pipe" in low \
            or "read error" in low or "remote process exited" in low:
        return "peer_died"
    if "nccl" in low and ("error" in low or "warning" in low):
        return "nccl"
    if "timed out" in low or "timeout" in low:
        return "collective_timeout" if phase in ("sweep", "connect") else "mesh" if phase == "init" else "other"
    return "other"


def addresses_in(text: str) -> List[str]:
    found = []
    for ip in _IPV4.findall(text or ""):
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            continue
        if ip not in found and not ip.startswith(("0.", "127.")):
            found.append(ip)
    return found


def rank_list(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    if len(ranks) > 6:
        first = ", ".join(map(str, ranks[:3]))
        return f"{len(ranks)} ranks ({first} ... {ranks[-1]})"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def names(hosts: Sequence[str], limit: int = 6) -> str:
    hosts = list(dict.fromkeys(hosts))
    more = f" and {len(hosts) - limit} more" if len(hosts) > limit else ""
    return ", ".join(hosts[:limit]) + more

