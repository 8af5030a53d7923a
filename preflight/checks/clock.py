"""Clock skew between each host and the coordinator, from an NTP-style exchange over the agent.

The coordinator notes its wall clock t0, asks the host for its own (``clock.now`` returns ``time.time()``), and
notes t1 when the answer is back: offset = host - (t0 + t1) / 2, known to within (t1 - t0) / 2. Of several
exchanges the one with the shortest round trip counts (as NTP does), e.g. facts::

    {"hosts": ["node01", "node02"], "samples": {"node01": [{"t0": 1795406671.120, "host": 1795406671.161,
     "t1": 1795406671.198}, ...]}, "errors": {}, "unreachable": []}

Thresholds: the ``[clock]`` section of clock.toml beside this module.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..hostside.seams import CheckSpec, ClusterView, HostContext, PromSample
from ..hostside.outcome import Outcome, Status, error, limits

NAME = "clock"

CLUSTER = "*"


def now(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Host side: this host's wall clock, read as late as possible (the reply follows at once)."""
    return {"time": time.time()}


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    lim = limits(cluster.thresholds, NAME)
    hosts = [h.name for h in cluster.hosts]
    facts: Dict[str, Any] = {"hosts": hosts, "samples": {h: [] for h in hosts}, "errors": {},
                             "unreachable": [h.name for h in cluster.all_hosts if h.name not in hosts]}
    from ..hostside.proc import parallel_map

    def exchange(host: str) -> List[Dict[str, float]]:
        out = []
        for _ in range(int(lim["exchanges"])):
            t0 = time.time()
            value = cluster.call(host, NAME + ".now", {}, 30.0)
            t1 = time.time()
            out.append({"t0": t0, "host": float(value["time"]), "t1": t1})
        return out

    for h, res in zip(hosts, parallel_map(exchange, hosts, cluster.parallel, 60.0 + 30.0 * int(lim["exchanges"]))):
        if isinstance(res, BaseException):
            facts["errors"][h] = str(res) or type(res).__name__
        else:
            facts["samples"][h] = res
    return facts


def offset(samples: List[Dict[str, float]]) -> Optional[Dict[str, float]]:
    """{"offset_s", "uncertainty_s", "rtt_s"} from the exchange with the shortest round trip."""
    good = [s for s in samples if s.get("t1", 0) >= s.get("t0", 0)]
    if not good:
        return None
    best = min(good, key=lambda s: s["t1"] - s["t0"])
    rtt = best["t1"] - best["t0"]
    return {"offset_s": best["host"] - (best["t0"] + best["t1"]) / 2, "uncertainty_s": rtt / 2, "rtt_s": rtt}


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    lim = limits(thresholds, NAME)
    warn_s = float(lim["max_skew_s"])
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable") or []:
        out[h] = error("not run: the host is unreachable (see its ssh result)")
    for h, why in (facts.get("errors") or {}).items():
        out[h] = error(f"could not read the clock of {h}: {why}", "rerun with -v")
    offsets: Dict[str, float] = {}
    for h, samples in (facts.get("samples") or {}).items():
        if h in out:
            continue
        o = offset(samples or [])
        if o is None:
            out[h] = error(f"no clock reading came back from {h}", "rerun with -v")
            continue
        offsets[h] = o["offset_s"]
        metrics = {k: round(v, 6) for k, v in o.items()}
        # Only a skew beyond the measurement's own uncertainty (half the round trip) is a finding.
        skew = abs(o["offset_s"]) - o["uncertainty_s"]
        side = "ahead of" if o["offset_s"] > 0 else "behind"
        text = f"clock {side} the coordinator's by {abs(o['offset_s']):.3f} s (+- {o['uncertainty_s']:.3f} s)"
        if skew > warn_s:
            out[h] = Outcome(Status.WARN, f"{h}: {text}, more than {warn_s:.1f} s: log timestamps and timeouts of the "
                             "ranks will not line up",
                             f"sync the clocks: chronyc tracking / timedatectl show-timesync on {h} (enable chrony or "
                             "systemd-timesyncd against the cluster's NTP server)", metrics)
        else:
            out[h] = Outcome(Status.PASS, text, metrics=metrics)
    if offsets:
        spread = max(offsets.values()) - min(offsets.values())
        farthest = max(offsets, key=lambda k: abs(offsets[k]))
        largest = max(abs(v) for v in offsets.values())
        message = (f"clocks of {len(offsets)} hosts within {spread:.3f} s of each other "
                   f"(largest offset {farthest} {largest:.3f} s)")
        out[CLUSTER] = Outcome(Status.PASS, message,
                               metrics={"offsets_s": {h: round(v, 6) for h, v in offsets.items()},
                                        "spread_s": round(spread, 6)})
    return out


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: each host's clock offset from the coordinator and its uncertainty (seconds), and the spread."""
    out: List[PromSample] = []
    for r in results:
        m = r.get("metrics") or {}
        if r["host"] == CLUSTER:
            if isinstance(m.get("spread_s"), (int, float)):
                out.append(PromSample("preflight_clock_spread_seconds", "largest minus smallest clock offset of the "
                                      "hosts", "gauge", {}, float(m["spread_s"])))
            continue
        for key, name, what in (("offset_s", "offset", "clock offset from the coordinator (positive: ahead)"),
                                ("uncertainty_s", "uncertainty", "half the round trip of the clock reading")):
            if isinstance(m.get(key), (int, float)):
                out.append(PromSample(f"preflight_clock_{name}_seconds", what, "gauge", {"host": r["host"]},
                                      float(m[key])))
    return out


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="clock skew of every host against the coordinator (NTP-style exchange over the agent)",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    prom_metrics=prom_metrics,
    # Each exchange's delays: a busy core or link on either end widens them (runner.Schedule keeps load off it).
    measures=("cpu", "network"),
    loads=(),
)
