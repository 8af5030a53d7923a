"""CI's strict-skip rule (tests/conftest.py) holds for a module that skips at import, not only for one test."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "import pytest\npytest.importorskip('no_such_module_for_preflight')\n\n\ndef test_x():\n    pass\n"
SKIPS_ONE = "import pytest\n\n\ndef test_y():\n    pytest.skip('no such tool here')\n\n\ndef test_z():\n    pass\n"


def _pytest(tmp_path: Path, strict: bool, *extra: str, probe: str = PROBE) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(probe)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PREFLIGHT_STRICT_SKIPS"] = "1" if strict else "0"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           *extra, "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_module_level_importorskip_fails_under_strict_skips(tmp_path):
    r = _pytest(tmp_path, strict=True)
    assert r.returncode != 0 and "skipped under PREFLIGHT_STRICT_SKIPS=1" in r.stdout, r.stdout[-2000:]


def test_without_strict_skips_it_is_an_ordinary_skip(tmp_path):
    r = _pytest(tmp_path, strict=False)
    assert r.returncode in (0, 5) and "1 skipped" in r.stdout, r.stdout[-2000:]  # 5: no test ran


def test_the_rule_holds_on_cis_two_xdist_workers(tmp_path):
    """.ci/run runs `-n 2 --dist loadgroup`: a skip in a worker, of a test or of a whole module, still fails."""
    r = _pytest(tmp_path, True, "-n", "2", "--dist", "loadgroup", probe=SKIPS_ONE)
    assert r.returncode == 1 and "skipped under PREFLIGHT_STRICT_SKIPS=1" in r.stdout and "1 passed" in r.stdout, \
        r.stdout[-2000:]
    r = _pytest(tmp_path, True, "-n", "2", "--dist", "loadgroup")
    assert r.returncode != 0 and "skipped under PREFLIGHT_STRICT_SKIPS=1" in r.stdout, r.stdout[-2000:]
