"""The SSE decoder against the framing cases real streams produce."""

from __future__ import annotations

import pytest
from kvagent._sse import ServerSentEvent, SSEDecoder
from sdk_helpers import sse


def decode(pieces: list[bytes]) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events = [e for piece in pieces for e in decoder.feed(piece)]
    return events + decoder.close()


def test_one_event_per_blank_line() -> None:
    events = decode([b"data: a\n\ndata: b\n\n"])
    assert [e.data for e in events] == ["a", "b"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_any_split_gives_the_same_events(size: int) -> None:
    body = sse("router_parallel_tools.sse")
    whole = decode([body])
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    assert decode(pieces) == whole
    assert len(whole) == 10 and whole[-1].data == "[DONE]"


@pytest.mark.parametrize("newline", [b"\r\n", b"\r", b"\n"])
def test_all_three_line_endings(newline: bytes) -> None:
    body = sse("vllm_text.sse").replace(b"\n", newline)
    for size in (1, 5, len(body)):
        events = decode([body[i:i + size] for i in range(0, len(body), size)])
        assert [e.data for e in events] == [e.data for e in decode([sse("vllm_text.sse")])]


def test_crlf_split_between_cr_and_lf_is_one_line_ending() -> None:
    events = decode([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"])
    assert [e.data for e in events] == ["a", "b"]


def test_comments_and_keepalives_are_ignored() -> None:
    events = decode([b": ping\n\n:keep-alive\ndata: x\n: mid-event comment\n\n"])
    assert [e.data for e in events] == ["x"]


def test_multiline_data_is_joined_with_newlines() -> None:
    events = decode([b"data: {\"a\":\ndata: 1}\n\n"])
    assert events[0].data == '{"a":\n1}'


def test_event_id_retry_fields_and_no_space_after_colon() -> None:
    events = decode([b"event: delta\nid: 7\nretry: 1500\ndata:x\n\n"])
    assert events == [ServerSentEvent(data="x", event="delta", id="7", retry=1500)]


def test_utf8_sequence_split_across_chunks() -> None:
    body = "data: 18°C ☀\n\n".encode()
    cut = body.index("☀".encode()) + 1  # in the middle of the 3-byte sequence
    assert decode([body[:cut], body[cut:]])[0].data == "18°C ☀"


def test_complete_event_without_final_blank_line_is_flushed_at_eof() -> None:
    assert [e.data for e in decode([b"data: [DONE]\n"])] == ["[DONE]"]


def test_cut_off_last_line_is_dropped_at_eof() -> None:
    assert decode([b'data: {"id":"chatcmpl-1","choi']) == []


def test_lines_without_data_dispatch_nothing() -> None:
    assert decode([b"event: ping\n\n\n\n"]) == []


@pytest.mark.parametrize("size", [1, 2, 4, 100])
def test_a_leading_byte_order_mark_is_skipped_even_split(size: int) -> None:
    body = b"\xef\xbb\xbfdata: first\n\ndata: second\n\n"
    events = decode([body[i:i + size] for i in range(0, len(body), size)])
    assert [e.data for e in events] == ["first", "second"]


def test_only_a_leading_byte_order_mark_is_special() -> None:
    events = decode([b"data: a\n\n\xef\xbb\xbfdata: b\n\n"])
    assert [e.data for e in events] == ["a"]  # mid-stream it is part of a field name
