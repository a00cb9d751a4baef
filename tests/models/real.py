"""Helpers for the real-vLLM model tests: one bundle per module, turns through the router,
reuse-off references straight on the decode node, and node metrics.

A reference is the same request sent to the decode node alone with a fresh random
`cache_salt`: no prefix cache can serve it (asserted: 0 cached tokens) and no KV moves, so
it is the plain recomputed greedy answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e.e2e_helpers import assert_pulled, p_hits
from support import bundle_config, free_port, start_bundle, vllm_available
from vllm_plugin.flow import metric_sum

GREEDY: dict[str, Any] = {"temperature": 0.0}


@dataclass
class Served:
    """A running bundle: the router and its one P and one D node."""

    base_url: str  # the router, ending in /v1
    prefill_url: str
    decode_url: str
    model: str
    run_dir: Path


@contextmanager
def serve(run_dir: Path, **overrides: Any) -> Iterator[Served]:
    """A 1 P + 1 D + router bundle with `overrides` of the test config (`router`: merged
    into the router's); stopped on exit."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    router = {"port": free_port(), "policy": {"params": {"skip_prefill_max_tokens": 0}},
              **overrides.pop("router", {})}
    config = bundle_config(run_dir, **{"max_model_len": 4096, "router": router, **overrides})
    handle, bundle = start_bundle(config)
    try:
        yield Served(base_url=handle.base_url, prefill_url=handle.prefill_urls[0],
                     decode_url=handle.decode_urls[0],
                     model=config.served_model_name or handle.model, run_dir=run_dir)
    finally:
        bundle.stop()


def answer(body: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What greedy decoding produced: the text and the tool calls (name, arguments)."""
    msg = body["choices"][0]["message"]
    calls = tuple((c["function"]["name"], c["function"]["arguments"])
                  for c in msg.get("tool_calls") or [])
    return msg.get("content") or "", calls


def reference(s: Served, body: dict[str, Any]) -> dict[str, Any]:
    """The same request recomputed on D alone (fresh salt: no cache can serve it)."""
    r = httpx.post(f"{s.decode_url}/v1/chat/completions", timeout=600,
                   json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out




def nixl_reads(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text,
                      "vllm:nixl_xfer_time_seconds_count")


@dataclass
class Conversation:
    """One session through the router: the history, its id and the last cache token."""

    served: Served
    model: str
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token: str | None = None

    def body(self, **opts: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": list(self.messages),
                                **GREEDY, **opts}
        if self.tools:
            body["tools"] = self.tools
        return body

    def send(self, **opts: Any) -> dict[str, Any]:
        """One non-streamed turn; its answer joins the history. Returns the response."""
        headers = {"X-Session-ID": self.session_id}
        if self.token:
            headers["X-KVAgent-Cache-Token"] = self.token
        r = httpx.post(f"{self.served.base_url}/chat/completions", json=self.body(**opts),
                       headers=headers, timeout=600)
        assert r.status_code == 200, r.text
        out = r.json()
        self.token = (out.get("kvagent") or {}).get("cache_token") or None
        msg = out["choices"][0]["message"]
        keep: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            # Text or tool calls: Mistral's format rejects an assistant message with both
            # (vLLM answers a forced call with content "").
            keep["content"] = msg.get("content") or None
            keep["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                for c in msg["tool_calls"]]
        self.messages.append(keep)
        return out

    def checked_send(self, *, strict: bool = False, **opts: Any) -> dict[str, Any]:
        """A turn whose answer must equal the recomputed reference's; a `pd_reuse` turn's
        reused tokens must show in P's counters as pulled over NIXL from D, or (unless
        `strict`) as P's own prefix-cache hits (see `assert_pulled`)."""
        ref = reference(self.served, self.body(**opts))
        hits = p_hits(self.served)
        out = self.send(**opts)
        assert_pulled(self.served, hits, out, strict=strict)
        assert answer(out) == answer(ref), out.get("kvagent")
        return out


def fuzz_case(s: Served, ops: list[tuple[Any, ...]], **options: Any) -> dict[str, Any]:
    """One case of the differential fuzz (tools/fuzz) on this bundle; its totals."""
    from benchmarks.api import Runner, Target

    with httpx.Client() as client:
        runner = Runner(Target.demo(s.base_url, s.prefill_url, s.model, None, **options),
                        client)
        runner.run_case(ops)
    stats = runner.stats.as_dict()
    print("fuzz case:", ops, stats)
    return stats
