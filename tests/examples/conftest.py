"""Fixtures of the adapter tests: the live bundle, skipped with its reason when unavailable."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def bundle(kvagent_bundle: Any) -> Any:
    """The real router (`.base_url`, `.model`) from the suite's `kvagent_bundle` fixture."""
    if getattr(kvagent_bundle, "available", True) is False:
        pytest.skip(getattr(kvagent_bundle, "reason", None) or "kvagent bundle unavailable")
    return kvagent_bundle
