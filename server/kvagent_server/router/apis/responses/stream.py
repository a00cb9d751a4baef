"""The relayed chat stream as the Responses event stream vLLM 0.32 sends."""

from __future__ import annotations

from typing import Any

from kvagent_server.router.apis import sse
from kvagent_server.router.apis.responses.output import (
    call_item,
    custom_call_item,
    message_item,
    namespaced,
    new_call_id,
    reasoning_item,
    response_base,
    status_of,
    text_part,
    usage_of,
)
from kvagent_server.router.apis.responses.request import custom_names, new_id


class ResponseStream:
    """Transcodes the relayed chat stream into the Responses event stream, chunk by chunk.

    One output item is open at a time (reasoning, message or function call), as in vLLM:
    a delta of another kind, or of another tool call, closes it and opens the next."""

    def __init__(self, *, request: dict[str, Any], response_id: str, created_at: int) -> None:
        self._request = request
        self._id = response_id
        self._created_at = created_at
        self._seq = 0
        self._started = False
        self._ended = False
        self._model: Any = request.get("model")
        self._finish: Any = None
        self._usage: dict[str, Any] | None = None
        self._kvagent: Any = None
        self._items: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning", "message" or "function_call"
        self._item_id = ""
        self._text = ""
        self._call: dict[str, Any] = {}
        self._response: dict[str, Any] | None = None
        self._custom = custom_names(request.get("tools"))

    @property
    def response(self) -> dict[str, Any] | None:
        """The completed Response, once `response.completed` was emitted."""
        return self._response

    def _event(self, kind: str, **data: Any) -> bytes:
        event = {**data, "sequence_number": self._seq, "type": kind}
        self._seq += 1
        return sse.named(kind, event)

    def _base(self, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_base(self._request, self._id, self._created_at, model=self._model,
                             status=status, output=output, usage=usage)

    def feed(self, chunk: dict[str, Any] | None) -> list[bytes]:
        """One parsed chat chunk (None for `[DONE]`) as zero or more Responses events."""
        if self._ended:
            return []
        out: list[bytes] = []
        if not self._started:
            self._started = True
            if chunk is not None and chunk.get("model"):
                self._model = chunk["model"]
            initial = self._base("in_progress", [], None)
            out.append(self._event("response.created", response=initial))
            out.append(self._event("response.in_progress", response=initial))
        if chunk is None:
            return out + self._complete()
        if isinstance(chunk.get("error"), dict):
            self._ended = True
            err = chunk["error"]
            code = err.get("code")
            return out + [self._event("error", code=None if code is None else str(code),
                                      message=str(err.get("message") or "upstream error"),
                                      param=err.get("param"))]
        if "kvagent" in chunk:
            self._kvagent = chunk["kvagent"]
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
            for kind, value in _split(choice.get("delta") or {}):
                out += self._delta(kind, value)
        return out

    def _delta(self, kind: str, value: Any) -> list[bytes]:
        out: list[bytes] = []
        if kind == "function_call":
            index = value[0].get("index")
            if self._open != kind or (index is not None and self._call.get("index") is not None
                                      and index != self._call["index"]):
                out += self._close() + self._open_call(value[0])
            args = "".join((tc.get("function") or {}).get("arguments") or "" for tc in value)
            if args and self._call.get("custom"):
                self._text += args  # its input is sent whole when the call closes
            elif args:
                self._text += args
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self._item_id, output_index=len(self._items),
                                       delta=args))
            return out
        if self._open != kind:
            out += self._close() + (self._open_reasoning() if kind == "reasoning"
                                    else self._open_message())
        self._text += value
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", item_id=self._item_id,
                                   output_index=len(self._items), content_index=0,
                                   delta=value))
        else:
            out.append(self._event("response.output_text.delta", content_index=0,
                                   output_index=len(self._items), item_id=self._item_id,
                                   delta=value, logprobs=[]))
        return out

    def _start(self, kind: str, prefix: str) -> str:
        self._open = kind
        self._item_id = new_id(f"{prefix}_")
        self._text = ""
        return self._item_id

    def _open_message(self) -> list[bytes]:
        item_id = self._start("message", "msg")
        index = len(self._items)
        return [self._event("response.output_item.added", output_index=index,
                            item=message_item(item_id, [], "in_progress")),
                self._event("response.content_part.added", output_index=index,
                            item_id=item_id, content_index=0, part=text_part("", []))]

    def _open_reasoning(self) -> list[bytes]:
        item_id = self._start("reasoning", "rs")
        index = len(self._items)
        item = {**reasoning_item(item_id, "", "in_progress"), "content": None}
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", output_index=index,
                            item_id=item_id, content_index=0,
                            part={"text": "", "type": "reasoning_text"})]

    def _open_call(self, tool_call: dict[str, Any]) -> list[bytes]:
        fn = tool_call.get("function") or {}
        custom = fn.get("name") in self._custom
        item_id = self._start("function_call", "ctc" if custom else "fc")
        name, namespace = namespaced(fn.get("name") or "", self._request)
        self._call = {"index": tool_call.get("index"), "name": name, "namespace": namespace,
                      "call_id": new_call_id(tool_call.get("id")), "custom": custom}
        item = (custom_call_item(item_id, self._call["call_id"], name, "") if custom else
                call_item(item_id, self._call["call_id"], name, namespace, "", "in_progress"))
        return [self._event("response.output_item.added", output_index=len(self._items),
                            item=item)]

    def _close(self) -> list[bytes]:
        """The done events of the open item, which joins the output."""
        index = len(self._items)
        item_id, text, kind = self._item_id, self._text, self._open
        out: list[bytes] = []
        if kind == "message":
            part = text_part(text, None)
            item = message_item(item_id, [part] if text else [], "completed")
            out += [self._event("response.output_text.done", output_index=index,
                                content_index=0, text=text, logprobs=[], item_id=item_id),
                    self._event("response.content_part.done", item_id=item_id,
                                output_index=index, content_index=0, part=part)]
        elif kind == "reasoning":
            part = {"text": text, "type": "reasoning_text"}
            item = reasoning_item(item_id, text, "completed")
            out += [self._event("response.reasoning_text.done", item_id=item_id,
                                output_index=index, content_index=0, text=text),
                    self._event("response.content_part.done", item_id=item_id,
                                output_index=index, content_index=0, part=part)]
        elif kind == "function_call" and self._call.get("custom"):
            item = custom_call_item(item_id, self._call["call_id"], self._call["name"], text)
            payload = item["input"]
            if payload:
                out.append(self._event("response.custom_tool_call_input.delta",
                                       output_index=index, item_id=item_id, delta=payload))
            out.append(self._event("response.custom_tool_call_input.done", output_index=index,
                                   item_id=item_id, input=payload))
        elif kind == "function_call":
            call = self._call
            item = call_item(item_id, call["call_id"], call["name"], call["namespace"], text,
                             "completed")
            out.append(self._event("response.function_call_arguments.done",
                                   output_index=index, item_id=item_id, arguments=text,
                                   name=call["name"]))
        else:
            return []
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self._items.append(item)
        self._open = None
        self._call = {}
        return out

    def _complete(self) -> list[bytes]:
        out = self._close()
        self._ended = True
        response = self._base(status_of(self._finish), list(self._items), usage_of(self._usage))
        if self._kvagent is not None:
            response["kvagent"] = self._kvagent
        self._response = response
        out.append(self._event("response.completed", response=response))
        return out


def _split(delta: dict[str, Any]) -> list[tuple[str, Any]]:
    """A chat delta as one-kind pieces in vLLM's order: reasoning, text, then each tool
    call's fragments; empty text and tool fragments without a function carry nothing."""
    out: list[tuple[str, Any]] = []
    reasoning = delta.get("reasoning")
    if reasoning is None:
        reasoning = delta.get("reasoning_content")
    if reasoning is not None:
        out.append(("reasoning", reasoning))
    if delta.get("content"):
        out.append(("message", delta["content"]))
    groups: dict[Any, list[dict[str, Any]]] = {}
    for tc in delta.get("tool_calls") or ():
        if isinstance(tc, dict):
            groups.setdefault(tc.get("index"), []).append(tc)
    out += [("function_call", tcs) for tcs in groups.values() if tcs[0].get("function")]
    return out
