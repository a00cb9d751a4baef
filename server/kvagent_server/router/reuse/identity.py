"""A prompt's KV identity: what besides its token ids decides the KV of those tokens. Pure.

Token ids alone do not prove two prompts have the same KV: the model or LoRA adapter
(`model`), the tenant's `cache_salt`, the pixels behind an image's placeholder tokens and
request fields such as `truncate_prompt_tokens` change it too. Reuse therefore also
requires equal identities, decided by an allow-list: a request field is either

- `IGNORED`: known to leave the prompt's KV and positions unchanged (sampling, output
  shaping, scheduling);
- `RENDERED`: it changes how messages become tokens, and the ids the router compares come
  from `/tokenize` with that field applied (nodes.prompt_ids), so a change shows there;
- `model`/`cache_salt`/`messages` media parts: recorded in the identity and compared;
- anything else, including fields a later vLLM adds: the turn cannot be verified and is
  recomputed (`unverifiable_input:<field>`), never refused.

The field lists follow vLLM 0.32's `ChatCompletionRequest` and `CompletionRequest`;
docs/router.md ("KV identity") gives each one's reason.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.reuse.transfer import INTERNAL_FIELDS
from kvagent_server.router.store.handle import KVIdentity, MediaItem

#: OpenAI Chat API fields that are not vLLM 0.32 request fields: vLLM drops them.
OPENAI_ONLY = ("store", "service_tier", "prompt_cache_key", "safety_identifier",
               "verbosity", "modalities", "audio", "prediction", "web_search_options",
               "functions", "function_call")

#: Fields that leave the prompt's KV unchanged (both endpoints).
IGNORED = frozenset({
    # sampling and stopping: act on logits after the prompt's KV is computed
    "temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "length_penalty", "logit_bias",
    "allowed_token_ids", "bad_words", "use_beam_search", "watermarking", "max_tokens",
    "max_completion_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "n", "best_of", "structured_outputs", "response_format",
    "thinking_token_budget", "repetition_detection", "vllm_xargs",
    # output shaping: what is returned, not what is computed
    "stream", "stream_options", "stream_interval", "logprobs", "top_logprobs",
    "prompt_logprobs", "logprob_token_ids", "echo", "skip_special_tokens",
    "spaces_between_special_tokens", "include_reasoning", "parallel_tool_calls",
    "tool_choice", "return_token_ids", "return_tokens_as_token_ids",
    "return_token_offsets", "return_prompt_text", "routed_experts_prompt_start",
    "mm_payload", "return_mm_kwargs",
    # bookkeeping and scheduling
    "user", "metadata", "request_id", "session_id", "priority",
    *OPENAI_ONLY,
    # truncation side only acts together with truncate_prompt_tokens (unverifiable)
    "truncation_side",
    # set by the router itself (client values are stripped before this point)
    *INTERNAL_FIELDS,
})

#: Chat fields that shape the rendered prompt: the compared ids are `/tokenize`d with them.
RENDERED_CHAT = frozenset({"messages", "tools", "chat_template", "chat_template_kwargs",
                           "add_generation_prompt", "continue_final_message",
                           "add_special_tokens", "documents", "reasoning_effort"})
#: Completion fields that shape the prompt's tokens (ids given directly are compared as is).
RENDERED_COMPLETION = frozenset({"prompt", "add_special_tokens"})
#: Recorded in the identity and compared between turns.
IDENTITY_FIELDS = frozenset({"model", "cache_salt"})

#: Content part types whose text is part of the rendered tokens; every other part type
#: (image_url, input_audio, file, video_url...) is a media item.
_TEXT_PARTS = frozenset({"text", "refusal"})


class IdentityCheck(BaseModel):
    """Whether a handle's KV may serve a prompt, and up to where."""

    model_config = ConfigDict(frozen=True)

    #: None: the identities agree; otherwise a `planner.Reason` value.
    reason: str | None = None
    detail: str | None = None
    #: Reuse at most this many tokens (the first differing media item); None: no cap.
    cap: int | None = Field(default=None, ge=0)


