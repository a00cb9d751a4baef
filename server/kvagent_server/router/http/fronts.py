"""The front doors besides chat completions: Anthropic Messages and OpenAI Responses.

Each is a thin shell around a pure translation in `apis`: its request becomes the chat body
every turn runs as (`prepare`), and the chat answer, whole or streamed, becomes its own
answer. Responses also keeps what `store` asks for in the store's records, so a later
turn's `previous_response_id` gets its history and its conversation back (see
docs/agents/index.md).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response

from kvagent_server.router.apis import anthropic, responses
from kvagent_server.router.apis.sse import DONE, ChatEvents
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.http.request import HTTPError
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore, StoreUnavailable
from kvagent_server.router.store.records import RESPONSES

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES_PATH = "/v1/responses"


@dataclass
class Prepared:
    """A translated request: the chat body its turn runs, and the conversation its API
    itself names (a stored previous response's; None: the headers and body decide)."""

    chat: dict[str, Any]
    session: str | None = None


class Front(Protocol):
    """One client API in front of the chat turn."""

    async def prepare(self, raw: dict[str, Any], tenant: Tenant) -> Prepared: ...

    def error(self, exc: HTTPError) -> Response: ...

    async def whole(self, out: dict[str, Any], session: str | None) -> dict[str, Any]: ...

    def stream(self, chunks: AsyncGenerator[bytes, None],
               session: str | None) -> AsyncIterator[bytes]: ...


async def _transcode(chunks: AsyncGenerator[bytes, None], feed: Any) -> AsyncIterator[bytes]:
    """The relayed chat stream through `feed` (a translation's chunk -> events)."""
    events = ChatEvents()
    saw_done = False
    async with contextlib.aclosing(chunks):  # a client gone closes the turn's stream too
        async for data in chunks:
            out: list[bytes] = []
            for chunk in events.feed(data):
                saw_done = saw_done or chunk is DONE
                out += feed(chunk)
            if out:
                yield b"".join(out)
    if not saw_done:
        tail = feed(DONE)
        if tail:
            yield b"".join(tail)


# ------------------------------------------------------------------ Anthropic Messages


class MessagesFront:
    """`POST /v1/messages`: Claude Code and the `anthropic` client."""

    def __init__(self) -> None:
        self.model = ""

    async def prepare(self, raw: dict[str, Any], tenant: Tenant) -> Prepared:
        try:
            chat = anthropic.to_chat(raw)
        except anthropic.ApiError as exc:
            raise HTTPError(exc.status, exc.message, type_=exc.type) from None
        self.model = str(raw.get("model") or "")
        return Prepared(chat)

    def error(self, exc: HTTPError) -> Response:
        return messages_error(exc)

    async def whole(self, out: dict[str, Any], session: str | None) -> dict[str, Any]:
        return anthropic.message_from_chat(out, model=self.model)

    def stream(self, chunks: AsyncGenerator[bytes, None],
               session: str | None) -> AsyncIterator[bytes]:
        return _transcode(chunks, anthropic.MessageStream(model=self.model).feed)


def messages_error(exc: HTTPError) -> Response:
    """Any router error in Anthropic's error shape (what its clients parse)."""
    body = anthropic.error_body(anthropic.error_type(exc.status), exc.message)
    resp = JSONResponse(body, status_code=exc.status)
    if exc.status == 429:
        resp.headers["Retry-After"] = "1"
    return resp


# ------------------------------------------------------------------ OpenAI Responses


def _record_key(tenant: Tenant, response_id: str) -> str:
    """A stored Response is its caller's: another API key's id reads as unknown."""
    return f"{tenant.caller}/{response_id}"


async def load_response(store: SessionStore, tenant: Tenant,
                        response_id: str) -> dict[str, Any] | None:
    """A stored Response record (`response`, `history`, `session`), or None."""
    try:
        raw = await store.get_record(tenant.name, RESPONSES, _record_key(tenant, response_id))
    except StoreUnavailable:
        raise HTTPError(503, "the response store is unavailable; retry later",
                        type_="server_error", code="store_unavailable") from None
    if raw is None:
        return None
    record = json.loads(raw)
    return record if isinstance(record, dict) else None


def not_found(response_id: str, param: str | None = None) -> HTTPError:
    return HTTPError(404, f"Response with id '{response_id}' not found.", param=param,
                     code="not_found")


class ResponsesFront:
    """`POST /v1/responses`: the OpenAI Agents SDK, pydantic-ai, Codex, openai-python."""

    def __init__(self, store: SessionStore, settings: RouterSettings) -> None:
        self._store = store
        self._ttl = settings.responses_ttl_s
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._raw: dict[str, Any] = {}
        self._chat: dict[str, Any] = {}
        self._tenant: Tenant | None = None

    async def prepare(self, raw: dict[str, Any], tenant: Tenant) -> Prepared:
        self._raw, self._tenant = raw, tenant
        previous = raw.get("previous_response_id")
        history, session = None, None
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise HTTPError(400, "'previous_response_id' must be a non-empty string",
                                param="previous_response_id")
            record = await load_response(self._store, tenant, previous)
            if record is None:
                raise not_found(previous, "previous_response_id")
            history, session = record.get("history"), record.get("session")
        try:
            self._chat = responses.to_chat(raw, previous=history)
        except responses.ApiError as exc:
            raise HTTPError(exc.status, exc.message, param=exc.param, code=exc.code) from None
        return Prepared(self._chat, session if isinstance(session, str) else None)

    def error(self, exc: HTTPError) -> Response:
        message, param = responses.responses_words(exc.message, exc.param)
        return HTTPError(exc.status, message, type_=exc.type, code=exc.code,
                         param=param).response()

    async def whole(self, out: dict[str, Any], session: str | None) -> dict[str, Any]:
        response = responses.response_from_chat(out, request=self._raw,
                                                response_id=self.response_id,
                                                created_at=self.created_at)
        await self._keep(response, session)
        return response

    def stream(self, chunks: AsyncGenerator[bytes, None],
               session: str | None) -> AsyncIterator[bytes]:
        return self._stream(chunks, session)

    async def _stream(self, chunks: AsyncGenerator[bytes, None],
                      session: str | None) -> AsyncIterator[bytes]:
        out = responses.ResponseStream(request=self._raw, response_id=self.response_id,
                                       created_at=self.created_at)
        async for data in _transcode(chunks, out.feed):
            yield data
        if out.response is not None:
            await self._keep(out.response, session)

    async def _keep(self, response: dict[str, Any], session: str | None) -> None:
        """Store the Response and its conversation when the request asked (`store`, on
        unless false). Best effort: a store down only costs a later chained turn."""
        if self._raw.get("store") is False or self._ttl <= 0 or self._tenant is None:
            return
        record = {"response": response, "session": session,
                  "history": responses.history(self._chat, response)}
        with contextlib.suppress(StoreUnavailable):
            await self._store.put_records(
                self._tenant.name, RESPONSES,
                [(_record_key(self._tenant, self.response_id), json.dumps(record).encode())],
                self._ttl)
