"""Validation of host-reported values before they flow into commands, files or the recommended environment.

Everything an agent sends back is data from an untrusted host. A value that is used to build a command, an
environment variable or a path must pass one of these predicates first, e.g.::

    ifname("eth0") -> True          ifname("$(touch${IFS}x)") -> False     ifname("a\\nLD_PRELOAD=x") -> False
    hca_name("mlx5_0") -> True      env_value("=eth0,ib0") -> True         env_value('a"b') -> False
    quote("a\\x1bb") -> "'a\\\\x1bb'"  (repr-style: control characters and quotes are escaped, length capped)

Standard library only, Python 3.9: used by checks on the coordinator and by preflight.recommend/report.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any, Iterable, List, Optional, Tuple

# Linux dev_valid_name() (net/core/dev.c): 1..IFNAMSIZ-1 = 15 bytes, not "." or "..", no '/', ':' or whitespace.
# preflight is stricter than the kernel, which allows almost any byte: only the characters real interface names use
# ([A-Za-z0-9_.:@-], with ':' for aliases like eth0:1 and '@' as `ip link` shows veth peers), never a leading '-'
# (it would become an option of a command).
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
# RDMA device names (mlx5_0, rocep1s0f0, irdma-eth0, bnxt_re0): the kernel's IB_DEVICE_NAME_MAX is 64 bytes.
_HCA = re.compile(r"[A-Za-z0-9_.:@-]{1,63}")
# Characters that a shell, or DeepSpeed's `export K="V"` (deepspeed/launcher/multinode_runner.py), would interpret,
# plus every control character: an environment value must hold none of them.
_ENV_BAD = re.compile(r'[$`"\\\x00-\x1f\x7f\'!;&|<>(){}*?\[\]~#\s]')
_ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")
# A path a fix or a command may name: absolute, printable, no '..' component, bounded.
_PATH_MAX = 4096
QUOTE_MAX = 80


def _plain(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def ifname(value: Any) -> bool:
    """A Linux network interface name by the rule above (host-reported, so checked before any use)."""
    text = _plain(value)
    return (text is not None and _IFNAME.fullmatch(text) is not None and not text.startswith("-")
            and text not in (".", "..") and len(text.encode()) <= 15)


def hca_name(value: Any) -> bool:
    """An RDMA device name (mlx5_0) as NCCL_IB_HCA takes it."""
    text = _plain(value)
    return text is not None and _HCA.fullmatch(text) is not None and not text.startswith("-")


def port_number(value: Any) -> bool:
    """An IB port number (1..255) or TCP port (0..65535): a real int, not a bool or a numeric string."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535


def ip_address(value: Any) -> bool:
    """An IPv4 or IPv6 address literal (no name, no brackets): what a bind or connect argument may be. An IPv6
    scope (fe80::1%eth0) must be an interface name: Python's parser takes any text after '%', newlines included."""
    if not isinstance(value, str):
        return False
    scope = value.partition("%")[2]
    if scope and not ifname(scope):
        return False
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


def path(value: Any) -> bool:
    """An absolute path without control characters, '..' components or a leading '-' component."""
    text = _plain(value)
    if text is None or not text.startswith("/") or len(text) > _PATH_MAX:
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return False
    return ".." not in text.split("/")


def env_key(value: Any) -> bool:
    text = _plain(value)
    return text is not None and _ENV_KEY.fullmatch(text) is not None


def env_value(value: Any) -> bool:
    """Safe inside `export K="V"`, inside K=V of a .deepspeed_env and after shlex: no quote, $, `, \\, space or
    control character (NCCL's values are names, numbers and the '=', '^', ',' of its list syntax)."""
    text = _plain(value)
    return text is not None and 0 < len(text) <= 1024 and _ENV_BAD.search(text) is None


def quote(value: Any, limit: int = QUOTE_MAX) -> str:
    """Show an untrusted value in a message: repr-style, so control characters, quotes and escapes are visible as
    text (never interpreted), and capped so a huge value cannot flood the report."""
    text = value if isinstance(value, str) else repr(value)
    shown = repr(text[:limit])
    return shown + (f"...({len(text)} chars)" if len(text) > limit else "")


def bad_interface_names(facts: Any) -> List[Tuple[str, Any]]:
    """(where, value) for every host-reported interface/HCA name in interfaces facts that breaks the rules."""
    bad: List[Tuple[str, Any]] = []
    if not isinstance(facts, dict):
        return bad
    for itf in _dicts(facts.get("interfaces")):
        if not ifname(itf.get("name")):
            bad.append(("interface name", itf.get("name")))
        master = itf.get("bridge_master")
        if master is not None and not ifname(master):
            bad.append((f"bridge master of {quote(itf.get('name'))}", master))
    for p in _dicts(facts.get("ib")):
        if not hca_name(p.get("device")):
            bad.append(("IB device name", p.get("device")))
        if p.get("port") is not None and not port_number(p.get("port")):
            bad.append(("IB port number", p.get("port")))
        for nd in p.get("netdevs") or [] if isinstance(p.get("netdevs"), list) else [p.get("netdevs")]:
            if not ifname(nd):
                bad.append(("IB netdev", nd))
    route = facts.get("route_to_master")
    if isinstance(route, dict) and route.get("dev") is not None and not ifname(route.get("dev")):
        bad.append(("route device", route.get("dev")))
    return bad


def _dicts(value: Any) -> Iterable[dict]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
