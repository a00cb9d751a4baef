"""Relaying the decode node's answer to the client, with the final-chunk rewrite.

Chunks pass through as they arrive (no buffering beyond one SSE event). Every chunk is
scrubbed of what the client must not see (`kv_transfer_params`, and the token ids the
router asked for on the client's behalf), while the scrubbed values are captured: D's
`kv_transfer_params` become the next cache token, the token ids the handle's content.

The client must see what a stock vLLM server would send for its request, although the
router always asks D for usage and token ids. So a token-id field the client did not ask
for keeps its key with `null` (as vLLM writes it), and the `kvagent` object rides on a
chunk the client receives anyway: the usage chunk when the client asked for usage (with
`usage.prompt_tokens_details.cached_tokens`), else the last chunk carrying a
`finish_reason`, held back until D's usage chunk (sent right after it) has been read and
dropped. A chunk without choices would break clients that read `choices[0]` of every
chunk, as vLLM's own benchmark client does. Chunks vLLM sends only to carry token ids
(an empty delta while a tool-call parser holds text back) are dropped too.

The relay itself settles nothing: it passes every chunk up to the last one, and the
stream's tail (that chunk, with the `kvagent` object, and `[DONE]`) waits for
`SseRelay.tail`, which the HTTP shell calls once `settle` has turned the `Capture` into
the `Final` (docs/architecture.md, "One turn").

An error event from the node (`data: {"error": ...}`, sent mid-stream when generation
fails) is rebuilt from the allow-listed parts of `common.node_errors`: its message could
name the node's engine id or side-channel address.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from kvagent_server.router.common import fastjson, node_errors
from kvagent_server.router.reuse.transfer import INTERNAL_FIELDS
from kvagent_server.router.turns.shapes import Capture, Final

#: Tool names kept from one answer (a handle records at most `store.handle.MAX_END_TOOLS`).
MAX_CAPTURED_TOOLS = 64

#: Token-id fields the router requests for itself (`return_token_ids`).
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")
DONE = b"[DONE]"
#: A chunk holding any of these takes the JSON path (rewrite, capture or final chunk).
_SLOW_MARKERS = (b'"kv_transfer_params"', b'"ec_transfer_params"', b'"prompt_token_ids"',
                 b'"usage"', b'"error"', b'"tool_calls"')
_TOKEN_IDS_RE = re.compile(rb',\s*"token_ids":\s*\[([0-9,\s]*)\]')
_FINISH_RE = re.compile(rb'"finish_reason":\s*"([a-z_]+)"')
_INDEX_RE = re.compile(rb'"index":\s*([0-9]+)')
_EMPTY_DELTA_RE = re.compile(rb'"delta":\s*\{\}')


class Scrubber:
    """Strips internal fields from one response object and records what it removed.

    `keep_usage`: the client asked for usage (a streamed request without
    `stream_options.include_usage` gets no usage chunk). `stream`: internal fields leave
    streamed chunks entirely, but stay `null` in a whole response, as vLLM writes them
    there when it has nothing to transfer.
    """

    def __init__(self, *, keep_token_ids: bool, keep_usage: bool = True,
                 stream: bool = True) -> None:
        self.keep_token_ids = keep_token_ids
        self.keep_usage = keep_usage
        self.stream = stream
        self.capture = Capture()

    def scrub(self, obj: dict[str, Any]) -> dict[str, Any]:
        cap = self.capture
        if not cap.template:
            cap.template = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        for name in INTERNAL_FIELDS:
            if name not in obj:
                continue
            value = obj.pop(name)
            if not self.stream:
                obj[name] = None
            if name == "kv_transfer_params" and value:
                cap.kv_params = value
        self._take_prompt_ids(obj)
        for choice in obj.get("choices") or ():
            index = choice.get("index", 0)
            cap.choices.add(index)
            self._take_prompt_ids(choice)
            ids = choice.get("token_ids")
            if not self.keep_token_ids and "token_ids" in choice:
                choice["token_ids"] = None
            if index == 0:
                if ids:
                    cap.output_token_ids.extend(ids)
                if choice.get("finish_reason"):
                    cap.finish_reason = choice["finish_reason"]
                _take_tool_names(choice, cap)
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
                payload = payload[:found.start()] + b',"token_ids":null' + payload[found.end():]
        reason = _FINISH_RE.search(payload)
        if reason is not None and choice == 0:
            cap.finish_reason = reason.group(1).decode()
        return payload

    def _take_prompt_ids(self, holder: dict[str, Any]) -> None:
        ids = holder.get("prompt_token_ids")
        if not self.keep_token_ids and "prompt_token_ids" in holder:
            holder["prompt_token_ids"] = None
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


def _take_tool_names(choice: dict[str, Any], cap: Capture) -> None:
    """The names of the tools choice 0 calls: a streamed call names its function in its
    first delta, a whole message in each call (how the turn ended: retention weighs it)."""
    for part in (choice.get("delta"), choice.get("message")):
        calls = part.get("tool_calls") if isinstance(part, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and name and len(cap.tool_names) < MAX_CAPTURED_TOOLS:
                cap.tool_names.append(name)


def rewrite_response(body: dict[str, Any], scrubber: Scrubber, final: Final) -> dict[str, Any]:
    """The non-streamed variant: one object in, one object out."""
    return scrubber.finish(body, final)


def _json(obj: Any, *, std: bool = False) -> bytes:
    """`std`: the stdlib read the chunk (see `fastjson.parse`)."""
    return json.dumps(obj, separators=(",", ":")).encode() if std else fastjson.dumps(obj)


def _dump(obj: Any, *, std: bool = False) -> bytes:
    """One SSE event."""
    return b"data: " + _json(obj, std=std) + b"\n\n"


def _is_last(obj: dict[str, Any]) -> bool:
    """vLLM's usage chunk (no choices) is the last data chunk of a stream."""
    return not obj.get("choices") and "usage" in obj


