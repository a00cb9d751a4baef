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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it (built once for this module)."""
    missing = _missing_doc_tools()
    if missing:
        pytest.skip(f"docs tooling not installed ({', '.join(missing)}); "
                    "install the `docs` extra: pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def test_mkdocs_build_strict(site: Path) -> None:
    # The API reference really rendered the SDK's docstrings (not an empty page).
    reference = (site / "reference" / "index.html").read_text(encoding="utf-8")
    assert "Session" in reference and "AsyncSession" in reference
    assert "mermaid" in (site / "concepts" / "index.html").read_text(encoding="utf-8")
    assert (site / "troubleshooting" / "index.html").is_file()


def test_no_placeholder_repo_url() -> None:
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml has !relative and !!python/name tags
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    url = config.get("repo_url")
    assert url is None or not any(p in url for p in ("example.", "invalid", "TODO")), url
    assert {"Troubleshooting": "troubleshooting.md"} in config["nav"]


def test_reference_shows_every_constructor_option_and_inherited_members(site: Path) -> None:
    """`**options: Unpack[SessionOptions]` is expanded (inherited TurnOptions keys too), and
    the methods Session and AsyncSession inherit from SessionCore are listed."""
    import re

    html = (site / "reference" / "index.html").read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", "", html)
    for cls in ("Session", "AsyncSession"):
        init = html.index(f'id="kvagent.{cls}.__init__"')
        signature = re.sub(r"<[^>]+>", "", html[init:init + 20000]).split("Parameters")[0]
        for option in ("system", "session_id", "api_key", "tools", "max_retries", "timeout",
                       "temperature", "max_tokens", "extra_body", "headers"):
            assert f"{option}:" in signature, (cls, option)
        assert "**options" not in signature
        for inherited in ("truncate", "add", "messages", "cache_token", "to_json"):
            assert f'id="kvagent.{cls}.{inherited}"' in html, (cls, inherited)
    assert "System prompt, added as the first message." in text
