"""bench/stale.py on a tiny git repository: a figure whose measured code changed after its results commit is listed,
one measured after the last change is not, whether the commit is cited or taken from the results file's history."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stale():
    spec = importlib.util.spec_from_file_location("bench_stale", REPO / "bench" / "stale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_stale"] = module  # dataclasses looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_stale", None)


def _git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(root)}
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def _commit(root: Path, files: dict, message: str, when: int) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "add", "-A")
    _git(root, "-c", "commit.gpgsign=false", "commit", "-qm", message, f"--date=@{when} +0000")
    return _git(root, "rev-parse", "HEAD")


README = """# Benchmarks

### Gate

| what | wall s | commit | results |
| --- | ---: | --- | --- |
| gate | 10.5 | `{gate}` | `bench/results/gate-x.{{json,txt}}` |
| scale | 3.79 | | `bench/results/scale-y.json` |
| named | 1.25 | `{gate}` | `preflight/other.py`, `bench/results/misc.json` |

## Superseded results

| results | commit | what |
| --- | --- | --- |
| `bench/results/gate-old.json` | `{gate}` | 2.73x |
"""


def test_lists_the_stale_rows_and_not_the_fresh_ones(stale, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _commit(root, {"preflight/gate.py": "a = 1\n", "preflight/scale.py": "b = 1\n", "preflight/other.py": "c = 1\n",
                   "bench/README.md": "# Benchmarks\n"}, "code", 1_700_000_000)
    gate = _commit(root, {"bench/results/gate-x.json": "{}", "bench/results/gate-x.txt": "",
                          "bench/results/misc.json": "{}", "bench/results/gate-old.json": "{}"},
                   "gate results", 1_700_000_100)
    _commit(root, {"bench/README.md": README.format(gate=gate[:7])}, "readme", 1_700_000_200)
    measures = (("gate-*", ["preflight/gate.py"]), ("scale-*", ["preflight/scale.py"]))
    files = ("bench/README.md",)

    rows = stale.rows(root, files)
    assert [r.line for r in rows] == [7, 8, 9]  # the superseded table, headers and separators left out
    assert rows[0].results == ["bench/results/gate-x.json", "bench/results/gate-x.txt"]
    # The scale row's results file is not committed yet: it cites nothing this repository has.
    assert [(r.line, why) for r, why in stale.stale(root, files, measures)] == [
        (8, "cites no results file or commit that this repository has")]

    # The scale results arrive (no commit cited: the commit that added the file is the row's), then the gate's
    # measured code changes: the gate row is stale, the scale row is not, the row naming its own module is not.
    _commit(root, {"bench/results/scale-y.json": "{}"}, "scale results", 1_700_000_300)
    changed = _commit(root, {"preflight/gate.py": "a = 2\n"}, "gate code", 1_700_000_400)
    found = stale.stale(root, files, measures)
    assert [(r.line, why.split(";")[0]) for r, why in found] == [(7, f"measured at {gate[:7]}")]
    assert "preflight/gate.py" in found[0][1] and changed[:7] in found[0][1]

    # The module a row names: changing it makes that row stale too; the scale row stays current.
    _commit(root, {"preflight/other.py": "c = 2\n"}, "other code", 1_700_000_500)
    assert [r.line for r, _ in stale.stale(root, files, measures)] == [7, 9]

    # Rerun the gate and cite the new commit: current again.
    rerun = _commit(root, {"bench/results/gate-x.json": '{"rerun": 1}'}, "gate rerun", 1_700_000_600)
    (root / "bench/README.md").write_text(README.replace("`{gate}` | `bench/results/gate-x", f"`{rerun[:7]}` | "
                                                         "`bench/results/gate-x").format(gate=gate[:7]))
    _commit(root, {}, "readme cites the rerun", 1_700_000_700)
    assert [r.line for r, _ in stale.stale(root, files, measures)] == [9]


def test_expand_and_the_real_readme_parse(stale):
    assert stale.expand("bench/results/a-{1,2}.{json,txt}") == ["bench/results/a-1.json", "bench/results/a-1.txt",
                                                                "bench/results/a-2.json", "bench/results/a-2.txt"]
    assert stale.expand("bench/results/s{,-max}.json") == ["bench/results/s.json", "bench/results/s-max.json"]
    rows = stale.rows(REPO)
    assert rows and all(r.results or r.commits for r in rows if r.file == "bench/README.md")
    # Every results file a row cites exists (a typo would make the row untraceable), and has declared code.
    for row in rows:
        for result in row.results:
            assert (REPO / result).exists() or (REPO / result).parent.exists(), (row.line, result)
        if row.results:
            assert stale.measured(row), (row.file, row.line, row.results)


def test_main_prints_one_line_per_stale_row_and_exits_0(stale, tmp_path, capsys):
    root = tmp_path / "empty"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "bench").mkdir()
    (root / "bench" / "README.md").write_text("| a | b |\n| --- | --- |\n| x | 1.5 |\n")
    _commit(root, {}, "readme", 1_700_000_000)
    assert stale.main(["--root", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("bench/README.md:3 ") and "cites no results file" in out[0]
