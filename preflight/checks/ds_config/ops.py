"""Which DeepSpeed ops the config needs (as engine._configure_basic_optimizer picks them), whether the hosts'
ds_report shows them usable, and whether the JIT build of one that is not pre-built can succeed there.

E.g. AdamW with ``"offload_optimizer": {"device": "cpu"}`` -> cpu_adam; NVMe offload -> async_io; against the
ds_report facts ``"ops": {"cpu_adam": {"installed": false, "compatible": true}, ...}, "nvcc": null, "cxx": ...``.
An op that is compatible but not pre-built is built when deepspeed.initialize constructs it (FusedAdam's
``FusedAdamBuilder().load()``; op_builder/builder.py:549-566 load -> jit_load): what stops that build is in
``hostside/jit.py``. Pure.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ...hostside import jit
from ...hostside.fixes import prebuild_phrase
from ...hostside.outcome import Status
from .parse import config_section, offload_devices, optimizer_params, optimizer_type
from .findings import Report, hosts_text


def required_ops(config: Dict[str, Any]) -> List[str]:
    """DeepSpeed ops (ds_report names) the config needs, mirroring engine._configure_basic_optimizer.

    async_io: any NVMe offload; gds: aio.use_gds; Adam/AdamW: cpu_adam under optimizer offload (cpu or nvme),
    else fused_adam (unless params.torch_adam); Adagrad: cpu_adagrad under offload; Lion: cpu_lion / fused_lion;
    Lamb: fused_lamb; 1-bit optimizers with comm_backend_name "compressed": packbits.
    """
    ops: List[str] = []

    def add(op: str) -> None:
        if op not in ops:
            ops.append(op)

    opt_dev, par_dev = offload_devices(config)
    if "nvme" in (opt_dev, par_dev):
        add("async_io")
    aio = config_section(config, "aio")
    if aio.get("use_gds") is True:
        add("gds")
    name = (optimizer_type(config) or "").lower()
    cpu_optimizer = opt_dev in ("cpu", "nvme")
    params = optimizer_params(config)
    if name in ("adam", "adamw"):
        if params.get("torch_adam") is not True:
            add("cpu_adam" if cpu_optimizer else "fused_adam")
    elif name == "adagrad":
        if cpu_optimizer:
            add("cpu_adagrad")
    elif name == "lion":
        add("cpu_lion" if cpu_optimizer else "fused_lion")
    elif name == "lamb":
        add("fused_lamb")
    elif name in ("onebitadam", "zerooneadam", "onebitlamb"):
        if str(params.get("comm_backend_name", "nccl")).lower() == "compressed":
            add("packbits")
    return ops


_OP_FIX = {
    "async_io": "apt install libaio-dev (and a C compiler) on the host so DeepSpeed can build async_io; "
                "ds_report must show async_io [OKAY]",
    "gds": "install libaio-dev and the GPUDirect Storage (cufile) libraries, or set aio.use_gds false",
    # {prebuild}: the pre-build command for the op on the hosts named (prebuild_phrase).
    "cpu_adam": "install a C++ compiler and ninja (JIT), or pre-build: {prebuild}",
    "fused_adam": "install the CUDA toolkit (nvcc) matching torch and ninja, or {prebuild}; or set "
                  "optimizer.params.torch_adam true",
}


# What else avoids a JIT build of the op, beside fixing the build: appended to a JIT-build fix.
_NO_BUILD = {
    "fused_adam": "or set optimizer.params.torch_adam true (torch's own Adam: nothing to build)",
    "cpu_adam": "or pre-build it: {prebuild}",
}

WHY = {"async_io": "NVMe offload", "gds": "aio.use_gds", "cpu_adam": "the optimizer runs on the CPU (offload)",
       "fused_adam": "Adam/AdamW on the GPU is DeepSpeed's FusedAdam", "cpu_adagrad": "Adagrad under offload",
       "cpu_lion": "Lion under offload", "fused_lion": "Lion on the GPU", "fused_lamb": "Lamb",
       "packbits": "the 'compressed' 1-bit comm backend"}


def _prebuild(op: str, hosts: List[str], facts: Dict[str, Any]) -> str:
    """The pre-build of op for these hosts: their interpreter and DeepSpeed version (ds_report) where all agree,
    else words saying whose pip and deepspeed unpinned."""
    drs = [((facts.get("host_facts") or {}).get(h) or {}).get("ds_report") or {} for h in hosts]
    pythons = {str(d.get("python")) for d in drs}
    versions = {str(d.get("deepspeed")) for d in drs}
    return prebuild_phrase(drs[0].get("python") if drs and len(pythons) == 1 else None, [f"DS_BUILD_{op.upper()}"],
                           drs[0].get("deepspeed") if drs and len(versions) == 1 else None)


def check_ops(config: Dict[str, Any], facts: Dict[str, Any], report: Report) -> str:
    ops = required_ops(config)
    if not ops:
        return ""
    bad: Dict[str, Dict[str, str]] = {}
    unknown_hosts: List[str] = []
    # (op, status, cause, message, fix) -> {host: its message}: one finding per cause, naming its hosts.
    jit_bad: Dict[Tuple[str, Status, str, str, str], Dict[str, str]] = {}
    launch_env = (facts.get("launch_env") or {}).get("vars") or {}
    for h in facts.get("hosts") or []:
        name = h["name"]
        dr = ((facts.get("host_facts") or {}).get(name) or {}).get("ds_report") or {}
        host_ops = dr.get("ops") or {}
        if not host_ops:
            unknown_hosts.append(name)
            continue
        for op in ops:
            e = host_ops.get(op)
            if not isinstance(e, dict):
                bad.setdefault(op, {})[name] = f"{op} is not in this DeepSpeed's op list (ds_report)"
            elif not (e.get("installed") or e.get("compatible")):
                note = e.get("note") or ""
                detail = ": " + str(note)[:160] if note else ""
                bad.setdefault(op, {})[name] = (f"{op} is neither pre-built nor JIT-compatible (ds_report [NO] / "
                                                f"[NO]){detail}")
            else:
                for b in jit.blockers(op, dr, launch_env):
                    outcome = "fails here" if b.status == Status.FAIL else "is risky here"
                    jit_bad.setdefault((op, b.status, b.short, b.message, b.fix), {})[name] = \
                        f"config needs op {op}, whose JIT build {outcome}: {b.message}"
    why = WHY
    for (op, status, _short, message, fix), per in sorted(jit_bad.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        on = hosts_text(sorted(per))
        verb = f"fails on {on}" if status == Status.FAIL else f"is allowed but risky on {on}"
        report.add(status, f"the config needs op {op} ({why.get(op, 'required by the config')}), which is not "
                           f"pre-built: deepspeed.initialize JIT-builds it, and that build {verb}: {message}",
                   "; ".join(x for x in (fix, _NO_BUILD.get(op, "").format(prebuild=_prebuild(op, sorted(per), facts)))
                             if x), per)
    for op, per in sorted(bad.items()):
        report.add(Status.FAIL, f"the config needs op {op} ({why.get(op, 'required by the config')}) but it is not "
                                f"usable on {hosts_text(sorted(per))}: {next(iter(per.values()))}",
                   _OP_FIX.get(op, f"fix the prerequisites ds_report lists for {op}, or pre-build it with "
                                   "{prebuild}").format(prebuild=_prebuild(op, sorted(per), facts)),
                   {h: f"config needs op {op} ({why.get(op, '')}): {m}" for h, m in per.items()})
    if unknown_hosts:
        report.add(Status.SKIP, f"ops {', '.join(ops)} not checked on {hosts_text(unknown_hosts)}: no ds_report facts "
                                "(DeepSpeed missing or ds_report not run)")
    return f"ops {', '.join(ops)}"
