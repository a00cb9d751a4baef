"""On real vLLM: a P/D turn's D leg takes the prompt token ids P computed
(router.forward_prompt_ids, vLLM's `kv_transfer_params.prompt_token_ids`) and answers
exactly as a recompute does, with tool calls and tool results in the history; the D leg
also takes the token P sampled (router.forward_first_token, the plugin's `first_token`).

First, that the pinned vLLM really feeds forwarded ids to the engine instead of the
messages (so the router's forwarding changes what D computes); then, a tool-using
conversation through a router that sends every reused turn `pd_reuse`, each answer
compared with the same request sent straight to P under a fresh random `cache_salt`
(nothing cached can match), greedy. The fake-node tests: tests/router/turns/test_forward_prompt_ids.py.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import metric_sum, second_router

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_tokens": 12}
TOOLS = [{"type": "function", "function": {
    "name": "search_logs", "description": "Search the service's logs.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}]
SYSTEM = ("You are an SRE agent. Use the tools, then answer in one line. Runbook: "
          + " ".join(f"rule {i}: compare the error rate before and after each deploy."
                     for i in range(25)))


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict]:
    """A streamed turn through the router: (answer text, the kvagent object)."""
    text, kva = "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, headers=headers,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for choice in obj.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
            kva = obj.get("kvagent") or kva
    return text, kva


def test_vllm_computes_the_forwarded_ids_not_the_messages(kvagent_bundle: Any) -> None:
    """Forwarded ids of one chat sent with another chat's messages: the engine takes the
    ids (prompt and answer are the first chat's)."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b, p = kvagent_bundle, kvagent_bundle.prefill_urls[0]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Disk full?"}]
    other = [{"role": "user", "content": "Something else entirely."}]
    ref = _chat(p, {"model": b.model, "messages": first, "return_token_ids": True,
                    "cache_salt": uuid.uuid4().hex, **GREEDY})
    got = _chat(p, {"model": b.model, "messages": other, "return_token_ids": True,
                    "cache_salt": uuid.uuid4().hex,
                    "kv_transfer_params": {"prompt_token_ids": ref["prompt_token_ids"]},
                    **GREEDY})
    assert got["prompt_token_ids"] == ref["prompt_token_ids"]
    assert got["choices"][0]["message"] == ref["choices"][0]["message"]


def test_pd_reuse_turns_with_forwarded_ids_answer_as_a_recompute(kvagent_bundle: Any,
                                                                 tmp_path: Path) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b = kvagent_bundle
    session = f"fwd-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "Checkout errors spiked."}]
    turns = []
    with second_router(b, tmp_path, policy={"params": {"skip_prefill_max_tokens": 0}}) as url:
        for i in range(4):
            body = {"model": b.model, "messages": messages, "tools": TOOLS, **GREEDY}
            text, kva = _streamed(url, body, {"X-Session-ID": session})
            ref = _chat(b.prefill_urls[0], {**body, "cache_salt": uuid.uuid4().hex})
            turns.append((kva.get("path"), text == (ref["choices"][0]["message"]["content"]
                                                    or "")))
            call_id = f"call{i}"
            messages = [
                *messages,
                {"role": "assistant", "content": text, "tool_calls": [{
                    "id": call_id, "type": "function", "function": {
                        "name": "search_logs",
                        "arguments": json.dumps({"query": f"checkout errors {i}"})}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": json.dumps({"hits": [f"{i}:{k} 502 from payments" for k in
                                                 range(8)]})},
            ]
        forwarded = metric_sum(url, "kvagent_router_prompt_ids_forwarded_total")
        first_tokens = metric_sum(url, "kvagent_router_first_tokens_forwarded_total")
    print("turns (path, equal to the recompute):", turns, "forwarded:", forwarded,
          "first tokens:", first_tokens)
    assert all(equal for _, equal in turns), turns
    assert [path for path, _ in turns[1:]] == ["pd_reuse"] * 3, turns
    assert forwarded == len(turns)  # every turn had a P leg, and every D leg took its ids
    # ...and P's token, which D emitted and computed from (vllm_plugin.first_token).
    assert first_tokens == len(turns)
