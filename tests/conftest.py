"""Shared pytest fixtures, the test tiers (unit, cluster, slurm, gpu: docs/testing.md), and CI's rule that a test
may not skip for lack of root, namespaces or a tool."""

import contextlib
import fcntl
import functools
import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[1]

# A suite started in the background by a non-interactive shell (`.ci/run &`, nohup) inherits SIGINT ignored, and
# every preflight it starts would too (Python installs its KeyboardInterrupt handler only over the default): the
# Ctrl-C tests would interrupt nothing. A Python handler here becomes the default again in each exec'd child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# preflight records every run in a history store (default ~/.local/share/preflight/history.db) and judges each host
# against its past runs: the suite's runs would pile up there and become baselines for later tests. Off for the
# suite and every CLI it starts; tests/history/test_history.py names its own stores.
os.environ["PREFLIGHT_HISTORY"] = "off"


def _skip_without_netcluster() -> None:
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)


@pytest.fixture
def netcluster_factory():
    """make(n=3, networks=1, setup=None, names=None) -> NetCluster; all are closed at teardown."""
    _skip_without_netcluster()
    with contextlib.ExitStack() as clusters:  # closes every cluster even if one close fails
        def make(n=3, networks=1, setup=None, names=None):
            return clusters.enter_context(NetCluster(n, networks=networks, setup=setup, names=names))
        yield make


@pytest.fixture(scope="session")
def cluster3():
    """Three hosts node01..node03 shared by every module that uses it (one per pytest-xdist worker): a test must
    undo what it changes (a firewall, a shaped link, a file in a host's /tmp), and a fault host it adds stays for
    the session, so its name must be new (``add_blackhole("deadhost")`` is tests/cli/test_pytest_plugin.py's)."""
    _skip_without_netcluster()
    with NetCluster(3, names=["node01", "node02", "node03"]) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def warm_ops(tmp_path_factory):
    """Build (or find) DeepSpeed's CPU ops in this machine's torch extensions cache, which the namespace hosts read
    through their home overlay: a one-rank rehearsal of the rehearsal's own script, here. A test that starts ranks
    on namespace hosts asks for it: each host writes into its own overlay, so from a cold cache every host would
    build every op itself, side by side (in CI a 3-host rehearsal spent its whole 400 s doing so)."""
    pytest.importorskip("deepspeed")
    from preflight.hostside import rehearsal as host_side

    work = tmp_path_factory.mktemp("warm")
    shutil.copy(host_side.__file__, work / "preflight_rehearse.py")
    config = work / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                  "zero_optimization": {"stage": 2}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    env.pop("DS_ENV_FILE", None)
    proc = subprocess.run([sys.executable, "preflight_rehearse.py", "--deepspeed_config", str(config),
                           "--preflight-run", "warm", "--lifetime", "1500"], cwd=work, capture_output=True, text=True,
                          timeout=1600, stdin=subprocess.DEVNULL, env=env)
    events = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
              if line.startswith(host_side.TAG)]
    assert any(e["event"] == "done" for e in events), proc.stdout[-3000:] + proc.stderr[-3000:]
    ops = next(e for e in events if e["event"] == "done")["ops"]
    print(f"\nops warmed in {time.monotonic() - started:.1f} s: {ops}")
    return ops


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test gets the environment the suite started with, whatever the last one set: a check's collect called
    in-process sets os.environ as it would in its agent (compute sets CUDA_DEVICE_ORDER), and every preflight run a
    later test starts would inherit it as the launch shell's, which launcher_ssh rightly WARNs about."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def thresholds():
    """The documented defaults (each check's TOML beside it, and preflight/defaults.toml), as evaluate() gets them
    without --config."""
    from preflight.config import load_defaults
    return load_defaults()


# With PREFLIGHT_STRICT_SKIPS=1 (set by .ci/run) a skip fails the test, unless its reason is one of these, which
# describe the machine rather than a missing install step. A namespace-cluster test that skips because CI lost
# root or a package would otherwise turn the suite green while testing nothing.
EXPECTED_SKIPS = (
    "DeepSpeed is installed on this machine",
    "a real NVIDIA driver is present",
    "this machine has an NVIDIA driver",
    "no NVIDIA GPU on this machine",  # tests/checks/gpu/test_gpu_device.py, module-level
)


