"""Fix commands that work where they are pasted: pip run by the job's own interpreter, and firewall rules for the
tool the host really runs, in the chain that really drops. Host-reported values are validated, then shlex-quoted.

``pip_install("/opt/venv/bin/python", "torch")`` -> ``/opt/venv/bin/python -m pip install torch`` (a bare ``pip``
is whatever is first on the host's PATH, often another interpreter's). ``read_firewall`` runs on the host and reads,
for example, ``firewall-cmd --state`` -> ``running``, ``ufw status`` -> ``Status: active``, and ``nft -j list
ruleset``::

    {"nftables": [{"metainfo": {...}}, {"table": {"family": "inet", "name": "site_fw", "handle": 1}},
     {"chain": {"family": "inet", "table": "site_fw", "name": "inbound", "hook": "input", "policy": "accept", ...}},
     {"rule": {"family": "inet", "table": "site_fw", "chain": "inbound", "expr": [{"match": ...}, {"drop": null}]}}]}

``firewall_fix`` turns that state into the lines to paste: ``nft insert rule inet site_fw inbound ip saddr
198.18.0.0/24 tcp dport 1024-65535 accept`` (an accept in a base chain of another table would not override the drop:
every base chain on the input hook sees the packet, and a drop in any of them ends it), ``iptables -I INPUT ...``,
``ufw allow ...`` or ``firewall-cmd --add-port=...``.

Standard library only, Python 3.9: the reader runs on the hosts, the formatters in the checks' evaluate.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import validate

# --- pip ------------------------------------------------------------------------------------------------------

# torch's local version tags that name a wheel index at download.pytorch.org/whl/<tag> (cu121, cpu, rocm6.1).
_TORCH_TAG = re.compile(r"\+((?:cu|rocm)[0-9][0-9.]*|cpu)$")


def python_word(executable: Any) -> Optional[str]:
    """The job's interpreter as the host reported it (sys.executable), as one shell word; None when it is not an
    absolute path a command can name (empty, relative, control characters)."""
    return shlex.quote(executable) if validate.path(executable) else None


def pip_install(executable: Any, *words: str) -> str:
    """``<python> -m pip install WORDS`` for the interpreter that failed; each word one shell word (a version a
    host reported is data). Prose when the host reported no usable path: a command would name the wrong pip."""
    args = " ".join(shlex.quote(str(w)) for w in words)
    python = python_word(executable)
    if python is None:
        return (f"install {args} with the pip of the job's interpreter (run `-m pip install {args}` by that "
                f"interpreter; the path the host reported, {validate.quote(executable)}, is not one to paste)")
    return f"{python} -m pip install {args}"


def pip_fix(prose: str, executable: Any, *words: str) -> str:
    """prose, then the pip command on a line of its own (``"prose:\\n  <python> -m pip install WORDS"``); when the
    host reported no usable path, all prose (nothing on a command line that would not run)."""
    if python_word(executable) is None:
        return f"{prose}: {pip_install(executable, *words)}"
    return f"{prose}:\n  {pip_install(executable, *words)}"


def pip_phrase(executable: Any, *words: str) -> str:
    """The pip command inside a sentence: the command when the path can be named, else words saying whose pip."""
    if python_word(executable) is None:
        return f"the job's interpreter's `-m pip install {' '.join(shlex.quote(str(w)) for w in words)}`"
    return pip_install(executable, *words)


def torch_index(version: Any) -> Optional[str]:
    """The wheel index of a torch build: '2.4.0+cu121' -> 'https://download.pytorch.org/whl/cu121'; None for a
    version without a local tag (PyPI's own build)."""
    m = _TORCH_TAG.search(str(version or ""))
    return f"https://download.pytorch.org/whl/{m.group(1)}" if m else None


def pip_install_torch(executable: Any, version: Any, *options: str) -> str:
    """Install exactly this torch build (``torch==2.4.0+cu121`` from its index) with the job's interpreter."""
    index = torch_index(version)
    return pip_install(executable, *options, f"torch=={version}", *(("--index-url", index) if index else ()))


# A version as pip takes it after ``==`` (PEP 440 public part, optional local tag): 0.19.8, 0.15.0rc1,
# 0.14.0+cu121. A host reports it, so anything else is left out of the command (unpinned).
_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc|\.post|\.dev)[0-9]+)*(?:\+[A-Za-z0-9]+(?:\.[A-Za-z0-9]+)*)?")
# Why each option: DeepSpeed is installed whenever a pre-build is suggested, so a plain install answers "Requirement
# already satisfied" and builds nothing; --force-reinstall builds it again, --no-cache-dir stops pip reusing the
# wheel it cached when it built the sdist without the ops, --no-deps leaves torch and the rest as they are.
PREBUILD_OPTIONS = ("--force-reinstall", "--no-deps", "--no-cache-dir")


