"""Fixtures of the SDK tests (helpers live in sdk_helpers.py)."""

from __future__ import annotations

import pytest
from sdk_helpers import FakeServer


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()
