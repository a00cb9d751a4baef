"""The end-to-end suites' shared vocabulary: the bundle's constants, the `E2E` handle,
sessions, reference answers, and the checks that a reused turn's KV really came from D.
The bundle itself is the `e2e` fixture in conftest.py."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from support import (
    RedisServer,
    p2p_received,  # noqa: F401  (the e2e tests import it from here)
)
from support import metric_sum as metric

SIGNING_KID = "e2e"


SIGNING_KEY = "e2e-signing-key-0123456789abcdef"


ALPHA_KEY = "key-alpha"


BETA_KEY = "key-beta"


#: D keeps a turn's blocks this long; tokens expire `MARGIN_S` earlier.
TTL_S = 100


MARGIN_S = 20


#: Deltas up to this many tokens skip P (`d_direct`); tool results are larger.
SKIP_PREFILL_MAX = 96


#: P keeps a finished prefill's blocks this long for a D that has not started reading
#: (vLLM's `kv_lease_duration` default; the router's `prefill_lease_s`).
PREFILL_LEASE_S = 30


GREEDY: dict[str, Any] = {"temperature": 0.0}


@dataclass
class E2E:
    """The running bundle and what the tests need to drive and hurt it."""

    bundle: Any  # kvagent_server.bundle.supervisor.Bundle
    base_url: str
    router_url: str
    model: str
    prefill_url: str
    decode_url: str
    redis: RedisServer

    def pid(self, name: str) -> int:
        pid = self.bundle.snapshot().proc(name).pid
        assert pid is not None, f"{name} has no pid"
        return pid

    def restarts(self, name: str) -> int:
        return self.bundle.snapshot().proc(name).restarts

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal a bundle process's whole group (the API server and its engine core)."""
        pid = self.pid(name)
        os.killpg(pid, sig)
        return pid

    def wait_restarted(self, name: str, restarts_before: int, timeout: float = 600) -> None:
        """Until the supervisor has relaunched `name` and it is healthy again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ps = self.bundle.snapshot().proc(name)
            if ps.restarts > restarts_before and ps.status == "healthy":
                return
            assert ps.status != "failed", f"{name} failed: {ps.last_event}"
            time.sleep(1.0)
        raise AssertionError(f"{name} was not restarted within {timeout} s")

    def wait_router_sees(self, role_name: str, healthy: bool, timeout: float = 120) -> None:
        """Until the router's `/ready` reports node `role_name` (e.g. "d0") as `healthy`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                nodes = httpx.get(f"{self.router_url}/ready", timeout=5).json().get("nodes", {})
                if nodes.get(role_name, {}).get("healthy") is healthy:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"router did not see {role_name} healthy={healthy}")

    def signal_engine(self, name: str, sig: int) -> list[int]:
        """Signal a node's engine processes (the API server's descendants) but not its API
        server: the node stays healthy over HTTP while its engine (and NIXL agent) stalls."""
        import psutil

        pids = [p.pid for p in psutil.Process(self.pid(name)).children(recursive=True)]
        assert pids, f"{name} has no engine process"
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def log_text(self, name: str) -> str:
        """A bundle process's log so far (stdout and stderr of its whole group)."""
        from pathlib import Path

        return Path(self.bundle.snapshot().proc(name).log).read_text(errors="replace")

    def metric(self, url: str, name: str) -> float:
        """Sum of a Prometheus metric's samples (all label sets) on a node or the router."""
        return metric(url, name)


def session(e: E2E, *, api_key: str = ALPHA_KEY, **kw: Any):
    from kvagent import Session
    from kvagent_server.demo.agent import TOOLS, system_prompt

    kw.setdefault("system", system_prompt())
    return Session(e.base_url, e.model, api_key=api_key, tools=list(TOOLS), timeout=600,
                   max_retries=0, **GREEDY, **kw)


TOOL_TURN: dict[str, Any] = {"tool_choice": "required", "max_tokens": 48,
                             "extra_body": {"parallel_tool_calls": False}}


TEXT_TURN: dict[str, Any] = {"tool_choice": "none", "max_tokens": 16}


