"""Hostfile parsing: DeepSpeed's format and errors, Slurm-style ranges, include/exclude."""
import subprocess
import sys

import pytest

from preflight.hostfile import HostfileError, apply_filters, load_hostfile, parse_hostfile


def names(hosts):
    return [h.name for h in hosts]


def test_deepspeed_format_with_comments_and_blank_lines():
    hosts = parse_hostfile("# cluster\n\nworker-1 slots=8\n  worker-2 slots=4  # spare\n")
    assert [(h.name, h.slots, h.index) for h in hosts] == [("worker-1", 8, 0), ("worker-2", 4, 1)]


def test_slurm_ranges_keep_zero_padding_and_mix_lists():
    hosts = parse_hostfile("node[01-03] slots=8\ngpu-[1,3,5-6] slots=4\n")
    assert names(hosts) == ["node01", "node02", "node03", "gpu-1", "gpu-3", "gpu-5", "gpu-6"]
    assert [h.slots for h in hosts] == [8, 8, 8, 4, 4, 4, 4]


@pytest.mark.parametrize("text, where, words", [
    ("worker-1\n", "hf:1", "bad entry"),
    ("worker-1 slots=8\n\nworker-1 slots=8\n", "hf:3", "duplicate host 'worker-1' (first listed on line 1)"),
    ("node[1-2] slots=8\nnode2 slots=8\n", "hf:2", "duplicate host"),
    ("# only comments\n\n", "hf", "no hosts found"),
    ("", "hf", "no hosts found"),
    ("node[04-01] slots=8\n", "hf:1", "range 'node[04-01]' is not valid"),
    ("node[a-b] slots=8\n", "hf:1", "range 'node[a-b]' is not valid"),
    ("node[1-200000000] slots=8\n", "hf:1", "more than 100000 hosts"),
    ("a slots=1\nn@grp[1-2] slots=8\n", "hf:2", "not a host range"),
    ("a slots=1\nb slots=99999999999999999999\n", "hf:2", "is not a number of GPUs (at most 1024)"),
    ("b slots=" + "9" * 5000 + "\n", "hf:1", "is not a number of GPUs"),
    ("\ufeffworker-1 slots=8\n", "hf:1", "byte-order mark"),
    ("a slots=1\n-oProxyCommand=touch\tslots=1\n", "hf:2", "starts with '-'"),
    ("a\x1b[31m slots=1\n", "hf:1", "invisible character U+001B"),
    ("node[1-2 slots=8\n", "hf:1", "range 'node[1-2' is not valid"),
    ("worker-1 slots=0\n", "hf:1", "at least one slot"),
    ("worker-1 slots=eight\n", "hf:1", "bad entry"),
])
def test_bad_hostfiles_name_file_and_line(text, where, words):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(text, "hf")
    assert str(err.value).startswith(where + ":") or str(err.value).startswith(where + " ") or \
        str(err.value).startswith(where)
    assert words in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(HostfileError, match="no such file"):
        load_hostfile(str(tmp_path / "nope"))


def test_include_and_exclude_follow_deepspeed():
    hosts = parse_hostfile("a slots=4\nb slots=4\nc slots=2\n")
    inc = apply_filters(hosts, include="a:0,1@c")
    assert [(h.name, h.slots, h.gpus, h.index) for h in inc] == [("a", 2, [0, 1], 0), ("c", 2, [0, 1], 1)]
    exc = apply_filters(hosts, exclude="b@a:3")
    assert [(h.name, h.gpus) for h in exc] == [("a", [0, 1, 2]), ("c", [0, 1])]
    with pytest.raises(HostfileError, match="not in the hostfile"):
        apply_filters(hosts, include="zz")
    with pytest.raises(HostfileError, match="mutually exclusive"):
        apply_filters(hosts, include="a", exclude="b")
    with pytest.raises(HostfileError, match="slots 0-1"):
        apply_filters(hosts, include="c:5")
    with pytest.raises(HostfileError, match="leaves no hosts"):
        apply_filters(parse_hostfile("a slots=1\n"), exclude="a")


@pytest.mark.parametrize("include, exclude, expected", [
    # the same host twice in a filter is merged, as DeepSpeed's parse_node_config_list does
    ("", "n1:1@n1:0", [("n1", [2, 3]), ("n2", [0, 1, 2, 3])]),
    ("n2:1,2,3@n2", "", [("n2", [1, 2, 3])]),
    ("n1:0,0", "", [("n1", [0])]),
    ("n2@n1:3,1", "", [("n1", [1, 3]), ("n2", [0, 1, 2, 3])]),  # hostfile order, sorted slots
    ("n1: 1,+2", "", [("n1", [1, 2])]),  # int() reads ' 1' and '+2', as in DeepSpeed
])
def test_filters_merge_like_deepspeed(include, exclude, expected):
    hosts = apply_filters(parse_hostfile("n1 slots=4\nn2 slots=4\n"), include, exclude)
    assert [(h.name, h.gpus) for h in hosts] == expected
    assert [h.slots for h in hosts] == [len(g) for _, g in expected]


@pytest.mark.parametrize("include, exclude, words", [
    (" n1", "", "host ' n1' is not in the hostfile"),
    ("n1 @n2", "", "host 'n1 ' is not in the hostfile"),
    ("n1:", "", "slot '' of 'n1' is not a number"),
    ("n1:0:1", "", "more than one ':'"),
    ("@", "", "host '' is not in the hostfile"),
    ("", "n1:0@n1:1@n2", "leaves no hosts"),
    ("n1:99999999999999999999", "", "n1 has slots 0-1, not 99999999999999999999"),
])
def test_filters_deepspeed_rejects_are_rejected(include, exclude, words):
    with pytest.raises(HostfileError) as err:
        apply_filters(parse_hostfile("n1 slots=2\nn2 slots=2\n"), include, exclude)
    assert words in str(err.value)


