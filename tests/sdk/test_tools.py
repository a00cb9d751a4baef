"""Tools from functions: schemas from type hints, clear declaration errors, safe execution."""

from __future__ import annotations

import asyncio
import enum
import gc
import socket
import warnings
from collections.abc import Callable
from typing import Annotated, Literal

import pytest
from kvagent import Tool, ToolCall, ToolSchemaError, tool
from kvagent.tools import as_tools, execute_async, execute_sync, prepare_call
from pydantic import BaseModel, Field


class Unit(enum.Enum):
    C = "c"
    F = "f"


class Place(BaseModel):
    city: str
    country: str = "FR"


@tool
def forecast(place: Place, days: int = 1, unit: Unit = Unit.C,
             detail: Literal["short", "long"] = "short") -> dict:
    """Forecast the weather.

    Args:
        place: Where to forecast.
        days: How many days ahead,
            counting today.
    """
    return {"city": place.city, "days": days, "unit": unit.value, "detail": detail}


def test_schema_from_type_hints_and_docstring() -> None:
    assert forecast.name == "forecast"
    assert forecast.description == "Forecast the weather."
    params = forecast.parameters
    assert params["required"] == ["place"]
    assert params["properties"]["days"] == {"default": 1, "description":
                                            "How many days ahead, counting today.",
                                            "type": "integer"}
    assert params["properties"]["detail"]["enum"] == ["short", "long"]
    assert params["properties"]["place"]["$ref"] == "#/$defs/Place"
    assert params["$defs"]["Unit"]["enum"] == ["c", "f"]
    assert "title" not in params and "title" not in params["properties"]["days"]


def test_annotated_field_descriptions_and_sphinx_docstrings() -> None:
    @tool(name="lookup", description="Find a user.")
    def find(user_id: Annotated[int, Field(description="numeric id", ge=1)]) -> str:
        """:param user_id: ignored because Annotated wins"""
        return str(user_id)

    assert find.name == "lookup" and find.description == "Find a user."
    assert find.parameters["properties"]["user_id"]["description"] == "numeric id"
    assert find.parameters["properties"]["user_id"]["minimum"] == 1


def test_tool_stays_callable_as_the_function() -> None:
    assert forecast(Place(city="Lyon"), days=2)["days"] == 2
    assert forecast.__doc__.startswith("Forecast")


def _socket_param(sock: socket.socket) -> str: ...
def _callable_param(cb: Callable[[int], int]) -> str: ...
def _untyped(x) -> str: ...  # type: ignore[no-untyped-def]
def _var_args(*args: int) -> str: ...
def _var_kwargs(**kw: int) -> str: ...
def _positional_only(a: int, /) -> str: ...


@pytest.mark.parametrize(("fn", "match"), [
    (_socket_param, "parameter 'sock' of tool '_socket_param' has type socket"),
    (_callable_param, "parameter 'cb'"),
    (_untyped, "parameter 'x' of tool '_untyped' has no type hint"),
    (_var_args, r"\*args/\*\*kwargs"),
    (_var_kwargs, r"\*args/\*\*kwargs"),
    (_positional_only, "positional-only"),
])
def test_undescribable_parameters_fail_at_declaration(fn: Callable, match: str) -> None:
    with pytest.raises(ToolSchemaError, match=match):
        tool(fn)


def test_invalid_and_duplicate_names() -> None:
    with pytest.raises(ToolSchemaError, match="invalid"):
        Tool(lambda: None, name="has space")
    with pytest.raises(ToolSchemaError, match="two tools are named 'forecast'"):
        as_tools([forecast, forecast])