def unverifiable_fields(body: Mapping[str, Any], *, chat: bool,
                        extra: Collection[str] = ()) -> tuple[str, ...]:
    """Fields present (not None) that may change KV beyond what the router compares.

    `extra` moves fields from `IGNORED` to unverifiable (a deployment whose renderer
    reads, say, `response_format`)."""
    rendered = RENDERED_CHAT if chat else RENDERED_COMPLETION
    return tuple(sorted(
        name for name, value in body.items()
        if value is not None and (name in extra or (
            name not in IGNORED and name not in rendered and name not in IDENTITY_FIELDS))))


def _digest(part: Any) -> str:
    canonical = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _inline(part: dict[str, Any]) -> bool:
    """The part carries its content (a `data:` URL, base64 audio, file bytes)."""
    kind = part.get("type")
    payload = part.get(kind) if isinstance(kind, str) else None
    if isinstance(payload, str):
        return payload.startswith("data:")
    if not isinstance(payload, dict):
        return False
    if "url" in payload:
        return isinstance(payload["url"], str) and payload["url"].startswith("data:")
    if kind == "input_audio":
        return isinstance(payload.get("data"), str)
    if kind == "file":
        return isinstance(payload.get("file_data"), str) and "file_id" not in payload
    return False


def media_parts(body: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every non-text content part of a chat body, in prompt order, with its path."""
    out: list[tuple[str, dict[str, Any]]] = []
    messages = body.get("messages")
    if not isinstance(messages, list):
        return out
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") not in _TEXT_PARTS:
                out.append((f"messages[{i}].content[{j}]", part))
    return out


def placeholder_starts(prompt_ids: Sequence[int],
                       placeholder_ids: Collection[int]) -> list[int]:
    """Start of every maximal run of placeholder tokens in `prompt_ids`."""
    if not placeholder_ids:
        return []
    ph = set(placeholder_ids)
    return [i for i, t in enumerate(prompt_ids)
            if t in ph and (i == 0 or prompt_ids[i - 1] not in ph)]


def history_digest(body: Mapping[str, Any], upto: int) -> str | None:
    """SHA-256 of what renders a chat body's first `upto` messages: those messages and
    every other rendered field (tools, the template and its arguments). None when the
    body has fewer messages.

    Two bodies with equal digests render their first `upto` messages from the same
    inputs, so (for a template that renders a conversation front to back) the later
    prompt starts with the earlier one."""
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) < upto:
        return None
    render = {k: body[k] for k in sorted(RENDERED_CHAT - {"messages"})
              if body.get(k) is not None}
    return _digest({"render": render, "messages": messages[:upto]})


def extension_chars(held: KVIdentity, body: Mapping[str, Any]) -> int | None:
    """Bytes of JSON a chat body adds to the held prompt's messages, when it repeats them
    exactly, under the same rendering inputs, and adds at least one; else None."""
    messages = body.get("messages")
    if (held.history is None or not isinstance(messages, list)
            or len(messages) <= held.messages
            or history_digest(body, held.messages) != held.history):
        return None
    return message_chars(messages[held.messages:])


def continues(held: KVIdentity | None, body: Mapping[str, Any]) -> bool | None:
    """Whether a chat body continues the conversation of a held turn: it repeats the held
    prompt's messages under the same rendering inputs (True), or provably not (False: a
    turn chained onto an earlier response than the session's latest, another history
    under a shared session id). None when the held turn recorded no digest to tell."""
    if held is None or held.history is None or not isinstance(body.get("messages"), list):
        return None
    return history_digest(body, held.messages) == held.history


def message_chars(messages: Any) -> int:
    """The size of `messages` as compact UTF-8 JSON (what tokens-per-byte ratios use)."""
    return len(json.dumps(messages, separators=(",", ":"), ensure_ascii=False).encode())


def identity_of(body: Mapping[str, Any], *, chat: bool, prompt_ids: Sequence[int] = (),
                placeholder_ids: Collection[int] = (),
                extra_unverifiable: Collection[str] = (),
                history: bool = False) -> KVIdentity:
    """The identity of the prompt `body` describes (`prompt_ids`: its tokenized ids;
    placeholder positions as `with_positions` finds them; `history`: record the digest
    of its messages, for a handle)."""
    parts = media_parts(body) if chat else []
    media = tuple(MediaItem(where=where, digest=_digest(part), inline=_inline(part))
                  for where, part in parts)
    messages = body.get("messages") if chat else None
    model = body.get("model")
    salt = body.get("cache_salt")
    ident = KVIdentity(model=model if isinstance(model, str) else None,
                       cache_salt=salt if isinstance(salt, str) else None, media=media,
                       messages=len(messages) if isinstance(messages, list) else 0,
                       unverifiable=unverifiable_fields(body, chat=chat,
                                                        extra=extra_unverifiable),
                       history=(history_digest(body, len(messages))
                                if history and isinstance(messages, list) else None))
    return with_positions(ident, prompt_ids, placeholder_ids)


def with_positions(ident: KVIdentity, prompt_ids: Sequence[int],
                   placeholder_ids: Collection[int]) -> KVIdentity:
    """`ident` with each media item's placeholder start found in `prompt_ids`.

    Known only when `placeholder_ids` (the model's image/audio placeholder token ids)
    split the prompt into exactly one run per item: two adjacent items' runs merge, and
    then no position is trusted."""
    if not ident.media:
        return ident
    starts = placeholder_starts(prompt_ids, placeholder_ids)
    known = len(starts) == len(ident.media)
    media = tuple(m.model_copy(update={"placeholder": starts[k] if known else None})
                  for k, m in enumerate(ident.media))
    return ident.model_copy(update={"media": media})


def _message_index(where: str) -> int:
    return int(where.split("]", 1)[0].removeprefix("messages["))


def check(held: KVIdentity | None, new: KVIdentity, *,
          trust_urls: bool = False) -> IdentityCheck:
    """May KV made under `held` serve a prompt of identity `new`, and up to which token?

    Order: fields that cannot be verified (on either turn), then model and salt (the
    whole KV differs), then media: reuse stops where the first differing item's
    placeholder starts, or at an item whose content the router cannot see (a URL, unless
    `trust_urls`); with that position unknown, nothing is reused. Items in messages
    after the held prompt and its reply are new content, not a difference."""
    if new.unverifiable:
        return IdentityCheck(reason="unverifiable_input", detail=new.unverifiable[0], cap=0)
    if held is None:
        return IdentityCheck(reason="identity_changed", detail="unrecorded", cap=0)
    if held.unverifiable:
        return IdentityCheck(reason="unverifiable_input", detail=held.unverifiable[0], cap=0)
    if held.model != new.model:
        return IdentityCheck(reason="identity_changed", detail="model", cap=0)
    if held.cache_salt != new.cache_salt:
        return IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    for k in range(max(len(held.media), len(new.media))):
        a = held.media[k] if k < len(held.media) else None
        b = new.media[k] if k < len(new.media) else None
        if a is None and b is not None and _message_index(b.where) > held.messages:
            break  # this and every later item come after everything the held KV covers
        same = (a is not None and b is not None and a.where == b.where
                and a.digest == b.digest)
        if same and a is not None and (a.inline or trust_urls):
            continue
        starts = [m.placeholder for m in (a, b) if m is not None]
        cap = 0 if any(s is None for s in starts) else min(s for s in starts if s is not None)
        if same:  # equal URL strings: the bytes behind them may differ
            return IdentityCheck(reason="unverifiable_input", detail="media_url", cap=cap)
        return IdentityCheck(reason="multimodal_changed", detail=f"item_{k}", cap=cap)
    return IdentityCheck()
