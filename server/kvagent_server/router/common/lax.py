"""Scalars as vLLM reads them, and a log line for what the router ignores. Pure but the log.

vLLM validates its request models with pydantic in lax mode, so `"4"` and `4.0` are the
integer 4, `"0.5"` is a float and `"yes"` is true. The router converts the same values the
same way (with pydantic itself) before it checks or translates a body, so it never refuses
what the node behind it would serve, and forwards the converted value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

log = logging.getLogger("kvagent.router.lax")

_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    "int": TypeAdapter(int), "number": TypeAdapter(float), "bool": TypeAdapter(bool)}
_logged: set[str] = set()


def coerce(body: MutableMapping[str, Any], names: Iterable[str], kind: str) -> None:
    """Each of `names` present (not None) in `body` converted to `kind` ("int", "number",
    "bool") as pydantic's lax mode does; a value it cannot convert is left as it is, for
    the caller's own check to refuse by name. A number stays an int when it is one."""
    adapter = _ADAPTERS[kind]
    for name in names:
        value = body.get(name)
        if value is None or _exact(value, kind):
            continue
        try:
            body[name] = adapter.validate_python(value)
        except ValidationError:
            continue
        ignored_once(f"coerced:{name}", "converted %r from %s to %s, as vLLM does",
                     name, type(value).__name__, kind)


def _exact(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == "int" else isinstance(value, int | float)


def ignored_once(kind: str, message: str, *args: Any) -> None:
    """Log, once per process and `kind`, what of a request the router ignored or
    converted (as vLLM does); later requests of the same kind log at debug."""
    if kind in _logged:
        log.debug(message, *args)
        return
    _logged.add(kind)
    log.info(message, *args)
