"""Whether DeepSpeed's async_io op can build here: libaio runtime vs dev files, loadability, test link.

Parses ``ldconfig -p`` lines and /etc/os-release, e.g.::

        libaio.so.1t64 (libc6,x86-64) => /lib/x86_64-linux-gnu/libaio.so.1t64
        libaio.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libaio.so
    ID=ubuntu
    ID_LIKE=debian

and the compiler's stderr (``/usr/bin/ld: cannot find -laio: No such file or directory``).

Thresholds: [libaio] in libaio.toml beside this module.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import sys
import sysconfig
import tempfile
from typing import Any, Dict, List, Optional, Set, Tuple

from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, HostContext
from ..hostside.proc import read_text, sh

NAME = "libaio"

# Where distributions install libaio (multiarch dirs are globbed below).
KNOWN_LIB_DIRS = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64"]
KNOWN_INCLUDE_DIRS = ["/usr/include", "/usr/local/include"]

# DeepSpeed's OpBuilder.has_function('io_submit', ('aio',)) compiles exactly this and links it with -laio.
LINK_PROBE_C = "void io_submit(void); int main(int argc, char** argv) { io_submit(); return 0; }\n"
# The op's sources include <libaio.h>; has_function does not check it, the real build does.
HEADER_PROBE_C = ("#include <libaio.h>\n"
                  "int preflight_probe(io_context_t ctx, struct iocb **cbs) { return io_submit(ctx, 1, cbs); }\n")
REPRODUCE = ("echo 'void io_submit(void); int main(void){io_submit();return 0;}' | ${CC:-cc} $CFLAGS -x c - $LDFLAGS"
             " -laio -o /dev/null && echo '#include <libaio.h>' | ${CC:-cc} $CFLAGS -x c -fsyntax-only -")

_RUNTIME_RE = re.compile(r"^libaio\.so\.\d")

# Loads libraries in a child interpreter: a corrupt file cannot crash the agent, and the call is bounded.
_LOADER = r"""
import ctypes, ctypes.util, json, sys
out = {"find_library": None, "soname_error": None, "loads": {}}
try:
    out["find_library"] = ctypes.util.find_library("aio")
except Exception as exc:
    out["find_library_error"] = str(exc)
if out["find_library"]:
    try:
        ctypes.CDLL(out["find_library"])
    except OSError as exc:
        out["soname_error"] = str(exc)
for p in sys.argv[1:]:
    try:
        ctypes.CDLL(p)
        out["loads"][p] = None
    except OSError as exc:
        out["loads"][p] = str(exc)
