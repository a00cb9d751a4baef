"""docs/reliability.md's "Limits" table states each limit's default: it is read here and
compared with `RouterSettings()`, so the documented defaults cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from kvagent_server.router.settings import LimitSettings, RouterSettings, TenantSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
_UNITS = {"": 1, "KiB": 1024, "MiB": 1024 * 1024, "s": 1}


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
            section, key = name.split(".")
            actual = getattr(getattr(defaults, section), key)
        assert _value(documented) == actual, f"{name}: documented {documented}, code {actual}"


def test_every_limit_setting_is_documented() -> None:
    documented = set(_table())
    limits = {f"limits.{name}" for name in LimitSettings.model_fields}
    assert limits <= documented, sorted(limits - documented)


def test_an_old_flat_key_moves_into_its_section_with_one_warning(caplog) -> None:
    from kvagent_server.router.settings import model as module

    module._WARNED.discard("retention_high_watermark")
    module._WARNED.discard("max_body_bytes")
    with caplog.at_level("WARNING", logger="kvagent.router"):
        s = RouterSettings.model_validate({"max_body_bytes": 4096,
                                           "retention_high_watermark": 0.9})
        RouterSettings(max_body_bytes=4096)  # warned once per key and process
    assert s.limits.max_body_bytes == 4096 and s.retention.high_watermark == 0.9
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("router.max_body_bytes is now router.limits.max_body_bytes" in w
               for w in warnings) == 1
    assert any("router.retention_high_watermark is now router.retention.high_watermark" in w
               for w in warnings)


def test_a_flat_key_joins_the_rest_of_its_section() -> None:
    s = RouterSettings(max_tools=2, limits={"max_messages": 4})
    assert (s.limits.max_tools, s.limits.max_messages) == (2, 4)
    same = RouterSettings(max_tools=2, limits={"max_tools": 2})
    assert same.limits.max_tools == 2


def test_a_key_given_flat_and_nested_with_different_values_is_an_error() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"router\.max_tools \(2\) and "
                                              r"router\.limits\.max_tools \(3\) disagree"):
        RouterSettings(max_tools=2, limits={"max_tools": 3})
    with pytest.raises(ValidationError, match=r"router\.retention_policy .* and "
                                              r"router\.retention\.policy"):
        RouterSettings(retention_policy={"name": "oldest_first"},
                       retention={"policy": {"name": "expected_return"}})


def test_every_old_flat_key_has_a_place() -> None:
    from kvagent_server.router.settings import FLAT_KEYS, SECTIONS, PathPolicySettings
    from kvagent_server.router.turns.policy_params import CostModelParams

    for old, path in FLAT_KEYS.items():
        assert old not in RouterSettings.model_fields, old
        section, key, *rest = path
        model = PathPolicySettings if section == "policy" else SECTIONS[section]
        assert key in model.model_fields, (old, path)
        if rest:  # a path policy's parameter: the default policy's model takes it
            assert path[:2] == ("policy", "params") and rest == [old], path
            assert old in CostModelParams.model_fields, old
    # the table is derived from the sections: the renamed keys and the policy's are in it
    assert FLAT_KEYS["node_max_in_flight"] == ("nodes", "max_in_flight")
    assert FLAT_KEYS["identity_unverifiable_fields"] == ("identity", "unverifiable_fields")
    assert FLAT_KEYS["max_tools"] == ("limits", "max_tools")
    assert FLAT_KEYS["path_policy"] == ("policy", "name")
    assert len(FLAT_KEYS) == 45, sorted(FLAT_KEYS)


def test_the_path_policy_defaults_to_the_cost_model_with_no_params() -> None:
    assert RouterSettings().policy.model_dump() == {"name": "cost_model", "params": {}}


def test_an_old_flat_policy_key_moves_into_the_policy_with_one_warning(caplog) -> None:
    from kvagent_server.router.settings import model as module

    for key in ("path_policy", "skip_prefill_max_tokens", "queue_aware_paths"):
        module._WARNED.discard(key)
    with caplog.at_level("WARNING", logger="kvagent.router"):
        s = RouterSettings(path_policy="cost_model", skip_prefill_max_tokens=0,
                           queue_aware_paths=False)
        RouterSettings(skip_prefill_max_tokens=0)  # warned once per key and process
    assert s.policy.name == "cost_model"
    assert s.policy.params == {"skip_prefill_max_tokens": 0, "queue_aware_paths": False}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("router.skip_prefill_max_tokens is now "
               "router.policy.params.skip_prefill_max_tokens" in w for w in warnings) == 1
    assert any("router.path_policy is now router.policy.name" in w for w in warnings)
    assert any("router.queue_aware_paths is now router.policy.params.queue_aware_paths" in w
               for w in warnings)


def test_a_flat_policy_key_joins_the_policys_own_params() -> None:
    given = {"name": "cost_model", "params": {"fresh_on_decode": "never"}}
    s = RouterSettings(skip_tokenize_extensions=False, policy=given)
    assert s.policy.params == {"fresh_on_decode": "never", "skip_tokenize_extensions": False}
    assert given == {"name": "cost_model", "params": {"fresh_on_decode": "never"}}  # as given
    same = RouterSettings(fresh_on_decode="never", policy=given)
    assert same.policy.params == {"fresh_on_decode": "never"}
    named = RouterSettings(path_policy="d_direct", policy={"params": {}})
    assert named.policy.name == "d_direct"


def test_a_flat_policy_key_that_disagrees_with_the_policy_is_an_error() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"router\.skip_prefill_max_tokens \(5\) and "
                                              r"router\.policy\.params\.skip_prefill_max_tokens "
                                              r"\(0\) disagree: keep router\.policy\.params"):
        RouterSettings(skip_prefill_max_tokens=5,
                       policy={"params": {"skip_prefill_max_tokens": 0}})
    with pytest.raises(ValidationError, match=r"router\.path_policy \('pd_reuse'\) and "
                                              r"router\.policy\.name \('d_direct'\) disagree"):
        RouterSettings(path_policy="pd_reuse", policy={"name": "d_direct"})
    with pytest.raises(ValidationError, match="router.fresh_on_decode .* and "
                                              "router.policy.params.fresh_on_decode"):
        RouterSettings(fresh_on_decode="never", policy={"params": {"fresh_on_decode": "auto"}})


def test_watermarks_are_checked_in_their_section() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="low_watermark"):
        RouterSettings(retention={"high_watermark": 0.5, "low_watermark": 0.6})
