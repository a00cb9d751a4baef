"""Tools from plain Python functions: JSON schema from type hints, docstring as description.

Declaration fails loudly (``ToolSchemaError``) when a parameter cannot be described; running
never does: unknown names, malformed arguments and exceptions inside the tool all become an
error result the model can read and react to.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, overload

import docstring_parser
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic.errors import (
    PydanticInvalidForJsonSchema,
    PydanticSchemaGenerationError,
    PydanticUserError,
)
from pydantic.fields import FieldInfo

from ._exceptions import ToolSchemaError
from .messages import ToolCall, ToolResultMessage

__all__ = ["Tool", "tool"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_SCHEMA_ERRORS = (PydanticSchemaGenerationError, PydanticInvalidForJsonSchema, PydanticUserError)


class Tool:
    """A function the model may call. Calling the ``Tool`` itself calls the function."""

    def __init__(self, function: Callable[..., Any], *, name: str | None = None,
                 description: str | None = None) -> None:
        self.function = function
        self.name: str = name or str(getattr(function, "__name__", ""))
        if not _NAME_RE.match(self.name):
            raise ToolSchemaError(
                f"tool name {self.name!r} is invalid: use 1-64 characters from [A-Za-z0-9_-]")
        summary, param_docs = _parse_docstring(inspect.getdoc(function) or "")
        self.description = description if description is not None else summary
        self.is_async = inspect.iscoroutinefunction(function)
        self._args_model = _arguments_model(function, self.name, param_docs)
        self.parameters: dict[str, Any] = _tidy_schema(self._args_model.model_json_schema())
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r})"

    def to_wire(self) -> dict[str, Any]:
        """This tool as an entry of the Chat Completions ``tools`` array: the dict a session
        sends, for building the same request by other means."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def validate_arguments(self, arguments: str) -> dict[str, Any]:
        """Parse and validate the model's JSON arguments; raises ``ValueError`` with details."""
        try:
            instance = self._args_model.model_validate_json(arguments.strip() or "{}")
        except ValidationError as exc:
            raise ValueError(_summarise(exc)) from None
        return {field: getattr(instance, field) for field in type(instance).model_fields}

    def run_sync(self, arguments: Mapping[str, Any]) -> Any:
        """Call the function from synchronous code (an async tool gets its own event loop).

        Inside a running loop (a Jupyter cell, an async web handler calling sync code) the
        coroutine runs on a private loop in a worker thread: ``asyncio.run`` would refuse,
        and the caller's loop cannot be re-entered while it waits for us.
        """
        if not self.is_async:
            return self.function(**arguments)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.function(**arguments))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvagent-tool") as pool:
            # The coroutine is created in the worker, so it is always awaited there.
            return pool.submit(lambda: asyncio.run(self.function(**arguments))).result()

    async def run_async(self, arguments: Mapping[str, Any]) -> Any:
        """Await the function; a sync tool runs in a worker thread so the loop stays free."""
        if self.is_async:
            return await self.function(**arguments)
        return await asyncio.to_thread(self.function, **arguments)


