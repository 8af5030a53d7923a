"""The inherited environment (preflight/hostside/launchenv.py): the findings that contradict preflight's own rules
for the NCCL/Gloo variables, on interface facts shaped as launcher_ssh passes them (``host_net``)."""
from __future__ import annotations

from preflight.hostside import launchenv
from preflight.hostside.outcome import Status

NET = {"node01": {"ifnames": ["lo", "eth0", "docker0"], "ib": [{"device": "mlx5_0", "port": 1, "active": True}]},
       "node02": {"ifnames": ["lo", "eth0"], "ib": [{"device": "mlx5_0", "port": 1, "active": True}]}}


def snap(shell=None, ds_vars=None):
    ds_env = {"files": ["/job/.deepspeed_env"] if ds_vars else [], "vars": dict(ds_vars or {}), "bad_lines": []}
    return launchenv.snapshot(dict(shell or {}), ds_env)


def named(found, prefix):
    return [f for f in found if f.message.startswith(prefix)]


def test_error_handling_that_keeps_a_failed_rank_alive_warns():
    # torch's default (3) tears the process down; 0 and 2 leave the job hanging on a failed collective.
    for value, what in (("0", "no handling"), ("2", "abort the communicators without tearing down")):
        (f,) = named(launchenv.check(snap(ds_vars={"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}), NET),
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING")
        assert f.status == Status.WARN and what in f.message and "/job/.deepspeed_env" in f.message
        assert "torch's default (3, SkipCleanUp) tears the process down" in f.message
        assert f.fix.startswith("unset TORCH_NCCL_ASYNC_ERROR_HANDLING")
    # 1 and 3 end the job: nothing to say. The legacy name at 0 is both legacy and hanging.
    for value in ("1", "3"):
        assert launchenv.check(snap(ds_vars={"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}), NET) == []
    legacy = launchenv.check(snap({"NCCL_ASYNC_ERROR_HANDLING": "0"}), NET)
    assert [f.status for f in legacy] == [Status.WARN, Status.WARN]
    assert "legacy name" in legacy[0].message and "no handling" in legacy[1].message


def test_ib_disabled_on_a_cluster_with_active_ib_everywhere_warns():
    (f,) = launchenv.check(snap({"NCCL_IB_DISABLE": "1"}), NET)
    assert f.status == Status.WARN and "every host (node01, node02) has an active IB/RoCE port" in f.message
    assert f.fix.startswith("unset NCCL_IB_DISABLE (remove it from the launch shell)")
    # One host without an active port: NCCL cannot mix IB and sockets, so disabling it is a fair choice.
    mixed = dict(NET, node02={"ifnames": ["lo", "eth0"], "ib": [{"device": "mlx5_0", "port": 1, "active": False}]})
    assert launchenv.check(snap({"NCCL_IB_DISABLE": "1"}), mixed) == []
    # No interface facts: not judged.
    assert launchenv.check(snap({"NCCL_IB_DISABLE": "1"}), {}) == []


def test_socket_ifname_on_loopback_or_docker_fails_on_those_hosts():
    (f,) = launchenv.check(snap({"NCCL_SOCKET_IFNAME": "lo"}), NET)
    assert f.status == Status.FAIL and list(f.hosts) == ["node01", "node02"]
    assert f.message.startswith("NCCL_SOCKET_IFNAME=lo (the launch shell) matches only loopback or docker "
                                "interfaces on node01, node02")
    # docker0 exists on node01 only: node02 matches nothing (the existing FAIL), node01 only docker.
    found = launchenv.check(snap({"NCCL_SOCKET_IFNAME": "docker"}), NET)
    assert [(f.status, list(f.hosts)) for f in found] == [(Status.FAIL, ["node02"]), (Status.FAIL, ["node01"])]
    assert "matches no interface on node02" in found[0].message and "only loopback or docker" in found[1].message
    # A real NIC among the matches, or one host only (a local launch): nothing.
    assert launchenv.check(snap({"NCCL_SOCKET_IFNAME": "eth0,lo"}), NET) == []
    assert launchenv.check(snap({"NCCL_SOCKET_IFNAME": "lo"}), {"node01": NET["node01"]}) == []
    (gloo,) = launchenv.check(snap(ds_vars={"GLOO_SOCKET_IFNAME": "lo"}), NET)
    assert gloo.status == Status.FAIL and "connectFullMesh" in gloo.message and list(gloo.hosts) == ["node01", "node02"]
