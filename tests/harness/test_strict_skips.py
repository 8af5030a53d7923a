"""CI's strict-skip rule (tests/conftest.py) holds for a module that skips at import, not only for one test."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "import pytest\npytest.importorskip('no_such_module_for_preflight')\n\n\ndef test_x():\n    pass\n"


def _pytest(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PREFLIGHT_STRICT_SKIPS"] = "1" if strict else "0"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_module_level_importorskip_fails_under_strict_skips(tmp_path):
    r = _pytest(tmp_path, strict=True)
    assert r.returncode != 0 and "skipped under PREFLIGHT_STRICT_SKIPS=1" in r.stdout, r.stdout[-2000:]


def test_without_strict_skips_it_is_an_ordinary_skip(tmp_path):
    r = _pytest(tmp_path, strict=False)
    assert r.returncode in (0, 5) and "1 skipped" in r.stdout, r.stdout[-2000:]  # 5: no test ran
