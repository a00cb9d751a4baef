"""Relaying the decode node's answer to the client, with the final-chunk rewrite.

Chunks pass through as they arrive (no buffering beyond one SSE event). Every chunk is
scrubbed of what the client must not see (`kv_transfer_params`, and the token ids the
router asked for on the client's behalf), while the scrubbed values are captured: D's
`kv_transfer_params` become the next cache token, the token ids the handle's content.
The last data chunk before `[DONE]` gets the top-level `kvagent` object and
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvagent_server.router.common import fastjson

#: Top-level response fields that are internal to P/D and never reach a client.
INTERNAL_FIELDS = ("kv_transfer_params", "ec_transfer_params")
#: Token-id fields the router requests for itself (`return_token_ids`).
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")
DONE = b"[DONE]"
#: A chunk holding any of these takes the JSON path (rewrite, capture or final chunk).
_SLOW_MARKERS = (b'"kv_transfer_params"', b'"ec_transfer_params"', b'"prompt_token_ids"',
                 b'"usage"')
_TOKEN_IDS_RE = re.compile(rb',\s*"token_ids":\s*\[([0-9,\s]*)\]')
_FINISH_RE = re.compile(rb'"finish_reason":\s*"([a-z_]+)"')
_INDEX_RE = re.compile(rb'"index":\s*([0-9]+)')


@dataclass
class Capture:
    """What the router learned from D's answer (choice 0 only: reuse needs n == 1)."""

    kv_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    choices: set[int] = field(default_factory=set)
    template: dict[str, Any] = field(default_factory=dict)  # id/object/created/model

    @property
    def sequence(self) -> list[int] | None:
        """Prompt plus generated ids: the tokens whose KV D retained (None if unknown)."""
        if self.prompt_token_ids is None or len(self.choices) > 1:
            return None
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass(frozen=True)
class Final:
    """What the router adds to the last chunk (or the non-streamed response)."""

    kvagent: dict[str, Any]
    cached_tokens: int | None


Finalize = Callable[[Capture], Awaitable[Final]]


class Scrubber:
    """Strips internal fields from one response object and records what it removed."""

    def __init__(self, *, keep_token_ids: bool, keep_usage: bool = True) -> None:
        self.keep_token_ids = keep_token_ids
        self.keep_usage = keep_usage
        self.capture = Capture()

    def scrub(self, obj: dict[str, Any]) -> dict[str, Any]:
        cap = self.capture
        if not cap.template:
            cap.template = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        for name in INTERNAL_FIELDS:
            value = obj.pop(name, None)
            if name == "kv_transfer_params" and value:
                cap.kv_params = value
        self._take_prompt_ids(obj)
        for choice in obj.get("choices") or ():
            index = choice.get("index", 0)
            cap.choices.add(index)
            self._take_prompt_ids(choice)
            ids = choice.get("token_ids") if self.keep_token_ids else choice.pop("token_ids",
                                                                                None)
            if index == 0:
                if ids:
                    cap.output_token_ids.extend(ids)
                if choice.get("finish_reason"):
                    cap.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            cap.usage = obj["usage"]
        return obj

    def scrub_bytes(self, payload: bytes) -> bytes | None:
        """The common chunk (one choice, a few tokens) without a JSON round trip: strip
        and record `token_ids` by pattern. None: the chunk needs the full path.

        Safe on vLLM's compact JSON: inside a string every quote is escaped, so
        `,"token_ids":[` can only be the field itself."""
        cap = self.capture
        if not cap.template:
            return None
        for marker in _SLOW_MARKERS:  # (a loop, not `any(...)`: no generator per chunk)
            if marker in payload:
                return None
        index = _INDEX_RE.findall(payload)
        if len(index) != 1:  # no choice, several, or tool-call deltas: the JSON path
            return None
        choice = int(index[0])
        cap.choices.add(choice)
        if b'"token_ids"' in payload:
            found = _TOKEN_IDS_RE.search(payload)
            if found is None:
                return None
            ids = found.group(1).strip()
            if ids and choice == 0:
                cap.output_token_ids.extend(map(int, ids.split(b",")))
            if not self.keep_token_ids:
                payload = payload[:found.start()] + payload[found.end():]
        reason = _FINISH_RE.search(payload)
        if reason is not None and choice == 0:
            cap.finish_reason = reason.group(1).decode()
        return payload

    def _take_prompt_ids(self, holder: dict[str, Any]) -> None:
        ids = holder.get("prompt_token_ids") if self.keep_token_ids else holder.pop(
            "prompt_token_ids", None)
        if ids and self.capture.prompt_token_ids is None:
            self.capture.prompt_token_ids = list(ids)

    def finish(self, obj: dict[str, Any], final: Final) -> dict[str, Any]:
        """Add the `kvagent` object and the cached-token count to the last object."""
        usage = obj.get("usage")
        if isinstance(usage, dict) and final.cached_tokens is not None:
            details = usage.get("prompt_tokens_details") or {}
            usage["prompt_tokens_details"] = {**details, "cached_tokens": final.cached_tokens}
        if not self.keep_usage:
            obj.pop("usage", None)
        obj["kvagent"] = final.kvagent
        return obj


