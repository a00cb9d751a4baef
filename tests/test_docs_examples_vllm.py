"""The bundle pages' code blocks run on the real bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_docs_examples import BUNDLE_CHECKS, BUNDLE_PAGES, ROOT, _run_page


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("page", BUNDLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run_on_the_real_bundle(page: Path, kvagent_bundle: Any, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    namespace = _run_page(page, kvagent_bundle.base_url, kvagent_bundle.model, tmp_path,
                          monkeypatch)
    BUNDLE_CHECKS[str(page.relative_to(ROOT))](namespace)
