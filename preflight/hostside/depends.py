"""A declared dependency's facts collected on the host, for a check that reads them when the run left it out.

Standard library only (Python 3.9). ``collect_facts("interfaces", ctx)`` runs the interfaces check's collect, as
the agent would, under the caller's deadline and without the run's per-host params; iperf3 lists a host's
interfaces this way when the interfaces check was not selected, without importing that check. The registry has
already checked that the caller names it in ``SPEC.reads``.
"""
from __future__ import annotations

from typing import Any, Dict

from .seams import HostContext


def collect_facts(name: str, ctx: HostContext) -> Dict[str, Any]:
    """The facts of the registered host check ``name`` on this host (its collect, run here)."""
    from .. import checks as registry  # at call time: the checks import this package, not the other way round

    spec = registry.spec(name)
    if spec.collect is None:
        raise ValueError(f"check {name!r} has no host-side collect (scope {spec.scope!r})")
    return spec.collect(HostContext(params={}, deadline=ctx.deadline))