def run_tools(s: Any, result: Any) -> None:
    """Execute the demo tools the model asked for and add their results to the history."""
    from kvagent import ToolResultMessage
    from kvagent_server.demo.agent import TOOLS

    by_name = {f.__name__: f for f in TOOLS}
    assert result.tool_calls, f"expected a tool call, got text {result.text!r}"
    for call in result.tool_calls:
        out = by_name[call.name](**json.loads(call.arguments))
        s.add(ToolResultMessage(tool_call_id=call.id, content=out, name=call.name))


def answer(result: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What greedy decoding produced: the text and the tool calls (name, arguments)."""
    return result.text, tuple((c.name, c.arguments) for c in result.tool_calls)


def reference(e: E2E, messages: Any, content: Any, opts: dict[str, Any]) -> Any:
    """The same request with no reuse at all: sent to P directly (no router, no handle)
    under a fresh random cache salt, so no block any earlier request computed can be hit;
    asserts P reports 0 cached prompt tokens."""
    from kvagent import Session
    from kvagent_server.demo.agent import TOOLS

    extra = {**opts.get("extra_body", {}), "cache_salt": uuid.uuid4().hex}
    with Session(f"{e.prefill_url}/v1", e.model, tools=list(TOOLS), timeout=600,
                 max_retries=0, messages=list(messages), **GREEDY) as ref:
        result = ref.send(content, **{**opts, "extra_body": extra})
    assert result.usage is not None and result.usage.cached_tokens == 0, result.usage
    return result


#: P's tokens loaded through its KV connector (NIXL, from D) and from its own prefix cache.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


LOCAL_HITS = "vllm:prefix_cache_hits_total"


class HasPrefill(Protocol):
    """Any running bundle with one prefill node: `E2E`, or tests/models' `Served`."""

    @property
    def prefill_url(self) -> str: ...


def p_hits(e: HasPrefill) -> tuple[float, float]:
    return metric(e.prefill_url, EXTERNAL_HITS), metric(e.prefill_url, LOCAL_HITS)


def assert_pulled(e: HasPrefill, before: tuple[float, float], result: Any, *,
                  strict: bool = False) -> float:
    """A `pd_reuse` turn's reused tokens reached P: P's own counters show external
    (connector, i.e. NIXL from D) hits, and external plus local hits cover what the router
    reports. `result` is the SDK's result or a response body (its `kvagent` object).

    Why the non-strict form may see no pull: vLLM's scheduler matches P's own prefix
    cache first and passes those hits to the NIXL connector as `num_computed_tokens`,
    which counts only `min(remote_num_tokens, prompt) - num_computed_tokens` tokens as
    external (vLLM's `NixlPullConnectorScheduler.get_num_new_matched_tokens`). A turn
    whose reused prefix P still caches itself (P prefilled it on the previous turn, e.g.
    a tool result appended to P's own prompt) therefore loads nothing from D: correct, so
    it is accepted when P's local hits cover all reused tokens. `strict` demands a pull
    all the same (a turn after a long answer only D computed). Returns the tokens pulled.
    Counters are updated as P's outputs arrive, so poll briefly."""
    if isinstance(result, dict):
        kv = result.get("kvagent") or {}
        path, reused = kv.get("path"), int(kv.get("reused_tokens") or 0)
    else:
        path, reused = result.path, result.reused_tokens
    if path != "pd_reuse" or not reused:
        return 0.0
    deadline = time.monotonic() + 5
    while True:
        ext, local = p_hits(e)
        pulled, own = ext - before[0], local - before[1]
        covered = pulled + own >= reused
        if covered and (pulled > 0 or (not strict and own >= reused)):
            return pulled
        if time.monotonic() > deadline:
            raise AssertionError(f"pd_reuse of {reused} tokens, but P pulled "
                                 f"{pulled} over NIXL and hit {own} in its own cache")
        time.sleep(0.2)


def checked_send(e: E2E, s: Any, content: Any, opts: dict[str, Any]) -> Any:
    """Send a turn and assert its answer equals the reuse-off answer of the same request
    (and that a `pd_reuse` turn's KV really came from D over NIXL)."""
    before = list(s.messages)
    hits = p_hits(e)
    result = s.send(content, **opts)
    assert_pulled(e, hits, result)
    ref = reference(e, before, content, opts)
    assert answer(result) == answer(ref), (result.path, result.reused_tokens)
    return result


