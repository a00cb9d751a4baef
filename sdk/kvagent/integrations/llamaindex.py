"""LlamaIndex LLM over the kvagent client: ``KVAgentLLM``.

A ``FunctionCallingLLM``: ``chat``/``stream_chat`` and their async variants, ``complete``,
and tool calling, so ``FunctionAgent`` and the other LlamaIndex agents run on it. LlamaIndex
keeps the conversation in its memory and resends it on every call; each answer's
``ChatMessage`` carries the router's cache token (and the session id it is bound to) in
``additional_kwargs["kvagent"]``, which memory stores keep, so the next call sends it and
the router reuses the KV cache.

Needs the extra ``kvagent[llamaindex]`` (``llama-index-core``)::

    from llama_index.core.agent.workflow import FunctionAgent
    from kvagent.integrations.llamaindex import KVAgentLLM

    llm = KVAgentLLM(model="kvagent-demo", base_url="http://127.0.0.1:8000/v1")
    agent = FunctionAgent(tools=[get_weather], llm=llm)
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    DocumentBlock,
    ImageBlock,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json

from .. import messages as kv
from ..async_session import AsyncSession
from ..events import Done, ReasoningDelta, TextDelta, ToolCallDelta
from ..results import TurnResult
from ..session import Session
from ._carry import (
    METADATA_KEY,
    attach_token,
    carrier_metadata,
    choose_session,
    read_carrier,
    usage_counts,
)
from ._clients import OwnedClients
from ._parts import bytes_part, text_or_parts

try:  # llama-index-core >= 0.14 has typed tool-call blocks; older ones use additional_kwargs
    from llama_index.core.base.llms.types import ToolCallBlock
except ImportError:  # pragma: no cover - depends on the installed llama-index-core
    ToolCallBlock = None  # type: ignore[assignment,misc]  # absent: callers test for None

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["KVAgentLLM"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_MODEL = "kvagent-demo"
_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop")


class KVAgentLLM(FunctionCallingLLM):
    """A LlamaIndex function-calling LLM served by a kvagent router (or any
    OpenAI-compatible server).

    Usage lands in ``ChatResponse.additional_kwargs`` (``prompt_tokens``,
    ``completion_tokens``, ``total_tokens`` and ``cached_tokens``: the prompt tokens whose
    KV was reused). Reuse needs no state in the LLM: pass ``session_id`` to pin the
    conversation id yourself; otherwise it follows the last assistant message of the input.
    """

    model: str = Field(default_factory=lambda: os.environ.get("KVAGENT_MODEL", DEFAULT_MODEL),
                       description="Model name the server serves (env KVAGENT_MODEL).")
    base_url: str = Field(
        default_factory=lambda: os.environ.get("KVAGENT_BASE_URL", DEFAULT_BASE_URL),
        description="OpenAI-compatible base URL ending in /v1 (env KVAGENT_BASE_URL).")
    api_key: str | None = Field(default_factory=lambda: os.environ.get("KVAGENT_API_KEY"),
                                description="Bearer key (env KVAGENT_API_KEY).", repr=False)
    session_id: str | None = Field(
        default=None, description="Fixed session id; by default it follows the conversation.")
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = Field(default=None, description="Seconds (SDK default if None).")
    max_retries: int | None = Field(default=None, description="Retries before the first byte.")
    context_window: int = Field(default=16384, description="Prompt + answer token budget.")
    extra_body: dict[str, Any] | None = Field(
        default=None, description="Extra request body fields (e.g. vLLM's top_k).")
    default_headers: dict[str, str] | None = None
    http_client: Any = Field(
        default=None, exclude=True,
        description="Your own httpx.Client; not closed by the LLM. Without one, the LLM "
                    "keeps one client, so its calls reuse connections.")
    http_async_client: Any = Field(
        default=None, exclude=True,
        description="Your own httpx.AsyncClient; without one, the LLM keeps one per event "
                    "loop.")

    _clients: OwnedClients = PrivateAttr(default_factory=OwnedClients)

    @classmethod
    def class_name(cls) -> str:
        return "KVAgentLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window,
                           num_output=self.max_tokens or 256, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model)

    # ------------------------------------------------------------------ chat

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        session_id, model, init = self._prepare(messages, kwargs)
        with Session(self.base_url, model, http_client=self._sync_client(), **init) as session:
            result = session.send()
        return _response(result, session_id)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        session_id, model, init = self._prepare(messages, kwargs)

        def gen() -> Generator[ChatResponse, None, None]:
            parts = _Partial()
            with Session(self.base_url, model, http_client=self._sync_client(),
                         **init) as session, session.stream() as events:
                for event in events:
                    yield parts.feed(event, session_id)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        session_id, model, init = self._prepare(messages, kwargs)
        async with AsyncSession(self.base_url, model, http_client=self._async_client(),
                                **init) as session:
            result = await session.send()
        return _response(result, session_id)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any
                           ) -> ChatResponseAsyncGen:
        session_id, model, init = self._prepare(messages, kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            parts = _Partial()
            async with AsyncSession(self.base_url, model, http_client=self._async_client(),
                                    **init) as session, session.stream() as events:
                async for event in events:
                    yield parts.feed(event, session_id)

        return gen()

    # ------------------------------------------------------------------ complete

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                 ) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                               ) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)

    # ------------------------------------------------------------------ tools

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments for a tool-calling turn (OpenAI tool schemas)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            messages.append(user_msg)
        specs = [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if specs:
            out["tools"] = specs
            out["tool_choice"] = _tool_choice(tool_choice, tool_required, specs)
            if not allow_parallel_tool_calls:
                out["parallel_tool_calls"] = False
        return out

    def _validate_chat_with_tools_response(self, response: ChatResponse,
                                           tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False,
                                           **kwargs: Any) -> ChatResponse:
        """Keep only the first call unless parallel calls were allowed (as OpenAI's LLM does)."""
        if not allow_parallel_tool_calls:
            calls = response.message.additional_kwargs.get("tool_calls")
            if isinstance(calls, list) and len(calls) > 1:
                response.message.additional_kwargs["tool_calls"] = calls[:1]
                keep = calls[0].get("id")
                response.message.blocks = [
                    b for b in response.message.blocks
                    if ToolCallBlock is None or not isinstance(b, ToolCallBlock)
                    or b.tool_call_id == keep]
        return response

    def get_tool_calls_from_response(self, response: ChatResponse,
                                     error_on_no_tool_call: bool = True, **kwargs: Any
                                     ) -> list[ToolSelection]:
        """The calls in an answer; partial arguments (mid-stream) are parsed leniently."""
        selections = [
            ToolSelection(tool_id=call.id, tool_name=call.name,
                          tool_kwargs=_lenient_arguments(call.arguments))
            for call in _calls_of(response.message)
        ]
        if not selections and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got: {response.message.content!r}")
        return selections

    # ------------------------------------------------------------------ plumbing

    def _sync_client(self) -> Any:
        return self.http_client or self._clients.sync(self.timeout)

    def _async_client(self) -> Any:
        return self.http_async_client or self._clients.for_running_loop(self.timeout)

    def _prepare(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
                 ) -> tuple[str, str, dict[str, Any]]:
        """(session id, model, Session keyword arguments) for one call."""
        call = dict(kwargs)
        model = call.pop("model", None) or self.model
        index = next((i for i in range(len(messages) - 1, -1, -1)
                      if messages[i].role == MessageRole.ASSISTANT), None)
        carrier = read_carrier(messages[index].additional_kwargs) if index is not None else None
        session_id, usable = choose_session(self.session_id, carrier)
        history = attach_token([_to_kvagent(m) for m in messages], index, usable)
        options: dict[str, Any] = {}
        for key in _SAMPLING:
            value = call.pop(key, None)
            if value is None:
                value = getattr(self, key)
            if value is not None and value != []:
                options[key] = value
        call.pop("formatted", None)
        body = {**(self.extra_body or {}), **call}  # tools, tool_choice, response_format, ...
        if body:
            options["extra_body"] = body
        if self.default_headers:
            options["headers"] = dict(self.default_headers)
        for key in ("api_key", "max_retries", "timeout"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return session_id, model, {"messages": history, "session_id": session_id, **options}


# ---------------------------------------------------------------------- messages in


def _calls_of(message: ChatMessage) -> list[kv.ToolCall]:
    """Tool calls of an assistant message: the raw OpenAI dicts we stored, else blocks."""
    calls: list[kv.ToolCall] = []
    for item in message.additional_kwargs.get("tool_calls") or ():
        if isinstance(item, Mapping):
            function = item.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments or {}, ensure_ascii=False)
            calls.append(kv.ToolCall(id=str(item.get("id") or ""),
                                     name=str(function.get("name") or ""),
                                     arguments=arguments))
    if calls or ToolCallBlock is None:
        return calls
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            kwargs = block.tool_kwargs
            calls.append(kv.ToolCall(
                id=block.tool_call_id or "", name=block.tool_name,
                arguments=kwargs if isinstance(kwargs, str)
                else json.dumps(kwargs, ensure_ascii=False)))
    return calls


def _user_content(message: ChatMessage) -> str | tuple[kv.ContentPart, ...]:
    """A user message's text, or its parts when it holds images, audio or documents."""
    parts: list[kv.ContentPart] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(kv.TextPart(text=block.text))
        elif isinstance(block, ImageBlock):
            if block.url is not None and block.image is None and block.path is None:
                parts.append(kv.ImagePart.from_url(str(block.url)))
            else:
                parts.append(bytes_part("image", block.resolve_image().read(),
                                        block.image_mimetype))
        elif isinstance(block, AudioBlock):
            fmt = block.format
            parts.append(bytes_part("audio", block.resolve_audio().read(),
                                    f"audio/{fmt}" if fmt else None))
        elif isinstance(block, DocumentBlock):
            parts.append(bytes_part("file", block.resolve_document().read(),
                                    block.document_mimetype, block.title))
        else:
            raise TypeError(f"KVAgentLLM cannot send a {type(block).__name__} in a user "
                             "message")
    return text_or_parts(parts)


def _text(message: ChatMessage) -> str:
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif ToolCallBlock is not None and isinstance(block, ToolCallBlock):
            continue
        else:
            raise ValueError(f"KVAgentLLM sends text only; a {message.role.value} message "
                             f"holds a {type(block).__name__}")
    return "".join(parts)


def _to_kvagent(message: ChatMessage) -> kv.Message:
    role = message.role
    if role in (MessageRole.SYSTEM, MessageRole.DEVELOPER):
        return kv.SystemMessage(content=_text(message))
    if role == MessageRole.USER:
        return kv.UserMessage(content=_user_content(message))
    if role in (MessageRole.ASSISTANT, MessageRole.CHATBOT, MessageRole.MODEL):
        text = _text(message)
        calls = tuple(_calls_of(message))
        return kv.AssistantMessage(content=text if text or not calls else None,
                                   tool_calls=calls)
    if role in (MessageRole.TOOL, MessageRole.FUNCTION):
        call_id = message.additional_kwargs.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError("a tool message needs additional_kwargs['tool_call_id']")
        name = message.additional_kwargs.get("name")
        return kv.ToolResultMessage(tool_call_id=call_id, content=_text(message),
                                    name=name if isinstance(name, str) else None)
    raise ValueError(f"KVAgentLLM cannot send a message with role {role.value!r}")


def _tool_choice(choice: str | dict[str, Any] | None, required: bool,
                 specs: list[dict[str, Any]]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return choice
    if choice is None:
        return "required" if required else "auto"
    if choice in ("auto", "none", "required"):
        return choice
    names = [s["function"]["name"] for s in specs]
    if choice in names:
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"tool_choice {choice!r} is neither 'auto', 'none', 'required' nor a "
                     f"tool ({names})")


def _lenient_arguments(arguments: str) -> dict[str, Any]:
    try:
        value = parse_partial_json(arguments or "{}")
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------- messages out


def _message(text: str, calls: Sequence[kv.ToolCall], meta: dict[str, Any] | None
             ) -> ChatMessage:
    blocks: list[Any] = [TextBlock(text=text)] if text or not calls else []
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for c in calls]
        if ToolCallBlock is not None:
            blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name,
                                     tool_kwargs=_lenient_arguments(c.arguments))
                       for c in calls]
    if meta is not None:
        extra[METADATA_KEY] = meta
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def _usage(result: TurnResult) -> dict[str, int]:
    counts = usage_counts(result.usage)
    if counts is None:
        return {}
    return {"prompt_tokens": counts["input"], "completion_tokens": counts["output"],
            "total_tokens": counts["total"], "cached_tokens": counts["cached"]}


