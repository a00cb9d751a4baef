"""The relayed chat stream as Anthropic's event stream, chunk by chunk."""

from __future__ import annotations

import uuid
from typing import Any

from kvagent_server.router.apis import sse
from kvagent_server.router.apis.anthropic.output import (
    is_json,
    message_id,
    reasoning_of,
    stop_reason,
    stream_error,
    usage,
)
from kvagent_server.router.apis.anthropic.validation import as_dict


class MessageStream:
    """Transcodes the relayed chat stream into Anthropic's event stream, chunk by chunk.

    The events and their order are vLLM's: `message_start` on the first chunk;
    one content block at a time (thinking, text, tool_use), a thinking block closed by
    its `signature_delta`; text arriving while a tool call's block is open held back and
    sent as its own text block once that block closes; `message_delta` (stop reason,
    usage) on the usage chunk; `message_stop` on `[DONE]`."""

    def __init__(self, *, model: str) -> None:
        self.model = model
        self._started = False
        self._ended = False
        self._delta_sent = False
        self._next_index = 0
        self._block: str | None = None  # the open block's type
        self._signature: str | None = None  # the open thinking block's, not yet sent
        self._tool_id: str | None = None  # the open tool_use block's id
        self._held_text: list[str] = []
        self._tool_ids: dict[int, str] = {}  # a tool call's index -> its id
        self._tool_used = False
        self._last_args: list[str] = []  # the latest tool call's argument fragments
        self._finish: Any = None
        self._chat_stop: Any = None
        self._usage: Any = None
        self._kvagent: Any = None

    # ------------------------------------------------------------------ blocks

    def _start(self, block: dict[str, Any]) -> bytes:
        self._block = block["type"]
        self._signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self._tool_id = block.get("id") if block["type"] == "tool_use" else None
        return sse.named("content_block_start", {
            "type": "content_block_start", "index": self._next_index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse.named("content_block_delta", {
            "type": "content_block_delta", "index": self._next_index, "delta": delta})

    def _stop(self) -> list[bytes]:
        if self._block is None:
            return []
        out = []
        if self._signature is not None:
            out.append(self._delta({"type": "signature_delta", "signature": self._signature}))
        out.append(sse.named("content_block_stop",
                             {"type": "content_block_stop", "index": self._next_index}))
        self._block = self._signature = self._tool_id = None
        self._next_index += 1
        return out

    def _stop_and_flush(self) -> list[bytes]:
        """Close the open block; text held back behind a tool call becomes its own block."""
        held = "".join(self._held_text)
        self._held_text.clear()
        out = self._stop()
        if held:
            out.append(self._start({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": held}))
            out.extend(self._stop())
        return out

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        return [*self._stop_and_flush(), self._start(block)]

    # ------------------------------------------------------------------ chunks

    def feed(self, chunk: dict[str, Any] | None) -> list[bytes]:
        """One parsed chat chunk (None for `[DONE]`) -> the SSE events it makes."""
        if self._ended:
            return []
        if chunk is None:
            return self._done()
        if "error" in chunk and not chunk.get("choices"):
            self._ended = True
            return [sse.named("error", stream_error(chunk["error"]))]
        if "kvagent" in chunk:
            self._kvagent = chunk["kvagent"]
        out: list[bytes] = []
        if not self._started:
            self._started = True
            out.append(self._message_start(chunk))
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            if "usage" in chunk:
                out.extend(self._stop_and_flush())
                out.append(self._message_delta())
            return out
        choice = as_dict(choices[0])
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            self._chat_stop = choice.get("stop_reason")
        delta = as_dict(choice.get("delta"))
        out.extend(self._reasoning(delta))
        out.extend(self._text(delta))
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                out.extend(self._tool_call(call))
        return out

    def _message_start(self, chunk: dict[str, Any]) -> bytes:
        return sse.named("message_start", {"type": "message_start", "message": {
            "id": message_id(chunk.get("id")), "type": "message", "role": "assistant",
            "content": [], "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": usage(chunk.get("usage"))}})

    def _reasoning(self, delta: dict[str, Any]) -> list[bytes]:
        text = reasoning_of(delta)
        if not isinstance(text, str) or not text:
            return []
        out = [] if self._block == "thinking" else self._open({"type": "thinking",
                                                               "thinking": ""})
        out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _text(self, delta: dict[str, Any]) -> list[bytes]:
        text = delta.get("content")
        if not isinstance(text, str) or not text:
            return []
        if self._block == "tool_use":
            self._held_text.append(text)
            return []
        out = [] if self._block == "text" else self._open({"type": "text", "text": ""})
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        """A tool call fragment: the first (with an id and a name) opens a tool_use block;
        argument fragments of the open call become `input_json_delta`s."""
        out: list[bytes] = []
        function = as_dict(call.get("function"))
        index = call.get("index", 0)
        call_id = call.get("id")
        if call_id is not None:
            self._tool_ids[index] = call_id
            name = function.get("name")
            if self._tool_id != call_id and name is not None:
                out.extend(self._stop_and_flush())
                self._tool_used = True
                self._last_args = []
                out.append(self._start({"type": "tool_use", "id": call_id, "name": name,
                                        "input": {}}))
        else:
            call_id = self._tool_ids.get(index)
        args = function.get("arguments")
        if call_id is not None and args and self._tool_id == call_id:
            self._last_args.append(args)
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def _message_delta(self) -> bytes:
        self._delta_sent = True
        complete = self._tool_used and is_json("".join(self._last_args))
        reason, sequence = stop_reason(self._finish or "stop", self._chat_stop,
                                       tool_used=self._tool_used, tool_complete=complete)
        event: dict[str, Any] = {"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage(self._usage)}
        if self._kvagent is not None:
            event["kvagent"] = self._kvagent
        return sse.named("message_delta", event)

    def _done(self) -> list[bytes]:
        """`[DONE]`: close what is open, and the message (with its `message_delta` if no
        usage chunk brought one)."""
        self._ended = True
        out = self._stop_and_flush()
        if self._started and not self._delta_sent:
            out.append(self._message_delta())
        out.append(sse.named("message_stop", {"type": "message_stop"}))
        return out
