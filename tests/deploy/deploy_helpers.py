"""Helpers for the deployment renderer tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from kvagent_server.config import BundleConfig, validate_config

#: The plugin's per-role env/args are passed explicitly: renderers stay pure in tests.
NO_PLUGIN: tuple[dict[str, dict[str, str]], dict[str, tuple[str, ...]]] = ({}, {})


def config(**over: Any) -> BundleConfig:
    """A deployable config, P/D unless `topology` says otherwise (the renderers' P/D tests)."""
    data: dict[str, Any] = {"model": "Qwen/Qwen3-8B", "name": "prod", "topology": "pd"}
    data.update(over)
    return validate_config(data)
