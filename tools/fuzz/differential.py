"""Differential fuzz of reuse on a real bundle: every answer with reuse ≡ the same prompt
recomputed from nothing.

A case is a list of operations on one agent conversation (Hypothesis draws them): user
turns, tool calls whose arguments are re-serialized before they go back into the history,
edits and deletions of earlier messages, stripped assistant text (what a template that
drops reasoning from history does), `truncate_prompt_tokens`, identical retries with one
token, forks of one session, and two turns racing for one handle with one token each; on a
vision-language model, user turns with images and images swapped in earlier messages; on a
bundle serving LoRA adapters, switches of the served model mid-session.
Every turn goes through the router (greedy, `return_token_ids`); its reference is the
same body sent to the prefill node directly under a fresh random `cache_salt`, which must
report 0 cached tokens. A turn is a mismatch when its output token ids differ from the
reference's, and a bound violation when it reused more tokens than the verified common
prefix of its prompt with the turn whose token it carried (prompt + output token ids),
cut at the first image placeholder whose image differs, and 0 when the served model
(adapter) differs: the token ids cannot see an image or an adapter, so the fuzz checks
what the router's KV identity must enforce.

Used by `tests/e2e/test_fuzz_vllm.py` (a seeded, bounded slice) and `run.py` (the long run).
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

from benchmarks.multiturn.prefix import common_prefix

#: How many tokens one turn generates. The fuzz is about prompts, but a random-weight
#: model's first tokens barely depend on its context: wrong KV shows in the answer only
#: after some tokens (the negative control found no mismatch at 8 in one run, 3 of 3 at 32).
MAX_TOKENS = 32
#: A long answer: over two CPU blocks (128 tokens) of KV only D has.
LONG_TOKENS = 300
USER_TEXTS = (
    "Checkout latency has been high since 10:00. Start with the API logs.",
    "What do the database metrics say about the last hour?",
    "Is the cache evicting more than usual? Check it.",
    "Summarise the incident for the status page.",
    "Thanks, go on.",
    "Ok.",
)
EDIT_TEXTS = ("Payments fail since 09:00. Check the queue.", "Ignore that; look at DNS.")
#: A tool result long enough (~150 tokens) that the turn after it is not a small delta:
#: it runs P (`pd_reuse`, a pull from D) rather than `d_direct`.
TOOL_RESULT = " ".join(f"[{10 + i}:0{i % 6}] svc=checkout p99={700 + 13 * i}ms err={i % 4}"
                       for i in range(12))
#: How a tool call's arguments are written back into the history.
SERIALIZATIONS = ("as_sent", "compact", "spaced_sorted")

OPS = st.one_of(
    st.tuples(st.just("user"), st.sampled_from(USER_TEXTS)),
    st.tuples(st.just("tool"), st.sampled_from(SERIALIZATIONS)),
    st.tuples(st.just("edit"), st.integers(0, 8), st.sampled_from(EDIT_TEXTS)),
    st.tuples(st.just("delete"), st.integers(0, 8)),
    st.tuples(st.just("strip"), st.integers(0, 8)),
    st.tuples(st.just("truncate"), st.integers(16, 200)),
    st.tuples(st.just("retry")),
    st.tuples(st.just("fork"), st.sampled_from(USER_TEXTS)),
    st.tuples(st.just("race")),
    st.tuples(st.just("long")),
)
#: Operations a bundle must offer: images (a vision-language model) and other served
#: models (LoRA adapters). An index picks one of `Target.images` / `Target.models`.
IMAGE_OPS = st.one_of(
    st.tuples(st.just("image"), st.integers(0, 3), st.sampled_from(USER_TEXTS)),
    st.tuples(st.just("swap"), st.integers(0, 8), st.integers(0, 3)),
)
ADAPTER_OPS = st.tuples(st.just("adapter"), st.integers(0, 3))


def cases(*, images: bool = False, adapters: bool = False
          ) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Cases of 1-5 operations; image and adapter operations only where asked for."""
    ops = [OPS, *([IMAGE_OPS] * images), *([ADAPTER_OPS] * adapters)]
    return st.lists(st.one_of(*ops), min_size=1, max_size=5)


