"""docs/reliability.md's "Limits" table states each limit's default: it is read here and
compared with `RouterSettings()`, so the documented defaults cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from kvagent_server.router.settings import RouterSettings, TenantSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
_UNITS = {"": 1, "KiB": 1024, "MiB": 1024 * 1024, "s": 1}
#: Settings named like limits that are not a client-facing limit (so not in the table).
NOT_LIMITS = {"max_retries"}


def _table() -> dict[str, str]:
    """setting -> documented default, from the table under "## Limits"."""
    section = DOC.read_text().split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w\[\].]+)` \| ([^|]+) \|", section, re.MULTILINE)
    return {name: default.strip() for name, default in rows}


def _value(text: str) -> float:
    found = re.fullmatch(r"([\d,.]+)\s*(KiB|MiB|s)?", text)
    assert found, f"unreadable default {text!r}"
    return float(found.group(1).replace(",", "")) * _UNITS[found.group(2) or ""]


def test_every_documented_default_is_the_settings_default() -> None:
    table = _table()
    assert len(table) >= 15, table
    defaults = RouterSettings()
    tenant = TenantSettings(name="t")
    for name, documented in table.items():
        if name.startswith("tenants[]."):
            actual = getattr(tenant, name.removeprefix("tenants[]."))
        else:
            actual = getattr(defaults, name)
        assert _value(documented) == actual, f"{name}: documented {documented}, code {actual}"


def test_every_limit_setting_is_documented() -> None:
    documented = set(_table())
    limits = {name for name in RouterSettings.model_fields
              if name.startswith("max_") or name.endswith("_timeout_s")} - NOT_LIMITS
    assert limits <= documented, sorted(limits - documented)