def _strict(report) -> None:
    """Turn an unexpected skip into a failure under PREFLIGHT_STRICT_SKIPS=1 (a test's, or a whole module's)."""
    if not report.skipped or os.environ.get("PREFLIGHT_STRICT_SKIPS") != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not any(expected in reason for expected in EXPECTED_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped under PREFLIGHT_STRICT_SKIPS=1 (CI must run every test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _strict(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip (or pytest.skip(allow_module_level=True)) skips at collection, where
    # no test report is made: without this, a missing package would silently drop a whole module under CI.
    outcome = yield
    _strict(outcome.get_result())


# ------------------------------------------------------------------ tiers
# Every test gets exactly one tier marker, here, from what it uses (docs/testing.md):
#   unit     no root, no namespace host, no Slurm, and quick: `python3 -m pytest -m unit` is the fast loop
#   slow     no root and no namespace host either, but seconds each: it starts preflight, pytest, pip, mypy or a
#            browser as real processes, or waits out a deadline (SLOW below)
#   cluster  namespace hosts with real sshd (tests/netcluster.py), or root for a private mount namespace
#   slurm    a Slurm cluster on namespace hosts (tests/slurmcluster.py)
#   gpu      a real NVIDIA GPU (tests/checks/gpu/test_gpu_device.py)
# A test is cluster (or slurm) when it or one of its fixtures builds a NetCluster (SlurmCluster): found by reading
# their code, so a new module-local fixture needs no entry here. A test marked unit that builds namespace hosts
# anyway fails: NetCluster refuses while PREFLIGHT_TEST_NO_NAMESPACES is set, which it is around each unit test.
TIERS = ("unit", "slow", "cluster", "slurm", "gpu")
NO_NAMESPACES = "PREFLIGHT_TEST_NO_NAMESPACES"
CLUSTER_FIXTURES = {"netcluster_factory", "cluster3"}
_BUILDS = {"slurm": re.compile(r"\bSlurmCluster\("), "cluster": re.compile(r"\bNetCluster\(")}
ALL = None  # every test of the module that is not cluster, slurm or gpu
# Modules are named by their file name without folder (item.path.stem): test file names are unique across tests/.
# Tests that need root without building a NetCluster: a private mount namespace (`unshare -m`), module -> tests.
# (Found by running the unit and slow tiers as nobody.)
NEEDS_ROOT = {
    "test_agent_reap": ("test_reap_spares_an_agent_of_the_same_run_in_another_hosts_uts_namespace",),  # unshare
    "test_bad_input": ("test_output_in_a_read_only_directory_is_exit_2_at_once",),
    "test_ds_config": ("test_the_unusable_nvme_path_fix_works_when_pasted_with_an_odd_path",),  # its fix chowns
    "test_gpu_expected": ("test_a_real_device_node_is_evidence",),
    "test_inputs": ("test_the_null_device_reads_as_empty_as_openssh_reads_dash_F_dev_null",),  # mknod
    "test_libaio": ("test_runtime_only_host_for_real", "test_library_bind_mounted_over_with_empty_file_for_real"),
    "test_nvme": ("test_no_o_direct_on_real_ramfs_is_detected",),
    "test_proxyjump": ("test_proxy_values_are_expanded_like_openssh",),  # expects %r to be root
}
# The tests that took 0.3 s or more (setup, call and teardown together) on the 2-core machine under load
# (`python3 -m pytest -m unit --durations=0`): module -> test functions (every parametrization of each). The rest of
# the unit tier, ~900 tests, runs in under 60 s there; a new test that starts a process belongs here.
SLOW = {
    "test_allreduce": ("test_supervisor_bounds_a_rank_that_never_comes_and_kills_the_rest",
        "test_supervisor_runs_one_process_per_slot",),
    "test_argv_safety": ("test_every_argv_with_a_host_value_has_dashdash",),
    "test_bad_input": ALL,
    "test_check_deps": ("test_no_check_imports_another",),
    "test_cli_cluster": ("test_local_run_without_hostfile_needs_no_ssh",),
    "test_cli_help": ("test_the_ssh_options_help_is_printed", "test_typos_are_one_line_exit_2_with_did_you_mean",),
    "test_cluster_phase": ("test_a_local_run_preloads_torch_at_connect_as_a_remote_one_does",
        "test_a_quiet_check_that_never_returns_costs_its_own_cell_only",),
    "test_compute": ("test_collect_measures_this_cpu_for_real",),
    "test_config": ("test_a_status_typo_in_a_config_is_exit_2_naming_key_and_values_before_any_host",
        "test_config_without_what_to_print_is_a_usage_error", "test_the_printed_defaults_load_back_as_a_config",),
    "test_coordinator_scale": ALL,
    "test_ds_config": ("test_cli_stops_on_a_config_that_does_not_parse_with_file_line_col",),
    "test_ds_report": ("test_collect_in_a_forked_child_reports_what_a_fresh_interpreter_reports",
        "test_fork_python_inherits_this_processs_imports_and_is_bounded",
        "test_the_forked_probe_finishes_inside_an_agent_worker",),
    "test_fault_isolation": ALL,
    "test_gpu_expected": ("test_a_real_device_node_is_evidence",),
    "test_healthy_hostfile": ("test_a_bad_min_hosts_is_exit_2_in_one_line",
        "test_write_hostfile_in_a_missing_directory_is_exit_2_before_any_host",),
    "test_history": ("test_a_corrupt_or_unwritable_store_never_fails_the_gate",
        "test_a_host_below_its_own_past_warns_on_its_cell_and_the_reports_stay_valid",
        "test_a_locked_store_never_fails_the_gate", "test_bad_history_input_is_one_line_and_exit_2",
        "test_eight_node_checks_writing_one_store_at_once_all_succeed_and_lose_nothing",
        "test_history_and_diff_read_back_what_was_recorded", "test_node_check_warns_against_its_own_past",
        "test_parallel_writers_lose_nothing", "test_prune_keeps_the_recent_runs_and_gives_the_space_back",
        "test_reading_a_store_that_is_not_there_is_exit_2_and_creates_nothing",
        "test_the_default_store_and_turning_it_off", "test_the_size_the_docs_state_is_measured",),
    "test_host_cleanup": ("test_a_kept_file_removed_by_a_later_request_is_forgotten_by_the_ledger",),
    "test_hostfile": ("test_cli_hostfile_bad_input_is_one_line_and_exit_2",
        "test_cli_hostfile_file_bad_input_is_one_line_and_exit_2",
        "test_cli_hostfile_file_lists_the_parsed_hosts_without_expand", "test_cli_hostfile_wants_exactly_one_file",
        "test_expand_output_is_read_by_deepspeeds_fetch_hostfile",),
    "test_hostfile_differential": ALL,
    "test_html": ("test_browser_renders_a_64_host_report", "test_cli_html_option_is_validated_and_written",),
    "test_install": ALL,
    "test_launch_path": ("test_master_addr_option_is_validated",),
    "test_launcher_ssh": ("test_probe_respects_the_overall_deadline",
        "test_probe_runs_concurrently_bounded_and_kills_slow_ssh",),
    "test_layout": ("test_no_module_under_preflight_uses_another_modules_private_name",),
    "test_libaio": ("test_collect_compile_timeout_leaves_nothing", "test_collect_here_passes_and_is_json",
        "test_collect_signal_during_compile_leaves_nothing",
        "test_library_bind_mounted_over_with_empty_file_for_real", "test_runtime_only_host_for_real",),
    "test_node_check": ("test_a_bad_checks_section_is_one_line_naming_the_file_and_key",
        "test_an_interpreter_that_never_answers_is_killed_at_the_deadline_and_nothing_is_left",
        "test_bad_input_is_one_line_and_exit_2", "test_the_checks_node_check_and_run_run_come_from_the_same_config",
        "test_thresholds_come_from_the_config_run_takes_and_the_test_file_is_removed",),
    "test_nvme": ("test_collect_dd_timeout_leaves_nothing", "test_no_o_direct_on_real_ramfs_is_detected",
        "test_signal_during_dd_leaves_nothing",),
    "test_ports": ("test_probe_times_out_and_stays_within_its_budget_against_a_silent_port",),
    "test_prometheus": ("test_node_check_refuses_a_path_it_cannot_write_before_it_runs",
        "test_prometheus_scraping_node_exporter_returns_the_status_node_check_wrote",
        "test_run_writes_the_metrics_of_its_report",),
    "test_proxyjump": ("test_unparsable_ssh_config_is_a_usage_error",),
    "test_pytest_plugin": ("test_bad_input_is_one_usage_error_and_nothing_runs",
        "test_dash_k_runs_only_the_checks_it_selects", "test_local_run_through_dash_p_without_autoload",
        "test_without_preflight_options_the_plugin_adds_nothing",),
    "test_python_check": ALL,
    "test_readme_example": ("test_the_module_its_toml_and_one_registry_line_are_all_a_check_needs",
        "test_the_pages_commands_pass_in_the_copy",),
    "test_readme_first_command": ALL,
    "test_rehearse": ("test_bad_input_is_one_line_and_exit_2",
        "test_the_launch_check_is_opt_in_and_selected_by_rehearse",),
    "test_renderers": ("test_a_renderer_registered_by_another_module_is_a_pytest_option_that_writes_its_file",
        "test_a_renderer_registered_by_another_module_writes_its_file_in_a_real_cli_run",),
    "test_severity": ("test_every_compute_peer_finding_is_significant",),
    "test_slurm": ("test_an_srun_that_never_reads_its_stdin_cannot_hold_the_agent_past_its_deadline",
        "test_closing_the_srun_transport_leaves_no_srun_that_ignores_its_lifeline",),
    "test_strict_skips": ALL,
    "test_terminal": ("test_the_progress_line_keeps_ticking_while_one_phase_waits",),
    "test_tiers": ("test_each_test_gets_its_tier_from_what_it_uses",),
    "test_testing": ("test_the_module_sample_runs",),
    "test_transport_local": ("test_a_command_that_stops_reading_its_stdin_fails_the_send_and_is_killed",
        "test_agent_collects_facts_and_reports_check_errors_per_check", "test_deadline_kills_the_whole_process_tree",
        "test_one_persistent_agent_serves_every_request_and_preloads_torch",
        "test_a_command_started_to_die_with_its_parent_goes_when_the_coordinator_is_killed",),
    "test_trends": ("test_the_report_draws_each_hosts_figures_against_its_own_past",),
    "test_typing_seam": ("test_a_correct_check_passes", "test_a_wrong_attribute_on_the_seam_fails",
        "test_an_unannotated_coordinate_fails_instead_of_going_unchecked",
        "test_the_public_fake_cluster_is_a_cluster_view_to_mypy",),
}
# Added after the tiers were first measured (the same rule: 0.3 s or more in `-m unit --durations=0`).
SLOW.update({
    "test_no_placeholder": ALL,  # reruns the checks' unit tests in a child pytest
    "test_pasted_fixes": ALL, "test_jit_cold": ALL, "test_honest_output": ALL, "test_ds_config_auto": ALL,
    "test_checkpoint_version": ALL, "test_calibration": ("test_a_fast_subset_of_the_calibration_grid_meets_the_targets",
                                                             "test_the_iperf3_core_names_what_evaluate_names"), "test_typing_seam": ALL, "test_history_causes": ALL,
    "test_dependencies": ALL, "test_num_nodes": ALL, "test_transport_seam": ALL,
    "test_compute": SLOW["test_compute"] + ("test_a_cuda_torch_whose_is_available_warns_and_says_false_is_not_passed",),
    "test_launchenv": ("test_the_torch_names_appear_in_the_installed_torch",),
})


@functools.lru_cache(maxsize=None)
def _builds(func) -> str | None:
    """'slurm' or 'cluster' when this function's own code builds such a cluster, else None."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return None
    for tier, pattern in _BUILDS.items():  # slurm first: a SlurmCluster is also namespace hosts
        if pattern.search(source):
            return tier
    return None


def _tier(item) -> str:
    if item.get_closest_marker("gpu"):
        return "gpu"
    found = {_builds(getattr(item, "function", None))}
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        if name in CLUSTER_FIXTURES:
            found.add("cluster")
        found.update(_builds(d.func) for d in defs)
    if "slurm" in found:
        return "slurm"
    if "cluster" in found:
        return "cluster"
    module = item.path.stem
    name = getattr(item, "originalname", item.name)
    if module in NEEDS_ROOT and (NEEDS_ROOT[module] is ALL or name in NEEDS_ROOT[module]):
        return "cluster"
    if module in SLOW and (SLOW[module] is ALL or name in SLOW[module]):
        return "slow"
    return "unit"


# Namespace-host modules whose assertions compare measurements (link rates shaped by tc, CPU quotas, stragglers,
# latencies, a run's wall time against a healthy one's): under --dist loadgroup they are one group, run one after the
# other on one worker, so that no two of them measure at once.
MEASURING = {"test_allreduce", "test_calibration", "test_compute", "test_coordinator_scale", "test_failfast",
             "test_history", "test_html", "test_iperf3", "test_iperf3_floor", "test_latency", "test_netcluster",
             "test_recommend_inherited", "test_severity", "test_single_node", "test_gate_overlap"}


# Modules whose slow and namespace tests start DeepSpeed's ranks, which load (and JIT-build, when a test made the
# cache cold or another process is rebuilding) ops in the one torch extensions cache this machine's hosts share
# (~/.cache/torch_extensions): side by side, one waits minutes on the other's build lock. CI once timed a 3-host
# rehearsal out at 400 s that way. They run one after another on one worker (the "torch-extensions" group).
TORCH_EXTENSIONS = {"test_rehearse", "test_jit_cold", "test_ds_config_auto", "test_launch_faults",
                    "test_launch_shell_cause", "test_checkpoint_version"}


def xdist_group(item, tier: str) -> str:
    """The pytest-xdist group of a test under --dist loadgroup: "measure" for a namespace test of MEASURING,
    "torch-extensions" for a test of TORCH_EXTENSIONS beyond the unit tier, else its module (a module's fixtures,
    module- or session-scoped, are then built once on the worker that runs it)."""
    module = item.path.stem
    if tier in ("cluster", "slurm", "gpu") and module in MEASURING:
        return "measure"
    return "torch-extensions" if tier != "unit" and module in TORCH_EXTENSIONS else module


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist's --dist loadgroup (.ci/run runs `-n 2 --dist loadgroup`; PREFLIGHT_CI_JOBS=1 runs serially):
    # each module is a group, so that namespace modules that only read their hosts, and the unit and slow tiers, run
    # beside each other; the measuring namespace modules are one group (MEASURING). NetCluster claims its own /24s,
    # namespaces, names and state directory, so clusters of two workers never meet.
    grouped = getattr(config.option, "loadgroup", False)  # what xdist sets in a worker for --dist loadgroup
    for item in items:
        tier = _tier(item)
        item.add_marker(getattr(pytest.mark, tier))
        if grouped:
            item.add_marker(pytest.mark.xdist_group(xdist_group(item, tier)))


@contextlib.contextmanager
def _measuring_alone(item):
    """Under pytest-xdist, a test of the "measure" group holds an exclusive lock of this test run and every other
    test a shared one, so that a measurement never runs beside another worker's tests (they would take the 2
    cores it measures on: a healthy host's TCP round trip read 10 ms beside them). Outside xdist, nothing."""
    worker = getattr(item.config, "workerinput", None)  # only an xdist worker, not a pytest a test starts
    if worker is None:
        yield
        return
    run = worker["testrunuid"]
    group = item.get_closest_marker("xdist_group")
    alone = bool(group and group.args and group.args[0] == "measure")
    # The workers' temporary directories (popen-gw0, ...) share a parent: this run's, which pytest rotates away.
    path = item.config._tmp_path_factory.getbasetemp().parent / f"measure-{run}.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Set for a unit test's setup, call and teardown (and every process it starts), unset for every other test.
    if item.get_closest_marker("unit"):
        os.environ[NO_NAMESPACES] = item.nodeid
    try:
        with _measuring_alone(item):
            yield
    finally:
        os.environ.pop(NO_NAMESPACES, None)