def _response(result: TurnResult, session_id: str, delta: str | None = None) -> ChatResponse:
    message = _message(result.text, result.tool_calls, carrier_metadata(result, session_id))
    return ChatResponse(message=message, delta=delta, raw=result.model_dump(mode="json"),
                        additional_kwargs=_usage(result))


class _Partial:
    """The answer so far, as LlamaIndex streams it: every response holds the whole message."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, list[str]] = {}
        self.ids: dict[int, str] = {}
        self.names: dict[int, str] = {}

    def feed(self, event: TextDelta | ReasoningDelta | ToolCallDelta | Done, session_id: str
             ) -> ChatResponse:
        if isinstance(event, Done):
            return _response(event.result, session_id, delta="")
        delta = ""
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            delta = event.text
        elif isinstance(event, ToolCallDelta):
            self.calls.setdefault(event.index, []).append(event.arguments)
            if event.id:
                self.ids.setdefault(event.index, event.id)
            if event.name:
                self.names.setdefault(event.index, event.name)
        calls = [kv.ToolCall(id=self.ids.get(i, ""), name=self.names.get(i, ""),
                             arguments="".join(parts))
                 for i, parts in sorted(self.calls.items())]
        return ChatResponse(message=_message("".join(self.text), calls, None), delta=delta)
