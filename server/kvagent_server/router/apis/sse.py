"""Server-sent events for the translated APIs: the relayed chat stream in, named events out."""

from __future__ import annotations

from typing import Any

from kvagent_server.router.common import fastjson

#: What `ChatEvents.feed` yields for the chat stream's `data: [DONE]`.
DONE = None


class ChatEvents:
    """Splits the relayed chat stream's bytes into parsed chunks, however the bytes were cut.

    Yields each `data:` event's JSON object, and `DONE` for `[DONE]`; comments and
    keep-alives are skipped."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[dict[str, Any] | None]:
        self._buffer += data
        out: list[dict[str, Any] | None] = []
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                return out
            event, self._buffer = self._buffer[:cut], self._buffer[cut + 2:]
            lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not lines:
                continue
            payload = b"\n".join(lines)
            if payload == b"[DONE]":
                out.append(DONE)
                continue
            obj = fastjson.loads(payload)
            if isinstance(obj, dict):
                out.append(obj)


def named(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event with a name, as Anthropic's and OpenAI's Responses streams send them."""
    return b"event: " + event.encode() + b"\ndata: " + fastjson.dumps(data) + b"\n\n"