def rewrite_response(body: dict[str, Any], scrubber: Scrubber, final: Final) -> dict[str, Any]:
    """The non-streamed variant: one object in, one object out."""
    return scrubber.finish(body, final)


def _dump(obj: Any, *, std: bool = False) -> bytes:
    """One SSE event. `std`: the stdlib read the chunk (see `fastjson.parse`)."""
    data = json.dumps(obj, separators=(",", ":")).encode() if std else fastjson.dumps(obj)
    return b"data: " + data + b"\n\n"


def _is_last(obj: dict[str, Any]) -> bool:
    """vLLM's usage chunk (no choices) is the last data chunk of a stream."""
    return not obj.get("choices") and "usage" in obj


async def relay_sse(upstream: AsyncIterator[bytes], scrubber: Scrubber,
                    finalize: Finalize) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes for D's SSE bytes, event by event.

    An upstream error after the first byte propagates: the client's stream is cut, never
    retried behind its back. `finalize` runs once, when the last chunk is known.
    """
    buffer = b""
    finished = False
    async for piece in upstream:
        buffer += piece
        ready: list[bytes] = []  # events that arrived together leave together (one send)
        while True:
            cut = buffer.find(b"\n\n")
            if cut < 0:
                break
            event, buffer = buffer[:cut], buffer[cut + 2:]
            out = await _event(event, scrubber, finalize, finished)
            if out is not None:
                ready.append(out[0])
                finished = out[1]
        if ready:
            yield b"".join(ready)
    if buffer.strip():
        out = await _event(buffer, scrubber, finalize, finished)
        if out is not None:
            yield out[0]


async def _event(event: bytes, scrubber: Scrubber, finalize: Finalize,
                 finished: bool) -> tuple[bytes, bool] | None:
    if event.startswith(b"data: ") and b"\n" not in event:  # the usual one-line event
        payload = event[6:].strip()
    else:
        lines = [ln for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if not lines:
            return None  # comments / keep-alives carry nothing the client needs
        payload = b"\n".join(ln[5:].strip() for ln in lines)
    if payload == DONE:
        tail = b""
        if not finished:  # no usage chunk came: add one carrying `kvagent`
            obj = {**scrubber.capture.template, "choices": []}
            tail = _dump(scrubber.finish(obj, await finalize(scrubber.capture)))
        return tail + b"data: [DONE]\n\n", True
    fast = scrubber.scrub_bytes(payload)
    if fast is not None:
        return b"data: " + fast + b"\n\n", finished
    try:
        obj, std = fastjson.parse(payload)
    except ValueError:
        return b"data: " + payload + b"\n\n", finished
    if not isinstance(obj, dict):
        return _dump(obj, std=std), finished
    scrubber.scrub(obj)
    if _is_last(obj) and not finished:
        scrubber.finish(obj, await finalize(scrubber.capture))
        return _dump(obj, std=std), True
    return _dump(obj, std=std), finished
