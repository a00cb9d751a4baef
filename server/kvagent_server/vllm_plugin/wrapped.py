"""The mark each patch leaves on the function it installs, so applying a patch twice is a no-op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Set on every function the plugin installs in vLLM's place.
WRAPPED_ATTR: Final = "__kvagent_wrapped__"


def mark_wrapped(fn: F) -> F:
    """`fn`, marked as kvagent's wrapper (setattr: a function declares no such attribute)."""
    setattr(fn, WRAPPED_ATTR, True)
    return fn


def is_wrapped(fn: object) -> bool:
    """True when `fn` is a wrapper the plugin already installed."""
    return bool(getattr(fn, WRAPPED_ATTR, False))
