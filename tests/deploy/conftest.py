"""Fixtures for the deployment renderer tests (helpers live in deploy_helpers.py)."""

from __future__ import annotations

import pytest
from deploy_helpers import config
from kvagent_server.config import BundleConfig


@pytest.fixture
def cfg() -> BundleConfig:
    return config(prefill={"count": 2}, decode={"count": 3})
