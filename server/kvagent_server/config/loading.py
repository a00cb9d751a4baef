"""Loading a `BundleConfig` from YAML and flags, and errors a person can act on.

Every problem becomes one line prefixed with its YAML path (`prefill.count: ...`), with a
"did you mean" hint for unknown keys.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kvagent_server.config.model import BundleConfig, ConfigError


def format_validation_error(err: ValidationError, fields: dict[str, Any] | None = None
                            ) -> list[str]:
    """One line per problem: `yaml.path: message`, with a suggestion for unknown keys."""
    lines: list[str] = []
    for e in err.errors():
        path = _yaml_path(e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            key = str(e["loc"][-1])
            known = _known_keys(e["loc"][:-1])
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{path}: unknown key{hint}")
            continue
        if e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            # Model-level checks already name their own paths, one per line.
            if not e["loc"]:
                lines.extend(msg.splitlines())
                continue
        if e["type"] == "missing":
            msg = "required"
        got = e.get("input")
        if e["type"] not in ("missing", "value_error") and not isinstance(got, dict | list):
            msg = f"{msg} (got {got!r})"
        lines.append(f"{path or '<root>'}: {msg}")
    return lines


def _yaml_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model at `loc` (for 'did you mean' hints)."""
    model: type[BaseModel] = BundleConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        inner = _model_in(field.annotation)
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def validate_config(data: dict[str, Any]) -> BundleConfig:
    """Validate a plain mapping; raise `ConfigError` with one line per problem."""
    try:
        return BundleConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None
                ) -> BundleConfig:
    """Load a YAML file (optional) and apply `overrides` (dotted keys, e.g. `prefill.count`).

    Flags override the file; the result is validated as a whole.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError([f"{path}:{where}: invalid YAML: {problem}"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of keys"])
        data = loaded
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return validate_config(data)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`set_dotted(d, "prefill.count", 2)` sets `d["prefill"]["count"] = 2`."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[keys[-1]] = value


def dump_config(cfg: BundleConfig) -> dict[str, Any]:
    """A JSON-able dict that validates back to `cfg`, secrets included (write it 0600)."""
    # exclude_unset: what was left to defaults stays a default (and stays unset) on reload.
    dumped: dict[str, Any] = reveal_secrets(cfg.model_dump(mode="python", exclude_unset=True))
    return dumped


def reveal_secrets(value: Any) -> Any:
    """Replace pydantic `SecretStr`s by their values and paths by strings, recursively."""
    from pydantic import SecretStr

    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: reveal_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [reveal_secrets(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
