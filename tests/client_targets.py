"""Where the tests of clients nobody here wrote point: the router before fake P/D nodes
(fast, always), or the suite's real bundle (`vllm`). One module-scoped fixture, `bundle`,
gives a module both targets (import `client_bundle` into the module); a module that must
also pass on the `single` and `replicas` topologies builds its own from `targets` with
`SINGLE` and `REPLICAS`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import last_use
import pytest
from fakes.threaded import MODEL, threaded_router_stack
from support import (
    metric_sum,
    replicas_config,
    second_router,
    start_bundle,
    vllm_available,
)


@dataclass(frozen=True)
class Target:
    base_url: str  # ends in /v1
    router_url: str
    model: str
    real: bool
    #: The fake stack (its cluster records wrong-KV pulls); None on the real bundle.
    stack: Any = None


#: Both real targets ask for `kvagent_bundle` at run time: the mark counts them as its users.
_ON_THE_BUNDLE = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.shared_engine("kvagent_bundle")]
REAL = pytest.param("real", marks=_ON_THE_BUNDLE)
#: A router of the `single` topology (no prefill node) in front of the real bundle's decode
#: node, as `kvagent-server up` runs it on a CPU box or one GPU.
SINGLE = pytest.param("single", marks=_ON_THE_BUNDLE)
#: A bundle of the `replicas` topology of its own (two symmetric nodes, one core each, a
#: router with no prefill node), started for the module that asks for it.
REPLICAS = pytest.param("replicas", marks=[pytest.mark.vllm, pytest.mark.slow])


def targets(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The router `request.param` names: "fake", "real", "single" or "replicas"."""
    if request.param == "fake":
        with threaded_router_stack() as stack:
            yield Target(f"{stack.url}/v1", stack.url, MODEL, real=False, stack=stack)
        return
    if request.param == "replicas":
        yield from _replicas(request)
        return
    last_use.check_live("kvagent_bundle")
    real = request.getfixturevalue("kvagent_bundle")
    if not real.available:
        pytest.skip(real.reason)
    if request.param == "real":
        yield Target(real.base_url, real.router_url, real.model, real=True)
        return
    tmp = request.getfixturevalue("tmp_path_factory").mktemp("single-router")
    # A guest on the bundle's decode node: its usage is mostly the bundle router's
    # retained turns, which only that router can give up. With a watermark this router
    # would evict its own sessions' turns to bring D's usage down, and could not.
    with second_router(real, tmp, prefill=False,
                       retention={"high_watermark": None}) as url:
        yield Target(f"{url}/v1", url, real.model, real=True)


def _replicas(request: pytest.FixtureRequest) -> Iterator[Target]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    tmp = request.getfixturevalue("tmp_path_factory").mktemp("replicas")
    handle, bundle = start_bundle(replicas_config(tmp / "run"))
    try:
        assert bundle.plan.topology == "replicas" and not handle.prefill_urls
        yield Target(handle.base_url, handle.router_url, handle.model, real=True)
    finally:
        bundle.stop()


@pytest.fixture(name="bundle", scope="module", params=["fake", REAL])
def client_bundle(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The router to drive: before fake nodes, or the suite's real bundle."""
    yield from targets(request)


def reuse_hits(router_url: str) -> float:
    """Turns the router served with reused KV so far."""
    return metric_sum(router_url, "kvagent_router_reuse_hits_total")


def cached_tokens(router_url: str) -> float:
    """Prompt tokens the router served from retained KV so far (all turns)."""
    return metric_sum(router_url, "kvagent_router_reused_tokens_total")
