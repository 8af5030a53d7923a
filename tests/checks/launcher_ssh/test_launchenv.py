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
    # The legacy name at 0 hangs: one WARN, whose fix is to unset it (renaming it would keep the hang).
    (legacy,) = launchenv.check(snap({"NCCL_ASYNC_ERROR_HANDLING": "0"}), NET)
    assert legacy.status == Status.WARN and "no handling" in legacy.message
    assert legacy.fix.startswith("unset NCCL_ASYNC_ERROR_HANDLING")
    # At 1 it is legacy and only restates torch's default: unset it, never "rename it TORCH_NCCL_...=1", which
    # would set what the recommendation says is not needed (issue 30: notes never contradict the recommendation).
    (legacy,) = launchenv.check(snap({"NCCL_ASYNC_ERROR_HANDLING": "1"}), NET)
    assert "legacy name" in legacy.message and legacy.fix.startswith("unset NCCL_ASYNC_ERROR_HANDLING")
    assert "rename" not in legacy.fix


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


# --- the environment the ranks really get (issue 31) -------------------------------------------------------------

DS_ROOT = None


def _deepspeed_root():
    import importlib.util
    import os
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin, "DeepSpeed 0.19.8 is a test dependency"
    return os.path.dirname(spec.origin)


def test_a_torch_variable_set_only_in_the_launch_shell_is_one_warn_with_the_line_to_add(tmp_path):
    import subprocess
    found = launchenv.check(snap({"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "PATH": "/usr/bin"}), NET)
    (f,) = found
    assert f.status == Status.WARN and f.hosts == ()
    assert f.message.startswith("TORCH_DISTRIBUTED_DEBUG=DETAIL is set in the launch shell, but DeepSpeed's pdsh "
                                "launcher does not pass it to the ranks")
    assert "echo TORCH_DISTRIBUTED_DEBUG=DETAIL >> .deepspeed_env" in f.fix
    # The fix, pasted where deepspeed runs, makes the ranks get it: the WARN is gone.
    command = f.fix.split(": ", 1)[1].split(" (or ", 1)[0]
    subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True)
    after = launchenv.snapshot({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                               launchenv.read_deepspeed_env(str(tmp_path), str(tmp_path / "home"), {}))
    assert after["exported"]["TORCH_DISTRIBUTED_DEBUG"] == ["DETAIL", str(tmp_path / ".deepspeed_env")]
    assert launchenv.check(after, NET) == []
    # The others of the issue, each its own WARN; CUDA_HOME (each host's own) and PATH are not judged.
    shell = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_LAUNCH_BLOCKING": "1",
             "TORCH_SHOW_CPP_STACKTRACES": "1", "CUDA_HOME": "/usr/local/cuda"}
    named_ = sorted(f.message.split("=")[0] for f in launchenv.check(snap(shell), NET))
    assert named_ == ["CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_SHOW_CPP_STACKTRACES"]


def test_the_line_is_added_on_a_line_of_its_own_when_the_file_lacks_a_final_newline(tmp_path):
    import subprocess
    (tmp_path / ".deepspeed_env").write_text("WANDB_PROJECT=x")  # no newline at the end
    ds_env = launchenv.read_deepspeed_env(str(tmp_path), str(tmp_path / "home"), {})
    (f,) = launchenv.check(launchenv.snapshot({"TORCH_DISTRIBUTED_DEBUG": "INFO"}, ds_env), NET)
    command = f.fix.split(": ", 1)[1].split(" (or ", 1)[0]
    assert command.startswith("printf"), command
    subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True)
    again = launchenv.read_deepspeed_env(str(tmp_path), str(tmp_path / "home"), {})
    assert again["vars"] == {"WANDB_PROJECT": "x", "TORCH_DISTRIBUTED_DEBUG": "INFO"} and again["bad_lines"] == []


def test_a_host_that_sets_the_variable_itself_is_not_named():
    shell = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    own = {"node01": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "node02": {}}
    (f,) = launchenv.check(snap(shell), NET, own)
    assert list(f.hosts) == ["node02"] and "to the ranks on node02" in f.message
    both = {"node01": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "node02": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}}
    assert launchenv.check(snap(shell), NET, both) == []
    # What a rank starts with there: the host's own, then the exports, which win.
    snap_ = snap({"NCCL_DEBUG": "WARN"}, {"NCCL_DEBUG": "INFO"})
    ranks = launchenv.rank_env(snap_, {"NCCL_DEBUG": "TRACE", "TORCH_LOGS": "+dynamo"})
    assert ranks == {"NCCL_DEBUG": ["INFO", "/job/.deepspeed_env"],
                     "TORCH_LOGS": ["+dynamo", "the host's own environment"]}


