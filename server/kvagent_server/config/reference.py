"""The configuration reference in docs/server.md, generated from the models' field
descriptions (`python -m kvagent_server.config` prints it)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic.fields import FieldInfo

from kvagent_server.config.model import BundleConfig, KVEventsConfig, LoraModule, RoleConfig
from kvagent_server.router.reuse.retention_policy import RETENTION_POLICIES
from kvagent_server.router.settings import (
    SECTIONS,
    PathPolicySettings,
    RetentionPolicySettings,
    RouterSettings,
)
from kvagent_server.router.turns.policy import POLICIES


def config_reference_markdown() -> str:
    """The config reference table in docs/server.md, generated from the models."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in BundleConfig.model_fields.items():
        if name in ("prefill", "decode", "router"):
            continue
        rows.append(_row(name, field))
    for name, field in RoleConfig.model_fields.items():
        rows.append(_row(f"prefill.{name} / decode.{name}", field,
                         default=_role_default(name)))
    for name, field in LoraModule.model_fields.items():
        rows.append(_row(f"lora_modules[].{name}", field))
    for name, field in KVEventsConfig.model_fields.items():
        rows.append(_row(f"kv_events.{name}", field))
    for name, field in RouterSettings.model_fields.items():
        if name == "policy":  # a section: its keys, then each path policy's params
            rows.append(_row(f"router.{name}", field))
            for sub, subfield in PathPolicySettings.model_fields.items():
                rows.append(_row(f"router.{name}.{sub}", subfield))
            _path_policy_rows(rows, f"router.{name}")
        elif name in SECTIONS:  # a section by concern: its keys
            rows.append(_row(f"router.{name}", field))
            for sub, subfield in SECTIONS[name].model_fields.items():
                rows.append(_row(f"router.{name}.{sub}", subfield))
                if subfield.annotation is RetentionPolicySettings:
                    _retention_policy_rows(rows, f"router.{name}.{sub}")
        else:
            rows.append(_row(f"router.{name}", field))
    return "\n".join(rows) + "\n"


def _path_policy_rows(rows: list[str], key: str) -> None:
    """Each path policy's params, a parameter several policies share in one row."""
    takers: dict[tuple[str, Any], tuple[FieldInfo, list[str]]] = {}
    for policy, registered in sorted(POLICIES.items()):
        for param, pfield in registered.params.model_fields.items():
            same = (param, (pfield.annotation, pfield.default, pfield.description))
            takers.setdefault(same, (pfield, []))[1].append(policy)
    for (param, _same), (pfield, policies) in takers.items():
        rows.append(_row(f"{key}.params.{param} ({', '.join(policies)})", pfield))


def _retention_policy_rows(rows: list[str], key: str) -> None:
    """The retention policy section's keys, then each retention policy's params."""
    for sub, subfield in RetentionPolicySettings.model_fields.items():
        rows.append(_row(f"{key}.{sub}", subfield))
    for policy, registered in sorted(RETENTION_POLICIES.items()):
        for param, pfield in registered.params.model_fields.items():
            rows.append(_row(f"{key}.params.{param} ({policy})", pfield))


def _role_default(name: str) -> str | None:
    fields = BundleConfig.model_fields
    p = getattr(fields["prefill"].get_default(call_default_factory=True), name)
    d = getattr(fields["decode"].get_default(call_default_factory=True), name)
    return None if p == d else f"`{p}` / `{d}`"


def _row(key: str, field: FieldInfo, default: str | None = None) -> str:
    desc = field.description or ""
    if default is None:
        if field.default_factory is not None:
            value = field.get_default(call_default_factory=True)
            default = "`{}`" if value == {} else "`[]`" if value == [] else "(see below)"
        else:
            default = f"`{_yaml_value(field.default)}`"
    return f"| `{key}` | {_type_name(field.annotation)} | {default} | {desc.replace('|', '/')} |"


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    name = getattr(annotation, "__name__", str(annotation))
    return {"SecretStr": "secret", "Path": "path"}.get(name, name)
