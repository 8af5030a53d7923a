"""Verdicts on ZeRO offload: the device and stage combinations, and each nvme_path on every host.

E.g. ``"offload_param": {"device": "cpu"}`` at stage 2 -> WARN (parameter offload is ZeRO-3 only); an
``nvme_path`` the hosts' facts (``host.paths``, or the nvme check) show missing or read-only -> FAIL naming the host.
"""
from __future__ import annotations

import os
import shlex
from typing import Any, Dict, List

from ...hostside.outcome import Status
from .parse import nvme_paths, offload_device, offload_devices, zero_section, zero_stage
from .findings import Report, hosts_text


def _norm(p: Any) -> str:
    return os.path.normpath(str(p)) if p not in (None, "") else ""


def check_nvme(config: Dict[str, Any], facts: Dict[str, Any], report: Report) -> None:
    zero = zero_section(config)
    for sec in ("offload_param", "offload_optimizer"):
        s = zero.get(sec)
        if isinstance(s, dict) and offload_device(s) == "nvme" and s.get("nvme_path") in (None, ""):
            report.add(Status.FAIL, f"zero_optimization.{sec}.device is nvme but nvme_path is not set (expected the "
                                    "directory to swap to)",
                       f'set zero_optimization.{sec}.nvme_path, e.g. "/local_nvme"')
    for path in nvme_paths(config):
        bad: Dict[str, str] = {}
        untested: List[str] = []
        for h in facts.get("hosts") or []:
            name = h["name"]
            nv = ((facts.get("host_facts") or {}).get(name) or {}).get("nvme") or {}
            probed = (facts.get("host_probe") or {}).get(name) or {}
            # the nvme check's entry when it ran for this path, else ds_config's own probe of the host
            entry = next((e for e in list(nv.get("paths") or []) + list(probed.get("paths") or [])
                          if isinstance(e, dict) and _norm(e.get("path")) == _norm(path)), None)
            if entry is None:
                untested.append(name)
                continue
            err = entry.get("error")
            detail = f" ({err})" if err else ""
            if not entry.get("exists"):
                bad[name] = f"nvme_path {path} does not exist on {name}{detail}"
            elif not entry.get("is_dir"):
                bad[name] = f"nvme_path {path} is not a directory on {name}{detail}"
            elif not entry.get("writable"):
                bad[name] = f"nvme_path {path} is not writable on {name}{detail}"
        if bad:
            listed = "; ".join(bad[h] for h in sorted(bad)[:3])
            # Quoted: the path comes from the user's config and may hold spaces or shell characters.
            quoted = shlex.quote(path)
            report.add(Status.FAIL, f"NVMe offload path {path} is unusable on {hosts_text(sorted(bad))}: {listed}",
                       f"create it on every host (on the NVMe mount), as root: mkdir -p -- {quoted} && "
                       f"chown -- \"$USER\" {quoted}", bad)
        if untested:
            why = ((facts.get("host_probe") or {}).get(untested[0]) or {}).get("error") or "not probed"
            report.add(Status.SKIP, f"NVMe offload path {path} not tested on {hosts_text(untested)} (no nvme check "
                                    f"result for it; host probe: {why})")


def check_offload_stage(config: Dict[str, Any], report: Report) -> None:
    stage = zero_stage(config)
    if stage is None:
        return
    zero = zero_section(config)
    opt_dev, par_dev = offload_devices(config)
    for dev, name in ((opt_dev, "offload_optimizer"), (par_dev, "offload_param")):
        if dev not in ("none", "cpu", "nvme"):
            device = (zero.get(name) or {}).get("device")
            report.add(Status.FAIL, f"zero_optimization.{name}.device = {device!r} (expected none, cpu or nvme)",
                       'set device to "cpu" or "nvme"')
    if par_dev in ("cpu", "nvme") and stage != 3:
        report.add(Status.WARN, f"zero_optimization.offload_param (device {par_dev}) has no effect at ZeRO stage "
                                f"{stage} (parameter offload is ZeRO-3 only)",
                   "use stage 3 for parameter offload, or remove offload_param")
    if opt_dev in ("cpu", "nvme") and stage == 0:
        report.add(Status.WARN, f"zero_optimization.offload_optimizer (device {opt_dev}) at ZeRO stage 0: optimizer "
                                "offload needs ZeRO stage 1, 2 or 3",
                   "set zero_optimization.stage to 1, 2 or 3, or remove offload_optimizer")
    if stage > 3 or stage < 0:
        report.add(Status.FAIL, f"zero_optimization.stage = {stage} (expected 0, 1, 2 or 3; DeepSpeed: 'Maximum "
                                "supported ZeRO stage is 3')", "set zero_optimization.stage to 0-3")
