"""Connection-level limits, enforced while a request's head is still arriving.

uvicorn's httptools parser buffers a header of any size until its line ends, and keeps a
connection whose head never completes open forever: one 200 MiB header block, or a
thousand clients sending a header byte a second, grow the router or exhaust its file
descriptors before any ASGI middleware can see a request. `GuardedHttpTools` (a uvicorn
protocol class) closes such connections early:

- the request line plus headers are counted as bytes arrive: past `max_header_bytes` the
  client gets a 431 and the connection is closed (nothing more is buffered);
- more than `max_header_count` header lines: 431;
- a head that has not arrived `header_timeout_s` after the connection opened (or after
  the previous response ended): 408 and closed;
- past `max_connections` open connections in all, or `max_connections_per_client` from
  one address, a new connection is closed at once, unanswered;
- a response sent while its request's body is still arriving (a 408 body timeout, a 401,
  413 or 404 answered before the body was read) ends the connection: the router's side
  is shut once the answer is written (FIN), the rest of the body is read and discarded,
  and the connection is closed when the body ends or `header_timeout_s` after the
  answer, whichever comes first. Without this a client trickling body bytes held the
  connection forever (uvicorn discards them, and its keep-alive timer restarts on every
  byte); reading to the end, rather than closing at once, keeps the kernel from
  resetting the connection under a client still uploading, which would lose its answer.

`HeadMeter` is the I/O-free part (counted per connection); the protocol class only
wires it to uvicorn's callbacks. `uvicorn_config` is how the router is served.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from kvagent_server.router.settings import RouterSettings


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    max_header_count: int
    header_timeout_s: float
    max_connections: int
    max_connections_per_client: int

    @classmethod
    def from_settings(cls, s: RouterSettings) -> ConnectionLimits:
        lim = s.limits
        return cls(max_header_bytes=lim.max_header_bytes, max_header_count=lim.max_header_count,
                   header_timeout_s=lim.header_timeout_s, max_connections=lim.max_connections,
                   max_connections_per_client=lim.max_connections_per_client)


class HeadMeter:
    """Counts one connection's request head (bytes and header lines) as it arrives.

    `room()` is how many more bytes may be fed while the head is open; a head is open from
    the connection (or the end of the previous request) until its blank line."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.in_head = True
        self.bytes = 0
        self.headers = 0

    def room(self) -> int:
        return self.limits.max_header_bytes - self.bytes if self.in_head else -1

    def fed(self, n: int) -> None:
        if self.in_head:
            self.bytes += n

    def header(self) -> bool:
        """One more header line: False once past `max_header_count`."""
        self.headers += 1
        return self.headers <= self.limits.max_header_count

    def head_done(self) -> None:
        self.in_head = False

    def next_request(self) -> None:
        self.in_head, self.bytes, self.headers = True, 0, 0


class ConnectionCounter:
    """Open connections, in all and per client address (shared by a server's protocols)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_client: dict[str, int] = {}

    def open(self, client: str) -> bool:
        """Count a new connection; False when it is over a cap (it is still counted:
        `close` is called for every `open`)."""
        self.total += 1
        n = self.per_client[client] = self.per_client.get(client, 0) + 1
        return (self.total <= self.limits.max_connections
                and n <= self.limits.max_connections_per_client)

    def close(self, client: str) -> None:
        self.total -= 1
        n = self.per_client.get(client, 0) - 1
        if n <= 0:
            self.per_client.pop(client, None)
        else:
            self.per_client[client] = n


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing; the verdict is on the protocol."""


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits above (`make_protocol` binds
    the limits and the shared counter)."""

    limits: ConnectionLimits
    counter: ConnectionCounter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = HeadMeter(self.limits)
        self._verdict: bytes | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._peer = "?"
        self._counted = False
        #: The request whose body is still arriving (headers parsed, message not complete).
        self._body_open: RequestResponseCycle | None = None
        #: Answered before its body ended: discarding the rest, then closing.
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own narrowing of BaseTransport
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else "?"
        self._counted = True
        if not self.counter.open(self._peer):
            transport.abort()  # over a cap: no answer, no buffer
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self.counter.close(self._peer)
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    # -- the head
    def data_received(self, data: bytes) -> None:
        room = self.meter.room()
        if room >= 0 and len(data) > room:
            head, data = data[:room], data[room:]
            self.meter.fed(len(head))
            super().data_received(head)
            if self.meter.in_head and not self.transport.is_closing():
                self._reject(431, "Request Header Fields Too Large",
                             f"request headers exceed {self.limits.max_header_bytes} bytes",
                             "headers_too_large")
                return
            if self.transport.is_closing() or not data:
                return
        self.meter.fed(len(data))
        super().data_received(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.meter.header():
            self._verdict = _response(431, "Request Header Fields Too Large",
                                      f"more than {self.limits.max_header_count} headers",
                                      "too_many_headers")
            raise _Rejected
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.meter.head_done()
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a new request (not a protocol upgrade)
            self._body_open = self.cycle

    def on_message_complete(self) -> None:
        self.meter.next_request()
        self._body_open = None
        super().on_message_complete()
        if self._lingering:  # the answered body is all read: nothing more is wanted
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        # The answered request's body is still arriving (a pipelined request's cycle is
        # not complete yet, so it keeps its connection).
        if self._body_open is not None and self._body_open.response_complete:
            self._linger()
            return
        self._arm()

    def _linger(self) -> None:
        """End a connection whose answer went out before its body ended: FIN now, read
        and discard the rest, close at the body's end or after `header_timeout_s`."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self.transport.close)

    def send_400_response(self, msg: str) -> None:
        if self._verdict is not None:  # a parser callback rejected the head
            self.transport.write(self._verdict)
            self.transport.close()
            return
        super().send_400_response(msg)

    # -- the deadline
    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timeout(self) -> None:
        self._head_timer = None
        if self.meter.in_head and not self.transport.is_closing():
            if self.meter.bytes:
                self._reject(408, "Request Timeout", "request headers not received within "
                             f"{self.limits.header_timeout_s:g} s", "header_timeout")
            else:  # an idle connection: nothing to answer
                self.transport.close()

    def _reject(self, status: int, reason: str, message: str, code: str) -> None:
        self._disarm()
        self.transport.write(_response(status, reason, message, code))
        self.transport.close()


def make_protocol(limits: ConnectionLimits) -> type[GuardedHttpTools]:
    """A protocol class bound to `limits` and one connection counter (one per server)."""
    return type("GuardedHttpTools", (GuardedHttpTools,),
                {"limits": limits, "counter": ConnectionCounter(limits)})


def uvicorn_config(app: Any, settings: RouterSettings, *, host: str, port: int,
                   **kwargs: Any) -> uvicorn.Config:
    """How the router is served: httptools with the head limits, and h11's own limit
    should someone switch to `http="h11"`."""
    kwargs.setdefault("http", make_protocol(ConnectionLimits.from_settings(settings)))
    return uvicorn.Config(app, host=host, port=port,
                          h11_max_incomplete_event_size=settings.limits.max_header_bytes, **kwargs)
