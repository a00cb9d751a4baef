"""The mark each patch leaves on the function it installs, so applying a patch twice is a no-op.

A mark carries the patch's tag: two patches may wrap the same vLLM method (each its own
concern), and `functools.wraps` copies the inner function's marks onto the outer one, so
each patch looks only for its own tag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Set on every function the plugin installs in vLLM's place: the tags of its patches.
WRAPPED_ATTR: Final = "__kvagent_wrapped__"


def mark_wrapped(fn: F, tag: str = "") -> F:
    """`fn`, marked as kvagent's wrapper for the patch `tag` (setattr: a function declares
    no such attribute)."""
    tags: object = getattr(fn, WRAPPED_ATTR, frozenset())
    kept = tags if isinstance(tags, frozenset) else frozenset()
    setattr(fn, WRAPPED_ATTR, kept | {tag})
    return fn


def is_wrapped(fn: object, tag: str = "") -> bool:
    """True when `fn` is a wrapper the patch `tag` already installed."""
    tags: object = getattr(fn, WRAPPED_ATTR, frozenset())
    return isinstance(tags, frozenset) and tag in tags
