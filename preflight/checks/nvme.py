"""NVMe offload path: exists, is a writable directory, filesystem and free space, dd sequential write/read throughput.

Parses the last stderr line of GNU dd (LC_ALL=C), e.g.::

    2048+0 records in
    2048+0 records out
    2147483648 bytes (2.1 GB, 2.0 GiB) copied, 1.43745 s, 1.5 GB/s

and /proc/mounts lines (``/dev/nvme0n1p1 /local_nvme xfs rw,noatime 0 0``) for the filesystem type.

Thresholds: [nvme] in nvme.toml beside this module.
"""
from __future__ import annotations

import errno
import os
import shlex
import re
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..hostside.outcome import Finding, Outcome, Status, combine, limits, skip
from ..hostside.seams import CheckOptions, CheckSpec, HostContext, Option, PromSample
from ..hostside.proc import read_text, sh
from ..hostside import tempfiles

NAME = "nvme"

MiB = 1024 * 1024
# What collect needs besides nvme_paths: the coordinator derives them from [nvme] (nvme.toml, the one source of the
# numbers) with params_from_thresholds() and sends them to every host.
HOST_PARAMS = ("nvme_test_bytes", "nvme_max_free_fraction", "nvme_min_test_bytes")
DD_TIMEOUT_CAP_S = 120.0
TEST_PREFIX = ".preflight-dd-"

NO_PATH_REASON = "no --nvme-path given and no nvme offload in the DeepSpeed config"


# --- pure parsers ----------------------------------------------------------------------------

_DD_RE = re.compile(r"^(\d+) bytes?\b.*copied,\s*([0-9]+(?:[.,][0-9]+)?(?:e-?\d+)?)\s*(?:s|seconds?)\b,?\s*(.*)$")


def parse_dd(stderr: str) -> Optional[Dict[str, Any]]:
    """The transfer line of dd's stderr: {"bytes", "seconds", "Bps" (computed, None when 0 s), "rate_text"}."""
    for line in reversed((stderr or "").splitlines()):
        m = _DD_RE.match(line.strip())
        if m:
            nbytes = int(m.group(1))
            seconds = float(m.group(2).replace(",", "."))
            return {"bytes": nbytes, "seconds": seconds, "Bps": (nbytes / seconds) if seconds > 0 else None,
                    "rate_text": m.group(3).strip()}
    return None


def dd_error_line(stderr: str) -> str:
    """The first ``dd: ...`` complaint (e.g. "dd: failed to open 'X': Invalid argument"), else the last line."""
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("dd:"):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def parse_mounts(text: str) -> List[Dict[str, str]]:
    """/proc/mounts as [{"device", "mountpoint", "fstype", "options"}] in file order (octal escapes decoded)."""
    out = []
    for line in (text or "").splitlines():
        f = line.split()
        if len(f) >= 4:
            out.append({"device": _unescape(f[0]), "mountpoint": _unescape(f[1]), "fstype": f[2],
                        "options": f[3]})
    return out


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_for(path: str, mounts: List[Dict[str, str]]) -> Optional[Dict[str, str]]:
    """The mount holding path: longest mount point that is path or a parent of it; the later one wins on ties."""
    best = None
    for m in mounts:
        mp = m["mountpoint"].rstrip("/") or "/"
        if path == mp or mp == "/" or path.startswith(mp + "/"):
            if best is None or len(mp) >= len(best["mountpoint"].rstrip("/") or "/"):
                best = m
    return best


def params_from_thresholds(thresholds: Dict[str, Any]) -> Dict[str, Any]:
    """Host params the coordinator should send with nvme_paths, from the [nvme] section."""
    t = limits(thresholds, NAME)
    return {"nvme_test_bytes": int(t["test_mib"]) * MiB, "nvme_max_free_fraction": float(t["max_free_fraction"]),
            "nvme_min_test_bytes": int(t["min_test_mib"]) * MiB}


# --- host side -------------------------------------------------------------------------------

def _remove(path: str) -> None:
    # sh() has already killed an interrupted dd (its finally stops the process group); dd runs with
    # conv=nocreat, so it cannot re-create the file after this. Nor can anything else: the agent may have removed
    # it first (its lifeline closed), and removes it if this worker is killed before it gets here.
    tempfiles.remove(path)


def _dd(argv: List[str], ctx: HostContext, cap: float) -> Tuple[Any, float]:
    timeout = ctx.remaining(cap)
    return sh(argv, timeout=timeout), timeout


