"""What openai-python users reach for: per-call timeout/retries/headers, ``with_options``,
environment variables, raw response facts, logging, structured output, content parts, and
sessions that stay usable in notebooks and after abandoned streams."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import warnings

import httpx
import pytest
from kvagent import (
    AsyncSession,
    AudioPart,
    FilePart,
    ImagePart,
    InternalServerError,
    Session,
    TextDelta,
    TextPart,
    UserMessage,
    tool,
)
from kvagent._logs import LOG_ENV, setup_from_env
from pydantic import BaseModel, ValidationError
from sdk_helpers import BASE_URL, MODEL, FakeServer, error_response, sse, stream_response


def text_reply(text: str = "ok", headers: dict[str, str] | None = None) -> httpx.Response:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL}
    body = b"".join(
        b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"
        for choice in ({"index": 0, "delta": {"content": text}, "finish_reason": None},
                       {"index": 0, "delta": {}, "finish_reason": "stop"}))
    return stream_response(body + b"data: [DONE]\n\n", headers=headers)


# ----------------------------------------------------------------------- per-call options


def test_per_call_timeout_reaches_the_request() -> None:
    server = FakeServer(text_reply(), text_reply())
    with Session(BASE_URL, MODEL, transport=server.transport, timeout=30.0) as s:
        s.send("a")
        s.send("b", timeout=2.5)
    first, second = (r.extensions["timeout"] for r in server.requests)
    assert first["read"] == 30.0 and second["read"] == 2.5


def test_per_call_max_retries_overrides_the_session_policy() -> None:
    server = FakeServer(error_response(500, "boom"), error_response(500, "boom"))
    with Session(BASE_URL, MODEL, transport=server.transport, max_retries=5) as s, \
            pytest.raises(InternalServerError):
        s.send("a", max_retries=0)
    assert len(server.requests) == 1


def test_with_options_shares_history_and_changes_only_what_it_names() -> None:
    server = FakeServer(text_reply("one"), text_reply("two"), text_reply("three"))
    with Session(BASE_URL, MODEL, transport=server.transport, temperature=0.5,
                 headers={"X-App": "a"}) as s:
        s.send("1")
        fast = s.with_options(timeout=1.0, max_retries=0, headers={"X-Trace": "t"},
                              temperature=0.0)
        fast.send("2")
        s.send("3")
        fast.close()  # closes nothing: the client belongs to s
        assert [m.content for m in s.messages if m.role == "assistant"] == [
            "one", "two", "three"]
        assert fast.messages == s.messages and fast.retry.max_retries == 0
    _, r2, r3 = server.requests
    assert r2.headers["X-Trace"] == "t" and r2.headers["X-App"] == "a"
    assert "X-Trace" not in r3.headers
    assert json.loads(r2.content)["temperature"] == 0.0
    assert json.loads(r3.content)["temperature"] == 0.5
    assert r2.extensions["timeout"]["read"] == 1.0


def test_with_options_copy_and_original_share_the_running_turn() -> None:
    server = FakeServer(stream_response(sse("router_text.sse"), split=40))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        events = s.stream("hi")
        next(events)
        with pytest.raises(RuntimeError, match="still open"):
            s.with_options(timeout=1.0).send("again")
        events.until_done()


# ----------------------------------------------------------------------- environment


def test_base_url_and_api_key_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVAGENT_BASE_URL", BASE_URL)
    monkeypatch.setenv("KVAGENT_API_KEY", "sk-env")
    server = FakeServer(text_reply())
    with Session(model=MODEL, transport=server.transport) as s:
        s.send("hi")
    assert str(server.requests[0].url) == f"{BASE_URL}/chat/completions"
    assert server.requests[0].headers["Authorization"] == "Bearer sk-env"


def test_explicit_arguments_win_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVAGENT_BASE_URL", "http://elsewhere.test/v1")
    monkeypatch.setenv("KVAGENT_API_KEY", "sk-env")
    s = Session(BASE_URL, MODEL, api_key="sk-arg")
    assert (s.base_url, s.api_key) == (BASE_URL, "sk-arg")
    s.close()


def test_missing_base_url_names_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("KVAGENT_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="KVAGENT_BASE_URL"):
        Session(model=MODEL)


# ----------------------------------------------------------------------- raw response


def test_headers_and_request_id_are_on_the_result() -> None:
    server = FakeServer(text_reply(headers={"x-request-id": "req-123", "x-extra": "1"}))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("hi")
    assert result.request_id == "req-123" and result.headers["x-extra"] == "1"


def test_errors_carry_the_request_id_and_headers() -> None:
    server = FakeServer(error_response(400, "bad", headers={"x-request-id": "req-9"}))
    with Session(BASE_URL, MODEL, transport=server.transport, max_retries=0) as s, \
            pytest.raises(Exception) as info:
        s.send("hi")
    assert info.value.request_id == "req-9" and info.value.headers["x-request-id"] == "req-9"


# ----------------------------------------------------------------------- logging


def test_library_logger_is_silent_by_default() -> None:
    logger = logging.getLogger("kvagent")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_kvagent_log_debug_logs_requests_without_secrets(caplog) -> None:
    logger = logging.getLogger("kvagent")
    handler = setup_from_env({LOG_ENV: "debug"})
    try:
        assert handler is not None and logger.level == logging.DEBUG
        server = FakeServer(text_reply(headers={"x-request-id": "req-7"}))
        with caplog.at_level(logging.DEBUG, logger="kvagent"), \
                Session(BASE_URL, MODEL, transport=server.transport, api_key="sk-secret") as s:
            s.send("hi")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    text = caplog.text
    assert "request: POST http://kvagent.test/v1/chat/completions" in text
    assert "HTTP 200" in text and "req-7" in text
    assert "sk-secret" not in text and "<redacted>" in text


def test_unknown_log_level_is_ignored() -> None:
    assert setup_from_env({LOG_ENV: "chatty"}) is None and setup_from_env({}) is None


# ----------------------------------------------------------------------- structured output


class Weather(BaseModel):
    city: str
    temp_c: float


def test_response_format_model_is_sent_as_json_schema_and_parsed() -> None:
    server = FakeServer(text_reply('{"city": "Paris", "temp_c": 18.5}'))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("weather?", response_format=Weather)
    sent = server.body()["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "Weather"
    assert sent["json_schema"]["schema"] == Weather.model_json_schema()
    assert result.parsed == Weather(city="Paris", temp_c=18.5)


def test_an_answer_that_does_not_fit_the_model_raises_on_parsed() -> None:
    server = FakeServer(text_reply('{"city": "Paris"'))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        result = s.send("weather?", response_format=Weather)
    assert result.text == '{"city": "Paris"'  # the answer itself is kept
    with pytest.raises(ValidationError):
        _ = result.parsed


def test_response_format_dict_passes_through_and_saves(tmp_path) -> None:
    server = FakeServer(text_reply("{}"), text_reply("{}"))
    fmt = {"type": "json_object"}
    with Session(BASE_URL, MODEL, transport=server.transport, response_format=Weather) as s:
        s.send("x", response_format=fmt)
        assert server.body()["response_format"] == fmt
        s.save(tmp_path / "s.json")
    saved = json.loads((tmp_path / "s.json").read_text())["options"]["response_format"]
    assert saved["json_schema"]["name"] == "Weather"  # the model's wire form, not code
    with Session.load(tmp_path / "s.json", transport=server.transport) as loaded:
        loaded.send("y")
    assert server.body()["response_format"] == saved


# ----------------------------------------------------------------------- content parts

PNG = b"\x89PNG\r\n\x1a\n fake image bytes"
PARTS = [
    {"type": "text", "text": "What is in these?"},
    {"type": "image_url", "image_url": {"url": "https://example.test/cat.png", "detail": "low"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBER",
                              "filename": "a.pdf"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"},
     "uuid": "img-1"},  # a server extension (vLLM's media uuid) rides along untouched
]


def test_content_parts_go_on_the_wire_unchanged_and_stay_in_history(tmp_path) -> None:
    server = FakeServer(text_reply("a cat"), text_reply("yes"), text_reply("again"))
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        s.send(PARTS)
        s.send("Sure?")
        assert server.body(0)["messages"][0] == {"role": "user", "content": PARTS}
        assert server.body(1)["messages"][0] == {"role": "user", "content": PARTS}
        # byte-identical prefix across turns, as reuse needs
        assert server.requests[1].content.startswith(
            server.requests[0].content[:server.requests[0].content.index(b'"stream"') - 2])
        message = s.messages[0]
        assert isinstance(message, UserMessage) and message.text == "What is in these?"
        s.save(tmp_path / "s.json")
    with Session.load(tmp_path / "s.json", transport=server.transport) as loaded:
        assert loaded.messages == s.messages
        loaded.send("And now?")
    assert server.body(2)["messages"][0] == {"role": "user", "content": PARTS}


def test_typed_parts_and_helpers() -> None:
    image = ImagePart.from_bytes(PNG, "image/png")
    assert image.image_url.url.startswith("data:image/png;base64,iVBORw0KGgog")
    audio = AudioPart.from_bytes(b"RIFF", "wav")
    message = UserMessage(content=[TextPart(text="hi"), image, audio,
                                   FilePart(file={"file_id": "file-1"})])
    wire = [p.model_dump(mode="json") for p in message.content]
    assert wire[0] == {"type": "text", "text": "hi"}
    assert wire[2] == {"type": "input_audio", "input_audio": {"data": "UklGRg==",
                                                              "format": "wav"}}
    assert wire[3] == {"type": "file", "file": {"file_id": "file-1"}}


def test_an_unknown_part_type_is_rejected_before_sending() -> None:
    server = FakeServer()
    with Session(BASE_URL, MODEL, transport=server.transport) as s, \
            pytest.raises(ValidationError):
        s.send([{"type": "video", "video": {}}])
    assert server.requests == [] and s.messages == ()


# ----------------------------------------------------------------------- notebooks


@tool
async def async_weather(city: str) -> str:
    """Current weather."""
    await asyncio.sleep(0.01)
    return f"sunny in {city}"


def tool_call_reply() -> httpx.Response:
    head = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "async_weather", "arguments": '{"city": "Paris"}'}}
    chunks = [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None},
              {"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
    body = b"".join(b"data: " + json.dumps({**head, "choices": [c]}).encode() + b"\n\n"
                    for c in chunks)
    return stream_response(body + b"data: [DONE]\n\n")


async def test_sync_run_with_an_async_tool_inside_a_running_loop() -> None:
    """A Jupyter cell: sync ``Session.run()`` while the notebook's loop runs."""
    server = FakeServer(tool_call_reply(), text_reply("done"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Session(BASE_URL, MODEL, transport=server.transport,
                     tools=[async_weather]) as s:
            run = s.run("weather?")
        gc.collect()
    assert run.tool_results[0].content == "sunny in Paris"
    assert not run.tool_results[0].is_error


# ----------------------------------------------------------------------- abandoned streams


async def test_breaking_out_of_an_async_stream_frees_the_session() -> None:
    server = FakeServer(stream_response(sse("router_text.sse"), split=40), text_reply())
    async with AsyncSession(BASE_URL, MODEL, transport=server.transport) as s:
        async for event in s.stream("hi"):
            assert isinstance(event, TextDelta)
            break  # no async with, no aclose: the stream is simply dropped
        result = await s.send("again")
    assert result.text == "ok"
    assert [m.role for m in s.messages] == ["user", "assistant"]  # the dropped turn left none


async def test_closing_a_kept_async_stream_frees_the_session() -> None:
    server = FakeServer(stream_response(sse("router_text.sse"), split=40), text_reply())
    async with AsyncSession(BASE_URL, MODEL, transport=server.transport) as s:
        stream = s.stream("hi")
        await stream.__anext__()
        with pytest.raises(RuntimeError, match="still open .* close it"):
            await s.send("too early")
        await stream.aclose()
        assert (await s.send("again")).text == "ok"


async def test_a_late_close_of_an_old_stream_does_not_free_a_newer_turn() -> None:
    server = FakeServer(stream_response(sse("router_text.sse"), split=40),
                        stream_response(sse("router_text.sse"), split=40))
    async with AsyncSession(BASE_URL, MODEL, transport=server.transport) as s:
        old = s.stream("one")
        await old.__anext__()
        await old.aclose()
        new = s.stream("two")
        await new.__anext__()
        await old.aclose()  # again, late: must not release "two"
        with pytest.raises(RuntimeError, match="still open"):
            await s.send("three")
        await new.until_done()


def test_a_given_clients_timeout_is_kept_unless_the_session_sets_one() -> None:
    server = FakeServer(text_reply(), text_reply())
    client = httpx.Client(transport=server.transport, timeout=7.0)
    with client:
        Session(BASE_URL, MODEL, http_client=client).send("a")
        Session(BASE_URL, MODEL, http_client=client, timeout=3.0).send("b")
    assert [r.extensions["timeout"]["read"] for r in server.requests] == [7.0, 3.0]


def test_breaking_out_of_a_sync_stream_without_with_frees_the_session() -> None:
    server = FakeServer(stream_response(sse("router_text.sse"), split=40), text_reply())
    with Session(BASE_URL, MODEL, transport=server.transport) as s:
        for _ in s.stream("hi"):
            break
        assert s.send("again").text == "ok"
