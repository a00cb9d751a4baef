"""The Responses API's client errors, in OpenAI's error shape, and a chat error reworded in
the Responses request's terms."""

from __future__ import annotations

import re


class ApiError(Exception):
    """A client error in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' {message}", param=param)


_CHAT_MAX_TOKENS = re.compile(r"\bmax_tokens\b")


def responses_words(message: str, param: str | None) -> tuple[str, str | None]:
    """An error about the chat body a Responses request became, in the Responses
    request's terms, as vLLM's own `/v1/responses` words it: the output cap is
    `max_output_tokens` there."""
    message = _CHAT_MAX_TOKENS.sub("max_output_tokens", message)
    return message, "max_output_tokens" if param == "max_tokens" else param