print(json.dumps(out))
"""


# --- pure parsers ----------------------------------------------------------------------------

def parse_ldconfig(text: str, prefix: str = "libaio.so") -> List[Dict[str, str]]:
    """Entries of ``ldconfig -p`` whose name starts with prefix: [{"name", "arch", "path"}]."""
    entries = []
    for line in text.splitlines():
        m = re.match(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S.*?)\s*$", line)
        if m and m.group(1).startswith(prefix):
            entries.append({"name": m.group(1), "arch": m.group(2), "path": m.group(3)})
    return entries


def parse_os_release(text: str) -> Dict[str, str]:
    """KEY=VALUE lines of os-release(5), quotes removed."""
    out: Dict[str, str] = {}
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def parse_mountpoints(mountinfo: str) -> List[str]:
    """Mount points of /proc/self/mountinfo (field 5), octal escapes decoded."""
    points = []
    for line in (mountinfo or "").splitlines():
        fields = line.split()
        if len(fields) >= 5:
            points.append(_unescape(fields[4]))
    return points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def first_error_line(stderr: str) -> str:
    """The compiler/linker line that says what went wrong (first 'error'/'cannot find' line, else the last line)."""
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if ("error" in low and "collect2" not in low) or "cannot find" in low or "undefined reference" in low \
                or "no such file" in low or "file format not recognized" in low or "file too short" in low:
            return ln[:300]
    return lines[-1][:300] if lines else ""


def flag_dirs(flags: str, option: str) -> List[str]:
    """Directories named by -L/-I options in a CFLAGS/LDFLAGS string ("-L/opt/x/lib" or "-L /opt/x/lib")."""
    try:
        words = shlex.split(flags or "")
    except ValueError:
        words = (flags or "").split()
    dirs = []
    i = 0
    while i < len(words):
        w = words[i]
        if w == option and i + 1 < len(words):
            dirs.append(words[i + 1])
            i += 1
        elif w.startswith(option) and len(w) > len(option):
            dirs.append(w[len(option):])
        i += 1
    return dirs


def package_hint(os_release: Dict[str, str], runtime_names: Optional[List[str]] = None) -> Dict[str, str]:
    """Install commands for the host's distribution (from os-release ID / ID_LIKE)."""
    ids = [os_release.get("ID", "").lower()] + os_release.get("ID_LIKE", "").lower().split()
    version = os_release.get("VERSION_ID", "")
    major = version.split(".")[0]
    t64 = any("1t64" in n for n in (runtime_names or []))
    if any(i in ("debian", "ubuntu") for i in ids):
        rt = "libaio1t64" if t64 else "libaio1"
        return {"manager": "apt", "dev": "libaio-dev", "runtime": rt,
                "install_dev": "apt-get update && apt-get install -y libaio-dev",
                "reinstall_runtime": f"apt-get install --reinstall -y {rt}",
                "install_compiler": "apt-get install -y gcc"}
    if any(i in ("rhel", "centos", "fedora", "rocky", "almalinux", "ol", "amzn") for i in ids):
        tool = "yum" if (ids[0] == "amzn" and major == "2") or (ids[0] in ("rhel", "centos", "ol")
                                                                 and major.isdigit() and int(major) < 8) else "dnf"
        return {"manager": tool, "dev": "libaio-devel", "runtime": "libaio",
                "install_dev": f"{tool} install -y libaio-devel",
                "reinstall_runtime": f"{tool} reinstall -y libaio",
                "install_compiler": f"{tool} install -y gcc"}
    if any(i in ("arch", "manjaro", "endeavouros") for i in ids):
        return {"manager": "pacman", "dev": "libaio", "runtime": "libaio",
                "install_dev": "pacman -S --noconfirm libaio",
                "reinstall_runtime": "pacman -S --noconfirm libaio",
                "install_compiler": "pacman -S --noconfirm gcc"}
    if any(i.startswith("opensuse") or i in ("suse", "sles", "sled") for i in ids):
        return {"manager": "zypper", "dev": "libaio-devel", "runtime": "libaio1",
                "install_dev": "zypper install -y libaio-devel",
                "reinstall_runtime": "zypper install -f -y libaio1",
                "install_compiler": "zypper install -y gcc"}
    return {"manager": "", "dev": "libaio-dev / libaio-devel", "runtime": "libaio",
            "install_dev": "install the libaio development package (apt: libaio-dev; dnf/yum/zypper: libaio-devel;"
                           " pacman: libaio)",
            "reinstall_runtime": "reinstall the libaio runtime package",
            "install_compiler": "install a C compiler (gcc)"}


# --- host side -------------------------------------------------------------------------------

def _multiarch_dirs() -> List[str]:
    dirs = []
    for base in ("/lib", "/usr/lib", "/usr/local/lib"):
        dirs.extend(sorted(glob.glob(os.path.join(base, "*-linux-gnu*"))))
    return dirs


def _unique_dirs(dirs: List[str]) -> List[str]:
    seen, out = set(), []
    for d in dirs:
        if not d or not os.path.isdir(d):
            continue
        real = os.path.realpath(d)
        if real in seen:
            continue
        seen.add(real)
        out.append(d)
    return out


