"""On real vLLM: the router with no prefill node (the `single` topology) in front of one
decode node, configured as the bundle configures it (NIXL connector, the kvagent plugin):
every turn is computed on that node, later turns extend the KV it kept (`d_direct`), and
greedy answers equal a recompute.

The node is the shared bundle's decode node (`kvagent_bundle`: no node of its own to
start); the router is `python -m kvagent_server.router --decode URL`, as a single bundle
starts it. The reference for each turn is the same request sent straight to the node
under a fresh random `cache_salt` (nothing cached can match: 0 cached tokens), greedy, so
any wrong KV shows as a different answer. The rules and the fake-node tests:
tests/router/turns/test_single.py, tests/router/http/test_single_topology.py.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import second_router, turn_against_recompute

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are a release assistant. Answer briefly. Checklist: "
          + " ".join(f"item {i}: confirm the build, tag it, and post the notes." for i in range(40)))


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    r = httpx.post(url, json=body, headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _text(message: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in message["content"] if b["type"] == "text")


def test_single_turns_equal_a_recompute_and_reuse_the_nodes_kv(kvagent_bundle: Any,
                                                                tmp_path: Path) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b = kvagent_bundle
    node = b.decode_urls[0]
    session = f"single-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Release {uuid.uuid4().hex[:6]} is ready. First step?"}]
    turns = []
    with second_router(b, tmp_path, prefill=False) as url:
        ready = httpx.get(f"{url}/ready", timeout=10).json()
        assert ready["status"] == "ready" and list(ready["nodes"]) == ["d0"]
        # Chat: the greedy differential over three turns.
        for i in range(3):
            turn, text = turn_against_recompute(url, node, b.model, session, messages)
            turns.append(turn)
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": f"Step {i} done; what next?"}]
        print("chat turns (path, reused, cached, equal to the recompute):", turns)
        assert all(equal for *_, equal in turns), turns
        assert turns[0][:2] == ("d_fresh", 0), turns
        assert all(path == "d_direct" and reused > 0 and (cached or 0) >= reused
                   for path, reused, cached, _ in turns[1:]), turns

        # Anthropic Messages: a turn pair, against vLLM's own /v1/messages on the node.
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Which item comes first?"}]
        got_turns = []
        for follow_up in ("And the one after it?", None):
            body = {"model": b.model, "system": SYSTEM, "max_tokens": 16, "temperature": 0.0,
                    "messages": msgs}
            got = _post(f"{url}/v1/messages", body, {"X-Session-ID": f"{session}-m"})
            ref = _post(f"{node}/v1/messages", {**body, "cache_salt": uuid.uuid4().hex})
            assert _text(got) == _text(ref) and got["stop_reason"] == ref["stop_reason"]
            got_turns.append((got["kvagent"]["path"], got["kvagent"]["reused_tokens"]))
            if follow_up is not None:
                msgs = [*msgs, {"role": "assistant", "content": got["content"]},
                        {"role": "user", "content": follow_up}]
        print("messages turns (path, reused):", got_turns)
        assert got_turns[0][0] == "d_fresh", got_turns
        assert got_turns[1][0] == "d_direct" and got_turns[1][1] > 0, got_turns

        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert not re.search(r'kvagent_router_turns_total\{path="(pd_|recompute)', metrics)
