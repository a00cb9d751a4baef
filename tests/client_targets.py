"""Where the tests of clients nobody here wrote point: the router before fake P/D nodes
(fast, always), or the suite's real bundle (`vllm`). One module-scoped fixture, `bundle`,
gives a module both targets (import `client_bundle` into the module)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fakes.threaded import MODEL, threaded_router_stack
from support import metric_sum


@dataclass(frozen=True)
class Target:
    base_url: str  # ends in /v1
    router_url: str
    model: str
    real: bool
    #: The fake stack (its cluster records wrong-KV pulls); None on the real bundle.
    stack: Any = None


@pytest.fixture(name="bundle", scope="module", params=[
    "fake", pytest.param("real", marks=[pytest.mark.vllm, pytest.mark.slow])])
def client_bundle(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The router to drive: before fake nodes, or the suite's real bundle."""
    if request.param == "real":
        real = request.getfixturevalue("kvagent_bundle")
        if not real.available:
            pytest.skip(real.reason)
        yield Target(real.base_url, real.router_url, real.model, real=True)
        return
    with threaded_router_stack() as stack:
        yield Target(f"{stack.url}/v1", stack.url, MODEL, real=False, stack=stack)


def reuse_hits(router_url: str) -> float:
    """Turns the router served with reused KV so far."""
    return metric_sum(router_url, "kvagent_router_reuse_hits_total")


def cached_tokens(router_url: str) -> float:
    """Prompt tokens the router served from retained KV so far (all turns)."""
    return metric_sum(router_url, "kvagent_router_reused_tokens_total")