def _find_compiler() -> Dict[str, Any]:
    """The C compiler DeepSpeed's op builder would use: $CC, Python's sysconfig CC, then cc/gcc/clang."""
    candidates: List[List[str]] = []
    for _source, value in (("CC", os.environ.get("CC")), ("sysconfig", sysconfig.get_config_var("CC"))):
        if value:
            try:
                candidates.append(shlex.split(value))
            except ValueError:
                pass
    candidates += [["cc"], ["gcc"], ["clang"]]
    tried = []
    for argv in candidates:
        if not argv:
            continue
        tried.append(argv[0])
        path = shutil.which(argv[0])
        if path:
            return {"argv": argv, "path": path, "tried": tried}
    return {"argv": None, "path": None, "tried": tried}


def _probe(argv: List[str], tmp: str, timeout: float) -> Dict[str, Any]:
    res = sh(argv, timeout=timeout, env={"TMPDIR": tmp}, cwd=tmp)
    return {"argv": argv, "rc": res.rc, "ok": res.ok, "stderr": (res.err or res.out)[-2000:],
            "timed_out": res.rc == 124}


def collect(ctx: HostContext) -> Dict[str, Any]:
    params = ctx.params or {}
    extra_dirs = [str(d) for d in (params.get("libaio_search_dirs") or [])]
    cflags = os.environ.get("CFLAGS", "")
    ldflags = os.environ.get("LDFLAGS", "")
    facts: Dict[str, Any] = {"os_release": {}, "ldconfig": None, "find_library": None, "soname_error": None,
                             "runtime": [], "dev_links": [], "headers": [], "search_dirs": [],
                             "include_dirs": [], "compiler": None, "cflags": cflags, "ldflags": ldflags,
                             "link_probe": None, "header_probe": None, "errors": []}

    osr = read_text("/etc/os-release") or read_text("/usr/lib/os-release") or ""
    facts["os_release"] = {k: v for k, v in parse_os_release(osr).items()
                           if k in ("ID", "ID_LIKE", "VERSION_ID", "PRETTY_NAME")}
    _read_ldconfig(facts, ctx)
    ld_dirs = [os.path.dirname(e["path"]) for e in (facts["ldconfig"] or [])]
    env_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    lib_dirs = _unique_dirs(extra_dirs + flag_dirs(ldflags, "-L") + env_dirs + ld_dirs
                            + KNOWN_LIB_DIRS + _multiarch_dirs())
    facts["search_dirs"] = lib_dirs
    runtime_paths = _find_libraries(lib_dirs, facts)

    inc_dirs = [os.path.normpath(os.path.join(d, "..", "include")) for d in extra_dirs]
    inc_dirs += flag_dirs(cflags, "-I")
    for var in ("CPATH", "C_INCLUDE_PATH"):
        inc_dirs += [d for d in os.environ.get(var, "").split(":") if d]
    inc_dirs += KNOWN_INCLUDE_DIRS + sorted(glob.glob("/usr/include/*-linux-gnu*"))
    inc_dirs = _unique_dirs(inc_dirs)
    facts["include_dirs"] = inc_dirs
    facts["headers"] = [os.path.join(d, "libaio.h") for d in inc_dirs if os.path.isfile(os.path.join(d, "libaio.h"))]

    _load_libraries(facts, runtime_paths, ctx)
    compiler = _find_compiler()
    facts["compiler"] = compiler
    if compiler["argv"]:
        facts["link_probe"], facts["header_probe"] = _compile_probes(list(compiler["argv"]), cflags, ldflags,
                                                                     extra_dirs, ctx)
    return facts


