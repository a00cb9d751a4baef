"""The console scripts on an install without the server extra: one line, exit 2.

`pip install kvagent` installs `kvagent` and `kvagent-server` (a wheel's scripts cannot
depend on an extra); without typer, rich and the rest they must say what to install
instead of failing with a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from support import skip_unless_required

ROOT = Path(__file__).resolve().parents[2]
HINT = "pip install 'kvagent[server]'"
#: The SDK's own dependencies, as pyproject.toml declares them (no extra).
SDK_DEPS: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "dependencies"]


def _run(argv: list[str], timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          env=env, **kw)  # type: ignore[arg-type]


def test_guard_names_the_extra_when_a_server_dependency_is_missing() -> None:
    code = ("import sys; sys.modules['typer'] = None\n"
            "from kvagent_server.cli.entry import server_main; server_main()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and HINT in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_guard_lets_our_own_import_errors_through() -> None:
    code = ("import sys; sys.modules['kvagent_server.config'] = None\n"
            "from kvagent_server.cli.entry import demo_main; demo_main()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr
    assert HINT not in res.stderr


@pytest.mark.slow
def test_sdk_only_install_scripts_exit_2_with_one_line(tmp_path: Path) -> None:
    """A real fresh venv: the project's wheel without dependencies, plus the SDK's own."""
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".*")
    for part in ("sdk", "server"):
        shutil.copytree(ROOT / part, src / part, ignore=junk)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(wheels), str(src)], cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    wheel = next(wheels.glob("kvagent-*.whl"))
    res = _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    assert res.returncode == 0, res.stderr
    deps = _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 *SDK_DEPS])
    if deps.returncode != 0:  # offline: a skip, but not where every check must run (CI)
        skip_unless_required("could not install the SDK's dependencies from pip: "
                             f"{deps.stderr[-300:]}")
    # Only the SDK's dependencies: the server extra really is absent, the SDK imports.
    probe = _run([str(py), "-c", ("import importlib.util as u, kvagent; "
                  "print(u.find_spec('typer'), u.find_spec('rich'))")], cwd=tmp_path)
    assert probe.returncode == 0 and probe.stdout.split() == ["None", "None"], probe
    for script in ("kvagent", "kvagent-server"):
        for args in ([], ["--help"]):
            res = _run([str(env_dir / "bin" / script), *args], timeout=60, cwd=tmp_path)
            assert res.returncode == 2, (script, res.stdout, res.stderr)
            lines = res.stderr.splitlines()
            assert len(lines) == 1 and HINT in lines[0] and lines[0].startswith(script + ":")
            assert res.stdout == ""
