"""The launch rehearsal's run over the coordinator's own command line to each host (``hostside.seams.HostShell``):
the launch directory with the script on every host, DeepSpeed's launcher under a supervisor on the launch host whose
stdin is its lifeline, the watch of the ranks' events until the end, and the clean-up on every host. Shared by
``preflight rehearse`` (preflight/rehearse.py, its own SSH connections) and the ``launch`` check of ``preflight run``
(the run's connections, through ``ClusterView.shell``).

    on node01:  sh -c 'cd "$1" && shift && exec "$@"' sh /tmp/preflight-rehearse-<id> python3 preflight_rehearse.py
                --supervise <mark>   (it runs launch.json's argv: deepspeed --hostfile ... --launcher pdsh ...)
    then on every host: pkill -KILL -f <the run's token>; rm -rf /tmp/preflight-rehearse-<id>; pgrep (nothing left)
"""
from __future__ import annotations

import inspect
import json
import os
import shlex
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from ...hostside import hfauto
from ...hostside import rehearsal as host_side
from ...hostside.outcome import Outcome, Status
from ...hostside.proc import parallel_map
from ...hostside.seams import HostShell
from .judge import (CLUSTER, ENV_FILE_NAME, GRACE_S, HOSTFILE, LOCAL, REAP_S, SCRIPT, STOP_S, TOKEN_PREFIX,
                    EventLog, LaunchPlan, Outcomes, RankView, secs, expected_ranks, pattern_of, rank_views)


def build_time(views: List[Any], now: float) -> float:
    """The longest time one rank has spent in JIT loads of ops so far (finished ones and the one it is in), on the
    events' clock: how far the launch's deadline moves on."""
    def spent(view: Any) -> float:
        done = sum(float(e.get("s") or 0) for e in view.loads if e.get("jit"))
        if view.building and isinstance(view.op_arrived, (int, float)):
            done += max(0.0, now - view.op_arrived)
        return done
    return max((spent(v) for v in views), default=0.0)


def script_source() -> str:
    """The host-side script: rehearsal.py's own source, written to every host's launch directory."""
    return inspect.getsource(host_side)