def _read_ldconfig(facts: Dict[str, Any], ctx: HostContext) -> None:
    """facts["ldconfig"]: the ldconfig cache (the first ldconfig found on PATH or in /sbin, /usr/sbin)."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        res = sh([ldconfig, "-p"], timeout=ctx.remaining(10))
        if res.rc != 127:
            if res.ok:
                facts["ldconfig"] = parse_ldconfig(res.out)
            else:
                facts["errors"].append(f"ldconfig -p: rc {res.rc} {res.err.strip()[:200]}")
            break


def _find_libraries(lib_dirs: List[str], facts: Dict[str, Any]) -> List[str]:
    """Every libaio.so* in lib_dirs into facts: dev links (libaio.so) and runtimes (libaio.so.1...), each real file
    once; returns the runtimes' paths that exist, for the load probe."""
    mountpoints = set(parse_mountpoints(read_text("/proc/self/mountinfo") or ""))
    seen_real: Set[Any] = set()  # (link, target) pairs of dev links, and real paths of runtimes
    runtime_paths: List[str] = []
    for d in lib_dirs:
        for path in sorted(glob.glob(os.path.join(d, "libaio.so*"))):
            real = os.path.realpath(path)
            base = os.path.basename(path)
            if base == "libaio.so":
                if (path, real) not in seen_real:
                    seen_real.add((path, real))
                    facts["dev_links"].append({"path": path, "realpath": real, "exists": os.path.exists(path)})
                continue
            if not _RUNTIME_RE.match(base) or real in seen_real:
                continue
            seen_real.add(real)
            try:
                size: Optional[int] = os.stat(path).st_size
            except OSError:
                size = None
            facts["runtime"].append({"path": path, "realpath": real, "name": base, "size": size,
                                     "exists": size is not None, "mounted_over": real in mountpoints or
                                     path in mountpoints, "loadable": None, "load_error": None})
            if size is not None:
                runtime_paths.append(path)
    return runtime_paths


