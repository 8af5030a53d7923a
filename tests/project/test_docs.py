"""The documentation keeps its promises: README.md is a front door of at most 300 lines; every repository path and
results file that README.md, docs/*.md and bench/README.md cite (`bench/results/gate-ab.json`,
[docs/ssh.md](docs/ssh.md), `preflight/checks/{nvme,gpu}.py`) is in git; every committed results file is cited; the
README's checks table lists the registry; docs/checks.md is what the registry generates now."""
from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import subprocess
from pathlib import Path

from preflight import docgen
from preflight.checks import ORDER

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BENCH = REPO / "bench" / "README.md"

# A path cited in text starts with one of the repository's top-level folders (or the old top-level checks/, which
# must not come back) and is not part of a longer path (/opt/preflight/bin, ~/.preflight, deepspeed/launcher/...).
CITED = re.compile(r"(?<![\w./~$-])((?:bench|docs|preflight|tests|\.ci|checks)/[\w.{},*/-]*)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# The files docs/adding-a-check.md tells the reader to create: cited, and rightly not in git.
TO_CREATE = {"preflight/checks/shm_free.py", "preflight/checks/shm_free.toml"}


def _documents() -> list[Path]:
    return [README, BENCH, *sorted((REPO / "docs").glob("*.md"))]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and os.path.exists(REPO / p)]


def _braces(path: str) -> list[str]:
    """bench/results/x{,-max}.{json,txt} -> the four names (shell brace expansion, innermost first)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [out for alt in m.group(1).split(",") for out in _braces(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str, tracked: list[str]) -> bool:
    """A tracked file, a folder holding one, or a glob matching one."""
    path = path.rstrip("/")
    if any(c in path for c in "*?["):
        return any(fnmatch.fnmatchcase(t, path) for t in tracked)
    return path in tracked or any(t.startswith(path + "/") for t in tracked)


def _citations(doc: Path) -> list[tuple[str, str]]:
    """(as written, repository path) for every path the document cites, in text and in relative links."""
    text = doc.read_text()
    found = []
    for raw in CITED.findall(text):
        written = raw.rstrip(".,:;")
        found += [(written, p) for p in _braces(written)]
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https://, mailto:
            continue
        rel = posixpath.normpath(posixpath.join(doc.parent.relative_to(REPO).as_posix(), target))
        found.append((target, rel))
    return found


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move a topic to docs/ and link it"


def test_every_cited_path_is_in_git():
    tracked = _tracked()
    missing = sorted({f"{doc.relative_to(REPO)}: {written}"
                      for doc in _documents() for written, path in _citations(doc)
                      if not _exists(path, tracked) and path not in TO_CREATE})
    assert not missing, "cited but not in git (commit it, or fix the citation):\n" + "\n".join(missing)


def test_the_checker_sees_citations_and_misses():
    """The path check can fail: it finds text and link citations, expands braces, and rejects a stale path."""
    tracked = _tracked()
    cites = {path for _, path in _citations(BENCH)}
    assert "bench/results/gate-ab.json" in cites and "bench/results/gate-ab.txt" in cites
    assert "docs/ssh.md" in cites  # from the link ../docs/ssh.md
    assert _braces("a/x{,-max}.{json,txt}") == ["a/x.json", "a/x.txt", "a/x-max.json", "a/x-max.txt"]
    assert not _exists("checks/base.py", tracked) and not _exists("bench/results/scale-light.json", tracked)
    assert not any(_exists(path, tracked) for path in TO_CREATE), "the example's check exists: drop it from TO_CREATE"
    assert CITED.findall("run /opt/preflight/bin/preflight or ~/.preflight/bin/pip; see `checks/base.py`.") == [
        "checks/base.py"]


def test_every_committed_result_is_cited():
    cited = {path for doc in _documents() for _, path in _citations(doc)}
    results = [t for t in _tracked() if t.startswith("bench/results/")]
    assert results, "no committed results: bench/README.md cites them"
    uncited = [r for r in results if not any(r == c or fnmatch.fnmatchcase(r, c) for c in cited)]
    assert not uncited, "committed but cited nowhere (add it to bench/README.md):\n" + "\n".join(uncited)


def test_readme_checks_table_lists_the_registry():
    text = README.read_text()
    section = text[text.index("\n## Checks"):]
    section = section[:section.index("\n## ", 1)]
    names = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert names == ORDER, "README's checks table differs from preflight/checks ORDER"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {path for _, path in _citations(README)}
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


def test_checks_page_is_generated_from_the_registry():
    assert docgen.PAGE.read_text() == docgen.render(), "docs/checks.md is stale: run python3 -m preflight.docgen"
    assert docgen.main(["--check"]) == 0


def test_docgen_check_fails_on_drift(tmp_path):
    stale = tmp_path / "checks.md"
    stale.write_text(docgen.render().replace("## ssh\n", "## ssh_old\n"))
    assert docgen.main(["--check", "--out", str(stale)]) == 1
    assert docgen.main(["--out", str(stale)]) == 0 and stale.read_text() == docgen.render()
