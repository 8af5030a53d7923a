"""Hostfile parsing: DeepSpeed's format and errors, Slurm-style ranges, include/exclude."""
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
    ("node[04-01] slots=8\n", "hf:1", "runs backwards"),
    ("node[a-b] slots=8\n", "hf:1", "bad range item"),
    ("node[1-2 slots=8\n", "hf:1", "bad host range"),
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
    with pytest.raises(HostfileError, match="no hosts left"):
        apply_filters(parse_hostfile("a slots=1\n"), exclude="a")
