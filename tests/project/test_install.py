"""preflight installed into a project's own environment leaves that project alone: no top-level ``checks``
package in site-packages, and its auto-loaded pytest plugin does not break a project that has its own ``checks/``;
and the install is whole: every check's thresholds TOML beside it, so the installed `preflight config --defaults`
prints the same page as the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv (no system site-packages) with preflight and pytest installed from this checkout."""
    root = tmp_path_factory.mktemp("install")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    build = root / "src"  # a copy, so the build leaves nothing in the checkout
    build.mkdir()
    shutil.copytree(REPO / "preflight", build / "preflight", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, build / name)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(build), "pytest"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No matching distribution" in r.stderr:
        pytest.skip(f"no package index reachable: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    return py


def _scratch(tmp_path: Path) -> Path:
    project = tmp_path / "scratch"
    (project / "checks").mkdir(parents=True)
    (project / "checks" / "__init__.py").write_text("def answer():\n    return 42\n")
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    (project / "tests").mkdir()
    (project / "tests" / "test_scratch.py").write_text(
        "from checks import answer\n\n\ndef test_own_checks_package():\n    assert answer() == 42\n")
    return project


def test_a_project_with_its_own_checks_package_still_works(installed, tmp_path):
    project = _scratch(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    site = subprocess.run([str(installed), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not (Path(site) / "checks").exists(), "preflight must not install a top-level `checks` package"
    assert (Path(site) / "preflight" / "checks" / "gpu.py").is_file()
    assert (Path(site) / "preflight" / "hostside" / "agent.py").is_file()

    bindir = installed.parent
    for argv in ([str(bindir / "pytest"), "-q"], [str(installed), "-m", "pytest", "-q"]):
        r = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and "1 passed" in r.stdout, (argv, r.stdout[-1500:], r.stderr[-1500:])
    # The plugin is really loaded in that session (so the test above is not vacuous) ...
    r = subprocess.run([str(bindir / "pytest"), "--help"], cwd=project, capture_output=True, text=True, env=env)
    assert "--preflight-hostfile" in r.stdout
    # ... and `import checks` is the project's own package.
    r = subprocess.run([str(installed), "-c", "import checks; print(checks.__file__)"], cwd=project,
                       capture_output=True, text=True, env=env)
    assert r.stdout.strip() == str(project / "checks" / "__init__.py"), r.stderr
    # The host-side code the agent ships is the installed package's, subpackages included.
    r = subprocess.run([str(installed), "-c", "import io, zipfile; from preflight.remote import agent_code; "
                        "print(sorted(zipfile.ZipFile(io.BytesIO(agent_code())).namelist())[:3])"],
                       cwd=project, capture_output=True, text=True, env=env)
    assert "'preflight/checks/__init__.py'" in r.stdout, r.stderr
    assert sys.executable != str(installed)


def test_the_install_ships_every_checks_thresholds_toml(installed, tmp_path):
    from preflight import checks
    from preflight.config import DEFAULTS_PATH, default_page
    site = Path(subprocess.run([str(installed), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    package = REPO / "preflight"
    wanted = [DEFAULTS_PATH] + [checks.thresholds_path(name) for name in checks.ORDER]
    assert {p.name for p in wanted} >= {"defaults.toml", "nvme.toml", "thresholds.toml"}
    for path in wanted:  # byte for byte what the checkout has, at the same place in the package
        installed_copy = site / "preflight" / path.relative_to(package)
        assert installed_copy.is_file() and installed_copy.read_bytes() == path.read_bytes(), installed_copy
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    # Run from elsewhere, so the import is the installed package's and not the checkout's.
    r = subprocess.run([str(installed.parent / "preflight"), "config", "--defaults"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout == default_page(), r.stderr[-1500:]
    bad = tmp_path / "bad.toml"
    bad.write_text('[driver_cuda]\nminor_compat_status = "warm"\n')
    r = subprocess.run([str(installed.parent / "preflight"), "node-check", "--config", str(bad)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "driver_cuda.minor_compat_status" in r.stderr and '"warn", "fail"' in r.stderr
