"""Put `kv_transfer_params` into the final chunk of streamed (chat) completions.

Stock vLLM returns `kv_transfer_params` only in non-streamed responses (upstream PR #40186 is
open), yet a decode node always streams. Without them a router cannot learn where D keeps a
finished turn's KV, so nothing is ever reused. This module wraps the two OpenAI stream
generators: it watches the engine's `RequestOutput`s as they pass, lets every chunk through
unbuffered until the request has finished, holds only the chunks produced after that (the
finish chunk and the usage chunk, emitted back to back), and adds the top-level
`kv_transfer_params` object to the last data chunk before `data: [DONE]`.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic_core

from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

KV_PARAMS_KEY = "kv_transfer_params"
_DATA_PREFIX = "data: "
_DONE = "data: [DONE]"


def add_params_to_event(event: str, params: dict[str, Any]) -> str:
    """Return the SSE `event` ("data: {...}\\n\\n") with `params` added at the top level.

    Events that are not JSON objects, error events and events that already carry the key
    (a vLLM that has the upstream fix) are returned unchanged.
    """
    if not event.startswith(_DATA_PREFIX):
        return event
    body = event[len(_DATA_PREFIX) :].rstrip("\n")
    try:
        obj = json.loads(body)
    except ValueError:
        return event
    if not isinstance(obj, dict) or "error" in obj or KV_PARAMS_KEY in obj:
        return event
    encoded = pydantic_core.to_json(params).decode()
    stripped = body.rstrip()
    if not stripped.endswith("}"):
        return event
    sep = "," if obj else ""
    trailer = event[len(_DATA_PREFIX) + len(body) :]
    return f"{_DATA_PREFIX}{stripped[:-1]}{sep}\"{KV_PARAMS_KEY}\":{encoded}}}{trailer}"


def inject_into_last_data_event(events: list[str], params: dict[str, Any]) -> list[str]:
    """Add `params` to the last `data:` event of `events` that is not `[DONE]`."""
    out = list(events)
    for i in range(len(out) - 1, -1, -1):
        if out[i].startswith(_DATA_PREFIX) and not out[i].startswith(_DONE):
            out[i] = add_params_to_event(out[i], params)
            break
    return out


class OutputWatch:
    """Watches `RequestOutput`s (or `(index, RequestOutput)` pairs) on their way through.

    `finished` turns true once every expected prompt has produced its final output; `params`
    holds the `kv_transfer_params` of the last final output that had them (what the
    non-streamed response reports).
    """

    def __init__(self, expected: int = 1) -> None:
        self.expected = max(1, expected)
        self.params: dict[str, Any] | None = None
        self._done: set[int] = set()

    @property
    def finished(self) -> bool:
        return len(self._done) >= self.expected

    def observe(self, item: Any) -> None:
        index, output = item if isinstance(item, tuple) else (0, item)
        if getattr(output, "finished", False):
            self._done.add(index)
            params = getattr(output, KV_PARAMS_KEY, None)
            if params is not None:
                self.params = params

    async def watch(self, source: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for item in source:
                self.observe(item)
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()


async def relay_with_params(events: AsyncIterator[str], watch: OutputWatch) -> AsyncIterator[str]:
    """Relay `events` unbuffered; once the request finished, hold events until `[DONE]`.

    Only the events produced after the final engine output are held, and vLLM produces them
    without awaiting anything, so streaming latency is unchanged.
    """
    held: list[str] = []
    try:
        async for event in events:
            if not watch.finished:
                yield event
                continue
            if event.startswith(_DONE):
                if watch.params is not None:
                    held = inject_into_last_data_event(held, watch.params)
                for h in held:
                    yield h
                held = []
                yield event
            else:
                held.append(event)
        for h in held:
            yield h
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def wrap_stream_generator(original: Callable[..., AsyncIterator[str]]) -> Callable[..., Any]:
    """Wrap a vLLM `*_stream_generator` method (signature has `result_generator`)."""
    sig = inspect.signature(original)
    if "result_generator" not in sig.parameters:
        raise TypeError(f"{original.__qualname__} has no result_generator parameter")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = sig.bind(*args, **kwargs)
        expected = bound.arguments.get("num_prompts", 1)
        watch = OutputWatch(expected if isinstance(expected, int) else 1)
        bound.arguments["result_generator"] = watch.watch(bound.arguments["result_generator"])
        return relay_with_params(original(*bound.args, **bound.kwargs), watch)

    mark_wrapped(wrapper)
    return wrapper


_TARGETS = (
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
     "chat_completion_stream_generator"),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
     "completion_stream_generator"),
)


def patch_module(module: Any) -> bool:
    """Patch the stream generator(s) that `module` defines; True if one was patched."""
    patched = False
    for mod_name, cls_name, meth in _TARGETS:
        if module.__name__ != mod_name:
            continue
        cls = getattr(module, cls_name)
        current = getattr(cls, meth)
        if is_wrapped(current):
            continue
        setattr(cls, meth, wrap_stream_generator(current))
        patched = True
    return patched


def target_modules() -> list[str]:
    """Modules whose import triggers `patch_module`."""
    return [t[0] for t in _TARGETS]