@overload
def tool(function: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None
         ) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(function: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: ``@tool`` or ``@tool(name=..., description=...)`` turns a function into a Tool."""
    if function is not None:
        return Tool(function, name=name, description=description)
    return lambda fn: Tool(fn, name=name, description=description)


def as_tools(items: Iterable[Tool | Callable[..., Any]] | None) -> dict[str, Tool]:
    """Normalise a list of tools/functions into a name-keyed mapping; names must be unique."""
    out: dict[str, Tool] = {}
    for item in items or ():
        t = item if isinstance(item, Tool) else Tool(item)
        if t.name in out:
            raise ToolSchemaError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out


# ----------------------------------------------------------------------- execution plan


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """A tool call resolved against the declared tools: runnable, or already an error."""

    call: ToolCall
    tool: Tool | None
    arguments: dict[str, Any] | None
    error: str | None = None


def prepare_call(tools: Mapping[str, Tool], call: ToolCall) -> PreparedCall:
    """Look the tool up and validate its arguments, without running anything."""
    found = tools.get(call.name)
    if found is None:
        available = ", ".join(sorted(tools)) or "none"
        return PreparedCall(call, None, None,
                            f"Error: unknown tool {call.name!r}. Available tools: {available}.")
    try:
        arguments = found.validate_arguments(call.arguments)
    except ValueError as exc:
        return PreparedCall(call, found, None,
                            f"Error: invalid arguments for tool {call.name!r}: {exc}")
    return PreparedCall(call, found, arguments)


def success_message(prepared: PreparedCall, value: Any) -> ToolResultMessage:
    """The tool's return value as the text the model reads."""
    content = value if isinstance(value, str) else pydantic_core.to_json(value).decode()
    return ToolResultMessage(tool_call_id=prepared.call.id, name=prepared.call.name,
                             content=content)


def error_message(prepared: PreparedCall, error: str | BaseException) -> ToolResultMessage:
    """An error result: the model is told what failed instead of the run crashing."""
    if isinstance(error, BaseException):
        error = f"Error: tool {prepared.call.name!r} raised {type(error).__name__}: {error}"
    return ToolResultMessage(tool_call_id=prepared.call.id, name=prepared.call.name,
                             content=error, is_error=True)


def execute_sync(prepared: PreparedCall) -> ToolResultMessage:
    """Run one prepared call; exceptions become error results."""
    if prepared.error is not None or prepared.tool is None or prepared.arguments is None:
        return error_message(prepared, prepared.error or "Error: tool call could not run")
    try:
        return success_message(prepared, prepared.tool.run_sync(prepared.arguments))
    except Exception as exc:  # noqa: BLE001 - reported to the model, by design
        return error_message(prepared, exc)


async def execute_async(prepared: PreparedCall) -> ToolResultMessage:
    """Async twin of ``execute_sync``."""
    if prepared.error is not None or prepared.tool is None or prepared.arguments is None:
        return error_message(prepared, prepared.error or "Error: tool call could not run")
    try:
        return success_message(prepared, await prepared.tool.run_async(prepared.arguments))
    except Exception as exc:  # noqa: BLE001 - reported to the model, by design
        return error_message(prepared, exc)


# ----------------------------------------------------------------------- schema building


def _arguments_model(function: Callable[..., Any], name: str,
                     param_docs: Mapping[str, str]) -> type[BaseModel]:
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function, include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolSchemaError(f"cannot read the signature of tool {name!r}: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        where = f"parameter {param.name!r} of tool {name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"{where}: *args/**kwargs cannot be described to a model")
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolSchemaError(f"{where}: positional-only parameters are not supported")
        if param.name not in hints:
            raise ToolSchemaError(f"{where} has no type hint; annotate it (e.g. `: str`)")
        annotation = hints[param.name]
        try:
            TypeAdapter(annotation).json_schema()
        except _SCHEMA_ERRORS as exc:
            raise ToolSchemaError(
                f"{where} has type {_type_name(annotation)}, which has no JSON schema; "
                "use str, int, float, bool, list, dict, Literal, Enum or a pydantic model"
            ) from exc
        default = ... if param.default is param.empty else param.default
        doc = None if _has_description(annotation) else param_docs.get(param.name)
        fields[param.name] = (annotation, Field(default, description=doc) if doc else default)
    try:
        return create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
    except _SCHEMA_ERRORS as exc:
        raise ToolSchemaError(f"cannot build a schema for tool {name!r}: {exc}") from exc


def _has_description(annotation: Any) -> bool:
    """An ``Annotated[..., Field(description=...)]`` says it better than the docstring."""
    return any(isinstance(meta, FieldInfo) and meta.description
               for meta in getattr(annotation, "__metadata__", ()))


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)


def _tidy_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's auto titles: they cost prompt tokens and tell the model nothing."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "title" and isinstance(value, str):
                continue
            if key in ("properties", "$defs") and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            elif key in ("default", "const", "enum", "examples"):
                out[key] = value
            else:
                out[key] = walk(value)
        return out

    tidied: dict[str, Any] = walk(schema)
    return tidied


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description for the model and per-parameter descriptions.

    Google (``Args:``), NumPy (``Parameters``) and Sphinx (``:param x:``) styles are read by
    ``docstring_parser``; only the summary and the free text reach the model, never the
    ``Returns``/``Raises``/``Examples`` sections, which describe the Python function.
    """
    try:
        parsed = docstring_parser.parse(doc)
    except docstring_parser.ParseError:
        return doc.strip(), {}
    parts = [p for p in (parsed.short_description, parsed.long_description) if p]
    summary = ("\n\n" if parsed.blank_after_short_description else "\n").join(parts)
    params = {p.arg_name.lstrip("*"): " ".join((p.description or "").split())
              for p in parsed.params if p.description}
    return summary.strip(), params


def _summarise(exc: ValidationError) -> str:
    """Pydantic's errors as one line the model can act on."""
    parts = []
    for error in exc.errors(include_url=False):
        location = ".".join(str(p) for p in error["loc"]) or "arguments"
        parts.append(f"{location}: {error['msg']}")
    return "; ".join(parts)