def _measure(entry: Dict[str, Any], test_file: str, count: int, ctx: HostContext, cap: float) -> None:
    """Write then read test_file with dd; fills write_Bps/read_Bps/direct/error in entry."""
    base_w = ["dd", "if=/dev/zero", "of=" + test_file, "bs=1M", f"count={count}"]
    direct = entry["direct_error"] is None
    if direct:
        res, timeout = _dd(base_w + ["oflag=direct,nofollow", "conv=fdatasync,nocreat"], ctx, cap)
        if not res.ok and res.rc != 124 and "Invalid argument" in res.err:
            entry["direct_error"] = dd_error_line(res.err)
            direct = False
    if not direct:
        res, timeout = _dd(base_w + ["oflag=nofollow", "conv=fdatasync,nocreat"], ctx, cap)
    entry["direct"] = direct
    entry["timeout_s"] = timeout
    if res.rc == 124:
        entry["timed_out"] = "write"
        entry["error"] = f"dd write of {count} MiB timed out after {timeout:.1f} s"
        return
    parsed = parse_dd(res.err)
    if not res.ok or parsed is None:
        entry["error"] = f"dd write failed (rc {res.rc}): {dd_error_line(res.err)}"
        return
    if parsed["bytes"] < count * MiB:
        entry["error"] = f"dd wrote only {parsed['bytes']} of {count * MiB} bytes: {dd_error_line(res.err)}"
        return
    entry["write_Bps"] = parsed["Bps"]

    base_r = ["dd", "if=" + test_file, "of=/dev/null", "bs=1M"]
    res, timeout = _dd(base_r + (["iflag=direct,nofollow"] if direct else ["iflag=nofollow"]), ctx, cap)
    if direct and not res.ok and res.rc != 124 and "Invalid argument" in res.err:
        entry["direct_error"] = dd_error_line(res.err)
        entry["direct"] = False
        res, timeout = _dd(base_r + ["iflag=nofollow"], ctx, cap)
    if res.rc == 124:
        entry["timed_out"] = "read"
        entry["timeout_s"] = timeout
        entry["error"] = f"dd read of {count} MiB timed out after {timeout:.1f} s"
        return
    parsed = parse_dd(res.err)
    if not res.ok or parsed is None:
        entry["error"] = f"dd read failed (rc {res.rc}): {dd_error_line(res.err)}"
        return
    entry["read_Bps"] = parsed["Bps"]


def _check_path(path: str, mounts: List[Dict[str, str]], ctx: HostContext, want_bytes: int, fraction: float,
                min_bytes: int, cap: float) -> Dict[str, Any]:
    """One path's entry: what it is and where it is mounted, its free space, whether this user can create a file
    there (and open it with O_DIRECT), and its dd write and read rates, in that order: a step that rules the path
    out ends it."""
    entry: Dict[str, Any] = {"path": path, "exists": False, "is_dir": False, "writable": False, "fstype": None,
                             "free_bytes": None, "write_Bps": None, "read_Bps": None, "direct": False,
                             "test_bytes": 0, "error": None,
                             # additions beyond the shared schema
                             "kind": None, "realpath": None, "mountpoint": None, "device": None,
                             "direct_error": None, "measure_skipped": None, "timed_out": None, "timeout_s": None,
                             "uid": os.geteuid()}
    real = _locate_dir(path, mounts, entry)
    if real is None:
        return entry
    size_known = _read_free_space(real, entry)
    if not os.access(real, os.W_OK | os.X_OK):
        entry["error"] = f"not writable (access(W_OK) denied for uid {os.geteuid()})"
        return entry
    _test_write_read(entry, real, size_known, ctx, want_bytes, fraction, min_bytes, cap)
    return entry