CASES = cases()


@dataclass
class Stats:
    """What a run found. `mismatches` and `bound_violations` must stay 0."""

    cases: int = 0
    turns: int = 0
    mismatches: int = 0
    bound_violations: int = 0
    reused_turns: int = 0
    pd_reuse_turns: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        for name in ("cases", "turns", "mismatches", "bound_violations", "reused_turns",
                     "pd_reuse_turns", "reused_tokens", "prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures.extend(other.failures)

    def as_dict(self) -> dict[str, Any]:
        share = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"cases": self.cases, "turns": self.turns, "mismatches": self.mismatches,
                "bound_violations": self.bound_violations, "reused_turns": self.reused_turns,
                "pd_reuse_turns": self.pd_reuse_turns, "reused_tokens": self.reused_tokens,
                "prompt_tokens": self.prompt_tokens, "reuse_share": round(share, 4),
                "failures": self.failures[:20]}


@dataclass
class Target:
    """Where to send: the router (with an API key) and a prefill node for references."""

    router_v1: str
    prefill_url: str
    model: str
    api_key: str | None
    tools: list[dict[str, Any]]
    system: str
    #: Negative control: ask the router (test hook) to hand P shifted blocks.
    shift_blocks: bool = False
    timeout: float = 600.0
    #: Image URLs (data URLs) the image operations attach; empty: no image operations.
    images: tuple[str, ...] = ()
    #: The model's image placeholder token ids (one run of them per image in a prompt).
    image_token_ids: tuple[int, ...] = ()
    #: Other served names (LoRA adapters) the adapter operation switches to.
    models: tuple[str, ...] = ()

    @classmethod
    def demo(cls, router_v1: str, prefill_url: str, model: str, api_key: str | None,
             **options: Any) -> Target:
        """A target with the demo's tools and system prompt (the conversations it draws
        are the demo agent's)."""
        from kvagent.tools import as_tools
        from kvagent_server.demo.agent import TOOLS, system_prompt

        return cls(router_v1=router_v1, prefill_url=prefill_url, model=model,
                   api_key=api_key, tools=[t.to_wire() for t in as_tools(TOOLS).values()],
                   system=system_prompt(handbook_sentences=8), **options)


@dataclass
class Sent:
    """One routed turn: what came back and what its token covers."""

    message: dict[str, Any]
    token: str | None
    held_ids: list[int]  # prompt + output token ids: the KV its token names
    model: str  # the served name (adapter) the KV was computed with
    images: list[str]  # its prompt's image URLs, in order


class Conversation:
    """One session's history and the last token, driven by `Runner`."""

    def __init__(self, system: str, model: str, session_id: str | None = None) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.model = model
        self.session_id = session_id or f"fuzz-{uuid.uuid4().hex}"
        self.last: Sent | None = None

    def fork(self) -> Conversation:
        other = Conversation("", self.model, self.session_id)
        other.messages = copy.deepcopy(self.messages)
        other.last = self.last
        return other


