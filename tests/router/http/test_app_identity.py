"""KV identity against fake P/D nodes: what token ids alone cannot tell apart recomputes.

Each wrong-reuse case here got `pd_reuse` (or `d_direct`) from a router that compared
token ids only: another model or LoRA adapter, an image swapped behind identical
placeholder tokens, `truncate_prompt_tokens`. Media: the router never fetches a URL, limits
inline data, and reuses a conversation with images when nothing changed.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from fakes import MEDIA, MEDIA_TOKENS, Stack, router_stack

MODEL = "fake-model"
LONG = "Please describe the attached picture in detail and carefully. " * 4
PNG_A = "data:image/png;base64," + base64.b64encode(b"\x89PNG picture A" * 8).decode()
PNG_B = "data:image/png;base64," + base64.b64encode(b"\x89PNG picture B" * 8).decode()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def turn(st: Stack, messages: list[dict[str, Any]], token: str | None = None, *,
               model: str = MODEL, **extra: Any) -> tuple[dict[str, Any], str]:
    """One non-streamed turn in session s1; returns (kvagent object, answer)."""
    headers = {"X-Session-ID": "s1"}
    if token is not None:
        headers["X-KVAgent-Cache-Token"] = token
    body = {"model": model, "messages": messages, "max_tokens": 8, **extra}
    r = await st.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["kvagent"], data["choices"][0]["message"]["content"]


def follow(messages: list[dict[str, Any]], answer: str, content: Any) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": content}]


def no_wrong_kv(st: Stack) -> None:
    assert not st.cluster.events_of("wrong_kv"), st.cluster.events
    assert not st.cluster.open_leases()


def pulled_from_decode(st: Stack) -> list[Any]:
    d = st.decode[0].engine_id
    return [e for e in st.cluster.events_of("pull") if e.detail["from"] == d]


FIRST = [{"role": "user", "content": LONG}]


# ------------------------------------------------------------------ the three cases


@pytest.mark.parametrize("skip_prefill", [0, 10**6], ids=["pd", "d_direct"])
async def test_model_or_adapter_switch_recomputes(skip_prefill: int) -> None:
    """A LoRA adapter is chosen by `model`; its KV differs for the same token ids. With
    P skipping allowed, the stale handle must not send the turn to D either."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": skip_prefill}}) as st:
        kva, answer = await turn(st, FIRST)
        msgs = follow(FIRST, answer, "and now?")
        kva2, answer2 = await turn(st, msgs, kva["cache_token"], model="fake-model-lora-b")
        assert (kva2["path"], kva2["reason"], kva2["reused_tokens"]) == (
            "recompute", "identity_changed:model", 0)
        assert not pulled_from_decode(st)
        # P was told to release D's blocks (remote_num_tokens 0), not to pull them
        assert st.prefill[0].requests[-1]["kv_transfer_params"]["remote_num_tokens"] == 0
        # the new handle is the adapter's: staying on it reuses
        kva3, _ = await turn(st, follow(msgs, answer2, "more"), kva2["cache_token"],
                             model="fake-model-lora-b")
        assert kva3["reason"] == "hit" and kva3["reused_tokens"] > 0
        no_wrong_kv(st)


async def test_swapped_image_with_identical_placeholders_recomputes() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        first = [{"role": "user", "content": [{"type": "text", "text": LONG}, image(PNG_A)]}]
        kva, answer = await turn(st, first)
        swapped = [{"role": "user", "content": [{"type": "text", "text": LONG},
                                                image(PNG_B)]}]
        kva2, _ = await turn(st, follow(swapped, answer, "and now?"), kva["cache_token"])
        # placeholder positions unknown to the router: nothing is reused
        assert (kva2["path"], kva2["reason"]) == ("recompute", "multimodal_changed:item_0")
        assert not pulled_from_decode(st)
        no_wrong_kv(st)


async def test_swapped_image_stops_reuse_at_its_placeholder() -> None:
    """With the placeholder token id configured, reuse covers the text before the
    changed image and ends at its first placeholder."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            identity={"mm_placeholder_token_ids": [MEDIA]}) as st:
        first = [{"role": "user", "content": [{"type": "text", "text": LONG}, image(PNG_A)]}]
        kva, answer = await turn(st, first)
        swapped = [{"role": "user", "content": [{"type": "text", "text": LONG},
                                                image(PNG_B)]}]
        kva2, _ = await turn(st, follow(swapped, answer, "and now?"), kva["cache_token"])
        placeholder = 1 + len(LONG)  # <|user|> + the text
        assert (kva2["path"], kva2["reason"]) == ("pd_reuse", "multimodal_changed:item_0")
        assert 0 < kva2["reused_tokens"] <= placeholder
        assert kva2["reused_tokens"] == placeholder // 16 * 16
        no_wrong_kv(st)


async def test_truncate_prompt_tokens_recomputes() -> None:
    """vLLM truncates after rendering and /tokenize does not: the positions shift."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer = await turn(st, FIRST)
        kva2, _ = await turn(st, follow(FIRST, answer, "and now?"), kva["cache_token"],
                             truncate_prompt_tokens=200)
        assert (kva2["path"], kva2["reason"]) == (
            "recompute", "unverifiable_input:truncate_prompt_tokens")
        assert not pulled_from_decode(st)
        no_wrong_kv(st)