def _locate_dir(path: str, mounts: List[Dict[str, str]], entry: Dict[str, Any]) -> Optional[str]:
    """The real path of `path` when it is a directory, with its kind and mount noted in `entry`; None (and why in
    entry["error"]) when it does not exist, cannot be read, or is not a directory (a block device's mounts listed)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        entry["error"] = "does not exist"
        return None
    except OSError as exc:
        entry["error"] = f"cannot stat: {exc.strerror}"
        return None
    entry["exists"] = True
    if stat.S_ISBLK(st.st_mode):
        entry["kind"] = "block device"
    elif stat.S_ISDIR(st.st_mode):
        entry["kind"] = "directory"
    elif stat.S_ISREG(st.st_mode):
        entry["kind"] = "file"
    else:
        entry["kind"] = "other"
    real = os.path.realpath(path)
    entry["realpath"] = real
    m = mount_for(real, mounts)
    if m:
        entry["fstype"], entry["mountpoint"], entry["device"] = m["fstype"], m["mountpoint"], m["device"]
    if not stat.S_ISDIR(st.st_mode):
        entry["error"] = f"is a {entry['kind']}, not a directory"
        if stat.S_ISBLK(st.st_mode):
            entry["device_mounts"] = [x["mountpoint"] for x in mounts
                                      if x["device"].startswith("/") and os.path.realpath(x["device"]) == real]
        return None
    entry["is_dir"] = True
    return real


def _read_free_space(real: str, entry: Dict[str, Any]) -> bool:
    """Note the directory's free bytes in `entry`; False when they are unknown: its filesystem reports no size, or
    statvfs fails (noted in entry["error"])."""
    size_known = False
    try:
        sv = os.statvfs(real)
        size_known = sv.f_blocks > 0  # ramfs and some pseudo filesystems report no size at all
        entry["free_bytes"] = sv.f_bavail * sv.f_frsize if size_known else None
    except OSError as exc:
        entry["error"] = f"statvfs failed: {exc.strerror}"
    return size_known


def _test_write_read(entry: Dict[str, Any], real: str, size_known: bool, ctx: HostContext, want_bytes: int,
                     fraction: float, min_bytes: int, cap: float) -> None:
    """Create a test file in the directory, open it with O_DIRECT, and (where the free space allows a test of at
    least `min_bytes`) measure dd's write and read rates on it; the file is removed however this ends."""
    marker = TEST_PREFIX + os.urandom(8).hex()  # not secrets: its hashlib import cost every host ~9 ms of CPU
    test_file = os.path.join(real, marker)
    tempfiles.register(test_file)  # before it exists: removed however this request ends (kill -9 of the coordinator)
    try:
        try:
            fd = os.open(test_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            os.close(fd)
        except OSError as exc:
            why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
            entry["error"] = f"cannot create a file: {why}"
            return
        entry["writable"] = True
        o_direct = getattr(os, "O_DIRECT", 0)
        if o_direct:  # DeepSpeed opens its swap files with O_DIRECT: test that on its own, before any dd
            try:
                os.close(os.open(test_file, os.O_WRONLY | o_direct))
            except OSError as exc:
                entry["direct_error"] = f"open(O_DIRECT): {exc.strerror}"
        if not size_known:
            entry["measure_skipped"] = ("the filesystem reports no size (statvfs f_blocks = 0), so free space is "
                                        "unknown and no test file is written")
            return
        free = entry["free_bytes"] or 0
        budget = min(want_bytes, int(free * fraction))
        count = budget // MiB
        if count == 0 or (budget < want_bytes and budget < min_bytes):
            entry["measure_skipped"] = (f"{free // MiB} MiB free; {fraction * 100:.0f}% of it is {budget // MiB} MiB, "
                                        f"below the {min_bytes // MiB} MiB minimum test size")
            return
        entry["test_bytes"] = count * MiB
        _measure(entry, test_file, count, ctx, cap)
    finally:
        _remove(test_file)


def collect(ctx: HostContext) -> Dict[str, Any]:
    params = ctx.params or {}
    paths = [str(p) for p in (params.get("nvme_paths") or [])]
    if not paths:
        return {"paths": []}
    missing = [k for k in HOST_PARAMS if k not in params]
    if missing:  # a coordinator bug, not a host fault: no silent second copy of the [nvme] numbers here
        raise ValueError(f"nvme collect needs params {', '.join(missing)} (the coordinator sends "
                         "params_from_thresholds() of [nvme])")
    want = int(params["nvme_test_bytes"])
    fraction = float(params["nvme_max_free_fraction"])
    min_bytes = int(params["nvme_min_test_bytes"])
    cap = float(params.get("nvme_dd_timeout_s", DD_TIMEOUT_CAP_S))
    mounts = parse_mounts(read_text("/proc/mounts") or "")
    out = []
    for p in paths:
        out.append(_check_path(p, mounts, ctx, want, fraction, min_bytes, cap))
    return {"paths": out}


# --- evaluation ------------------------------------------------------------------------------

def _gb(bps: Optional[float]) -> str:
    if bps is None:
        return "?"
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} GB/s"
    return f"{bps / 1e6:.0f} MB/s"


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


