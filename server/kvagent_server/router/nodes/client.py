"""The router's one HTTP client to its nodes: a pooled aiohttp session per node.

Legs, `/tokenize`, health probes, `/metrics` reads and releases all go through
`NodeClient`. aiohttp rather than httpx: per request it costs about a third of httpx's
CPU (`benchmarks/router_overhead`), and a turn makes two or three requests. The rest of
the router sees only `NodeResponse`, `UpstreamError` and the `NodeHttp` protocol (which a
simulator or a test may implement), never aiohttp itself.

Error classes (what `Legs` does with them):

    UpstreamError            any failure talking to a node (a leg retries elsewhere,
    |                        a started stream is cut)
    +-- ConnectFailed        no connection (refused, connect timeout): node marked down
    +-- StaleConnection      the connection broke before any response: sent again once
    +-- ReadTimeout          the node sent nothing for the read timeout
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from kvagent_server.router.common import fastjson

#: Timeouts in the sense httpx had them: connect, and the longest wait for any byte.
CONNECT_TIMEOUT_S = 5.0
#: Idle keep-alive connections are dropped before the nodes drop them (uvicorn: 5 s), so
#: a request rarely meets a connection the node is closing.
KEEPALIVE_S = 4.0
#: Identity only: the relay forwards D's bytes as they come, never compressed ones.
_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


class UpstreamError(Exception):
    """Talking to a node failed; the message is the underlying error's class name."""


class ConnectFailed(UpstreamError):
    """No connection to the node could be made (the request was never sent).

    `timed_out`: the node did not accept in time (overloaded, or a network problem)
    rather than refusing outright (nothing listening)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class StaleConnection(UpstreamError):
    """A (pooled) connection broke before the node sent a response."""


class ReadTimeout(UpstreamError):
    """The node took the request but sent nothing for the read timeout (a hung node, or
    one too busy to start): a gateway timeout, not an unreachable node."""


class BodyTooLarge(UpstreamError):
    """A non-streamed answer larger than the router reads whole (`max_body_bytes`)."""


#: The default cap on a non-streamed answer held in memory.
MAX_BODY_BYTES = 64 * 1024 * 1024


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes `limit` (declared or read)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge("BodyTooLarge")
    chunks: list[bytes] = []
    size = 0
    async for piece in resp.content.iter_any():
        size += len(piece)
        if size > limit:
            raise BodyTooLarge("BodyTooLarge")
        chunks.append(piece)
    return b"".join(chunks)


def _wrap(exc: BaseException) -> UpstreamError:
    name = type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectFailed(name, timed_out=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ConnectFailed(name)
    if isinstance(exc, TimeoutError):  # aiohttp's sock_read timeout (connect's is above)
        return ReadTimeout(name)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                  | aiohttp.ClientPayloadError):
        return StaleConnection(name)
    return UpstreamError(name)


#: What aiohttp raises for a failed exchange (its timeouts are also `TimeoutError`s).
_ERRORS = (aiohttp.ClientError, TimeoutError)


def _buffered(reader: aiohttp.StreamReader) -> bytes:
    """Bytes received but not yet read. aiohttp raises a stream's error before handing
    out what it buffered; httpx handed it out first, and so does the relay."""
    try:
        return reader._read_nowait(-1) if reader._buffer else b""
    except (AttributeError, TypeError, RuntimeError):  # a private API that may change:
        return b""  # lose the tail rather than fail differently


class NodeResponse:
    """A node's answer. Not streamed, or not 200: `content` holds the whole body.
    Streamed: `aiter_raw` yields the body as it arrives, `aclose` ends it."""

    __slots__ = ("_resp", "content", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse | None, content: bytes | None,
                 status: int | None = None) -> None:
        self._resp = resp
        self.status_code = resp.status if resp is not None else (status or 200)
        self.content = content

    @classmethod
    def of(cls, status: int, content: bytes) -> NodeResponse:
        """A whole answer from its parts (what a `NodeHttp` other than `NodeClient`,
        e.g. a simulated node, returns)."""
        return cls(None, content, status)

    def json(self) -> Any:
        if self.content is None:
            raise ValueError("streamed response: no body to parse")
        return fastjson.loads(self.content)

    @property
    def text(self) -> str:
        if self.content is None:
            raise ValueError("streamed response: no body to read")
        return self.content.decode("utf-8", "replace")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes (de-chunked, not decoded) as the node sends them."""
        if self.content is not None or self._resp is None:
            yield self.content or b""
            return
        reader = self._resp.content
        try:
            async for piece in reader.iter_any():
                yield piece
        except _ERRORS as exc:
            rest = _buffered(reader)
            if rest:  # what the node sent before the failure still reaches the client
                yield rest
            raise _wrap(exc) from exc

    async def aclose(self) -> None:
        """Idempotent. A body read to its end frees the connection for reuse; an unfinished
        one closes it, which makes vLLM abort the request."""
        resp = self._resp
        if resp is None or resp.closed:
            return
        if self.content is not None or resp.content.at_eof():
            resp.release()
        else:
            resp.close()


