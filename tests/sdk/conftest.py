"""Fixtures of the SDK tests (helpers live in sdk_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sdk_helpers import FakeServer

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # so the benchmark smoke test can import benchmarks.sdk_overhead
    sys.path.insert(0, ROOT)


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()
