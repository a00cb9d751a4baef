"""The differential fuzz's own logic (no server): the reuse bound it enforces for images
and adapters, and the image and adapter operations on a conversation's history. The fuzz
itself runs on real vLLM (tests/e2e/test_fuzz_vllm.py, tests/models/)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.api import (
    Conversation,
    Runner,
    Sent,
    Target,
    cases,
    image_urls,
    placeholder_starts,
)

IMG = 9


def _target(**kw: Any) -> Target:
    return Target(router_v1="http://router/v1", prefill_url="http://p", model="base",
                  api_key=None, tools=[], system="sys", **kw)


def _held(ids: list[int], model: str = "base", images: list[str] | None = None) -> Sent:
    return Sent(message={}, token="t", held_ids=ids, model=model, images=images or [])


def test_placeholder_starts_one_per_run() -> None:
    assert placeholder_starts([1, IMG, IMG, 2, IMG, IMG, IMG, 3], (IMG,)) == [1, 4]
    assert placeholder_starts([IMG, 1], (IMG,)) == [0]
    assert placeholder_starts([1, 2], (IMG,)) == []


def test_image_urls_in_message_order() -> None:
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                         {"type": "text", "text": "x"}]},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b"}}]}]
    assert image_urls(msgs) == ["a", "b"]


def test_bound_is_the_token_prefix_cut_at_the_first_other_image_and_zero_on_another_model(
        ) -> None:
    r = Runner(_target(images=("a", "b"), image_token_ids=(IMG,)), httpx.Client())
    prompt = [1, 2, IMG, IMG, 3, IMG, IMG, 4, 5]
    held_ids = [1, 2, IMG, IMG, 3, IMG, IMG, 4, 6]
    assert r.bound(prompt, _held(held_ids, images=["a", "b"]), "base", ["a", "b"]) == 8
    assert r.bound(prompt, _held(held_ids, images=["a", "a"]), "base", ["a", "b"]) == 5
    assert r.bound(prompt, _held(held_ids, images=["b", "b"]), "base", ["a", "b"]) == 2
    assert r.bound(prompt, _held(held_ids, images=["a", "b"]), "lora", ["a", "b"]) == 0


def test_image_and_adapter_ops_are_drawn_only_where_offered() -> None:
    seen: set[str] = set()

    @settings(max_examples=200, database=None, derandomize=True)
    @given(ops=cases())
    def plain(ops: list[tuple[Any, ...]]) -> None:
        seen.update(op[0] for op in ops)

    plain()
    assert not seen & {"image", "swap", "adapter"}
    seen.clear()

    @settings(max_examples=200, database=None, derandomize=True)
    @given(ops=cases(images=True, adapters=True))
    def extended(ops: list[tuple[Any, ...]]) -> None:
        seen.update(op[0] for op in ops)

    extended()
    assert {"image", "swap", "adapter"} <= seen


class _Echo:
    """Router and prefill node in one: greedy answers that are a function of the body, so
    every turn equals its reference; records what the router was sent."""

    def __init__(self) -> None:
        self.routed: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.host == "router":
            self.routed.append(body)
        out = [len(json.dumps(body["messages"])) % 97, 1]
        return httpx.Response(200, json={
            "choices": [{"message": {"role": "assistant", "content": "ok"},
                         "token_ids": out}],
            "prompt_token_ids": [1, 2, 3], "usage": {"prompt_tokens": 3},
            "kvagent": {"path": "pd_fresh", "reused_tokens": 0, "cache_token": "t"}})


@given(k=st.integers(0, 5), i=st.integers(0, 5))
def test_swap_puts_another_image_in_an_earlier_message_and_adapter_switches_model(
        k: int, i: int) -> None:
    echo = _Echo()
    images = ("red", "green", "blue")
    with httpx.Client(transport=httpx.MockTransport(echo)) as client:
        r = Runner(_target(images=images, models=("lora",)), client)
        conv = Conversation("sys", "base")
        r.op_image(conv, k, "what is it?")
        before = image_urls(conv.messages)
        r.op_swap(conv, i, k)
        after = image_urls(echo.routed[-1]["messages"])
        assert len(after) == 1 and after != before and after[0] in images
        r.op_adapter(conv, 1)
        assert echo.routed[-1]["model"] == "lora" and conv.last is not None
        assert conv.last.model == "lora" and conv.last.images == after
    assert r.stats.mismatches == 0 and r.stats.bound_violations == 0