def _load_libraries(facts: Dict[str, Any], runtime_paths: List[str], ctx: HostContext) -> None:
    """Load each runtime in a child interpreter (_LOADER): loadable/load_error per runtime, and what
    ctypes.util.find_library and the soname say."""
    python = sys.executable
    if not python:
        facts["errors"].append("no Python interpreter path (sys.executable) to run the load probe")
        return
    res = sh([python, "-c", _LOADER] + runtime_paths, timeout=ctx.remaining(20))
    try:
        loaded = json.loads(res.out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        loaded = None
        facts["errors"].append(f"library load probe: rc {res.rc} {res.err.strip()[-300:]}")
    if loaded:
        facts["find_library"] = loaded.get("find_library")
        facts["soname_error"] = loaded.get("soname_error")
        for entry in facts["runtime"]:
            if entry["path"] in loaded.get("loads", {}):
                err = loaded["loads"][entry["path"]]
                entry["loadable"] = err is None
                entry["load_error"] = err


def _compile_probes(cc: List[str], cflags: str, ldflags: str, extra_dirs: List[str],
                    ctx: HostContext) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(link probe, header probe): a program calling io_submit linked with -laio, and one including <libaio.h>,
    built with the user's CFLAGS/LDFLAGS and the extra search dirs."""
    cf = [w for w in _split(cflags) if w]
    lf = [w for w in _split(ldflags) if w]
    extra_l = ["-L" + d for d in extra_dirs]
    extra_i = ["-I" + os.path.normpath(os.path.join(d, "..", "include")) for d in extra_dirs]
    with tempfile.TemporaryDirectory(prefix=".preflight-libaio-") as tmp:
        # sh() kills the compiler's process group when a signal interrupts it, so the dir can go.
        with open(os.path.join(tmp, "probe.c"), "w") as fh:
            fh.write(LINK_PROBE_C)
        with open(os.path.join(tmp, "header.c"), "w") as fh:
            fh.write(HEADER_PROBE_C)
        link = _probe(cc + cf + lf + extra_l + [os.path.join(tmp, "probe.c"), "-o", os.path.join(tmp, "probe.out"),
                                                "-laio"], tmp, ctx.remaining(30))
        header = _probe(cc + cf + extra_i + ["-c", os.path.join(tmp, "header.c"), "-o", os.path.join(tmp, "header.o")],
                        tmp, ctx.remaining(30))
    return link, header


def _split(flags: str) -> List[str]:
    try:
        return shlex.split(flags or "")
    except ValueError:
        return (flags or "").split()


NO_COMPILER = "cannot confirm libaio builds: no C compiler found"

# --- evaluation ------------------------------------------------------------------------------

def _other_arch(err: Optional[str]) -> bool:
    return bool(err) and "wrong ELF class" in str(err)  # a 32-bit copy next to the 64-bit one: not ours to load


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    """The verdict, with the severities of [libaio] applied: unusable_status and no_compiler_status."""
    lim = limits(thresholds, NAME)
    outcome = _verdict(facts)
    severity = {Status.FAIL: Status.WARN if str(lim["unusable_status"]).lower() == "warn" else Status.FAIL}
    no_cc = Status.FAIL if str(lim["no_compiler_status"]).lower() == "fail" else Status.WARN
    if not outcome.findings:
        return outcome
    findings = [Finding(no_cc if f.message.startswith(NO_COMPILER) else severity.get(f.status, f.status),
                        f.message, f.fix) for f in outcome.findings]
    metrics = {k: v for k, v in outcome.metrics.items() if k != "findings"}
    ok = outcome.message if outcome.status == Status.PASS else ""
    return combine(findings, ok, metrics)


def _verdict(facts: Dict[str, Any]) -> Outcome:
    seen = _Seen(facts)
    metrics = seen.metrics()
    # Each question in turn; the first that finds the install broken is the verdict.
    for question in (seen.not_installed, seen.not_loadable, seen.no_dev_files, seen.no_compiler):
        findings = question()
        if findings:
            return combine(findings, "", metrics)
    return combine(seen.probe_findings(), seen.usable_message(), metrics)


class _Seen:
    """What a host's libaio facts say, derived once for _verdict's questions: the runtime libraries of this
    architecture (loadable or not), the dev link and headers, the compiler, and the link and header probes."""

    ASYNC_NO = "DeepSpeed's async_io op (NVMe offload) will report [NO]"

    def __init__(self, facts: Dict[str, Any]) -> None:
        self.facts = facts
        runtime = [r for r in facts.get("runtime", []) if r.get("exists")]
        self.runtime_ours = [r for r in runtime if not _other_arch(r.get("load_error"))]
        self.loadable = [r for r in self.runtime_ours if r.get("loadable")]
        self.broken = [r for r in self.runtime_ours if r.get("loadable") is False]
        self.dev_links = [d for d in facts.get("dev_links", []) if d.get("exists")]
        self.headers = list(facts.get("headers", []))
        self.compiler = facts.get("compiler") or {}
        self.link = facts.get("link_probe")
        self.header = facts.get("header_probe")
        self.hint = package_hint(facts.get("os_release") or {}, [r.get("name", "") for r in runtime])
        self.link_ok = bool(self.link and self.link.get("ok"))
        self.header_ok = bool(self.header and self.header.get("ok"))
        self.have_cc = bool(self.compiler.get("argv"))
        self.by_name = facts.get("find_library") if not facts.get("soname_error") else None

    def metrics(self) -> Dict[str, Any]:
        return {
            "runtime": [r["path"] for r in self.runtime_ours],
            "runtime_loadable": [r["path"] for r in self.loadable],
            "dev_links": [d["path"] for d in self.dev_links],
            "headers": self.headers,
            "find_library": self.facts.get("find_library"),
            "compiler": self.compiler.get("path"),
            "link_probe_ok": self.link_ok if self.link else None,
            "header_probe_ok": self.header_ok if self.header else None,
            "package": self.hint["dev"],
        }

    def not_installed(self) -> List[Finding]:
        if self.runtime_ours or self.by_name or self.link_ok:
            return []
        dirs = len(self.facts.get("search_dirs", []))
        no_header = "" if self.headers else ", no libaio.h"
        findings = [Finding(
            Status.FAIL,
            f"libaio is not installed: no libaio.so.1 in the ldconfig cache or {dirs} library dirs{no_header} "
            f"(expected the libaio runtime plus {self.hint['dev']}); {self.ASYNC_NO}",
            self.hint["install_dev"])]
        if not self.have_cc:
            findings.append(_no_compiler(self.compiler, self.hint))
        return findings

    def not_loadable(self) -> List[Finding]:
        if not (self.runtime_ours and not self.loadable and self.broken):
            return []
        bad = self.broken[0]
        over = bad.get("mounted_over")
        why = bad.get("load_error") or "load failed"
        fix = self.hint["reinstall_runtime"]
        if over:
            fix = f"umount {shlex.quote(str(bad['realpath']))} && {fix}"
        else:
            fix = f"ls -lL {shlex.quote(str(bad['path']))}; {fix}"
        mounted = ", a file is mounted over it" if over else ""
        return [Finding(
            Status.FAIL,
            f"libaio is present but cannot be loaded: {bad['path']} ({bad.get('size')} bytes{mounted}): {why} "
            f"(expected a loadable shared library); {self.ASYNC_NO}",
            fix)]

    def no_dev_files(self) -> List[Finding]:
        missing = []
        if not self.dev_links and not self.link_ok:
            missing.append("no libaio.so link")
        if not self.headers and not self.header_ok:
            missing.append("no libaio.h")
        if not missing:
            return []
        rt = (self.loadable or self.runtime_ours)
        where = rt[0]["path"] if rt else (self.by_name or "libaio.so.1")
        fix = self.hint["install_dev"]
        if not self.have_cc:
            fix += " && " + self.hint["install_compiler"].replace("apt-get update && ", "")
        detail = ""
        if self.link and not self.link_ok:
            detail = f"; the test link says: {first_error_line(self.link.get('stderr', ''))}"
        return [Finding(
            Status.FAIL,
            f"libaio installed but async_io [NO]: the runtime library {where} is present, but the development files "
            f"are not ({', '.join(missing)}; expected the {self.hint['dev']} package){detail}",
            fix)]

    def no_compiler(self) -> List[Finding]:
        return [] if self.have_cc else [_no_compiler(self.compiler, self.hint)]

    def probe_findings(self) -> List[Finding]:
        """What the link and header probes found wrong, with files and a compiler present."""
        findings: List[Finding] = []
        for probe, what in ((self.link, "a test program calling io_submit does not link with -laio"),
                            (self.header, "a test program including <libaio.h> does not compile")):
            if probe and not probe.get("ok"):
                if probe.get("timed_out"):
                    findings.append(Finding(Status.ERROR, "could not confirm libaio: the compiler "
                                            f"({self.compiler.get('path')}) timed out", REPRODUCE))
                else:
                    link = self.dev_links[0]["path"] if self.dev_links else "libaio.so ?"
                    header = self.headers[0] if self.headers else "libaio.h ?"
                    findings.append(Finding(
                        Status.FAIL,
                        f"libaio dev files are present ({link}, {header}) but {what}: "
                        f"{first_error_line(probe.get('stderr', ''))}; {self.ASYNC_NO} (check CC/CFLAGS/LDFLAGS: "
                        "-I/-L must point at libaio)",
                        "env | grep -E '^(CC|CFLAGS|LDFLAGS)='; " + REPRODUCE))
        return findings

    def usable_message(self) -> str:
        rt_path = self.loadable[0]["path"] if self.loadable else (self.by_name or "found by the linker")
        link = self.dev_links[0]["path"] if self.dev_links else "libaio.so (found by the linker)"
        header = self.headers[0] if self.headers else "libaio.h (found by the compiler)"
        compiler = self.compiler.get("path")
        return f"libaio usable: runtime {rt_path}, {link}, {header}; io_submit links with -laio ({compiler})"


def _no_compiler(compiler: Dict[str, Any], hint: Dict[str, str]) -> Finding:
    return Finding(
        Status.WARN,
        f"{NO_COMPILER} (tried {', '.join(compiler.get('tried') or ['cc', 'gcc'])}); DeepSpeed JIT-compiles "
        "async_io and needs one",
        hint["install_compiler"])


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="libaio runtime, dev files and a test link with -laio, as DeepSpeed's async_io op builder needs",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
)
