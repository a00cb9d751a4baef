"""Incremental server-sent-events decoder (WHATWG rules), fed raw bytes, no I/O.

Bytes arrive split anywhere: inside a line, between ``\\r`` and ``\\n``, inside a UTF-8
sequence. The decoder buffers until a line ends, so callers can feed whatever the
transport yields. A byte-order mark opening the stream is skipped, as the standard says;
left in, it would glue itself to the first field name and lose the first event.
"""

from __future__ import annotations

from typing import NamedTuple

_BOM = b"\xef\xbb\xbf"


class ServerSentEvent(NamedTuple):
    """One dispatched event; ``data`` joins the event's ``data:`` lines with ``\\n``.

    A NamedTuple: one is built per chunk, and it is the cheapest immutable record.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Turns a byte stream into ``ServerSentEvent``s; call ``feed`` per chunk, ``close`` at EOF."""

    __slots__ = ("_at_start", "_buf", "_data", "_event", "_id", "_retry", "_skip_lf")

    def __init__(self) -> None:
        self._at_start = True  # until the first bytes show whether a BOM opens the stream
        self._buf = b""
        self._skip_lf = False  # the previous chunk ended in "\r": a leading "\n" belongs to it
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Consume ``chunk`` and return the events it completed (often zero or one)."""
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if self._at_start:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buf = buf  # maybe a BOM split across reads: wait for more
                return []
            self._at_start = False
            self._buf = b""
            buf = buf.removeprefix(_BOM)
        if not buf:
            return []
        lines = buf.splitlines(keepends=True)
        last = lines[-1]
        if last.endswith((b"\n", b"\r")):
            self._buf = b""
            if last.endswith(b"\r"):
                self._skip_lf = True
        else:
            self._buf = last
            lines.pop()
        events: list[ServerSentEvent] = []
        for raw in lines:
            event = self._line(raw.rstrip(b"\r\n").decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[ServerSentEvent]:
        """End of stream: an event whose lines all ended is dispatched; a cut-off line is not."""
        self._buf = b""  # an unterminated last line is a truncated one: drop it
        event = self._dispatch()
        return [event] if event is not None else []

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None  # comment / keep-alive
        field, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = None
            return None
        event = ServerSentEvent(
            data="\n".join(self._data), event=self._event or "message", id=self._id,
            retry=self._retry,
        )
        self._data = []
        self._event = None
        return event