async def test_unknown_field_recomputes_and_is_not_an_error() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer = await turn(st, FIRST)
        msgs = follow(FIRST, answer, "and now?")
        kva2, answer2 = await turn(st, msgs, kva["cache_token"], future_kv_knob={"x": 1})
        assert kva2["reason"] == "unverifiable_input:future_kv_knob"
        # the handle made under that field is not reused without it either
        kva3, _ = await turn(st, follow(msgs, answer2, "more"), kva2["cache_token"])
        assert kva3["reason"] == "unverifiable_input:future_kv_knob"
        no_wrong_kv(st)


async def test_ignored_fields_keep_reuse() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer = await turn(st, FIRST, temperature=0.0)
        kva2, _ = await turn(st, follow(FIRST, answer, "and now?"), kva["cache_token"],
                             temperature=0.7, top_p=0.5, seed=3, user="u", stop=["zz"],
                             response_format={"type": "json_object"}, priority=0,
                             metadata={"k": "v"}, logprobs=True, top_logprobs=1)
        assert kva2["reason"] == "hit" and kva2["reused_tokens"] > 0
        no_wrong_kv(st)


# ------------------------------------------------------------------ rendering fields


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]),
    ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"),
    ("chat_template_kwargs", {"enable_thinking": True}),
    ("documents", [{"title": "t", "text": "a document"}]),
    ("reasoning_effort", "high")])
async def test_rendering_fields_are_seen_in_the_token_ids(field: str, value: Any) -> None:
    """Setting a rendering field on turn 2 changes the ids the router compares exactly as
    it changes the prompt P computes: reuse ends where they differ (here: at once)."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer = await turn(st, FIRST)
        kva2, _ = await turn(st, follow(FIRST, answer, "and now?"), kva["cache_token"],
                             **{field: value})
        assert (kva2["path"], kva2["reason"]) == ("recompute", "diverged_at_0")
        sent = st.prefill[0].tokenize_requests[-1]
        assert field in sent or field in (sent.get("chat_template_kwargs") or {})
        no_wrong_kv(st)


async def test_add_generation_prompt_is_rendered() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer = await turn(st, FIRST)
        msgs = follow(FIRST, answer, "and now?")
        kva2, _ = await turn(st, msgs, kva["cache_token"], add_generation_prompt=False)
        assert st.prefill[0].tokenize_requests[-1]["add_generation_prompt"] is False
        assert kva2["reused_tokens"] > 0  # the prefix is unchanged; only the tail differs
        no_wrong_kv(st)


# ------------------------------------------------------------------ media


async def test_conversation_with_images_reuses_when_nothing_changed() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        msgs = [{"role": "user", "content": [{"type": "text", "text": LONG}, image(PNG_A)]}]
        kva, answer = await turn(st, msgs)
        msgs = follow(msgs, answer, [{"type": "text", "text": "and this one?"}, image(PNG_B)])
        kva2, answer2 = await turn(st, msgs, kva["cache_token"])
        assert (kva2["path"], kva2["reason"]) == ("pd_reuse", "hit")
        assert kva2["reused_tokens"] >= 1 + len(LONG) + MEDIA_TOKENS - 16
        kva3, _ = await turn(st, follow(msgs, answer2, "compare them"), kva2["cache_token"])
        assert (kva3["path"], kva3["reason"]) == ("pd_reuse", "hit")
        assert kva3["reused_tokens"] > kva2["reused_tokens"]
        no_wrong_kv(st)


async def test_image_urls_are_never_fetched_by_the_router() -> None:
    """An `image_url` naming an http URL reaches the nodes as a string; the router opens
    no connection to it (no SSRF), and does not vouch for what is behind it: the turn
    after it reuses nothing past the URL's item."""
    hits: list[str] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append("connection")
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/cat.png"
    try:
        async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
            msgs = [{"role": "user", "content": [{"type": "text", "text": LONG}, image(url)]}]
            kva, answer = await turn(st, msgs)
            kva2, _ = await turn(st, follow(msgs, answer, "and now?"), kva["cache_token"])
            assert (kva2["path"], kva2["reason"]) == ("recompute",
                                                      "unverifiable_input:media_url")
            sent = st.prefill[0].requests[-1]["messages"][0]["content"][1]
            assert sent == image(url)  # passed through untouched
            await asyncio.sleep(0.2)
    finally:
        server.close()
        await server.wait_closed()
    assert hits == []


async def test_trusted_media_urls_reuse() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            identity={"trust_media_urls": True}) as st:
        msgs = [{"role": "user", "content": [{"type": "text", "text": LONG},
                                             image("http://198.51.100.7/cat.png")]}]
        kva, answer = await turn(st, msgs)
        kva2, _ = await turn(st, follow(msgs, answer, "and now?"), kva["cache_token"])
        assert kva2["reason"] == "hit"


@pytest.mark.parametrize("part", [
    image("data:image/png;base64," + "A" * 5000),
    {"type": "input_audio", "input_audio": {"data": "A" * 5000, "format": "wav"}},
    {"type": "file", "file": {"file_data": "A" * 5000, "filename": "a.pdf"}}])
async def test_inline_media_over_the_limit_is_413(part: dict[str, Any]) -> None:
    async with router_stack(limits={"max_inline_media_bytes": 4096}) as st:
        body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
        r = await st.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "media_too_large" and err["param"].startswith(
            "messages[0].content[0].")
        assert not st.prefill[0].requests and not st.prefill[0].tokenize_requests
        # an item under the limit, and a long URL (not inline), pass
        small = {"model": MODEL, "messages": [{"role": "user", "content": [
            image("data:image/png;base64," + "A" * 100),
            image("http://198.51.100.7/" + "a" * 5000)]}], "max_tokens": 4}
        assert (await st.client.post("/v1/chat/completions", json=small)).status_code == 200
