"""LangChain chat model over the kvagent client: ``ChatKVAgent``.

LangChain keeps the conversation in its own messages and resends all of them on every
call. Each answer's ``AIMessage`` therefore carries the router's cache token (and the
session id it is bound to) in ``response_metadata["kvagent"]``. When the last ``AIMessage``
of the next call's input carries one, it is sent, so an agent loop, a chain with memory or
a LangGraph checkpoint keeps reusing the KV cache without extra code.

Needs the extra ``kvagent[langchain]`` (``langchain-core``)::

    from kvagent.integrations.langchain import ChatKVAgent

    llm = ChatKVAgent(model="kvagent-demo", base_url="http://127.0.0.1:8000/v1")
    reply = llm.bind_tools([get_weather]).invoke(messages)
    reply.usage_metadata["input_token_details"]["cache_read"]   # prompt tokens reused
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

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
    tool_call_arguments,
)
from ._clients import OwnedClients
from ._parts import part_from_dict, text_or_parts

__all__ = ["ChatKVAgent"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_MODEL = "kvagent-demo"

#: Per-call keyword arguments that map to the session's own options.
_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop")
#: ``chunk_position`` appeared in langchain-core 1.0; older cores merge chunks without it.
#: Carrier entry holding each tool call's raw argument text, keyed by call id.
TOOL_ARGUMENTS = "tool_arguments"
#: LangChain's own estimate when no tokenizer is given (``count_tokens_approximately``).
_CHARS_PER_TOKEN = 4.0
_LAST: dict[str, Any] = (
    {"chunk_position": "last"} if "chunk_position" in AIMessageChunk.model_fields else {}
)


def _env(name: str, default: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, default)


def _api_key_from_env() -> SecretStr | None:
    value = os.environ.get("KVAGENT_API_KEY")
    return SecretStr(value) if value else None


class ChatKVAgent(BaseChatModel):
    """A LangChain chat model served by a kvagent router (or any OpenAI-compatible server).

    Sync and async, streaming with tool-call chunks, ``bind_tools``,
    ``with_structured_output``, and usage with the reused prompt tokens in
    ``usage_metadata["input_token_details"]["cache_read"]``.

    Reuse across calls needs no state in the model: the token rides on the returned
    ``AIMessage`` (``response_metadata["kvagent"]``). Pass ``session_id`` to pin the
    conversation's id yourself; otherwise it is taken from the last ``AIMessage`` of the
    input, or a new one is made for a conversation that has none yet. One model instance
    can serve many conversations at once.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(default_factory=_env("KVAGENT_MODEL", DEFAULT_MODEL), alias="model_name")
    """Model name the server serves (env ``KVAGENT_MODEL``)."""
    base_url: str = Field(default_factory=_env("KVAGENT_BASE_URL", DEFAULT_BASE_URL))
    """OpenAI-compatible base URL ending in ``/v1`` (env ``KVAGENT_BASE_URL``)."""
    api_key: SecretStr | None = Field(default_factory=_api_key_from_env)
    """Sent as ``Authorization: Bearer`` (env ``KVAGENT_API_KEY``)."""
    session_id: str | None = None
    """Fixed session id; by default it follows the conversation's last ``AIMessage``."""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, alias="max_completion_tokens")
    seed: int | None = None
    stop: list[str] | str | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = None
    """Seconds; ``None`` keeps the SDK's default (generous: CPU prefill is slow)."""
    max_retries: int | None = None
    """Retries before the first byte (connection errors, 408/409/429/5xx)."""
    streaming: bool = False
    """Stream underneath ``invoke`` (callbacks receive tokens)."""
    extra_body: dict[str, Any] | None = Field(default=None, alias="model_kwargs")
    """Extra request body fields (vLLM's ``top_k``, ``return_token_ids``, ...)."""
    default_headers: dict[str, str] | None = None
    http_client: httpx.Client | None = Field(default=None, exclude=True)
    """Your own ``httpx.Client`` (proxies, ``MockTransport`` in tests); not closed by the
    model. Without one, the model keeps one client, so its calls reuse connections."""
    http_async_client: httpx.AsyncClient | None = Field(default=None, exclude=True)
    """Your own ``httpx.AsyncClient``; without one, the model keeps one per event loop."""

    _clients: OwnedClients = PrivateAttr(default_factory=OwnedClients)

    # ------------------------------------------------------------------ LangChain hooks

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd``/``dumps`` write it; ``loads(..., valid_namespaces=["kvagent"])`` reads it."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["kvagent", "integrations", "langchain"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "KVAGENT_API_KEY"}

    def get_num_tokens(self, text: str) -> int:
        """Tokens in ``text``: exact with ``custom_get_token_ids`` (your model's tokenizer),
        otherwise LangChain's character estimate (about 4 characters a token), which needs
        no tokenizer download and no ``transformers``."""
        if self.custom_get_token_ids is not None:
            return len(self.custom_get_token_ids(text))
        return math.ceil(len(text) / _CHARS_PER_TOKEN)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[Any] | None = None) -> int:
        """Tokens in ``messages`` (and ``tools``' schemas); see ``get_num_tokens``."""
        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages, tools)
        return count_tokens_approximately(messages, chars_per_token=_CHARS_PER_TOKEN,
                                          tools=list(tools) if tools else None)

    @property
    def _llm_type(self) -> str:
        return "kvagent-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url, "temperature": self.temperature,
                "max_tokens": self.max_tokens}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvagent", ls_model_type="chat",
            ls_model_name=str(kwargs["model"]) if isinstance(kwargs.get("model"), str)
            else self.model,
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = [stops] if isinstance(stops, str) else list(stops)
        return params

    # ------------------------------------------------------------------ tools and schemas

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` to the model (OpenAI function schemas).

        ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` (or LangChain's ``"any"``,
        or ``True``), a tool name, or an OpenAI ``tool_choice`` dict.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Answers parsed into ``schema``.

        ``function_calling`` forces a call of a tool shaped like the schema;
        ``json_schema`` constrains the text to the schema (vLLM structured outputs);
        ``json_mode`` asks for any JSON object (say which in the prompt).
        """
        if kwargs:
            raise ValueError(f"unsupported arguments: {sorted(kwargs)}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'function_calling', 'json_schema' or "
                             f"'json_mode', not {method!r}")
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]  # narrowed by is_model, which mypy cannot see
            if is_model else JsonOutputParser())
        if method == "json_schema":
            json_schema = convert_to_json_schema(schema)
            response_format: dict[str, Any] = {"type": "json_schema", "json_schema": {
                "name": json_schema.get("title", "output"), "schema": json_schema}}
            if strict is not None:
                response_format["json_schema"]["strict"] = strict
        else:
            response_format = {"type": "json_object"}
        llm = self.bind(response_format=response_format, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": schema})
        if not include_raw:
            return llm | parser
        with_parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                                 parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | with_parsed.with_fallbacks(
            [fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ calls

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        if self.streaming:
            return _from_chunks(self._stream(messages, stop, run_manager, **kwargs))
        session_id, model, init = self._prepare(messages, stop, kwargs)
        with Session(self.base_url, model, http_client=self._sync_client(), **init) as session:
            result = session.send()
        return ChatResult(generations=[ChatGeneration(message=_ai_message(result, session_id))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        session_id, model, init = self._prepare(messages, stop, kwargs)
        with Session(self.base_url, model, http_client=self._sync_client(),
                     **init) as session, session.stream() as events:
            for event in events:
                chunk = _chunk(event, session_id)
                if run_manager:
                    run_manager.on_llm_new_token(_chunk_text(event), chunk=chunk)
                yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if self.streaming:
            chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
            return _from_chunks(iter(chunks))
        session_id, model, init = self._prepare(messages, stop, kwargs)
        async with AsyncSession(self.base_url, model, http_client=self._async_client(),
                                **init) as session:
            result = await session.send()
        return ChatResult(generations=[ChatGeneration(message=_ai_message(result, session_id))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        session_id, model, init = self._prepare(messages, stop, kwargs)
        async with AsyncSession(self.base_url, model, http_client=self._async_client(),
                                **init) as session, session.stream() as events:
            async for event in events:
                chunk = _chunk(event, session_id)
                if run_manager:
                    await run_manager.on_llm_new_token(_chunk_text(event), chunk=chunk)
                yield chunk

    # ------------------------------------------------------------------ plumbing

    def _sync_client(self) -> httpx.Client:
        return self.http_client or self._clients.sync(self.timeout)

    def _async_client(self) -> httpx.AsyncClient:
        return self.http_async_client or self._clients.for_running_loop(self.timeout)

    def _prepare(self, messages: Sequence[BaseMessage], stop: list[str] | None,
                 kwargs: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
        """(session id, model, Session keyword arguments) for one call."""
        call = dict(kwargs)
        model = call.pop("model", None) or self.model
        last_ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        carrier = (read_carrier(last_ai.response_metadata, last_ai.additional_kwargs)
                   if last_ai is not None else None)
        session_id, usable = choose_session(self.session_id, carrier)
        index = (max(i for i, m in enumerate(messages) if m is last_ai)
                 if last_ai is not None else None)
        history = attach_token([_to_kvagent(m) for m in messages], index, usable)
        options: dict[str, Any] = {}
        for key in _SAMPLING:
            value = call.pop(key, None)
            if value is None:
                value = getattr(self, key)
            if value is not None:
                options[key] = value
        stops = stop if stop is not None else options.pop("stop", None)
        options.pop("stop", None)
        if stops:
            options["stop"] = stops
        body = {**(self.extra_body or {}), **call}  # tools, tool_choice, response_format, ...
        if body:
            options["extra_body"] = body
        if self.default_headers:
            options["headers"] = dict(self.default_headers)
        if self.api_key is not None:
            options["api_key"] = self.api_key.get_secret_value()
        if self.max_retries is not None:
            options["max_retries"] = self.max_retries
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return session_id, model, {"messages": history, "session_id": session_id, **options}


# ---------------------------------------------------------------------- messages in


def _text(content: str | list[Any], role: str) -> str:
    """Text of a message's content; kvagent messages are text-only, so other blocks fail."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call"):
            continue  # the same call is in AIMessage.tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatKVAgent sends text only; a {role} message holds a "
                             f"{kind!r} content block")
    return "".join(parts)


