"""Pure (``SPEC.recommend``): NCCL's socket and IB/RoCE variables from the network this check measured fastest and
the hosts' interfaces facts, e.g. ``NCCL_SOCKET_IFNAME=eth1`` from ``{"chosen": {"network": "10.0.1.0/24",
"devices": ["eth1", "eth1"], ...}}``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

from .common import CLUSTER, NAME
from ...hostside import ncclenv, validate
from ...hostside.netinfo import trusted_interfaces
from ...hostside.seams import EnvVar, Recommendation, RecommendInput


def _nccl_versions(given: RecommendInput) -> Dict[str, Optional[Tuple[int, int]]]:
    """NCCL's version on each host, as the python check (else driver_cuda) read it from torch."""
    out = {}
    for h in given.hosts:
        hf = given.facts.get(h) or {}
        raw = (hf.get("python") or {}).get("nccl") or (hf.get("driver_cuda") or {}).get("nccl")
        out[h] = ncclenv.nccl_version(raw) if raw else None
    return out


def recommend(given: RecommendInput) -> Recommendation:
    """NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME on the network this check measured fastest (without a measurement,
    the interface each host routes to the master over) and the IB/RoCE variables, from the interfaces facts; the
    rules are hostside.ncclenv's. Pure: the facts of this check and its reads in, its part of the environment out."""
    iface = {}
    for h in given.hosts:
        facts = (given.facts.get(h) or {}).get("interfaces")
        if isinstance(facts, dict):
            iface[h] = trusted_interfaces(facts)  # host-reported names outside validate's rules left out
    measured = (given.facts.get(CLUSTER) or {}).get(NAME) or {}
    steps: List[Union[EnvVar, str]] = []
    try:
        ncclenv.socket_env(steps, given.hosts, iface, measured, given.master_address)
        ncclenv.ib_env(steps, given.hosts, iface, lambda: _nccl_versions(given))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # Facts of a shape no check produces (a broken or lying host): no network variables, never a crash.
        steps = [s for s in steps if isinstance(s, str)]
        steps.append("no network recommendation: the hosts' interface facts are malformed "
                     f"({type(exc).__name__}: {validate.quote(str(exc))})")
    failing = sorted(set(given.failed.get("interfaces", [])) | set(given.failed.get(NAME, [])))
    caveats = (f"network checks failed ({', '.join(failing)}): fix them before trusting the interface "
               "recommendation",) if failing else ()
    return Recommendation(tuple(steps), caveats)
