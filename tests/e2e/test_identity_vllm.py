"""KV identity on real vLLM: turns whose KV token ids cannot vouch for recompute, with the
reason, and their greedy answers equal the recomputed ones; P then gets nothing from D.

References are the same request sent to the decode node alone with a fresh random
`cache_salt`: no prefix cache can serve it (asserted) and no KV moves.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from .e2e_helpers import ALPHA_KEY, E2E, GREEDY, p2p_received

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _reference(e: E2E, body: dict[str, Any]) -> str:
    r = httpx.post(f"{e.decode_url}/v1/chat/completions", timeout=600,
                   json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out["choices"][0]["message"]["content"]


class Chat:
    """One session through the router, raw HTTP (fields the SDK does not send)."""

    def __init__(self, e: E2E, first: str) -> None:
        from kvagent_server.demo.agent import system_prompt

        self.e = e
        self.session = uuid.uuid4().hex
        self.token: str | None = None
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt()}, {"role": "user", "content": first}]

    def send(self, **fields: Any) -> tuple[dict[str, Any], str, str]:
        """A turn; returns (kvagent object, answer, the recomputed reference answer)."""
        body = {"model": self.e.model, "messages": list(self.messages), "max_tokens": 12,
                **GREEDY, **fields}
        body = {k: v for k, v in body.items() if v is not None}
        headers = {"Authorization": f"Bearer {ALPHA_KEY}", "X-Session-ID": self.session}
        if self.token:
            headers["X-KVAgent-Cache-Token"] = self.token
        r = httpx.post(f"{self.e.base_url}/chat/completions", json=body, headers=headers,
                       timeout=600)
        assert r.status_code == 200, r.text
        out = r.json()
        kva = out["kvagent"]
        self.token = kva["cache_token"]
        text = out["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": text})
        return kva, text, _reference(self.e, body)


def test_model_name_switch_recomputes_and_equals_recompute(e2e: E2E) -> None:
    """Omitting `model` selects the default model on vLLM, a name the handle was not made
    under: the router cannot tell a name from an adapter, so it recomputes."""
    chat = Chat(e2e, "Checkout latency doubled. What do you look at first?")
    kva, text, ref = chat.send()
    assert text == ref
    chat.messages.append({"role": "user", "content": "And after that?"})
    received = p2p_received(e2e.prefill_url)
    kva, text, ref = chat.send(model=None)
    assert (kva["path"], kva["reason"], kva["reused_tokens"]) == (
        "recompute", "identity_changed:model", 0)
    assert text == ref
    assert p2p_received(e2e.prefill_url) == received, "P pulled KV from D for another model name"
    # the next turn under the same name reuses the handle made under it
    chat.messages.append({"role": "user", "content": "Summarise."})
    kva, text, ref = chat.send(model=None)
    assert kva["path"] in ("pd_reuse", "d_direct") and kva["reused_tokens"] > 0, kva
    assert text == ref


def test_truncate_prompt_tokens_recomputes_and_equals_recompute(e2e: E2E) -> None:
    chat = Chat(e2e, "The payment webhook queue is backing up. Why?")
    chat.send()
    chat.messages.append({"role": "user", "content": "Keep only what matters."})
    received = p2p_received(e2e.prefill_url)
    kva, text, ref = chat.send(truncate_prompt_tokens=256)
    assert (kva["path"], kva["reason"], kva["reused_tokens"]) == (
        "recompute", "unverifiable_input:truncate_prompt_tokens", 0)
    assert text == ref
    assert p2p_received(e2e.prefill_url) == received, "P pulled KV from D for a truncated prompt"