def _user_content(content: str | list[Any]) -> str | tuple[kv.ContentPart, ...]:
    """A user message's text, or its parts when it holds images, audio or files."""
    if isinstance(content, str):
        return content
    parts = [kv.TextPart(text=b) if isinstance(b, str) else part_from_dict(b) for b in content]
    return text_or_parts([p for p in parts if p is not None])


def _tool_calls(message: AIMessage) -> tuple[kv.ToolCall, ...]:
    """Calls as the model wrote them: the raw argument text when we kept it (our carrier,
    or OpenAI-style ``additional_kwargs["tool_calls"]``), so the history is resent byte
    for byte; else the parsed arguments re-serialised."""
    raw: dict[str, str] = {}
    for item in message.additional_kwargs.get("tool_calls") or ():
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            arguments = item["function"].get("arguments")
            if isinstance(item.get("id"), str) and isinstance(arguments, str):
                raw[item["id"]] = arguments
    carried = message.response_metadata.get(METADATA_KEY)
    if isinstance(carried, dict) and isinstance(carried.get(TOOL_ARGUMENTS), dict):
        raw.update({k: v for k, v in carried[TOOL_ARGUMENTS].items() if isinstance(v, str)})
    calls = []
    for call in message.tool_calls:
        call_id = call.get("id") or ""
        arguments = raw.get(call_id) or json.dumps(call["args"], ensure_ascii=False)
        calls.append(kv.ToolCall(id=call_id, name=call["name"], arguments=arguments))
    for bad in message.invalid_tool_calls:
        calls.append(kv.ToolCall(id=bad.get("id") or "", name=bad.get("name") or "",
                                 arguments=bad.get("args") or "{}"))
    return tuple(calls)


