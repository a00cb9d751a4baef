"""Stream shapes servers really send, replayed through the whole SDK (decoder, accumulator,
sync and async sessions), split at awkward places: each must give the same answer as the
stream recorded from vLLM. Files: tests/sdk/data/README.md."""

from __future__ import annotations

import json
import math

import pytest
from kvagent import AsyncSession, ReasoningDelta, Session, TextDelta
from sdk_helpers import BASE_URL, MODEL, FakeServer, sse, stream_response

REFERENCE = "vllm_recorded_text.sse"


def _recorded_text() -> str:
    chunks = [json.loads(e[6:]) for e in sse(REFERENCE).split(b"\n\n")
              if e.startswith(b"data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


TEXT = _recorded_text()
VARIANTS = ["vllm_no_done.sse", "vllm_bom.sse", "vllm_crlf.sse", "vllm_heartbeats.sse",
            "vllm_usage_chunks.sse"]


@pytest.mark.parametrize("split", [None, 1, 3, 17])
@pytest.mark.parametrize("name", [REFERENCE, *VARIANTS])
def test_every_shape_gives_the_recorded_answer(name: str, split: int | None) -> None:
    server = FakeServer(stream_response(sse(name), split=split))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        events = list(s.stream("hi"))
    result = events[-1].result
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == TEXT
    assert result.text == TEXT and result.finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 8
    assert [m.role for m in s.messages] == ["user", "assistant"]


@pytest.mark.parametrize("name", VARIANTS)
async def test_every_shape_gives_the_recorded_answer_async(name: str) -> None:
    server = FakeServer(stream_response(sse(name), split=5))
    async with AsyncSession(BASE_URL, MODEL, transport=server.transport) as s:
        result = await s.send("hi")
    assert result.text == TEXT and result.usage.completion_tokens == 8


def test_a_bom_does_not_cost_the_first_event() -> None:
    """A server without a role chunk: the event after the BOM carries the first token."""
    body = sse("vllm_bom.sse")
    without_role_chunk = body[:3] + body[body.index(b"\n\n") + 2:]
    for split in (1, 2, None):  # the BOM itself split across reads, too
        server = FakeServer(stream_response(without_role_chunk, split=split))
        with Session(BASE_URL, MODEL, transport=server.transport) as s:
            assert s.send("hi").text == TEXT


def test_no_done_after_a_finished_choice_returns_like_openai_python() -> None:
    server = FakeServer(stream_response(sse("vllm_no_done.sse")))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("hi")
    assert result.finish_reason == "length" and s.messages[-1].content == TEXT


@pytest.mark.parametrize("name", ["router_text.sse", "router_kvagent_on_finish.sse"])
def test_router_shapes_carry_the_token_wherever_it_rides(name: str) -> None:
    server = FakeServer(stream_response(sse(name), split=11))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("hi")
    assert result.cache_token_received and result.path == "pd_reuse"
    assert result.text == "The weather in Paris is mild today."


@pytest.mark.parametrize("name", ["reasoning.sse", "reasoning_content.sse"])
def test_reasoning_is_kept_on_the_answer_not_in_the_text(name: str) -> None:
    server = FakeServer(stream_response(sse(name), split=7))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        events = list(s.stream("hi"))
    result = events[-1].result
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    expected = {"reasoning.sse": ("The user asks about Paris.", "Mild today."),
                "reasoning_content.sse": ("Think twice.", "Done.")}[name]
    assert (reasoning, result.text) == expected
    assert result.reasoning == result.message.reasoning == expected[0]


def test_reasoning_is_stripped_from_history_by_default_and_sent_when_asked() -> None:
    for policy, sent in (("strip", None), ("send", "The user asks about Paris.")):
        server = FakeServer(stream_response(sse("reasoning.sse")),
                            stream_response(sse("vllm_text.sse")))
        kwargs = {} if policy == "strip" else {"reasoning_history": policy}
        with Session(BASE_URL, MODEL, transport=server.transport, **kwargs) as s:
            s.send("hi")
            s.send("more")
        assistant = server.body(1)["messages"][1]
        assert assistant["content"] == "Mild today." and assistant.get("reasoning") == sent


def test_logprobs_are_asked_for_and_exposed() -> None:
    server = FakeServer(stream_response(sse("logprobs.sse"), split=13))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("hi", logprobs=True, top_logprobs=2)
    assert server.body()["logprobs"] is True and server.body()["top_logprobs"] == 2
    assert [t.token for t in result.logprobs] == [" Mild", "."]
    assert math.isclose(result.logprobs[0].logprob, -0.25)
    assert [a.token for a in result.logprobs[0].top_logprobs] == [" Mild", " Warm"]
    assert result.logprobs[1].bytes == [46]


def test_logprobs_are_none_when_not_asked() -> None:
    server = FakeServer(stream_response(sse("vllm_recorded_text.sse")))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        assert s.send("hi").logprobs is None


def test_other_choices_are_exposed_and_the_history_keeps_the_first() -> None:
    server = FakeServer(stream_response(sse("n2.sse"), split=29))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("hi", extra_body={"n": 2})
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (0, "Sunny.", "stop"), (1, "Rain", "length")]
    assert result.text == "Sunny." and s.messages[-1].content == "Sunny."


def test_a_second_choice_that_never_finished_without_done_is_incomplete() -> None:
    cut = sse("n2.sse").split(b"data: [DONE]")[0]
    cut = cut[:cut.index(b'"finish_reason":"length"')]  # cut before choice 1 finished
    cut = cut[:cut.rindex(b"\n\n") + 2]
    server = FakeServer(stream_response(cut))
    with Session(BASE_URL, MODEL, transport=server.transport) as s, \
            pytest.raises(Exception, match="incomplete"):
        s.send("hi")