def _prebuild_parts(build_vars: Sequence[str], version: Any) -> Tuple[str, str]:
    env = " ".join(f"{v}=1" for v in dict.fromkeys(build_vars) if validate.env_key(v)) or "DS_BUILD_OPS=1"
    text = str(version or "").strip()
    return env, (f"deepspeed=={text}" if _VERSION.fullmatch(text) else "deepspeed")


def prebuild_install(executable: Any, build_vars: Sequence[str], version: Any = None) -> str:
    """``DS_BUILD_OPS=1 <python> -m pip install --force-reinstall --no-deps --no-cache-dir deepspeed==0.19.8``:
    rebuild the installed DeepSpeed (``version``, the host's, when known and valid; unpinned otherwise) with the
    ops named by build_vars (DS_BUILD_OPS, DS_BUILD_CPU_ADAM, ...) compiled in."""
    env, spec = _prebuild_parts(build_vars, version)
    return f"{env} {pip_install(executable, *PREBUILD_OPTIONS, spec)}"


def prebuild_phrase(executable: Any, build_vars: Sequence[str], version: Any = None) -> str:
    """prebuild_install inside a sentence: words saying whose pip when the host reported no usable path."""
    env, spec = _prebuild_parts(build_vars, version)
    return f"{env} {pip_phrase(executable, *PREBUILD_OPTIONS, spec)}"


# --- firewalls: reading the host ------------------------------------------------------------------------------

# nft/iptables names a fix may print bare: what nft accepts unquoted; anything else is left out of commands.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
VERDICTS = ("drop", "reject")
# The agent's name of ``firewall`` below: cluster.call(host, FIREWALL_CALL, {"addresses": [...]}, timeout).
FIREWALL_CALL = "hostside.fixes.firewall"


def _search() -> str:
    # An SSH session's PATH often lacks the sbin directories where nft, iptables and ufw live.
    return os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])


def _run(argv: List[str], timeout: float = 5.0) -> Dict[str, Any]:
    from .proc import sh
    tool = shutil.which(argv[0], path=_search())
    if tool is None:
        return {"rc": 127, "out": "", "err": f"{argv[0]}: not installed"}
    res = sh([tool] + argv[1:], timeout=timeout)
    # What it said on failure: stderr, or stdout where a tool prints its error there.
    said = (res.err or "").strip() or ((res.out or "").strip() if res.rc else "")
    return {"rc": res.rc, "out": res.out[:1 << 20], "err": said[:300]}


def _run_root(argv: List[str], root: bool) -> Dict[str, Any]:
    """argv, and again through `sudo -n` (never a password prompt) when it failed for a non-root agent: nft, ufw
    and iptables read the ruleset only as root."""
    res = _run(argv)
    if res["rc"] not in (0, 127) and not root:
        again = _run(["sudo", "-n"] + argv)
        if again["rc"] == 0:
            return again
    return res


