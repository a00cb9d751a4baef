"""A prompt's token ids, from a prefill node's own `/tokenize` endpoint.

Prefix verification compares token ids, so they must come from the same tokenizer and
chat template, with the same template arguments, that the prefill leg will use: the
request is built from exactly the fields of the client's body that change rendering.
(`cache_salt` changes KV hashes, not tokens, and `/tokenize` does not take it.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvagent_server.router.nodes.client import NodeClient, UpstreamError

#: Chat-request fields that change how vLLM renders messages into tokens.
CHAT_TEMPLATE_FIELDS = ("tools", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                        "mm_processor_kwargs", "media_io_kwargs")
#: Chat fields `/tokenize` does not take but vLLM's chat endpoint hands the template as
#: template arguments (vLLM 0.32 `ChatCompletionRequest.build_chat_params`).
TEMPLATE_KWARG_FIELDS = ("documents", "reasoning_effort")


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """`chat_template_kwargs` as the chat endpoint renders with them: the request's own,
    overridden by `documents`/`reasoning_effort` (and the `enable_thinking` that
    `reasoning_effort` implies), unset values (None, "auto") dropped as vLLM does."""
    own = body.get("chat_template_kwargs")
    extra = {k: body[k] for k in TEMPLATE_KWARG_FIELDS if body.get(k) not in (None, "auto")}
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (own or {}):
        extra["enable_thinking"] = effort != "none"
    if not extra:
        return own
    return {**(own or {}), **extra}


class TokenizeError(Exception):
    """The node could not tokenize the prompt (the turn then skips reuse)."""


def tokenize_request(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """The `/tokenize` body for a chat or completion body; None when it cannot be tokenized.

    A completion prompt given as token ids needs no call (see `prompt_ids`); a batch of
    prompts is never reused.
    """
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if chat:
        out["messages"] = body.get("messages")
        for name in CHAT_TEMPLATE_FIELDS:
            if name in body:
                out[name] = body[name]
        kwargs = _template_kwargs(body)
        if kwargs is not None:
            out["chat_template_kwargs"] = kwargs
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            return None
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def prompt_ids(body: Mapping[str, Any]) -> list[int] | None:
    """A completion prompt that is already token ids (one prompt only)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list)
            and all(isinstance(t, int) for t in prompt[0])):
        return list(prompt[0])
    return None


async def tokenize(client: NodeClient, base_url: str, body: Mapping[str, Any], *,
                   chat: bool, timeout_s: float = 30.0) -> list[int]:
    """Token ids of the prompt `body` describes, as the node at `base_url` renders it."""
    ids = None if chat else prompt_ids(body)
    if ids is not None:
        return ids
    request = tokenize_request(body, chat=chat)
    if request is None:
        raise TokenizeError("prompt shape cannot be tokenized for reuse")
    try:
        resp = await client.post(f"{base_url}/tokenize", request, stream=False,
                                 timeout_s=timeout_s)
    except UpstreamError as exc:
        raise TokenizeError(f"tokenize call failed: {exc}") from exc
    if resp.status_code != 200:
        raise TokenizeError(f"tokenize returned {resp.status_code}")
    try:
        answer = resp.json()
    except ValueError:
        raise TokenizeError("tokenize response is not JSON") from None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        raise TokenizeError("tokenize response has no token list")
    return tokens