def test_host_environment_is_parsed_as_data():
    text = ("PATH=/bin\nTORCH_DISTRIBUTED_DEBUG=INFO\nNCCL_DEBUG=" + "x" * 999 + "\n$(evil)=1\nnot a line\n"
            "MLFLOW_TRACKING_PASSWORD=secret\nPYTHONSTARTUP=/x\n")  # not read by a rank: not kept
    env = launchenv.parse_host_env(text)
    assert env == {"TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "x" * launchenv.VALUE_KEEP}


def test_the_launchers_order_and_exclusions(tmp_path):
    """DeepSpeed 0.19.8 runner.py:591-611: the shell's EXPORT_ENVS prefixes, then ~/.deepspeed_env, then
    ./.deepspeed_env (a later value wins); with AISC_JOB_NAME set, EXCLUDE_ENVS' names are not exported."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nTORCH_LOGS=+dynamo\n")
    (work / ".deepspeed_env").write_text("NCCL_DEBUG=TRACE\n")
    shell = {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5", "UCX_NET_DEVICES": "mlx5_0:1", "AISC_JOB_NAME": "j"}
    got = launchenv.snapshot(shell, launchenv.read_deepspeed_env(str(work), str(home), {}))["exported"]
    assert got == {"NCCL_DEBUG": ["TRACE", str(work / ".deepspeed_env")],
                   "TORCH_LOGS": ["+dynamo", str(home / ".deepspeed_env")]}


def test_a_misspelt_name_gets_a_did_you_mean():
    (f,) = launchenv.check(snap({"DS_ACCELERATORATOR": "cuda"}), NET)
    assert f.status == Status.WARN and "did you mean DS_ACCELERATOR?" in f.message
    assert f.message.startswith("DS_ACCELERATORATOR=cuda (the launch shell) is not a variable")
    assert f.fix.startswith("unset DS_ACCELERATORATOR; echo DS_ACCELERATOR=cuda >> .deepspeed_env (in the directory")
    for typo, meant in (("TORCH_DISTRIBUTED_DEBG", "TORCH_DISTRIBUTED_DEBUG"), ("NCCL_SOCKET_IFNAM", "NCCL_SOCKET_IFNAME"),
                        ("NCCL_SOCKET_IFANME", "NCCL_SOCKET_IFNAME"), ("DS_SKIP_CUDA_CHEK", "DS_SKIP_CUDA_CHECK")):
        assert launchenv.did_you_mean(typo) == meant, typo
    # In a .deepspeed_env too, naming the file.
    (g,) = launchenv.check(snap(ds_vars={"NCCL_IB_HCAA": "mlx5_0"}), NET)
    assert "did you mean NCCL_IB_HCA?" in g.message and "(/job/.deepspeed_env)" in g.message
    assert g.fix == "sed -i 's/^NCCL_IB_HCAA=/NCCL_IB_HCA=/' /job/.deepspeed_env"
    (h,) = launchenv.check(snap({"NCCL_SOCKET_IFNAM": "eth0"}), NET)
    assert h.fix == "unset NCCL_SOCKET_IFNAM; export NCCL_SOCKET_IFNAME=eth0"  # NCCL*: passed from the shell


def test_the_rename_fixes_work_when_pasted(tmp_path):
    """Each did-you-mean fix, run: the .deepspeed_env's line renamed in place; the launch shell's name moved into
    the .deepspeed_env the ranks get; afterwards nothing is left to say."""
    import subprocess
    (tmp_path / ".deepspeed_env").write_text("WANDB_PROJECT=x\nDS_SKIP_CUDA_CHEK=1\n")
    ds_env = launchenv.read_deepspeed_env(str(tmp_path), str(tmp_path / "home"), {})
    shell = {"DS_ACCELERATORATOR": "cpu"}
    found = launchenv.check(launchenv.snapshot(shell, ds_env), {})
    assert sorted(f.message.split(" ")[0] for f in found) == ["DS_ACCELERATORATOR=cpu", "DS_SKIP_CUDA_CHEK=1"]
    script = "; ".join(f.fix.split(" (in the directory")[0] for f in found) + "; env"
    out = subprocess.run(["sh", "-c", script], cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **shell},
                         capture_output=True, text=True, check=True).stdout
    after_shell = {k: v for k, v in (line.split("=", 1) for line in out.splitlines() if "=" in line)
                   if k in shell or k.startswith("DS_")}
    after = launchenv.check(launchenv.snapshot(after_shell, launchenv.read_deepspeed_env(
        str(tmp_path), str(tmp_path / "home"), {})), {})
    assert after == [], after
    assert (tmp_path / ".deepspeed_env").read_text() == "WANDB_PROJECT=x\nDS_SKIP_CUDA_CHECK=1\nDS_ACCELERATOR=cpu\n"


def test_no_did_you_mean_for_the_variables_of_a_usual_container():
    """Real names a CUDA/PyTorch image or a site sets, none of them a typo (the did-you-mean must not cry wolf)."""
    real = ("NVIDIA_VISIBLE_DEVICES CUDA_VERSION CUDA_HOME CUDA_PATH CUDA_ROOT PYTHONPATH PYTHONUNBUFFERED "
            "PYTHONHASHSEED PYTHONDONTWRITEBYTECODE PYTHONIOENCODING NCCL_VERSION CUDNN_VERSION TORCH_HOME "
            "PYTORCH_VERSION TORCH_NCCL_USE_COMM_NONBLOCKING TORCHELASTIC_RUN_ID NCCL_IB_QPS_PER_CONNECTION "
            "NCCL_NCHANNELS_PER_NET_PEER CUDA_DRIVER_VERSION NCCL_IB_TIMEOUT NCCL_IB_SL NCCL_IB_TC DS_BUILD_OPS "
            "TORCH_CPP_LOG_LEVEL CUDA_CACHE_MAXSIZE TRITON_CACHE_DIR")
    assert [n for n in real.split() if launchenv.did_you_mean(n)] == []
    assert launchenv.check(snap({n: "1" for n in real.split() if n.startswith("NCCL_")}), {}) == []


def test_a_deepspeed_looking_name_deepspeed_does_not_read_is_a_note():
    found = launchenv.check(snap({"DEEPSPEED_DEBUG": "1", "DEEPSPEED_PROFILE": "1"}), NET)
    assert [f.status for f in found] == [Status.PASS, Status.PASS]  # notes: said, never a warning
    assert found[0].message.startswith("DEEPSPEED_DEBUG (the launch shell) is not a variable DeepSpeed 0.19.8 reads")


def test_the_deepspeed_names_are_those_of_the_installed_deepspeed():
    """DEEPSPEED_READS is every DS_/DEEPSPEED_ string literal of the installed DeepSpeed: re-derived here, so an
    upgrade that adds or drops one fails this test."""
    import os
    import re
    found = set()
    for folder, _, files in os.walk(_deepspeed_root()):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), errors="replace") as fh:
                    found.update(re.findall(r"[\"']((?:DS|DEEPSPEED)_[A-Z0-9_]+)[\"']", fh.read()))
    assert found == set(launchenv.DEEPSPEED_READS), (found ^ set(launchenv.DEEPSPEED_READS))


def test_the_torch_names_appear_in_the_installed_torch():
    import importlib.util
    import os
    root = os.path.dirname(importlib.util.find_spec("torch").origin)
    wanted = set(launchenv.TORCH_READS) - {"OMP_NUM_THREADS"}  # the OpenMP runtime's
    for folder, _, files in os.walk(root):
        for name in files:
            if wanted and name.endswith((".py", ".h", ".hpp")):
                with open(os.path.join(folder, name), errors="replace") as fh:
                    text = fh.read()
                wanted = {w for w in wanted if w not in text}
    assert wanted == set(), wanted


def test_a_comment_in_deepspeed_env_stops_the_launch_and_fails(tmp_path):
    """DeepSpeed's own export builder on a .deepspeed_env with a '#' line: the shell command every host runs loses
    everything after the '#' (no rank would start); the check FAILs naming the file and line."""
    import subprocess
    from tests.hostile import deepspeed_exports
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("A=1\n# the debug level=x\nB=2\n")
    script = deepspeed_exports(env_file) + " echo RAN"
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert "RAN" not in ran.stdout  # the command after the exports never ran
    ds_env = launchenv.read_deepspeed_env(str(tmp_path), str(tmp_path / "home"), {})
    (f,) = [f for f in launchenv.check(launchenv.snapshot({}, ds_env), NET) if f.status == Status.FAIL]
    assert f.message.startswith(f"{env_file}:2: # the debug level=x: its name is not a variable name")
    assert "no rank starts" in f.message and f.fix.startswith("remove the line")