def _env_proxy(url: str) -> tuple[str | None, aiohttp.BasicAuth | None]:
    """The proxy `HTTP(S)_PROXY`/`NO_PROXY` name for a node, as httpx honoured them, read
    once per node (aiohttp's `trust_env` would read the environment on every request)."""
    try:
        proxy, auth = get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None
    return str(proxy), auth


class NodeHttp(Protocol):
    """What the router asks of a node's HTTP client: whole answers to a GET or a POST."""

    async def get(self, url: str, *, timeout_s: float | None = None) -> NodeResponse: ...

    async def post(self, url: str, body: dict[str, Any], *, stream: bool,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> NodeResponse: ...


class NodeClient:
    """One node's connection pool (one per node: small pools stay cheap under load)."""

    def __init__(self, *, timeout_s: float, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT_S,
                                                                         timeout_s),
                                             sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._proxy: tuple[str | None, aiohttp.BasicAuth | None] = (None, None)

    def _open(self) -> aiohttp.ClientSession:
        # Created lazily: a session binds the running event loop.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        return aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                     auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                     skip_auto_headers=("User-Agent",))

    async def get(self, url: str, *, timeout_s: float | None = None) -> NodeResponse:
        """GET `url` whole (health, metrics, models). Raises `UpstreamError`."""
        return await self._send("GET", url, None, stream=False, timeout_s=timeout_s)

    async def post(self, url: str, body: dict[str, Any], *, stream: bool,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> NodeResponse:
        """POST `body` as JSON. Raises `UpstreamError`; any status is a `NodeResponse`."""
        return await self._send("POST", url, fastjson.dumps(body), stream=stream,
                                headers=headers, timeout_s=timeout_s)

    async def _send(self, method: str, url: str, data: bytes | None, *, stream: bool,
                    headers: dict[str, str] | None = None,
                    timeout_s: float | None = None) -> NodeResponse:
        session = self._session
        if session is None or session.closed:
            session = self._session = self._open()
            self._proxy = _env_proxy(url)
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(
            total=None, sock_connect=min(CONNECT_TIMEOUT_S, timeout_s), sock_read=timeout_s)
        try:
            resp = await session.request(
                method, url, data=data,
                headers={**_HEADERS, **headers} if headers else _HEADERS,
                timeout=timeout, proxy=self._proxy[0], proxy_auth=self._proxy[1],
                allow_redirects=False)  # as httpx: a node's answer
        except _ERRORS as exc:
            raise _wrap(exc) from exc
        if stream and resp.status == 200:
            return NodeResponse(resp, None)
        try:
            content = await _read_capped(resp, self.max_body_bytes)
        except _ERRORS as exc:
            resp.close()
            raise _wrap(exc) from exc
        except BaseException:
            resp.close()
            raise
        resp.release()
        return NodeResponse(resp, content)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
