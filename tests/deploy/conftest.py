"""Fixtures for the deployment renderer tests (helpers live in deploy_helpers.py)."""

from __future__ import annotations

import pytest
from kvagent_server.config import BundleConfig

from tests.deploy.deploy_helpers import config


@pytest.fixture
def cfg() -> BundleConfig:
    return config(prefill={"count": 2}, decode={"count": 3})