def test_prepare_call_validates_and_coerces_arguments() -> None:
    tools = as_tools([forecast])
    ok = prepare_call(tools, ToolCall(id="1", name="forecast",
                                      arguments='{"place": {"city": "Nice"}, "unit": "f"}'))
    assert ok.error is None
    assert ok.arguments == {"place": Place(city="Nice"), "days": 1, "unit": Unit.F,
                            "detail": "short"}
    result = execute_sync(ok)
    assert not result.is_error
    assert result.content == '{"city":"Nice","days":1,"unit":"f","detail":"short"}'
    assert result.tool_call_id == "1" and result.name == "forecast"


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("nope", "{}", "Error: unknown tool 'nope'. Available tools: forecast."),
    ("forecast", "{not json", "Error: invalid arguments for tool 'forecast': "),
    ("forecast", '{"days": 2}', "place: Field required"),
    ("forecast", '{"place": {"city": "X"}, "bogus": 1}', "bogus: Extra inputs"),
    ("forecast", '[1]', "Error: invalid arguments"),
])
def test_bad_calls_become_error_results(name: str, arguments: str, expected: str) -> None:
    prepared = prepare_call(as_tools([forecast]), ToolCall(id="9", name=name,
                                                           arguments=arguments))
    result = execute_sync(prepared)
    assert result.is_error and result.tool_call_id == "9"
    assert expected in result.content


def test_a_raising_tool_is_reported_not_raised() -> None:
    @tool
    def boom(x: int) -> str:
        raise RuntimeError(f"disk full at {x}")

    result = execute_sync(prepare_call(as_tools([boom]), ToolCall(id="b", name="boom",
                                                                  arguments='{"x": 3}')))
    assert result.is_error
    assert result.content == "Error: tool 'boom' raised RuntimeError: disk full at 3"


async def test_async_and_sync_tools_both_run_in_async_code() -> None:
    @tool
    async def slow_add(a: int, b: int) -> int:
        return a + b

    @tool
    def mul(a: int, b: int) -> int:
        return a * b

    tools = as_tools([slow_add, mul])
    added = await execute_async(prepare_call(tools, ToolCall(id="1", name="slow_add",
                                                             arguments='{"a":2,"b":3}')))
    multiplied = await execute_async(prepare_call(tools, ToolCall(id="2", name="mul",
                                                                  arguments='{"a":2,"b":3}')))
    assert (added.content, multiplied.content) == ("5", "6")


def test_async_tool_runs_from_sync_code() -> None:
    @tool
    async def hello(name: str) -> str:
        return f"hi {name}"

    result = execute_sync(prepare_call(as_tools([hello]), ToolCall(id="1", name="hello",
                                                                   arguments='{"name":"a"}')))
    assert result.content == "hi a"


# ----------------------------------------------------------------------- docstring styles


def _google(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Uses the public API.

    Args:
        city: City name,
            e.g. Paris.
        days (int): Days ahead.

    Returns:
        A short text forecast.

    Raises:
        ConnectionError: when the API is down.
    """
    return city


def _numpy(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Parameters
    ----------
    city : str
        City name.
    days : int, optional
        Days ahead.

    Returns
    -------
    str
        A short text forecast.
    """
    return city


def _sphinx(city: str, days: int = 1) -> str:
    """Forecast the weather.

    :param city: City name.
    :param int days: Days ahead.
    :returns: A short text forecast.
    :raises ConnectionError: when the API is down.
    """
    return city


def test_google_sections_other_than_args_never_reach_the_model() -> None:
    t = Tool(_google)
    assert t.description == "Forecast the weather.\n\nUses the public API."
    assert "Returns" not in t.description and "Raises" not in t.description
    props = t.parameters["properties"]
    assert props["city"]["description"] == "City name, e.g. Paris."
    assert props["days"]["description"] == "Days ahead."


@pytest.mark.parametrize("fn", [_numpy, _sphinx])
def test_numpy_and_sphinx_parameters_are_described(fn: Callable) -> None:
    t = Tool(fn)
    assert t.description == "Forecast the weather."
    props = t.parameters["properties"]
    assert (props["city"]["description"], props["days"]["description"]) == (
        "City name.", "Days ahead.")


# ----------------------------------------------------------------------- sync over async


@tool
async def slow_lookup(key: str) -> str:
    """Look a key up."""
    await asyncio.sleep(0.01)
    return f"value of {key}"


async def test_an_async_tool_runs_from_sync_code_inside_a_running_loop() -> None:
    """As in a Jupyter cell: sync code called while an event loop runs in this thread."""
    asyncio.get_running_loop()  # the premise
    call = ToolCall(id="c1", name="slow_lookup", arguments='{"key": "k"}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail here
        message = execute_sync(prepare_call(as_tools([slow_lookup]), call))
        gc.collect()
    assert not message.is_error and message.content == "value of k"
