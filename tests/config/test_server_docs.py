"""docs/server.md and examples/bundle.yaml cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from kvagent_server.config import config_reference_markdown, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_server_guide_has_the_current_config_reference() -> None:
    text = (ROOT / "docs" / "server.md").read_text()
    start = text.index("<!-- config-reference:start -->\n") + len(
        "<!-- config-reference:start -->\n")
    end = text.index("<!-- config-reference:end -->")
    assert text[start:end] == config_reference_markdown(), (
        "docs/server.md is stale: paste `python -m kvagent_server.config` between the "
        "config-reference markers")


def test_reference_lists_every_key() -> None:
    from kvagent_server.config import BundleConfig, RoleConfig
    from kvagent_server.router.settings import SECTIONS, RouterSettings

    table = config_reference_markdown()
    for name in BundleConfig.model_fields:
        if name not in ("prefill", "decode", "router"):
            assert f"| `{name}` |" in table
    for name in RoleConfig.model_fields:
        assert f"| `prefill.{name} / decode.{name}` |" in table
    for name in RouterSettings.model_fields:
        assert f"| `router.{name}` |" in table
    for section, model in SECTIONS.items():
        for name in model.model_fields:
            assert f"| `router.{section}.{name}` |" in table


def test_example_bundle_is_valid() -> None:
    cfg = load_config(ROOT / "examples" / "bundle.yaml")
    assert cfg.prefill.count == 1 and cfg.decode.count == 1 and cfg.model is None


def test_every_setting_documents_itself_with_a_field_description() -> None:
    """The reference reads `Field(description=...)` only: an undocumented key is a bug."""
    from kvagent_server.config import BundleConfig, KVEventsConfig, RoleConfig
    from kvagent_server.router.settings import RouterSettings, TenantSettings

    missing = [f"{model.__name__}.{name}"
               for model in (BundleConfig, RoleConfig, KVEventsConfig, RouterSettings,
                             TenantSettings)
               for name, field in model.model_fields.items() if not field.description]
    assert not missing, missing