def test_lines_end_where_deepspeed_readlines_ends_them():
    # a form feed, vertical tab, NEL or U+2028 does not end a line for readlines(): DeepSpeed sees one host
    for sep in ("\f", "\v", "\x85", "\u2028", "\u2029", "\x1c"):
        notes = []
        hosts = parse_hostfile(f"n1 slots=1{sep}n2 slots=2\n", "hf", notes)
        assert [(h.name, h.slots) for h in hosts] == [("n1", 1)], repr(sep)
        assert notes and "ignored 'n2 slots=2'" in notes[0]
    # CR, CRLF and LF do
    hosts = parse_hostfile("n1 slots=1\rn2 slots=2\r\nn3 slots=3\n")
    assert [(h.name, h.slots, h.line) for h in hosts] == [("n1", 1, 1), ("n2", 2, 2), ("n3", 3, 3)]


def test_trailing_tokens_are_accepted_with_a_note_naming_them():
    notes = []
    hosts = parse_hostfile("node1 slots=8 max_slots=8\nnode2 slots=4  # spare\nnode3\tslots=2x\n", "hf", notes)
    assert [(h.name, h.slots) for h in hosts] == [("node1", 8), ("node2", 4), ("node3", 2)]
    assert len(notes) == 2  # a trailing comment is not worth a warning
    assert notes[0].startswith("hf:1: ignored 'max_slots=8'") and notes[1].startswith("hf:3: ignored 'x'")


def test_multi_bracket_ranges_and_one_note_that_deepspeed_does_not_expand_them():
    notes = []
    hosts = parse_hostfile("rack[1-2]-node[01-02] slots=4\nnode[08-10] slots=8\nsolo slots=1\n", "hf", notes)
    assert names(hosts) == ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02",
                            "node08", "node09", "node10", "solo"]
    assert len(notes) == 1
    assert "does not expand ranges" in notes[0] and "preflight hostfile --expand hf" in notes[0]
    assert "line 1 rack[1-2]-node[01-02] (4 hosts)" in notes[0]


def test_expand_output_is_read_by_deepspeeds_fetch_hostfile(tmp_path):
    runner = pytest.importorskip("deepspeed.launcher.runner")
    src = tmp_path / "hostfile"
    src.write_text("# cluster\nrack[1-2]-node[01-02] slots=4 max_slots=4\nsolo slots=2\n")
    out = tmp_path / "hostfile.expanded"
    proc = subprocess.run([sys.executable, "-m", "preflight", "hostfile", "--expand", str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ignored 'max_slots=4'" in proc.stderr and "does not expand" not in proc.stderr
    out.write_text(proc.stdout)
    pool = runner.fetch_hostfile(str(out))
    assert dict(pool) == {"rack1-node01": 4, "rack1-node02": 4, "rack2-node01": 4, "rack2-node02": 4, "solo": 2}
    assert dict(pool) == {h.name: h.slots for h in load_hostfile(str(src))}


@pytest.mark.parametrize("text, words", [
    ("n1 slots=0\n", "hf:1: slots=0 for n1"),
    ("n1 slots=8\n\nn1 slots=8\n", "hf:3: duplicate host 'n1'"),
    ("node[1-2 slots=8\n", "hf:1: range 'node[1-2' is not valid"),
])
def test_cli_hostfile_bad_input_is_one_line_and_exit_2(tmp_path, text, words):
    hf = tmp_path / "hf"
    hf.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "preflight", "hostfile", "--expand", "hf"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and words in proc.stderr and "Traceback" not in proc.stderr


def test_cli_hostfile_file_lists_the_parsed_hosts_without_expand(tmp_path):
    """`preflight hostfile FILE` checks the file and prints its hosts: line, name, slots, then the totals (issue 26:
    it used to demand --expand); the warnings about text DeepSpeed reads otherwise go to stderr."""
    hf = tmp_path / "hf"
    hf.write_text("# cluster\nrack[1-2]-node[01-02] slots=4 max_slots=4\n\nsolo slots=2\n")
    proc = subprocess.run([sys.executable, "-m", "preflight", "hostfile", "hf"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert rows == [["line", "host", "slots"],
                    ["2", "rack1-node01", "4"], ["2", "rack1-node02", "4"], ["2", "rack2-node01", "4"],
                    ["2", "rack2-node02", "4"], ["4", "solo", "2"],
                    ["hf:", "5", "hosts,", "18", "slots"]]
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 2 and "ignored 'max_slots=4'" in warnings[0], proc.stderr
    assert "does not expand ranges" in warnings[1] and "preflight hostfile --expand hf" in warnings[1]


@pytest.mark.parametrize("text, words", [
    ("n1 slots=0\n", "hf:1: slots=0 for n1"),
    ("n1 slots=8\n\nn1 slots=8\n", "hf:3: duplicate host 'n1'"),
    ("node1;touch${IFS}/tmp/x slots=1\n", "hf:1: host name 'node1;touch${IFS}/tmp/x'"),
])
def test_cli_hostfile_file_bad_input_is_one_line_and_exit_2(tmp_path, text, words):
    (tmp_path / "hf").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "preflight", "hostfile", "hf"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and words in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [[], ["hf", "--expand", "hf"]])
def test_cli_hostfile_wants_exactly_one_file(tmp_path, argv):
    (tmp_path / "hf").write_text("n1 slots=1\n")
    proc = subprocess.run([sys.executable, "-m", "preflight", "hostfile", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "preflight hostfile FILE" in proc.stderr and "--expand FILE" in proc.stderr