q = shlex.quote  # every path in a printed fix: a path like '/mnt/a b;touch /tmp/x' stays one word


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    t = limits(thresholds, NAME)
    min_w = float(t["min_write_gbps"]) * 1e9
    min_r = float(t["min_read_gbps"]) * 1e9
    require_direct = bool(t["require_direct_io"])
    entries = facts.get("paths") or []
    if not entries:
        return skip(NO_PATH_REASON)
    findings: List[Finding] = []
    oks = []
    for e in entries:
        found, ok = _path_findings(e, min_w, min_r, require_direct)
        findings.extend(found)
        if ok is not None:
            oks.append(ok)
    metrics = {"paths": [{k: e.get(k) for k in ("path", "fstype", "free_bytes", "write_Bps", "read_Bps", "direct",
                                                "test_bytes")} for e in entries]}
    return combine(findings, "; ".join(oks), metrics)


def _path_findings(e: Dict[str, Any], min_w: float, min_r: float,
                   require_direct: bool) -> Tuple[List[Finding], Optional[str]]:
    """(findings, its line of the PASS message) for one nvme path; no line when it could not be measured."""
    p = e["path"]
    mount = f" ({e['fstype']} on {e.get('mountpoint')})" if e.get("fstype") else ""
    where = f"{p}{mount}"
    unusable = _unusable_path(e, p, where)
    if unusable is not None:
        return [unusable], None
    findings: List[Finding] = []
    if e.get("direct_error"):
        st = Status.FAIL if require_direct else Status.WARN
        measured = (f"; measured buffered (not direct) instead: write {_gb(e.get('write_Bps'))}, "
                    f"read {_gb(e.get('read_Bps'))}") if e.get("write_Bps") else ""
        findings.append(Finding(st, f"nvme path {where} does not support O_DIRECT ({e['direct_error']}); "
                                    "DeepSpeed's async_io opens its swap files with O_DIRECT, so NVMe offload there "
                                    f"fails{measured}",
                                f"findmnt -T {q(p)}; set nvme_path / --nvme-path to a directory on a local NVMe "
                                "ext4/xfs mount"))
    if e.get("measure_skipped"):
        free = e.get("free_bytes")
        only = f"; only {_size(free)} free" if free is not None else ""
        findings.append(Finding(Status.WARN, f"nvme path {where}: throughput not measured: "
                                             f"{e['measure_skipped']}{only}",
                                f"df -h {q(p)}; du -xsh {q(p)}/* | sort -h | tail" if free is not None else
                                f"findmnt -T {q(p)}"))
        return findings, None
    if e.get("error"):
        findings.append(_measure_error(e, p, where, min_w, min_r))
        return findings, None
    tag = "" if e.get("direct") else " (buffered, not direct)"
    w, r = e.get("write_Bps"), e.get("read_Bps")
    for op, rate, minimum in (("write", w, min_w), ("read", r, min_r)):
        if rate is not None and rate < minimum:
            findings.append(Finding(Status.WARN, f"nvme path {where}: sequential {op} {_gb(rate)}{tag} < "
                                                 f"{_gb(minimum)} expected (local NVMe is typically > 3 GB/s; check "
                                                 "what backs the path and the device's health)",
                                    _slow_fix(p, e.get("device"))))
    mode = " (direct)" if e.get("direct") else tag
    return findings, (f"{where}: write {_gb(w)}, read {_gb(r)}{mode}, {_size(e.get('test_bytes'))} test, "
                      f"{_size(e.get('free_bytes'))} free")


def _unusable_path(e: Dict[str, Any], p: str, where: str) -> Optional[Finding]:
    """A FAIL when the path does not exist, is not a directory (a block device: how to mount it), or is not
    writable; None when DeepSpeed could use it."""
    if not e.get("exists"):
        return Finding(Status.FAIL, f"nvme path {p}: {e.get('error') or 'does not exist'} (expected an existing "
                                    "directory on the mounted NVMe filesystem)",
                       f"mkdir -p -- {q(p)} && findmnt -T {q(p)}")
    if not e.get("is_dir"):
        if e.get("kind") == "block device" and e.get("device_mounts"):
            mp = e["device_mounts"][0]
            offload = q(mp.rstrip("/") + "/offload")
            fix = (f"mkdir -p -- {offload}, then set nvme_path / --nvme-path to {offload} "
                   f"({q(p)} is mounted on {q(mp)})")
        elif e.get("kind") == "block device":
            fix = (f"mkdir -p /local_nvme && mount {q(p)} /local_nvme, then set nvme_path / --nvme-path to "
                   f"/local_nvme (the device needs a filesystem first; lsblk -f {q(p)} shows it)")
        else:
            fix = "set nvme_path / --nvme-path to a directory, e.g. mkdir -p /local_nvme/offload"
        return Finding(Status.FAIL, f"nvme path {p} is a {e.get('kind') or 'non-directory'}, not a directory "
                                    "(DeepSpeed writes its swap files into nvme_path)", fix)
    if not e.get("writable"):
        return Finding(Status.FAIL, f"nvme path {where} is not writable by uid {e.get('uid', '?')}: "
                                    f"{e.get('error') or '?'} (expected a directory the training user can create "
                                    "files in)",
                       f"mount -o remount,rw {q(str(e.get('mountpoint') or p))}"
                       if "Read-only" in (e.get("error") or "") else
                       f"chown $(id -u):$(id -g) {q(p)} && chmod u+rwx {q(p)}  # run as root, with the training "
                       "user's ids")
    return None


