"""Inside one torch rank process on a host: rendezvous, init_process_group, and the timed all-reduce sweep.

Started by ``supervisor.run`` as ``agent.fork_call("allreduce.rank.run", ...)`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set. It prints phase markers for the supervisor (``@@ALLREDUCE-PHASE {"phase": "init"}``)
and returns, e.g.::

    {"rank": 1, "ok": true, "phase": "done", "sizes": [{"bytes": 1048576, "time_s": 0.058, "iters": 3,
                                                        "iter_s": [0.057, 0.059, 0.058]}, ...]}
    {"rank": 2, "ok": false, "phase": "rendezvous", "kind": "rendezvous", "target": "198.18.0.1",
     "error": "could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s (connection timed out: ...)"}
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...hostside.fmt import human_bytes
from .common import PHASE, classify

class _Failed(Exception):
    def __init__(self, kind: str, message: str, target: Optional[str] = None):
        super().__init__(message)
        self.kind = kind
        self.target = target


def _mark(phase: str) -> None:
    # Read by supervisor.run: if this rank is killed, the last phase still says where it was stuck.
    sys.stdout.write(f"{PHASE} {json.dumps({'phase': phase})}\n")
    sys.stdout.flush()


def _await_master(addr: str, port: int, timeout: float, starting_until: float) -> float:
    """Connect to MASTER_ADDR:MASTER_PORT (rank 0's TCPStore) until it accepts, so that a blocked or wrong address
    fails with our own precise message instead of torch's retry log. Returns the seconds waited.

    A refused connection may only mean that rank 0 is still importing torch: it is retried until
    ``starting_until`` (the ranks' start allowance). Dropped packets (a firewall) fail after ``timeout``.
    """
    start = time.monotonic()
    deadline = start + timeout
    last = "no answer"
    pause = 0.02  # rank 0 listens within milliseconds of its start: retry fast at first, then back off to 0.5 s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((addr, port), timeout=min(3.0, max(0.2, left)))
            sock.close()
            return time.monotonic() - start
        except socket.timeout:
            last = f"connection timed out: packets dropped, inbound TCP to port {port} blocked by a firewall?"
        except ConnectionRefusedError:
            last = f"connection refused: nothing listens on port {port} (rank 0 not started or failed?)"
            deadline = max(deadline, min(starting_until, time.monotonic() + timeout))
        except OSError as exc:
            last = str(exc.strerror or exc)
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(0.5, pause * 2)
    waited = time.monotonic() - start
    raise _Failed("rendezvous", f"could not connect to MASTER_ADDR {addr}:{port} within {waited:.0f}s ({last})",
                  target=addr)


JOINED_KEY = "preflight/joined"
ALL_JOINED_KEY = "preflight/all-joined"  # set by the last rank to arrive; the others wait on it


def _join(dist: Any, addr: str, port: int, rank: int, world: int, until: float, init_timeout: float) -> Any:
    """rank 0's TCPStore, once every rank has joined it: the ranks' clocks start together.

    Ranks finish importing torch at very different times (a cold conda env on NFS, or many ranks on few cores),
    and torch's init timeout would count that stagger against the early ranks: a late rank looked like a
    network failure. Here every rank may take until ``until`` (its start allowance) to arrive; only then do
    init_process_group and the collectives get ``init_timeout`` each.

    The last rank to arrive sets a key that the others wait on inside the store: they go on the moment it is
    set, and thousands of waiting ranks send rank 0's store nothing meanwhile (polling it did both worse).
    """
    import datetime
    store = dist.TCPStore(addr, port, world_size=None, is_master=(rank == 0),
                          timeout=datetime.timedelta(seconds=max(1.0, until - time.monotonic())),
                          wait_for_workers=False)
    joined = store.add(JOINED_KEY, 1)
    if joined >= world:
        store.set(ALL_JOINED_KEY, "1")
    while joined < world:
        left = until - time.monotonic()
        if left <= 0:
            raise _Failed("incomplete", f"only {joined} of {world} ranks joined rank 0's store by the start deadline: "
                                        "the others are still importing torch, or failed")
        try:
            # In slices, so that the deadline above is ours and a store that went away is noticed below.
            store.wait([ALL_JOINED_KEY], datetime.timedelta(seconds=min(1.0, max(0.05, left))))
            break
        except Exception:  # the slice ran out, or rank 0's store is gone: asking it again tells which
            pass
        try:
            joined = store.add(JOINED_KEY, 0)
        except Exception as exc:  # rank 0 gave up (or died) first and its store went with it
            detail = str(exc)[:120]
            raise _Failed("incomplete", f"rank 0's store closed when only {joined} of {world} ranks joined "
                                        f"({detail}): rank 0 gave up waiting for the others, or failed") from None
    store.set_timeout(datetime.timedelta(seconds=init_timeout))
    return store


def _sweep(torch: Any, dist: Any, dev: Any, params: Dict[str, Any], world: int) -> Tuple[List[Dict[str, Any]],
                                                                                          Optional[str]]:
    """Warm-up plus timed iterations per size; every stop decision uses all-reduced (MAX) numbers so that all
    ranks take it together (a rank that stopped alone would leave the others waiting)."""
    cuda = dev.type == "cuda"
    budget = float(params["size_budget_s"])
    sweep_budget = float(params["sweep_budget_s"])
    iters = max(1, int(params["iters"]))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def agree(values: Sequence[float]) -> List[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def barrier() -> None:
        if cuda:
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    start = time.monotonic()
    rows: List[Dict[str, Any]] = []
    for nbytes in params["sizes"]:
        x = torch.ones(int(nbytes) // 4, dtype=torch.float32, device=dev)
        barrier()
        t0 = time.monotonic()
        dist.all_reduce(x)
        sync()
        warm = time.monotonic() - t0
        # Ones summed over n ranks must give n: catches silent corruption at no cost.
        wrong = 0.0 if (x[0].item() == world and x[-1].item() == world) else 1.0
        x.zero_()  # zeros stay zeros however often they are summed: no overflow over the timed iterations
        warm, wrong = agree([warm, wrong])
        if wrong:
            size = human_bytes(nbytes)
            raise _Failed("wrong_result", f"all-reduce of ones over {world} ranks gave a wrong sum at {size}")
        k = max(1, min(iters, int((budget - warm) / max(warm, 1e-6))))
        barrier()
        # Each iteration is timed on its own: their spread is the measurement's noise, which the straggler
        # detector (stragglers.py) needs to tell a slow host from a noisy one.
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(k + 1)]
            events[0].record()
            for i in range(k):
                dist.all_reduce(x)
                events[i + 1].record()
            events[-1].synchronize()
            each = [events[i].elapsed_time(events[i + 1]) / 1000.0 for i in range(k)]
        else:
            each = []
            for _ in range(k):
                t0 = time.monotonic()
                dist.all_reduce(x)  # gloo on CPU tensors returns when the reduction is done
                each.append(time.monotonic() - t0)
        # The slowest rank's view of every iteration (all ranks agree on it, so all take the same decisions).
        agreed = agree([sum(each) / k, time.monotonic() - start] + each)
        per_iter, spent, each = agreed[0], agreed[1], agreed[2:]
        rows.append({"bytes": int(nbytes), "time_s": per_iter, "iters": k, "warmup_s": round(warm, 6),
                     "iter_s": [round(t, 6) for t in each]})
        del x
        total = warm + per_iter * k
        next_est = 2 * (warm + per_iter)  # the next size's warm-up plus one timed iteration
        if nbytes == params["sizes"][-1]:
            break
        if total > budget:
            return rows, f"{human_bytes(nbytes)} took {total:.1f}s (> size_budget_s {budget:.0f}s)"
        if next_est > budget or spent + next_est > sweep_budget:
            return rows, (f"{human_bytes(nbytes * 2)} would take ~{next_est:.1f}s (size_budget_s {budget:.0f}s, "
                          f"sweep_budget_s {sweep_budget:.0f}s, {spent:.1f}s spent)")
    return rows, None


def _straggler_rounds(torch: Any, dist: Any, dev: Any, params: Dict[str, Any], rank: int) -> List[Dict[str, Any]]:
    """After the sweep, in the same processes (no second torch start): the hosts paired around the ring, each pair
    a 2-rank group of the hosts' first ranks, all pairs of a round at once, a global barrier between rounds. Each
    pair times its iterations one by one (the pair's MAX of both ranks' views); a slow pair is cut to what fits in
    size_budget_s, as in the sweep. Returns this rank's pairs: [{"round", "ranks", "iter_s"}]."""
    plan = params["stragglers"]
    cuda = dev.type == "cuda"
    nbytes, iters, budget = int(plan["bytes"]), max(1, int(plan["iters"])), float(params["size_budget_s"])
    # Every rank creates every group, in the same order (torch.distributed requires it, members or not).
    groups = [[(pair, dist.new_group(ranks=list(pair))) for pair in rnd] for rnd in plan["rounds"]]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def barrier() -> None:
        if cuda:
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    mine: List[Dict[str, Any]] = []
    for i, rnd in enumerate(groups):
        barrier()
        for pair, group in rnd:
            if rank not in pair:
                continue
            x = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
            t0 = time.monotonic()
            dist.all_reduce(x, group=group)  # also connects the pair
            sync()
            warm = torch.tensor([time.monotonic() - t0], dtype=torch.float64, device=dev)
            dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
            k = max(1, min(iters, int((budget - float(warm.item())) / max(float(warm.item()), 1e-6))))
            each = []
            for _ in range(k):
                t0 = time.monotonic()
                dist.all_reduce(x, group=group)
                sync()
                each.append(time.monotonic() - t0)
            agreed = torch.tensor(each, dtype=torch.float64, device=dev)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            mine.append({"round": i, "ranks": list(pair), "iter_s": [round(float(t), 6) for t in agreed.tolist()],
                         "warmup_s": round(float(warm.item()), 6)})
            del x
    barrier()
    return mine


def run(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """One rank (started by supervisor.run with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set)."""
    import datetime

    from ...hostside import agent
    job = params["job"]
    info = _rank_info(params)
    start = time.monotonic()
    dist: Any = None
    initialized = False

    def phase(name: str) -> None:
        info["phase"] = name
        info.setdefault("phases", {})[name] = round(time.monotonic() - start, 3)
        _mark(name)

    try:
        phase("import")
        torch, dist = _import_torch()
        backend = params["backend"]
        dev = _device(torch, backend, job, info)
        timeout = float(params["init_timeout_s"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # Every rank gets the same start allowance, counted from its own launch (they launch together).
        starting_until = start + float(params["start_timeout_s"]) + timeout
        phase("rendezvous")
        if info["rank"] != 0:
            info["rendezvous_s"] = round(_await_master(addr, port, timeout, starting_until), 3)
        phase("join")
        store = _join(dist, addr, port, info["rank"], info["world_size"], starting_until, timeout)
        phase("init")
        # The timeout bounds init and every collective; torch's default (10 min) is far too long here.
        dist.init_process_group(backend=backend, store=store, rank=info["rank"], world_size=info["world_size"],
                                timeout=datetime.timedelta(seconds=timeout))
        initialized = True
        phase("connect")  # NCCL connects lazily: the first collective builds the rings
        _first_all_reduce(torch, dist, dev, info["world_size"])
        phase("sweep")
        info["sizes"], info["stopped_early"] = _sweep(torch, dist, dev, params, info["world_size"])
        info["backend"] = backend
        info["ok"] = True
        if params.get("stragglers"):
            phase("stragglers")
            if not _add_straggler_rounds(torch, dist, dev, params, info):
                initialized = False  # a communicator broken mid-collective can hang in destroy_process_group
        phase("done")
    except agent.Abort as exc:
        elapsed = time.monotonic() - start
        info.update(kind="aborted", error=f"aborted ({exc}) in phase {info['phase']} after {elapsed:.0f}s")
    except _Failed as exc:
        info.update(kind=exc.kind, error=str(exc), target=exc.target)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0][:600] if str(exc).strip() else ""
        text = f"{type(exc).__name__}: {first_line}"
        info.update(kind=classify(text, info["phase"]), error=text)
    finally:
        info["elapsed_s"] = round(time.monotonic() - start, 3)
        if initialized and info["ok"] and dist is not None:
            try:  # only after success: tearing down a broken NCCL communicator can hang
                dist.destroy_process_group()
            except Exception:
                pass
    return info


def _rank_info(params: Dict[str, Any]) -> Dict[str, Any]:
    """What this rank returns, as it starts: who it is (the environment supervisor.run set), not ok yet."""
    job = params["job"]
    return {"tag": job["tag"], "rank": int(os.environ.get("RANK", "-1")),
            "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
            "world_size": int(os.environ.get("WORLD_SIZE", "0")), "host": params["host"],
            "pid": os.getpid(), "ok": False, "phase": "import",
            # forked from an agent that preloaded torch: no import of its own (agent.fork_call)
            "torch_preloaded": "torch" in sys.modules}


def _import_torch() -> Tuple[Any, Any]:
    """(torch, torch.distributed); a torch that this Python cannot import is the rank's failure, named as such."""
    try:
        import torch
        import torch.distributed as torch_dist
    except Exception as exc:
        raise _Failed("torch_missing", f"torch is not importable by {sys.executable}: "
                                       f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return torch, torch_dist


def _device(torch: Any, backend: str, job: Dict[str, Any], info: Dict[str, Any]) -> Any:
    """The device the tensors live on: for NCCL the job's GPU (made current, and noted in info), else the CPU."""
    if backend == "nccl":
        torch.cuda.set_device(int(job["device"]))
        dev = torch.device("cuda", int(job["device"]))
        info["device"] = int(job["device"])
    else:
        dev = torch.device("cpu")
    return dev


def _first_all_reduce(torch: Any, dist: Any, dev: Any, world: int) -> None:
    """All-reduce a one from every rank: the first collective (which makes NCCL connect), and its sum proves it."""
    one = torch.ones(1, dtype=torch.float32, device=dev)
    dist.all_reduce(one)
    if one.item() != world:
        raise _Failed("wrong_result", f"all-reduce of ones over {world} ranks gave a wrong sum {one.item()}")


def _add_straggler_rounds(torch: Any, dist: Any, dev: Any, params: Dict[str, Any], info: Dict[str, Any]) -> bool:
    """The straggler rounds (and their time) into info; False when they failed, their error noted instead: the
    sweep's result stands, but the communicator may be broken."""
    t0 = time.monotonic()
    ok = True
    try:
        info["stragglers"] = _straggler_rounds(torch, dist, dev, params, info["rank"])
    except Exception as exc:  # the sweep's result stands; the rounds only add evidence
        info["stragglers_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        ok = False
    info["stragglers_s"] = round(time.monotonic() - t0, 3)
    return ok
