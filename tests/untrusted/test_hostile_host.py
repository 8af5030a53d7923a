"""A hostile host: its --python is a wrapper that runs the real agent and rewrites what it reports (tests/hostile.py),
and real interfaces with odd names made with `ip link`. Everything a host sends is data: the run finishes, the
JSON keeps the text (escaped), the HTML shows it inert, and the env file never carries it.

Terminal bytes and JUnit belong to the `ux` engineer, result-shape validation and output caps to `scale`: where
those make a run crash on this branch the assertion is an xfail naming the owner."""
from __future__ import annotations

import json
import re

import pytest

from preflight.hostside import validate
from preflight.recommend import OWNED_KEYS
from tests.hostile import wrapper
from tests.cli.test_cli_cluster import preflight as _preflight

EVIL = "[/]\x1b]0;pwned\x07\x1b[2J<script>alert(1)</script>&amp;\x00[bold red]x[/bold red]\u202e\u0085"
ODD_IFNAME = "<i>[b]$(id)"  # 11 bytes: the kernel accepts it (it refuses "/" and whitespace)


def run(cluster, tmp_path, *args, python=None):
    """preflight against the cluster; returns (proc, json dict or None, html text or None, env text or None)."""
    out = {k: tmp_path / n for k, n in (("json", "r.json"), ("html", "r.html"), ("env", "env"))}
    extra = ["--python", str(python)] if python else []
    proc = _preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"), "--json", out["json"],
                      "--html", out["html"], "--env-file", out["env"], *extra, *args, timeout=300)
    read = {k: (p.read_text(encoding="utf-8") if p.exists() else None) for k, p in out.items()}
    return proc, (json.loads(read["json"]) if read["json"] else None), read["html"], read["env"]


def cell(data, host, check):
    return next(r for r in data["results"] if (r["host"], r["check"]) == (host, check))


def assert_env_safe(env):
    assert env is not None
    for line in env.splitlines():
        key, value = line.split("=", 1)
        assert key in OWNED_KEYS and validate.env_value(value), line


def assert_json_raw_escaped(path_text):
    assert "\x1b" not in path_text and "\x00" not in path_text and "\x07" not in path_text


@pytest.fixture(scope="module")
def cluster(request):
    from tests.conftest import _skip_without_netcluster
    from tests.netcluster import NetCluster
    _skip_without_netcluster()
    # node02 also has a real interface whose name is markup, HTML and a command substitution at once.
    setup = {"node02": [["ip", "link", "add", "name", ODD_IFNAME, "type", "veth", "peer", "name", "pfodd1"]]}
    with NetCluster(2, names=["node01", "node02"], setup=setup) as c:
        yield c


def test_escapes_markup_html_and_nul_in_host_text(cluster, tmp_path):
    python = wrapper(cluster.dir, "node02", f"""
        EVIL = {EVIL!r}
        def mutate(payload):
            value = payload.get("value")
            if isinstance(value, dict) and "python" in value:
                facts = value["python"]["facts"]
                facts["torch"] = EVIL
                facts["torch_error"] = EVIL
            host = payload.get("host")
            if isinstance(host, dict):
                host["hostname"] = EVIL
        """)
    proc, data, html, env = run(cluster, tmp_path, "--checks", "python,interfaces,versions", python=python)
    assert proc.returncode == 1 and data is not None
    assert_json_raw_escaped((tmp_path / "r.json").read_text())
    c = cell(data, "node02", "python")
    assert c["status"] == "fail" and EVIL in c["message"]  # the text is kept, as data
    v = cell(data, "*", "versions")
    assert v["status"] == "fail" and "node02" in v["message"]
    assert html is not None and "<script>alert(1)</script>" not in html and "[/]" in html
    assert "&lt;script&gt;" in html
    assert_env_safe(env)


def test_real_odd_interface_name(cluster, tmp_path):
    assert ODD_IFNAME in cluster.exec("node02", ["ip", "-br", "link"]).stdout
    proc, data, html, env = run(cluster, tmp_path, "--checks", "interfaces")
    c = cell(data, "node02", "interfaces")
    assert c["status"] == "fail" and repr(ODD_IFNAME) in c["message"], c
    assert cell(data, "node01", "interfaces")["status"] == "pass"
    assert "<i>[b]" not in html
    assert_env_safe(env)
    assert ODD_IFNAME not in env


def test_ten_megabyte_string(cluster, tmp_path):
    python = wrapper(cluster.dir, "node02", """
        def mutate(payload):
            value = payload.get("value")
            if isinstance(value, dict) and "python" in value:
                value["python"]["facts"]["torch_error"] = "E" * (10 << 20)
        """)
    proc, data, html, env = run(cluster, tmp_path, "--checks", "python", python=python)
    assert data is not None
    c = cell(data, "node02", "python")
    assert c["status"] == "fail", c["message"][:300]  # read whole, to channel EOF, within the 64 MiB cap
    assert_env_safe(env)


def test_invalid_json_costs_that_host_an_error(cluster, tmp_path):
    python = wrapper(cluster.dir, "node02", """
        def mutate(payload):
            if "python" in (payload.get("value") or {}):
                return b'@@PREFLIGHT-RESULT {"ok": true, "value": {"python": \\n'
        """)
    proc, data, html, env = run(cluster, tmp_path, "--checks", "python", python=python)
    assert proc.returncode == 1 and data is not None
    assert cell(data, "node02", "python")["status"] == "error"
    assert cell(data, "node01", "python")["status"] == "pass"
    assert_env_safe(env)


@pytest.mark.parametrize("shape", ["value-list", "facts-string", "no-duration", "interfaces-wrong-types"])
def test_wrong_types_cost_that_host_an_error(cluster, tmp_path, shape):
    python = wrapper(cluster.dir, "node02", f"""
        SHAPE = {shape!r}
        def mutate(payload):
            value = payload.get("value")
            if not isinstance(value, dict) or "interfaces" not in value:
                return
            if SHAPE == "value-list":
                payload["value"] = [1, 2, 3]
            elif SHAPE == "facts-string":
                value["interfaces"]["facts"] = "not a dict"
            elif SHAPE == "no-duration":
                del value["interfaces"]["duration_s"]
            else:
                value["interfaces"]["facts"]["interfaces"] = [{{"name": 7, "ipv4": "x"}}, "eth0", None]
                value["interfaces"]["facts"]["ib"] = {{"device": "mlx5_0"}}
        """)
    proc, data, html, env = run(cluster, tmp_path, "--checks", "interfaces", python=python)
    assert data is not None
    c = cell(data, "node02", "interfaces")
    assert c["status"] in ("error", "fail"), c
    assert cell(data, "node01", "interfaces")["status"] == "pass"
    assert_env_safe(env)
    assert not re.search(r"Traceback", proc.stdout + proc.stderr)
