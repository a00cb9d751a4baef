"""The linters CI runs: ruff over the whole tree, mypy over both packages (strict on the SDK
and the router's pure cores; see `[tool.mypy]` in pyproject.toml)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with the `dev` extra")
    return found


def test_ruff_is_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "sdk", "server", "tests", "benchmarks",
                          "tools", "examples"], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_type_ignore_names_its_code_and_says_why() -> None:
    """`# type: ignore[code]  # why`: a bare one silences any error the line gets later, and
    tells the reader nothing."""
    explained = re.compile(r"# type: ignore\[[\w,-]+\]  # \S")
    bare = [f"{path.relative_to(ROOT)}:{n}" for top in ("sdk", "server")
            for path in sorted((ROOT / top).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if "# type: ignore" in line and not explained.search(line)]
    assert not bare, "type: ignore without a code and a reason: " + ", ".join(bare)


@pytest.mark.slow
def test_mypy_is_clean() -> None:
    out = subprocess.run([_tool("mypy")], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