class Runner:
    """Sends turns, references and checks; counts into `stats`."""

    def __init__(self, target: Target, client: httpx.Client) -> None:
        self.t = target
        self.client = client
        self.stats = Stats()

    # ------------------------------------------------------------------ requests

    def _body(self, model: str, messages: list[dict[str, Any]], extra: dict[str, Any]
              ) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "tools": self.t.tools,
                "temperature": 0.0, "max_tokens": MAX_TOKENS, "tool_choice": "none",
                "return_token_ids": True}
        body.update(extra)
        return body

    def _route(self, conv: Conversation, messages: list[dict[str, Any]],
               extra: dict[str, Any], token: str | None) -> dict[str, Any]:
        headers = {"X-Session-ID": conv.session_id}
        if self.t.api_key:
            headers["Authorization"] = f"Bearer {self.t.api_key}"
        if token:
            headers["X-KVAgent-Cache-Token"] = token
        if self.t.shift_blocks:
            headers["X-Kvagent-Test-Shift-Blocks"] = "1"
        r = self.client.post(f"{self.t.router_v1}/chat/completions", headers=headers,
                             json=self._body(conv.model, messages, extra),
                             timeout=self.t.timeout)
        _raise_for_status(r)
        return r.json()

    def _reference(self, model: str, messages: list[dict[str, Any]], extra: dict[str, Any]
                   ) -> dict[str, Any]:
        body = self._body(model, messages, {**extra, "cache_salt": uuid.uuid4().hex})
        r = self.client.post(f"{self.t.prefill_url}/v1/chat/completions", json=body,
                             timeout=self.t.timeout)
        _raise_for_status(r)
        out = r.json()
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") or 0
        if cached:
            raise AssertionError(f"reference hit {cached} cached tokens under a fresh salt")
        return out

    # ------------------------------------------------------------------ one turn

    def turn(self, conv: Conversation, user: str | list[dict[str, Any]] | None,
             extra: dict[str, Any] | None = None, *, commit: bool = True,
             token: str | None = None, use_last: bool = True) -> dict[str, Any]:
        """Send the history (+ `user`: text or content parts), check it against its
        reference, commit the answer."""
        extra = extra or {}
        messages = copy.deepcopy(conv.messages)
        if user is not None:
            messages.append({"role": "user", "content": user})
        held = conv.last if use_last else None
        sent_token = token if token is not None else (held.token if held else None)
        # The reference first: a request vLLM rejects fails here with vLLM's own message
        # (the router passes on only messages known to name nothing internal).
        ref = self._reference(conv.model, messages, extra)
        out = self._route(conv, messages, extra, sent_token)
        images = image_urls(messages)
        self.check(out, ref, held if sent_token else None, extra, conv.model, images)
        message = _assistant(out)
        if commit:
            conv.messages = [*messages, message]
            conv.last = Sent(message=message, token=(out.get("kvagent") or {}).get(
                "cache_token"), held_ids=_held_ids(out), model=conv.model, images=images)
        return out

    def bound(self, prompt_ids: list[int], held: Sent, model: str, images: list[str]
              ) -> int:
        """The most tokens a turn may reuse from `held`: their common token prefix, cut at
        the first image that differs (its placeholder tokens are the same for any image),
        and 0 on another served model (adapter)."""
        if model != held.model:
            return 0
        bound = common_prefix(prompt_ids, held.held_ids)
        differs = next((i for i, (a, b) in enumerate(zip(images, held.images)) if a != b),
                       None)
        if differs is not None:
            starts = placeholder_starts(prompt_ids, self.t.image_token_ids)
            if differs < len(starts):
                bound = min(bound, starts[differs])
        return bound

    def check(self, out: dict[str, Any], ref: dict[str, Any], held: Sent | None,
              extra: dict[str, Any], model: str, images: list[str]) -> None:
        s = self.stats
        s.turns += 1
        kv = out.get("kvagent") or {}
        reused = int(kv.get("reused_tokens") or 0)
        prompt_ids = out.get("prompt_token_ids") or []
        s.prompt_tokens += len(prompt_ids)
        s.reused_tokens += reused
        s.reused_turns += bool(reused)
        s.pd_reuse_turns += kv.get("path") == "pd_reuse" and reused > 0
        got, want = _output_ids(out), _output_ids(ref)
        if got != want:
            s.mismatches += 1
            s.failures.append(f"mismatch path={kv.get('path')} reused={reused} "
                              f"reason={kv.get('reason')} extra={sorted(extra)}")
        bound = self.bound(prompt_ids, held, model, images) if held is not None else 0
        if reused > bound or (reused and reused >= len(prompt_ids)):
            s.bound_violations += 1
            s.failures.append(f"reused {reused} > verified prefix {bound} "
                              f"(prompt {len(prompt_ids)}, path={kv.get('path')})")

    # ------------------------------------------------------------------ operations

    def run_case(self, ops: list[tuple[Any, ...]]) -> None:
        """A conversation that opens with a tool call, then `ops`."""
        conv = Conversation(self.t.system, self.t.model)
        self.tool_turn(conv, "as_sent", USER_TEXTS[0])
        for op in ops:
            getattr(self, f"op_{op[0]}")(conv, *op[1:])
        self.stats.cases += 1

    def tool_turn(self, conv: Conversation, how: str, user: str | None = None) -> None:
        out = self.turn(conv, user, {"tool_choice": "required",
                                     "parallel_tool_calls": False, "max_tokens": 48})
        message = conv.messages[-1]
        calls = message.get("tool_calls") or []
        for call in calls:
            fn = call["function"]
            fn["arguments"] = reserialize(fn["arguments"], how)
            conv.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": f"{fn['name']}: {TOOL_RESULT}"})
        if not calls:  # the model answered in text after all: still a valid history
            del out

    def op_user(self, conv: Conversation, text: str) -> None:
        self.turn(conv, text)

    def op_long(self, conv: Conversation) -> None:
        """A long answer: D then holds blocks of generated tokens P never computed, so a
        later `pd_reuse` turn must pull them over NIXL."""
        self.turn(conv, "Explain in detail.", {"max_tokens": LONG_TOKENS})

    def op_tool(self, conv: Conversation, how: str) -> None:
        if conv.messages[-1]["role"] == "tool":
            self.turn(conv, None)  # answer the tool results first
        self.tool_turn(conv, how, USER_TEXTS[1])
        # Answer the results; if the model answered in text after all, a user turn (a
        # history may not end in an assistant message: Mistral's format rejects it).
        self.turn(conv, None if conv.messages[-1]["role"] == "tool" else "Go on.")

    def _pick(self, conv: Conversation, role: str, i: int) -> int | None:
        idx = [k for k, m in enumerate(conv.messages) if m["role"] == role
               and not m.get("tool_calls")]
        return idx[i % len(idx)] if idx else None

    def op_edit(self, conv: Conversation, i: int, text: str) -> None:
        k = self._pick(conv, "user", i)
        if k is not None:
            conv.messages[k] = {"role": "user", "content": text}
        self.turn(conv, "And now?")

    def op_delete(self, conv: Conversation, i: int) -> None:
        k = self._pick(conv, "user", i)
        if k is not None and k + 1 < len(conv.messages) and conv.messages[k + 1][
                "role"] == "assistant" and not conv.messages[k + 1].get("tool_calls"):
            del conv.messages[k:k + 2]
        self.turn(conv, "Continue.")

    def op_strip(self, conv: Conversation, i: int) -> None:
        k = self._pick(conv, "assistant", i)
        if k is not None:
            text = conv.messages[k].get("content") or ""
            # Half of it, never nothing: an empty assistant message is invalid in some
            # formats (Mistral's), and "nothing" is not what a reasoning strip leaves.
            conv.messages[k] = {**conv.messages[k], "content": text[: max(1, len(text) // 2)]}
        self.turn(conv, "Go on.")

    def op_truncate(self, conv: Conversation, keep: int) -> None:
        # vLLM rejects a truncation that would cut an image (placeholders expand after it):
        # with images in the history, a plain turn.
        extra = {} if image_urls(conv.messages) else {"truncate_prompt_tokens": keep + 64}
        self.turn(conv, "Short version?", extra)

    def op_retry(self, conv: Conversation) -> None:
        """The same turn twice with the same token: the second finds it claimed."""
        held = conv.last
        self.turn(conv, "Retry check.", commit=False)
        self.turn(conv, "Retry check.", token=held.token if held else None)

    def op_fork(self, conv: Conversation, text: str) -> None:
        other = conv.fork()
        self.turn(other, text)
        self.turn(conv, "Other branch.")

    def op_image(self, conv: Conversation, k: int, text: str) -> None:
        """A user turn with an image (then its text)."""
        if not self.t.images:
            raise ValueError("the image operations need Target.images")
        url = self.t.images[k % len(self.t.images)]
        self.turn(conv, [{"type": "image_url", "image_url": {"url": url}},
                         {"type": "text", "text": text}])

    def op_swap(self, conv: Conversation, i: int, k: int) -> None:
        """Another image in an earlier user message (same placeholder tokens, other KV)."""
        if not self.t.images:
            raise ValueError("the image operations need Target.images")
        parts = [p for m in conv.messages if m["role"] == "user"
                 and isinstance(m["content"], list) for p in m["content"]
                 if p.get("type") == "image_url"]
        if parts and len(self.t.images) > 1:
            part = parts[i % len(parts)]
            others = [u for u in self.t.images if u != part["image_url"]["url"]]
            part["image_url"] = {"url": others[k % len(others)]}
        self.turn(conv, "And now?")

    def op_adapter(self, conv: Conversation, k: int) -> None:
        """Switch the served model (base or a LoRA adapter) for the rest of the case."""
        if not self.t.models:
            raise ValueError("the adapter operation needs Target.models")
        served = (self.t.model, *self.t.models)
        conv.model = served[k % len(served)]
        self.turn(conv, "Go on.")

    def op_race(self, conv: Conversation) -> None:
        """Two one-token turns of one session carrying one token, at once."""
        a, b = conv.fork(), conv.fork()
        errors: list[BaseException] = []

        def go(c: Conversation) -> None:
            try:
                self.turn(c, "Quick?", {"max_tokens": 1})
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(c,)) for c in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        conv.messages, conv.last = a.messages, a.last


def reserialize(arguments: str, how: str) -> str:
    """Tool-call arguments as a client might write them back (the KV of the original
    text then no longer matches from the first changed character)."""
    if how == "as_sent":
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if how == "compact":
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value, indent=1, sort_keys=True)


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The prompt's image URLs in order: its multimodal items as the router sees them."""
    return [p["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image_url"]


def placeholder_starts(ids: list[int], token_ids: tuple[int, ...]) -> list[int]:
    """Where each run of image placeholder tokens starts (one run per image)."""
    return [i for i, t in enumerate(ids) if t in token_ids
            and (i == 0 or ids[i - 1] not in token_ids)]


def _raise_for_status(r: httpx.Response) -> None:
    """Like `raise_for_status`, with the server's error body in the message."""
    if r.is_error:
        raise httpx.HTTPStatusError(f"{r.status_code} from {r.request.url}: {r.text[:500]}",
                                    request=r.request, response=r)


#: What the history keeps of an answer with no text and no tool call (a model may stop at
#: once): formats like Mistral's reject an empty assistant message.
EMPTY_ANSWER = "(no answer)"


def _assistant(out: dict[str, Any]) -> dict[str, Any]:
    """The answer as the history keeps it: text or tool calls (formats like Mistral's
    reject an assistant message with both, or with neither)."""
    msg = out["choices"][0]["message"]
    keep: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or EMPTY_ANSWER}
    if msg.get("tool_calls"):
        keep["content"] = None
        keep["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["function"]["name"],
                                            "arguments": c["function"]["arguments"]}}
                              for c in msg["tool_calls"]]
    return keep


def _output_ids(out: dict[str, Any]) -> list[int]:
    choice = out["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:  # no ids: compare what greedy decoding produced as text
        return [hash(json.dumps(_assistant(out), sort_keys=True))]
    return list(ids)


def _held_ids(out: dict[str, Any]) -> list[int]:
    return list(out.get("prompt_token_ids") or []) + list(out["choices"][0].get(
        "token_ids") or [])