def _to_kvagent(message: BaseMessage) -> kv.Message:
    if isinstance(message, SystemMessage):
        return kv.SystemMessage(content=_text(message.content, "system"))
    if isinstance(message, HumanMessage):
        return kv.UserMessage(content=_user_content(message.content))
    if isinstance(message, AIMessage):
        text = _text(message.content, "assistant")
        calls = _tool_calls(message)
        return kv.AssistantMessage(content=text if text or not calls else None,
                                   tool_calls=calls)
    if isinstance(message, ToolMessage):
        content = message.content
        text = content if isinstance(content, str) else (
            _text(content, "tool") if all(isinstance(b, str) or (isinstance(b, dict)
                                          and b.get("type") == "text") for b in content)
            else json.dumps(content, ensure_ascii=False))
        return kv.ToolResultMessage(tool_call_id=message.tool_call_id, content=text,
                                    name=message.name, is_error=message.status == "error")
    if isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant"):
        text = _text(message.content, message.role)
        if message.role == "system":
            return kv.SystemMessage(content=text)
        if message.role == "user":
            return kv.UserMessage(content=_user_content(message.content))
        return kv.AssistantMessage(content=text)
    raise ValueError(f"ChatKVAgent cannot send a {type(message).__name__} "
                     f"(role {getattr(message, 'role', message.type)!r})")