def _finishes(obj: dict[str, Any]) -> bool:
    return any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or ())


def _only_token_ids(obj: dict[str, Any]) -> bool:
    """A chat chunk vLLM sends only because token ids were asked for: an empty delta
    (a tool-call or reasoning parser holding text back), no logprobs, no finish. Without
    `return_token_ids` vLLM does not send it, so neither does the router."""
    choices = obj.get("choices")
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and c.get("delta") == {} and "token_ids" in c
        and "logprobs" in c and c["logprobs"] is None and not c.get("finish_reason")
        for c in choices)


def _payload(event: bytes) -> bytes | None:
    """The data of one SSE event; None for comments and keep-alives (nothing for the
    client)."""
    if event.startswith(b"data: ") and b"\n" not in event:  # the usual one-line event
        return event[6:].strip()
    lines = [ln for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(ln[5:].strip() for ln in lines)


class SseRelay:
    """One stream's relay: scrubs and passes D's events on as they arrive, and keeps
    the tail (the last chunk, held for the `kvagent` object, and `[DONE]`) for `tail`."""

    def __init__(self, scrubber: Scrubber) -> None:
        self.scrubber = scrubber
        self.hold = not scrubber.keep_usage
        self.drop_empty = not scrubber.keep_token_ids
        self.held: bytes | None = None  # the latest scrubbed finish chunk's JSON
        #: D's usage chunk (the stream's last data chunk) and how it was parsed.
        self.last: tuple[dict[str, Any], bool] | None = None
        #: Events after the last chunk (vLLM sends none but `[DONE]`): they follow it.
        self.after: list[bytes] = []
        self.done = False  # `[DONE]` arrived

    @property
    def capture(self) -> Capture:
        return self.scrubber.capture

    async def relay(self, upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Yield the client's SSE bytes for D's, event by event, until `[DONE]` or the
        end of D's stream. An upstream error propagates: the client's stream is cut,
        never retried behind its back (and `tail` is never called)."""
        buffer = b""
        async for piece in upstream:
            buffer += piece
            ready: list[bytes] = []  # events that arrived together leave together
            while not self.done:
                cut = buffer.find(b"\n\n")
                if cut < 0:
                    break
                event, buffer = buffer[:cut], buffer[cut + 2:]
                out = self.event(event)
                if out:
                    ready.append(out)
            if ready:
                yield b"".join(ready)
            if self.done:
                return
        out = self.event(buffer) if buffer.strip() else b""
        if out:
            yield out

    def event(self, event: bytes) -> bytes:
        """The client's bytes for one upstream event (often empty)."""
        payload = _payload(event)
        if payload is None:
            return b""
        if payload == DONE:
            self.done = True
            return b""
        out = self._event(payload)
        if out and self.last is not None:
            self.after.append(out)
            return b""
        return out

    def _event(self, payload: bytes) -> bytes:
        fast = self.scrubber.scrub_bytes(payload)
        if fast is not None:
            if (self.drop_empty and _EMPTY_DELTA_RE.search(fast) is not None
                    and _only_token_ids(fastjson.loads(fast))):
                return b""
            if self.hold and _FINISH_RE.search(fast) is not None:
                return self._hold(fast)
            return self.release() + b"data: " + fast + b"\n\n"
        try:
            obj, std = fastjson.parse(payload)
        except ValueError:
            return self.release() + b"data: " + payload + b"\n\n"
        if not isinstance(obj, dict):
            return self.release() + _dump(obj, std=std)
        safe = node_errors.client_error_event(obj)
        if safe is not None:
            return self.release() + _dump(safe)
        self.scrubber.scrub(obj)
        if self.drop_empty and _only_token_ids(obj):
            return b""
        if _is_last(obj):
            if self.last is None:
                self.last = (obj, std)
                return b""
            return b"" if self.hold else _dump(obj, std=std)
        if self.hold and _finishes(obj):
            return self._hold(_json(obj, std=std))
        return self.release() + _dump(obj, std=std)

    def _hold(self, payload: bytes) -> bytes:
        """Hold this finish chunk; an earlier one (another choice's) was not the last."""
        out = self.release()
        self.held = payload
        return out

    def release(self, final: Final | None = None, *, fingerprint: Any = None) -> bytes:
        """The held chunk, if any, with `final`'s `kvagent` object when given."""
        held, self.held = self.held, None
        if held is None:
            return b""
        if final is None:
            return b"data: " + held + b"\n\n"
        obj, std = fastjson.parse(held)
        if fingerprint is not None:
            obj.setdefault("system_fingerprint", fingerprint)
        return _dump(self.scrubber.finish(obj, final), std=std)

    def tail(self, final: Final) -> bytes:
        """The stream's last bytes, with the settled turn's `kvagent` object: on the
        usage chunk when the client asked for usage, else on the held finish chunk
        (usage dropped; vLLM then stamps the finish chunk with the fingerprint)."""
        if self.last is not None:
            obj, std = self.last
            if self.hold:
                out = self.release(final, fingerprint=obj.get("system_fingerprint"))
            else:
                out = self.release() + _dump(self.scrubber.finish(obj, final), std=std)
        elif self.held is not None:
            out = self.release(final)
        elif self.hold:
            out = b""  # no chunk to ride on, and a choice-less one would break clients
        else:  # usage was asked for but none came: a usage-shaped chunk carries `kvagent`
            obj = {**self.capture.template, "choices": []}
            out = _dump(self.scrubber.finish(obj, final))
        out += b"".join(self.after)
        return out + (b"data: [DONE]\n\n" if self.done else b"")
