"""The run's inputs are a registry (issue 32): each check declares its own flags (``CheckSpec.options``), the shared
groups and ``--set`` live in preflight/flags.py, and every command's options, the pytest plugin's, docs/checks.md
and the thresholds are generated from that one declaration, as tests/render/test_renderers.py shows for the outputs."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Dict, List

import pytest

from preflight import checks as registry
from preflight import cli, flags, pytest_plugin, testing
from preflight.config import ConfigError, load_defaults
from preflight.hostside import seams
from preflight.hostside.outcome import Outcome, Status, limits

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> Dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def test_every_check_option_is_in_each_commands_help_the_plugin_and_the_docs():
    declared = [(option, spec.name) for spec in registry.all_specs() for option in spec.options]
    assert {o.flag for o, _ in declared} >= {"--nvme-path", "--checkpoint-dir", "--model-params", "--min-busbw",
                                             "--rehearse"}
    commands = _commands()
    plugin = {f.cli: f for f in pytest_plugin.flags()}
    docs = (ROOT / "docs" / "checks.md").read_text()
    for option, check in declared:
        for command in option.commands:
            parser = commands[command]
            action = _flags(parser).get(option.flag)
            assert action is not None and action.help == option.help and action.dest == option.dest, \
                (command, option.flag)
            assert option.flag in parser.format_help(), (command, option.flag)
        if "run" in option.commands:
            assert plugin[option.flag].help == option.help and plugin[option.flag].option == \
                "--preflight-" + option.flag[2:]
        section = docs[docs.index(f"\n## {check}\n"):]
        section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
        assert f"- `{option.flag}" in section and option.help in section, (check, option.flag)
    for command, parser in commands.items():  # and no command offers a check's option it does not declare
        offered = {o.flag for o, _ in registry.options(command)}
        assert offered == {o.flag for o, _ in declared if command in o.commands} and \
            offered <= set(_flags(parser)), command


def test_the_plugin_offers_the_shared_groups_and_every_check_option_with_the_clis_names_and_defaults():
    plugin = [f.cli for f in pytest_plugin.run_flags()]
    assert plugin[:5] == ["--hostfile", "--include", "--slots", "--exclude", "--python"]
    assert "--set" in plugin and "--known-hosts" in plugin and "--num_nodes" not in plugin
    run = _flags(_commands()["run"])
    for flag in plugin:  # every one is a `preflight run` option, so cli_argv's argv parses
        assert flag in run, flag
    assert not hasattr(pytest_plugin, "RUN_FLAGS")


def test_a_threshold_option_sets_its_key_through_limits_only(tmp_path):
    args = cli.build_parser().parse_args(["run", "--min-busbw", "20", "--set", "nvme.min_write_gbps=1.5",
                                          "--set", "driver_cuda.minor_compat_status=FAIL"])
    thresholds = flags.thresholds(args)
    assert limits(thresholds, "allreduce")["min_busbw"] == 20.0
    assert limits(thresholds, "nvme")["min_write_gbps"] == 1.5
    assert thresholds["driver_cuda"]["minor_compat_status"] == "fail"  # a word that is not TOML is text
    assert load_defaults()["allreduce"]["min_busbw"] == 0.0  # no floor unless given
    options = flags.check_options(args, "ssh")
    assert "min_busbw" not in options.inputs and not hasattr(options, "min_busbw")
    # a flag wins over --set and --config for its key
    config = tmp_path / "site.toml"
    config.write_text("[allreduce]\nmin_busbw = 5.0\n")
    args = cli.build_parser().parse_args(["run", "--config", str(config), "--set", "allreduce.min_busbw=7",
                                          "--min-busbw", "9"])
    assert flags.thresholds(args)["allreduce"]["min_busbw"] == 9.0


@pytest.mark.parametrize("argv, line", [
    (["--min-busbw", "-1"], "--min-busbw: allreduce.min_busbw = -1.0 is out of range; expected 0 <= x <= 1000000"),
    (["--set", "allreduce.min_busbw=x"], "--set allreduce.min_busbw=x: allreduce.min_busbw = 'x' must be a float "
                                         "like the default 0.0"),
    (["--set", "allreduce.nope=1"], "--set allreduce.nope=1: unknown key allreduce.nope; known keys: "),
    (["--set", "nope.x=1"], "--set nope.x=1: unknown section [nope]; known sections: "),
    (["--set", "min_busbw=3"], "--set 'min_busbw=3': expected CHECK.KEY=VALUE, e.g. --set allreduce.min_busbw=20"),
    (["--set", "allreduce.min_bytes=134217728"], "the thresholds with --set and the checks' options: "
                                                 "allreduce.min_bytes = 134217728 must not exceed allreduce.max_bytes "
                                                 "= 67108864"),
])
def test_a_bad_override_is_one_line_exit_2_before_any_host(argv, line, capsys, tmp_path):
    hostfile = tmp_path / "hf"
    hostfile.write_text("node-that-does-not-resolve.invalid slots=1\n")
    assert cli.main(["run", "--hostfile", str(hostfile), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"preflight: error: {line}") and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ConfigError):
        flags.thresholds(cli.build_parser().parse_args(["node-check", *argv]) if argv[0] == "--set" else
                         cli.build_parser().parse_args(["run", *argv]))


def test_each_cluster_check_sees_its_own_inputs_and_the_shared_fields():
    args = cli.build_parser().parse_args(["run", "--checkpoint-dir", "/ckpt", "--model-params", "7e9",
                                          "--nvme-path", "/a", "--nvme-path", "/b", "--rehearse",
                                          "--master-port", "29600", "--deepspeed-config", "ds.json"])
    run = flags.check_options(args, "ssh")
    assert run.inputs == {"nvme_path": ["/a", "/b"], "checkpoint_dir": "/ckpt", "model_params": 7e9,
                          "largest_layer_params": None, "model_parallel_size": None, "rehearse": True}
    checkpoint = run.for_check(registry.spec("checkpoint"))
    assert checkpoint.inputs == {"checkpoint_dir": "/ckpt", "model_params": 7e9}
    assert checkpoint.master_port == 29600 and checkpoint.deepspeed_config == "ds.json"
    assert run.for_check(registry.spec("allreduce")).inputs == {}  # --min-busbw is a threshold, not an input
    assert run.for_check(registry.spec("gpu")).inputs == {}
    assert registry.spec("nvme").params_from_options(run.for_check(registry.spec("nvme"))) == \
        {"nvme_paths": ["/a", "/b"]}

    seen: List[seams.CheckOptions] = []

    def coordinate(cluster: seams.ClusterView) -> dict:
        seen.append(cluster.options)
        return {"ok": True}

    # The runner hands each cluster check its own view (runner.Cluster.for_check).
    from preflight.runner import Cluster, RunOptions, Runner
    own = seams.Option("--probe-dir", "a probe's directory", metavar="DIR")
    spec = dataclasses.replace(testing.fake_check("probe_inputs", coordinate).SPEC, options=(own,))
    run.inputs["probe_dir"] = "/p"
    runner = Runner(RunOptions(hosts=[], checks=[], thresholds={}, check_options=run))

    class Host:
        name, slots, gpus = "node01", 1, None

    cluster = Cluster.__new__(Cluster)  # the run's view, without its nodes (coordinate calls no host here)
    cluster.hosts = cluster.all_hosts = [Host()]
    cluster.options, cluster.facts = run, {}
    outcomes, _ = runner._cluster_check(cluster, spec)
    assert outcomes["*"].status == Status.PASS, outcomes
    assert seen[0].inputs == {"probe_dir": "/p"} and seen[0].master_port == 29600
    assert cluster.options is run  # the run's own view is unchanged


def test_a_malformed_option_or_two_different_declarations_of_one_flag_are_refused(monkeypatch):
    def evaluate(facts: dict, thresholds: dict) -> Outcome:
        return Outcome(Status.PASS, "ok")

    bad = seams.CheckSpec("x", "x", "cluster", False, evaluate, coordinate=lambda c: {},
                          options=(seams.Option("-x", ""), seams.Option("--min", "m", threshold="a", action="append"),
                                   seams.Option("--y", "y", commands=("launch",))))
    with pytest.raises(TypeError) as err:
        seams.validate_spec(bad, "x")
    for words in ("option '-x' must be a lowercase long option", "option -x has no help",
                  "option --min: a threshold override takes one value", "option --y: commands must name some of"):
        assert words in str(err.value)
    ok = seams.CheckSpec("x", "x", "cluster", False, evaluate, coordinate=lambda c: {}, selected_by=("probe",),
                         options=(seams.Option("--probe", "p", action="store_true"),))
    assert seams.validate_spec(ok, "x") is ok  # selected by its own option
    other = seams.Option("--checkpoint-dir", "another meaning", metavar="DIR")
    real = registry.spec
    monkeypatch.setattr(registry, "all_specs", lambda: [real("checkpoint"), seams.CheckSpec(
        "y", "y", "cluster", False, evaluate, coordinate=lambda c: {}, options=(other,))])
    with pytest.raises(TypeError, match="check y: its option --checkpoint-dir differs from the one checkpoint "
                                        "declares"):
        registry.options()


def test_the_floor_flags_reach_the_verdicts_through_limits():
    """--iperf3-min-gbps and --min-busbw set their checks' keys; evaluate reads them with limits() on recorded
    facts, which hold no floor of their own."""
    import json

    from preflight.checks import allreduce, iperf3

    facts = json.loads((ROOT / "tests" / "fixtures" / "iperf3" / "facts-3hosts-2networks.json").read_text())
    assert "min_gbps" not in json.dumps(facts)
    default = flags.thresholds(cli.build_parser().parse_args(["run"]))
    assert iperf3.evaluate(facts, default)["*"].status == Status.PASS  # 383 Mbit/s, no floor
    floor = flags.thresholds(cli.build_parser().parse_args(["run", "--iperf3-min-gbps", "1"]))
    assert limits(floor, "iperf3")["min_gbps"] == 1.0
    star = iperf3.evaluate(facts, floor)["*"]
    assert star.status == Status.FAIL and "below the minimum 1.00 Gbit/s" in star.message
    sweep = {"world_size": 2, "hosts": ["node01", "node02"], "backend": "gloo", "status": "ok",
             "sizes": [{"bytes": 1 << 20, "time_s": 0.1, "iters": 5}]}
    assert allreduce.evaluate(sweep, default)["*"].status == Status.PASS
    busbw = flags.thresholds(cli.build_parser().parse_args(["run", "--min-busbw", "1000"]))
    out = allreduce.evaluate(sweep, busbw)["*"]
    assert out.status == Status.FAIL and "< --min-busbw 1000 GB/s" in out.message, out.message
    assert out.metrics["min_busbw"] == 1000.0  # the HTML plot's dashed line