def read_firewall(addresses: Sequence[str] = ()) -> Dict[str, Any]:
    """What manages this host's inbound filtering, read the way each tool reports it: {"firewalld": {"running",
    "zone"}, "ufw": {"active"}, "nft": {"ruleset": parsed JSON or None, "error"}, "iptables": {"rules": `iptables
    -S INPUT`, "backend": "nf_tables" | "legacy", "error"}, "root": bool}. addresses: this host's addresses the
    blocked probes went to (firewalld's zone is the zone of the interface holding one)."""
    root = os.geteuid() == 0
    state: Dict[str, Any] = {"root": root}
    fw = _run(["firewall-cmd", "--state"])
    running = fw["rc"] == 0 and fw["out"].strip() == "running"
    state["firewalld"] = {"running": running, "error": None if fw["rc"] in (0, 127, 252) else fw["err"]}
    if running:
        state["firewalld"]["zone"] = _firewalld_zone(addresses)
    ufw = _run_root(["ufw", "status"], root)
    state["ufw"] = {"active": ufw["rc"] == 0 and "Status: active" in ufw["out"],
                    "error": None if ufw["rc"] in (0, 127) else ufw["err"] or ufw["out"].strip()[:300]}
    nft = _run_root(["nft", "-j", "list", "ruleset"], root)
    ruleset = None
    if nft["rc"] == 0:
        try:
            ruleset = json.loads(nft["out"] or "{}")
        except ValueError:
            nft["err"] = "nft -j printed no JSON"
    # Only the chains that matter go back (a ruleset can be megabytes): those on the input hook that can drop.
    state["nft"] = {"read": ruleset is not None, "installed": nft["rc"] != 127,
                    "error": None if ruleset is not None else nft["err"] or f"rc={nft['rc']}",
                    "drops": dropping_input_chains(ruleset), "drops6": dropping_input_chains(ruleset, v6=True)}
    version = _run(["iptables", "--version"])
    if version["rc"] == 0:
        backend = "nf_tables" if "nf_tables" in version["out"] else "legacy"
        rules = _run_root(["iptables", "-S", "INPUT"], root)
        state["iptables"] = {"backend": backend, "rules": rules["out"] if rules["rc"] == 0 else None,
                             "error": None if rules["rc"] == 0 else rules["err"] or f"rc={rules['rc']}"}
    return state