def _measure_error(e: Dict[str, Any], p: str, where: str, min_w: float, min_r: float) -> Finding:
    """The test did not complete: a timeout that bounds the throughput below the minimum is a WARN, an I/O error
    or a full disk a FAIL, anything else an ERROR."""
    if e.get("timed_out"):
        bound = (e.get("test_bytes") or 0) / float(e.get("timeout_s") or 1)
        op_min = min_w if e["timed_out"] == "write" else min_r
        if bound < op_min:
            return Finding(Status.WARN, f"nvme path {where}: {e['error']}, so {e['timed_out']} throughput is below "
                                        f"{_gb(bound)} (expected >= {_gb(op_min)})", _slow_fix(p, e.get("device")))
        return Finding(Status.ERROR, f"nvme path {where}: could not measure: {e['error']}",
                       "rerun with a longer --timeout or a smaller [nvme] test_mib")
    if "Input/output error" in e["error"] or "No space left" in e["error"]:
        return Finding(Status.FAIL, f"nvme path {where}: {e['error']}",
                       f"check the device: dmesg | tail -50; df -h {q(p)}")
    return Finding(Status.ERROR, f"nvme path {where}: could not measure: {e['error']}", _dd_fix(p))


_NVME_DEVICE = re.compile(r"^(/dev/nvme[0-9]+n[0-9]+)(?:p[0-9]+)?$")


def _slow_fix(p: str, device: Any = None) -> str:
    # What backs the path (network/HDD filesystem?), and is the NVMe throttling (thermal, wear)? smart-log only for
    # the NVMe namespace the path is on: a fixed /dev/nvme0n1 was the wrong disk for a path on /dev/vda.
    m = _NVME_DEVICE.match(device) if isinstance(device, str) else None
    health = f"; nvme smart-log {q(m.group(1))}" if m else ""
    return f"findmnt -T {q(p)}; lsblk -o NAME,ROTA,TRAN,MODEL{health}"


def _dd_fix(p: str) -> str:
    """The dd test to paste: mktemp makes a fresh file (O_EXCL, mode 0600) rather than a fixed name, which another
    user of a shared directory could plant as a symlink to a file root would then overwrite."""
    return (f"f=$(mktemp -p {q(p)} .preflight-ddtest.XXXXXX) && dd if=/dev/zero of=\"$f\" bs=1M count=256 "
            "oflag=direct,nofollow conv=fdatasync,notrunc; rm -f -- \"$f\"")


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: each measured path's dd rates (bytes per second), by host and path."""
    out: List[PromSample] = []
    for r in results:
        for e in (r.get("metrics") or {}).get("paths") or []:
            for key, what in (("write_Bps", "write"), ("read_Bps", "read")):
                if isinstance(e.get(key), (int, float)):
                    out.append(PromSample(f"preflight_nvme_{what}_bytes_per_second", f"dd {what} rate of the nvme "
                                          "path (O_DIRECT, unless the path refused it)", "gauge",
                                          {"host": r["host"], "path": str(e.get("path"))}, float(e[key])))
    return out


NVME_PATH = Option("--nvme-path", "directory to measure with dd on every host (repeatable); the test file is removed",
                   metavar="DIR", default=(), action="append", commands=("run", "node-check"))


def params_from_options(options: CheckOptions) -> Dict[str, Any]:
    """The --nvme-path directories, as every host's nvme_paths (a DeepSpeed config's nvme_path adds its own)."""
    paths = [str(p) for p in NVME_PATH.value(options)]
    return {"nvme_paths": paths} if paths else {}


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description=("NVMe offload path (--nvme-path / DeepSpeed nvme_path): writable dir, fs, free space, "
                 "dd write/read GB/s"),
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
    # Compared with the host's own past runs (preflight/history/): a disk that wears drops against itself.
    baseline={"paths[*].write_Bps": "higher", "paths[*].read_Bps": "higher"},
    host_params=params_from_thresholds,
    options=(NVME_PATH,),
    params_from_options=params_from_options,
    prom_metrics=prom_metrics,
)
