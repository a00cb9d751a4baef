"""The documentation site builds with `mkdocs build --strict`, as CI builds it.

Strict mode turns every warning into a failure: a page in the nav that does not exist, a
broken link between pages, a `::: kvagent` directive naming something the SDK does not
export, a docstring mkdocstrings cannot parse.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _missing_doc_tools() -> list[str]:
    wanted = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    missing = []
    for name in wanted:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = _missing_doc_tools()
    if missing:
        pytest.skip(f"docs tooling not installed ({', '.join(missing)}); "
                    "install the `docs` extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    # The API reference really rendered the SDK's docstrings (not an empty page).
    reference = (site / "reference" / "index.html").read_text(encoding="utf-8")
    assert "Session" in reference and "AsyncSession" in reference
    assert "mermaid" in (site / "concepts" / "index.html").read_text(encoding="utf-8")