def firewall(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """Host function (``hostside.fixes.firewall``, any check may call it through the agent): ``read_firewall`` for
    the addresses in params, the host's own addresses that the blocked connections went to."""
    return read_firewall([str(a) for a in params.get("addresses") or [] if validate.ip_address(a)])


def _firewalld_zone(addresses: Sequence[str]) -> Optional[str]:
    """The zone of the interface holding one of addresses, else the default zone."""
    from .proc import sh
    ip = shutil.which("ip", path=_search())
    wanted = {str(a) for a in addresses}
    if ip and wanted:
        res = sh([ip, "-o", "addr", "show"], timeout=5)
        for line in res.out.splitlines():
            f = line.split()
            if len(f) >= 4 and f[3].split("/")[0] in wanted and validate.ifname(f[1]):
                zone = _run(["firewall-cmd", f"--get-zone-of-interface={f[1]}"])
                if zone["rc"] == 0 and zone["out"].strip():
                    return zone["out"].strip()
    zone = _run(["firewall-cmd", "--get-default-zone"])
    return zone["out"].strip() or None if zone["rc"] == 0 else None


# --- firewalls: the fix ---------------------------------------------------------------------------------------

def _has_verdict(node: Any) -> bool:
    """A drop or reject anywhere in an nft JSON expression."""
    if isinstance(node, dict):
        return any(k in VERDICTS or _has_verdict(v) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_verdict(v) for v in node)
    return False


def _is_compat(node: Any) -> bool:
    """An iptables-nft rule (an "xt" expression): iptables manages that chain."""
    if isinstance(node, dict):
        return "xt" in node or any(_is_compat(v) for v in node.values())
    if isinstance(node, list):
        return any(_is_compat(v) for v in node)
    return False


def dropping_input_chains(ruleset: Any, v6: bool = False) -> List[Dict[str, Any]]:
    """The base chains on the input hook that can drop this traffic: policy drop, or a drop/reject in their table
    (their own rules, or a chain they jump to). [{"family", "table", "chain", "compat": iptables-nft's}], families
    ip/inet (ip6/inet for IPv6 sources)."""
    items = ruleset.get("nftables") if isinstance(ruleset, dict) else None
    if not isinstance(items, list):
        return []
    families = ("ip6", "inet") if v6 else ("ip", "inet")
    tables: Dict[tuple, Dict[str, Any]] = {}
    chains: List[Dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        chain, rule = item.get("chain"), item.get("rule")
        if isinstance(chain, dict) and chain.get("hook") == "input" and chain.get("family") in families:
            chains.append(chain)
        if isinstance(rule, dict):
            t = tables.setdefault((rule.get("family"), rule.get("table")), {"drops": False, "compat": False})
            t["drops"] = t["drops"] or _has_verdict(rule.get("expr"))
            t["compat"] = t["compat"] or _is_compat(rule.get("expr"))
    out = []
    for c in chains:
        t = tables.get((c.get("family"), c.get("table")), {"drops": False, "compat": False})
        if c.get("policy") == "drop" or t["drops"]:
            out.append({"family": c.get("family"), "table": c.get("table"), "chain": c.get("name"),
                        "priority": c.get("prio"), "compat": t["compat"]})
    return out


def _iptables_drops(rules: Optional[str]) -> bool:
    """`iptables -S INPUT` drops: '-P INPUT DROP', or a rule jumping to DROP/REJECT (or any chain: it may drop)."""
    for line in (rules or "").splitlines():
        words = line.split()
        if words[:3] == ["-P", "INPUT", "DROP"]:
            return True
        if words[:1] == ["-A"] and "-j" in words and words.index("-j") + 1 < len(words):
            if words[words.index("-j") + 1] not in ("ACCEPT", "RETURN", "LOG"):
                return True
    return False


def _sources(sources: Sequence[Any]) -> List[str]:
    """The cluster's addresses or subnets that may go into a command: literal networks only."""
    out = []
    for s in sources:
        try:
            out.append(str(ipaddress.ip_network(str(s), strict=False)) if "/" in str(s) else
                       str(ipaddress.ip_address(str(s))))
        except ValueError:
            continue
    return out


def _nft_fix(where: str, nft: Dict[str, Any], ipt: Dict[str, Any], srcs: List[str], ports: str, ipt_line: str,
             sudo: str) -> str:
    """firewall_fix under nftables: an accept rule in each input chain that drops the traffic (iptables' own line
    for iptables-nft's INPUT chain and for iptables-legacy's rules), or where else the block is."""
    v6 = all(":" in s for s in srcs)
    family_word = "ip6" if v6 else "ip"
    nft_src = srcs[0] if len(srcs) == 1 else "{ " + ", ".join(srcs) + " }"
    lines: List[str] = []
    drops = (dropping_input_chains(nft["ruleset"], v6) if nft.get("ruleset") is not None else
             [c for c in nft.get("drops6" if v6 else "drops") or [] if isinstance(c, dict)])
    odd = [c for c in drops if not all(_NAME.fullmatch(str(c.get(k) or "")) for k in ("table", "chain"))
           or c.get("family") not in ("ip", "ip6", "inet")]
    for c in drops:
        if c in odd:
            continue
        if c.get("compat") and c["table"] == "filter" and c["chain"] == "INPUT":
            if ipt_line not in lines:
                lines.append(ipt_line)  # iptables-nft's own chain: iptables edits it
            continue
        lines.append(f"{sudo}nft insert rule {c['family']} {c['table']} {c['chain']} {family_word} saddr "
                     f"{nft_src} tcp dport {ports} accept")
    if ipt.get("backend") == "legacy" and _iptables_drops(ipt.get("rules")) and ipt_line not in lines:
        lines.append(ipt_line)  # iptables-legacy's rules are not in nft's ruleset
    if odd:
        shown = ", ".join(f"{validate.quote(c.get('table'))} {validate.quote(c.get('chain'))}" for c in odd)
        lines.append(f"# and in {shown} (names not safe to paste): insert the same accept rule there")
    if lines:
        chains = len([x for x in lines if " nft insert " in " " + x])
        head = (f"{where} allow TCP {ports} from the cluster in every input chain that drops it "
                f"({'each base chain decides on its own: ' if chains > 1 else ''}a rule must go in the "
                "chain that drops, before its drop):")
        return head + "\n" + "\n".join("  " + x for x in lines)
    return (f"{where} no input chain of the nftables ruleset drops this traffic (nft list ruleset): the block is "
            "outside the host (a security group, a switch ACL) or in iptables-legacy (iptables-legacy -S INPUT)")

def firewall_fix(host: str, state: Optional[Dict[str, Any]], sources: Sequence[Any], ports: str) -> str:
    """The lines that let ``sources`` reach TCP ``ports`` ('1024-65535' or '29500') on host, for the firewall the
    host runs (``read_firewall``'s state): prose first, then one command per line, indented by two spaces."""
    lo, _, hi = ports.partition("-")
    hi = hi or lo
    srcs = _sources(sources)
    sudo = "" if not state or state.get("root", True) else "sudo "
    where = f"on {host}"
    if not srcs:
        return f"{where} allow inbound TCP {ports} from the other hosts of the cluster (firewall)"
    v6 = all(":" in s for s in srcs)
    fwd = (state or {}).get("firewalld") or {}
    if fwd.get("running"):
        zone = fwd.get("zone")
        named = isinstance(zone, str) and _NAME.fullmatch(zone) is not None
        zone_opt = f" --zone={zone}" if named else ""
        zone = zone if named else "(default)" if not zone else validate.quote(zone)
        span = lo if lo == hi else f"{lo}-{hi}"
        lines = [f"{sudo}firewall-cmd{zone_opt} --add-port={span}/tcp",
                 f"{sudo}firewall-cmd{zone_opt} --permanent --add-port={span}/tcp"]
        return (f"{where} firewalld manages the firewall: open TCP {ports} in its zone {zone} "
                "(now, and --permanent for the next reload or boot):\n" + "\n".join("  " + x for x in lines))
    if ((state or {}).get("ufw") or {}).get("active"):
        span = lo if lo == hi else f"{lo}:{hi}"
        lines = [f"{sudo}ufw allow from {s} proto tcp to any port {span}" for s in srcs]
        return f"{where} ufw manages the firewall: allow TCP {ports} from the cluster:\n" + \
            "\n".join("  " + x for x in lines)
    nft = (state or {}).get("nft") or {}
    ipt = (state or {}).get("iptables") or {}
    ipt_span = lo if lo == hi else f"{lo}:{hi}"
    ipt_cmd = ("ip6tables" if v6 else "iptables")
    ipt_line = f"{sudo}{ipt_cmd} -I INPUT -p tcp -s {','.join(srcs)} --dport {ipt_span} -j ACCEPT"
    if nft.get("read") or nft.get("ruleset") is not None:
        return _nft_fix(where, nft, ipt, srcs, ports, ipt_line, sudo)
    if ipt.get("rules") is not None:
        if _iptables_drops(ipt["rules"]):
            return f"{where} allow TCP {ports} from the cluster in iptables' INPUT chain:\n  {ipt_line}"
        return (f"{where} iptables' INPUT chain does not drop this traffic (iptables -S INPUT): the block is outside "
                "the host (a security group, a switch ACL)")
    said = nft.get("error") or ipt.get("error") or (state or {}).get("error")
    why = (f"its ruleset could not be read: {validate.quote(said, 120)}" if said else
           "preflight did not read its ruleset")
    return (f"{where} allow TCP {ports} from the cluster in the firewall ({why}); as root, `nft -a list ruleset` "
            "shows the chain that drops it, then, with "
            "the tool that manages the firewall, one of:\n"
            f"  {sudo}iptables -I INPUT -p tcp -s {','.join(srcs)} --dport {ipt_span} -j ACCEPT\n"
            + "".join(f"  {sudo}ufw allow from {s} proto tcp to any port {ipt_span}\n" for s in srcs)
            + f"  {sudo}firewall-cmd --add-port={lo if lo == hi else f'{lo}-{hi}'}/tcp")