class LaunchRun:
    """One rehearsal over connected shells: prepare every host, launch, watch, stop, clean up, and judge.

    shells: {host name (or LOCAL): a connected HostShell}; a host missing from it, or named in ``errors``, is not
    prepared. The caller owns the shells (this never closes them).
    """

    def __init__(self, plan: LaunchPlan, shells: Optional[Dict[str, HostShell]] = None, progress: Any = None) -> None:
        self.o = plan
        self.progress = progress
        hexid = uuid.uuid4().hex[:12]
        self.token = TOKEN_PREFIX + hexid
        self.dir = os.path.join(plan.workdir, self.token)
        # "auto" values filled as the HF integration fills them, in a copy the ranks open (ds_config's hfauto).
        self.o, self.config_files = hfauto.for_rehearsal(plan, self.dir)
        self.pattern = pattern_of(self.token)
        self.mark = host_side.SUPERVISOR_PREFIX + hexid  # the supervisor's argv: its own reap spares it
        self.transports: Dict[str, HostShell] = dict(shells or {})
        self.errors: Dict[str, Tuple[str, str]] = {}  # host -> (message, fix): could not prepare it
        self.unreachable: List[str] = []
        self.cleanup: Dict[str, Dict[str, Any]] = {}
        self.interrupted = False

    def _note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.note(text)

    @property
    def launch_host(self) -> str:
        if self.o.launch_from == "first":
            return self.o.hosts[0].name
        return self.o.launch_from

    def launch_spec(self) -> Dict[str, Any]:
        """launch.json: what the supervisor runs, and what it reaps when its lifeline closes."""
        return {"argv": self.launcher_argv(), "token": self.token, "hosts": [h.name for h in self.o.hosts],
                "lifetime": self.lifetime + 60.0, "beside": self.o.deepspeed_beside}

    @property
    def lifetime(self) -> float:
        """How long a rank lives at most: past the coordinator's deadline (--timeout, plus the JIT build time it
        allows), it ends itself."""
        return max(30.0, self.o.timeout + self.o.build_budget + 30.0)

    def launcher_argv(self) -> List[str]:
        """``deepspeed --hostfile H [-i/-e] [--master_addr/--master_port] --launcher pdsh SCRIPT --deepspeed_config
        C`` and the rehearsal's own arguments after it."""
        argv = shlex.split(self.o.deepspeed) + ["--hostfile", os.path.join(self.dir, HOSTFILE)]
        if self.o.include:
            argv += ["--include", self.o.include]
        if self.o.exclude:
            argv += ["--exclude", self.o.exclude]
        if self.o.master_addr:
            argv += ["--master_addr", self.o.master_addr]
        if self.o.master_port:
            argv += ["--master_port", str(self.o.master_port)]
        if self.o.launcher_ssh_port:
            argv += ["--ssh_port", str(self.o.launcher_ssh_port)]
        return argv + ["--launcher", "pdsh", SCRIPT, "--deepspeed_config", self.o.deepspeed_config,
                       "--preflight-run", self.token, "--steps", str(self.o.steps),
                       "--model-params", f"{self.o.model_params:g}", "--init-timeout", f"{self.o.init_timeout:g}",
                       "--lifetime", f"{self.lifetime:g}", "--build-budget", f"{self.o.build_budget:g}"]

    # -- phases
    def prepare(self, env_text: Optional[str], hostfile_text: str) -> None:
        """The launch directory on every host with the script; on the launch host also the hostfile and the
        working directory's .deepspeed_env (under the name the launcher reads)."""
        script = script_source().encode()
        hosts = [n for n in self.transports if n not in self.errors]
        if self.progress is not None:
            self.progress.phase("writing the script", len(hosts))

        def write(name: str, path: str, data: bytes) -> Optional[str]:
            res = self.transports[name].run(
                ["sh", "-c", 'umask 077 && mkdir -p "$1" && cat > "$1/$2"', "sh", self.dir, path], 30, stdin=data)
            if res.rc != 0:
                return (res.stderr.strip() or res.error or f"rc {res.rc}")[:300]
            return None

        def one(name: str) -> None:
            files = [(SCRIPT, script)] + self.config_files
            if name == self.launch_host:
                files.append((HOSTFILE, hostfile_text.encode()))
                files.append((host_side.LAUNCH_FILE, json.dumps(self.launch_spec()).encode()))
                if env_text is not None:
                    files.append((os.environ.get("DS_ENV_FILE", ENV_FILE_NAME), env_text.encode()))
            for path, data in files:
                problem = write(name, path, data)
                if problem:
                    self.errors[name] = (f"could not write {self.dir}/{path}: {problem}",
                                         f"make {self.o.workdir} writable on the host, or pass --workdir")
                    break
            if self.progress is not None:
                self.progress.advance(name)

        for name, done in zip(hosts, parallel_map(one, hosts, max(1, self.o.parallel), 120.0)):
            if isinstance(done, BaseException) and name not in self.errors:
                self.errors[name] = (f"writing the script did not finish: {done}", "check the host")

    def launch_and_watch(self, log: EventLog) -> Tuple[str, Dict[str, Any]]:
        """Start the supervisor on the launch host and watch the events until the end: (why it stopped, facts of
        the launch). Ctrl-C stops it the same way (and is re-raised by run())."""
        transport = self.transports[self.launch_host]
        # Relative to the launch directory, and the launcher's argv in launch.json: the supervisor's argv holds
        # no token, so that its own reap of the token on this host (pdsh reaches it too) spares it.
        argv = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", self.dir, self.o.python, SCRIPT,
                "--supervise", self.mark]
        launcher = self.launcher_argv()
        launched: Dict[str, Any] = {"command": " ".join(shlex.quote(a) for a in launcher), "host": self.launch_host}
        cmd = transport.start(argv, keep_stdin_open=True)
        cmd.stream_to(log.feed)
        started = time.monotonic()
        total = len(expected_ranks(self.o.hosts))
        if self.progress is not None:
            self.progress.phase(f"rehearsing from {self.launch_host}", total)
        reason = ""
        finished_at: Optional[float] = None
        counted = 0
        try:
            while not reason:
                with log.cond:
                    log.cond.wait(0.25)
                views, launcher_events = rank_views(expected_ranks(self.o.hosts), log.snapshot())
                now = time.monotonic()
                ended = [v for v in views if v.ended]
                while counted < len([v for v in ended if "done" in v.seen]):
                    counted += 1
                    if self.progress is not None:
                        self.progress.advance("rank", "done")
                if any(e.get("event") == "launcher_exit" for e in launcher_events) or cmd.done:
                    reason = "the launcher exited"
                    break
                if len(ended) == total:
                    finished_at = finished_at or now
                    if now - finished_at > min(GRACE_S, 5.0):  # its exit code, if it comes soon
                        reason = "every rank ended"
                        break
                reason = self._why_stuck(views, now, now - log.arrived, started)
        except KeyboardInterrupt:
            reason = "interrupted (Ctrl-C)"
            self.interrupted = True
        launched["elapsed"] = time.monotonic() - log.arrived  # the events' clock
        self._stop(cmd, log, launched)
        return reason, launched

    def _why_stuck(self, views: List[RankView], now: float, rel: float, started: float) -> str:
        """Why to stop watching a launch whose ranks have not all ended (a rank raised, a build or an init ran past
        its budget, the deadline passed), or "" to watch on; rel is now on the events' clock."""
        errors = [v.seen["error"].get("arrived", 0) for v in views if "error" in v.seen]
        if errors and rel - min(errors) > GRACE_S:
            return f"stopped {secs(GRACE_S)} after the first rank raised"
        # A JIT build is a measurement, not a hang: while a rank builds an op (DeepSpeed builds its comm op
        # before init_process_group), the others wait for it, the init timeout does not run, and the
        # deadline moves on by the build's time, up to the build budget.
        building = [v for v in views if v.building]
        over = [v for v in building
                if isinstance(v.op_arrived, (int, float)) and rel - v.op_arrived > self.o.build_budget]
        if over:
            late = over[0]
            return (f"[launch] jit_build_budget_s {secs(self.o.build_budget)} passed while "
                    f"{late.slot.host} was still building {late.op_running}")
        deadline = started + self.o.timeout + min(self.o.build_budget, build_time(views, rel))
        # A rank past its own init timeout (and a grace) is hung where torch's timeout does not reach:
        # gloo's connect to a host that drops SYNs waits for the kernel's retries (over 2 minutes). It
        # counts from the last build's end: a rank that waited for another's build was not hung.
        in_init = [v.seen["init_begin"].get("arrived", 0) for v in views
                   if "init_begin" in v.seen and not any(k in v.seen for k in ("init", "error", "deadline"))]
        built_at = max((float(e.get("arrived") or 0) for v in views for e in v.loads), default=0.0)
        if in_init and not building and rel - max(min(in_init), built_at) > self.o.init_timeout + GRACE_S:
            return f"init did not finish within --init-timeout {secs(self.o.init_timeout)}"
        if now > deadline:
            return f"--timeout {secs(self.o.timeout)} passed"
        return ""

    def _stop(self, cmd: Any, log: EventLog, launched: Dict[str, Any]) -> None:
        """Stop the supervisor through its lifeline (it kills the launcher and reaps over pdsh) and record how
        it ended in launched."""
        self._note(f"stopping the launch on {self.launch_host}")
        cmd.close_stdin(wait=False)  # the supervisor's lifeline: it kills the launcher and reaps over pdsh
        if not cmd.join(STOP_S):
            cmd.kill()
        res = cmd.wait(5)
        log.finish()
        launched.update(rc=res.rc, stderr=res.stderr[-2000:])

    def reap(self) -> None:
        """Kill whatever of the run is left on every host (pkill by the run's token) and remove the launch
        directories; what survives is recorded per host."""
        names = list(self.transports)
        self._note(f"cleaning up on {len(names)} host(s)")

        def one(name: str) -> Dict[str, Any]:
            transport = self.transports[name]
            out: Dict[str, Any] = {}
            if name in self.unreachable:
                return out
            kill = transport.run(["pkill", "-KILL", "-f", self.pattern], REAP_S)
            out["killed"] = kill.rc == 0
            transport.run(["pkill", "-KILL", "-f", pattern_of(self.mark)], REAP_S)
            # The token is never written out in the command, or pkill -f of another host's reap would match it.
            # The torch extension locks its ranks held when they were killed go first (host_side.RELEASE_LOCKS).
            transport.run(["sh", "-c", f'd="$1/{TOKEN_PREFIX}$2"; {host_side.RELEASE_LOCKS}; rm -rf -- "$d"', "sh",
                           self.o.workdir, self.token[len(TOKEN_PREFIX):]], REAP_S)
            left = transport.run(["pgrep", "-a", "-f", self.pattern], REAP_S)
            if left.rc == 0 and left.stdout.strip():
                time.sleep(1.0)
                transport.run(["pkill", "-KILL", "-f", self.pattern], REAP_S)
                left = transport.run(["pgrep", "-a", "-f", self.pattern], REAP_S)
                if left.rc == 0 and left.stdout.strip():
                    out["left"] = left.stdout.strip().splitlines()[:10]
            return out

        for name, done in zip(names, parallel_map(one, names, max(1, self.o.parallel), REAP_S * 4 + 10)):
            self.cleanup[name] = done if isinstance(done, dict) else {"error": str(done)}

    def rehearse(self, env_text: Optional[str], hostfile_text: str) -> Dict[str, Outcome]:
        """Prepare, launch, watch, judge and clean up: {host name or CLUSTER: outcome}, each with its clean-up in
        its metrics, a host whose processes survived the clean-up an ERROR. Ctrl-C stops the launch, cleans up
        and sets ``interrupted`` (the outcomes are then those of the launch until then)."""
        rows: Dict[str, Outcome] = {}
        try:
            self.prepare(env_text, hostfile_text)
            if self.errors:
                rows = self.not_launched()
            else:
                log = EventLog(self.token, [h.name for h in self.o.hosts])
                reason, launched = self.launch_and_watch(log)
                judged = Outcomes(self.o, self.launch_host, log, reason, launched.get("elapsed", 0.0), launched)
                rows = judged.host_rows()
                rows[CLUSTER] = judged.cluster_row(rows)
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self.reap()
        return self.with_leftovers(rows)

    def not_launched(self) -> Dict[str, Outcome]:
        """Every host's row when some host could not be prepared (nothing was launched)."""
        rows: Dict[str, Outcome] = {}
        first = sorted(self.errors)[0]
        for h in self.o.hosts:
            if h.name in self.errors:
                message, fix = self.errors[h.name]
                rows[h.name] = Outcome(Status.ERROR, message, fix)
            else:
                rows[h.name] = Outcome(Status.ERROR, f"not rehearsed: {first} could not be prepared",
                                       f"see {first}'s result")
        if LOCAL in self.errors:
            message, fix = self.errors[LOCAL]
            rows[CLUSTER] = Outcome(Status.ERROR, f"this machine: {message}", fix)
        else:
            rows[CLUSTER] = Outcome(Status.ERROR, f"not launched: {first} could not be prepared",
                                    f"see {first}'s result")
        return rows

    def survivors(self) -> Dict[str, str]:
        """{host name or CLUSTER: the processes of the run that survived pkill -KILL there}."""
        return {(CLUSTER if name == LOCAL else name): "; ".join(done["left"])[:400]
                for name, done in self.cleanup.items() if done.get("left")}

    def with_leftovers(self, rows: Dict[str, Outcome]) -> Dict[str, Outcome]:
        """Each row with its host's clean-up in its metrics."""
        for name, done in self.cleanup.items():
            row = rows.get(CLUSTER if name == LOCAL else name)
            if row is not None:
                row.metrics["cleanup"] = done
        return rows
