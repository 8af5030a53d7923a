"""One test double for the coordinator: ``FakeCluster`` implements ``preflight.hostside.seams.ClusterView``.

A cluster check's ``coordinate(cluster)`` runs against it without SSH: by default ``call``/``call_all``/``start``
run the named host-side function in this process (as the agent would on the host), and a test can plant a
handler per function to script a host's answer, raise on one host, or record what was asked.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from preflight.hostside.seams import CheckOptions, HostContext
from preflight.hostside.proc import parallel_map
from preflight.runner import Progress

Handler = Callable[[str, Dict[str, Any], float], Any]  # (host, params, timeout) -> value, or raise


@dataclass
class FakeHost:
    name: str
    slots: int = 1
    gpus: Optional[List[int]] = None
    index: int = 0


def run_host_function(func: str, params: Dict[str, Any], timeout: float) -> Any:
    """What the agent does for a "module.attr" request, in this process."""
    module, _, attr = func.rpartition(".")
    fn = getattr(importlib.import_module("preflight.checks." + module), attr)
    return fn(params, HostContext(params=params, deadline=time.monotonic() + timeout))


@dataclass
class FakeCluster:
    """Hosts ``node01..`` (or the given names); every reachable unless listed in ``unreachable``."""

    hosts_or_count: Union[int, Sequence[str]] = 2
    slots: int = 1
    thresholds: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    facts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    options: CheckOptions = field(default_factory=CheckOptions)
    handlers: Dict[str, Handler] = field(default_factory=dict)
    unreachable: Sequence[str] = ()
    parallel: int = 32
    local: bool = False
    progress: Any = field(default_factory=Progress)
    calls: List[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = (["node%02d" % (i + 1) for i in range(self.hosts_or_count)]
                 if isinstance(self.hosts_or_count, int) else list(self.hosts_or_count))
        self.all_hosts = [FakeHost(n, self.slots, index=i) for i, n in enumerate(names)]
        self.hosts = [h for h in self.all_hosts if h.name not in set(self.unreachable)]
        self.master = self.all_hosts[0]
        self.world_size = sum(h.slots for h in self.all_hosts)
        for h in self.all_hosts:
            self.facts.setdefault(h.name, {})

    def address(self, host: str) -> str:
        return "198.18.0.%d" % (1 + [h.name for h in self.all_hosts].index(host))

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any:
        self.calls.append((host, func, params))
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(host, params, timeout)
        return run_host_function(func, params, timeout)

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        names = list(params_by_host)
        out = parallel_map(lambda h: self.call(h, func, params_by_host[h], timeout), names, self.parallel,
                           timeout + 30)
        return dict(zip(names, out))

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any:
        self.calls.append((host, func, params))
        return self.handlers[func](host, params, timeout)