def _tool_choice(choice: dict[str, Any] | str | bool, tools: list[dict[str, Any]]
                 ) -> dict[str, Any] | str:
    names = [t["function"]["name"] for t in tools if "function" in t]
    if choice is True:
        if len(names) != 1:
            raise ValueError("tool_choice=True needs exactly one tool")
        choice = names[0]
    if isinstance(choice, dict):
        return choice
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    if choice in names:
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"tool_choice {choice!r} is neither 'auto', 'none', 'required', 'any' "
                     f"nor a bound tool ({names})")


# ---------------------------------------------------------------------- messages out


def _usage_metadata(result: TurnResult) -> dict[str, Any] | None:
    usage = result.usage
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "input_token_details": {"cache_read": usage.cached_tokens}}


def _response_metadata(result: TurnResult, session_id: str) -> dict[str, Any]:
    carrier = carrier_metadata(result, session_id)
    if result.tool_calls:
        # Raw argument text, so the calls go back exactly as written. Not in
        # additional_kwargs["tool_calls"]: LangChain would re-parse those into a second copy
        # of every streamed call.
        carrier[TOOL_ARGUMENTS] = {c.id: c.arguments for c in result.tool_calls}
    meta: dict[str, Any] = {"model_name": result.model, "model_provider": "kvagent",
                            "finish_reason": result.finish_reason, METADATA_KEY: carrier}
    if result.response_id:
        meta["id"] = result.response_id
    return meta


def _parsed_tool_calls(result: TurnResult) -> tuple[list[Any], list[Any]]:
    good, bad = [], []
    for call in result.tool_calls:
        args, error = tool_call_arguments(call)
        if args is None:
            bad.append(invalid_tool_call(name=call.name, args=call.arguments, id=call.id,
                                         error=error))
        else:
            good.append(tool_call(name=call.name, args=args, id=call.id))
    return good, bad


def _ai_message(result: TurnResult, session_id: str) -> AIMessage:
    good, bad = _parsed_tool_calls(result)
    extra: dict[str, Any] = {}
    usage = _usage_metadata(result)
    if usage is not None:
        extra["usage_metadata"] = usage
    return AIMessage(content=result.text, tool_calls=good, invalid_tool_calls=bad,
                     response_metadata=_response_metadata(result, session_id),
                     id=result.response_id, **extra)


def _chunk(event: TextDelta | ReasoningDelta | ToolCallDelta | Done, session_id: str
           ) -> ChatGenerationChunk:
    if isinstance(event, TextDelta):
        return ChatGenerationChunk(message=AIMessageChunk(content=event.text))
    if isinstance(event, ReasoningDelta):  # where langchain-openai puts reasoning, too
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", additional_kwargs={"reasoning_content": event.text}))
    if isinstance(event, ToolCallDelta):
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
            tool_call_chunk(name=event.name, args=event.arguments or None, id=event.id,
                            index=event.index)]))
    result = event.result
    extra: dict[str, Any] = {}
    usage = _usage_metadata(result)
    if usage is not None:
        extra["usage_metadata"] = usage
    message = AIMessageChunk(content="", response_metadata=_response_metadata(result, session_id),
                             **extra, **_LAST)
    return ChatGenerationChunk(message=message,
                               generation_info={"finish_reason": result.finish_reason})


def _chunk_text(event: TextDelta | ReasoningDelta | ToolCallDelta | Done) -> str:
    return event.text if isinstance(event, TextDelta) else ""


def _from_chunks(chunks: Iterator[ChatGenerationChunk]) -> ChatResult:
    merged: ChatGenerationChunk | None = None
    for chunk in chunks:
        merged = chunk if merged is None else merged + chunk
    if merged is None:
        raise ValueError("the stream produced no chunks")
    msg = merged.message
    if not isinstance(msg, AIMessageChunk):  # `_chunk` makes only these; this tells mypy so
        raise TypeError(f"expected AIMessageChunk chunks, got {type(msg).__name__}")
    message = AIMessage(content=msg.content, tool_calls=msg.tool_calls,
                        invalid_tool_calls=msg.invalid_tool_calls,
                        additional_kwargs=msg.additional_kwargs,
                        response_metadata=msg.response_metadata,
                        usage_metadata=msg.usage_metadata,
                        id=msg.id)
    return ChatResult(generations=[ChatGeneration(message=message,
                                                  generation_info=merged.generation_info)])
