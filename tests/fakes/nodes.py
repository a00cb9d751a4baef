"""Fake vLLM prefill (P) and decode (D) nodes: the router's test seam.

Each fake is a starlette app that speaks the slice of vLLM's HTTP surface the router uses:
`/v1/chat/completions`, `/v1/completions` (streamed like vLLM, with the usage chunk and,
when `return_token_ids` is set, `prompt_token_ids` in the first chunk and per-choice
`token_ids`), `/tokenize`, `/health`, `/v1/models` and `/metrics`.

The nodes share a `FakeCluster` that plays NIXL: P's blocks leased for a D, D's retained
blocks after a turn, with vLLM's exact `kv_transfer_params` field set. A pull checks that
the pulled KV really belongs to the new prompt's tokens and records a `wrong_kv` event
when it does not (vLLM #43094), so a router that skips prefix verification fails tests.

Tokenizer: special tokens are single ids, other characters are `1000 + ord(ch)`; the chat
template renders an assistant message exactly as generation produced it (content + EOS),
so a conversation's next prompt extends the previous turn's tokens, as with a real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvagent_server.common.ports import free_port
from kvagent_server.router.reuse.transfer import (
    EXPECT_KEY,
    FIRST_TOKEN_KEY,
    RETAIN_KEY,
    VERIFIED_KEY,
)
from kvagent_server.vllm_plugin.pull_check import check_offer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

SPECIALS = {"<|user|>": 1, "<|assistant|>": 2, "<|system|>": 3, "<|tool|>": 4,
            "<|end|>": 5, "<|tools|>": 6, "<|developer|>": 7, "<|media|>": 8}
#: A media part (image, audio, file) renders as this many `<|media|>` placeholders
#: whatever its content, like a real model's fixed-size image placeholder.
MEDIA = SPECIALS["<|media|>"]
MEDIA_TOKENS = 16
EOS = SPECIALS["<|end|>"]
MAX_MODEL_LEN = 32768

#: The exact key set vLLM's NixlConnector puts in `kv_transfer_params` (0.32).
KV_PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id",
                 "remote_request_id", "remote_host", "remote_port", "remote_block_ids",
                 "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                 "remote_blocks_expiry_time", "transfer_mode")


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Binary search on slice equality: C-speed comparisons, fast enough for benchmarks."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def encode_text(text: str) -> list[int]:
    return [1000 + ord(ch) for ch in text]


def decode_ids(ids: list[int]) -> str:
    rev = {v: k for k, v in SPECIALS.items()}
    return "".join(rev.get(i, chr(i - 1000) if i >= 1000 else "?") for i in ids)


def _content_ids(content: Any) -> list[int]:
    if content is None:
        return []
    if isinstance(content, str):
        return encode_text(content)
    out: list[int] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") in ("text", "refusal"):
            out += encode_text(p.get("text", "") or p.get("refusal", ""))
        elif isinstance(p, dict):
            out += [MEDIA] * MEDIA_TOKENS
    return out


def tool_calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """How the fake template renders (and the fake model generates) tool calls."""
    return json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                       for c in tool_calls], separators=(",", ":"))


def render_chat(messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
                add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The fake chat template, straight to token ids. A custom template and template
    arguments render as a header, so changing them changes the ids (as with a real one)."""
    out: list[int] = []
    if chat_template is not None:
        out += [SPECIALS["<|system|>"], *encode_text(chat_template), EOS]
    if chat_template_kwargs:
        out += [SPECIALS["<|system|>"],
                *encode_text(json.dumps(chat_template_kwargs, sort_keys=True)), EOS]
    if tools:
        out += [SPECIALS["<|tools|>"], *encode_text(json.dumps(tools, sort_keys=True)), EOS]
    for i, m in enumerate(messages):
        role = m.get("role", "user")
        out.append(SPECIALS.get(f"<|{role}|>", SPECIALS["<|user|>"]))
        out += _content_ids(m.get("content"))
        if m.get("tool_calls"):
            out += encode_text(tool_calls_text(m["tool_calls"]))
        if not (continue_final_message and i == len(messages) - 1):
            out.append(EOS)
    if add_generation_prompt and not continue_final_message:
        out.append(SPECIALS["<|assistant|>"])
    return out


def _template_args(body: dict[str, Any]) -> dict[str, Any]:
    return {"tools": body.get("tools"),
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "chat_template": body.get("chat_template"),
            "chat_template_kwargs": body.get("chat_template_kwargs")}


def _forwarded_prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """vLLM's decode-side reuse: `kv_transfer_params.prompt_token_ids` (popped) replace
    the rendered chat, except with `echo` or non-text content, where vLLM renders."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or "prompt_token_ids" not in params:
        return None
    ids = params.pop("prompt_token_ids")
    media = any(isinstance(m, dict) and isinstance(m.get("content"), list)
                and any(isinstance(p, dict) and p.get("type") != "text" for p in m["content"])
                for m in body.get("messages") or [])
    if body.get("echo") or media:
        return None
    return list(ids)


def render_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return encode_text(str(prompt))


@dataclass
class Reply:
    """What the fake model answers: text, or tool calls."""

    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None

    def generated_ids(self) -> list[int]:
        text = tool_calls_text(self.tool_calls) if self.tool_calls else self.content
        return [*encode_text(text), EOS]


def default_reply(prompt_ids: list[int]) -> Reply:
    # Long enough that D holds well over `kv_recompute_threshold` tokens P has not seen.
    return Reply(content=f"answer after {len(prompt_ids)} tokens: " + "lorem ipsum " * 12)


@dataclass
class Retained:
    """KV blocks a node holds for someone else to pull (a P lease or D's retained turn)."""

    engine_id: str
    request_id: str
    tokens: list[int]
    num_tokens: int
    expiry: float
    consumed_by: str | None = None


@dataclass
class Event:
    kind: str  # pull | decline | wrong_kv | failed_pull | abort | prefix_hit | release
    node: str
    detail: dict[str, Any] = field(default_factory=dict)


class FakeCluster:
    """Shared NIXL state of all fake nodes, and the knobs tests turn."""

    def __init__(self, *, block_size: int = 16, recompute_threshold: int = 64,
                 decode_ttl_s: float = 480.0, lease_s: float = 30.0,
                 reply: Callable[[list[int]], Reply] = default_reply,
                 kv_params_chunk: str = "usage", chunk_chars: int = 4,
                 token_delay_s: float = 0.0, prefill_delay_s: float = 0.0,
                 prefix_cache: bool = True, kv_blocks: int = 1_000_000,
                 pull_check: bool = True) -> None:
        self.block_size = block_size
        #: P checks an offer's block digests against its prompt first, as the kvagent
        #: plugin does (`vllm_plugin.pull_check`, the same function); off: a P without it.
        self.pull_check = pull_check
        self.recompute_threshold = recompute_threshold
        self.decode_ttl_s = decode_ttl_s
        self.lease_s = lease_s
        self.reply = reply
        self.kv_params_chunk = kv_params_chunk  # "usage" or "finish"
        self.chunk_chars = chunk_chars
        self.token_delay_s = token_delay_s
        self.prefill_delay_s = prefill_delay_s
        self.prefix_cache = prefix_cache  # off: an "instant" backend for benchmarks
        self.kv_blocks = kv_blocks  # each node's KV capacity, for kv_cache_usage_perc
        self.retained: dict[tuple[str, str], Retained] = {}
        self.events: list[Event] = []
        self._ids = itertools.count(1)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def open_leases(self) -> list[Retained]:
        """P blocks leased for a D that never came (what hangs a real P: docs/engine.md)."""
        return [r for r in self.retained.values()
                if r.engine_id.startswith("engine-p") and r.consumed_by is None]

    def events_of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def pull(self, puller: str, params: dict[str, Any], prompt: list[int],
             *, locally_cached: int = 0) -> int:
        """Emulate NIXL's read of remote blocks; returns the tokens pulled (0: declined)."""
        key = (params.get("remote_engine_id", ""), params.get("remote_request_id", ""))
        held = self.retained.get(key)
        if held is None or held.consumed_by is not None or held.expiry < time.monotonic():
            self.events.append(Event("failed_pull", puller, {"key": key}))
            return -1
        # D (do_remote_prefill) pulls the whole prompt from P; P (do_remote_decode) pulls
        # min(remote_num_tokens, prompt) from D, like vLLM's pull scheduler.
        if params.get("do_remote_prefill"):
            n = len(prompt)
        else:
            n = min(int(params.get("remote_num_tokens") or 0), len(prompt))
        count = n - locally_cached
        blocks = params.get("remote_block_ids") or [[]]
        held.consumed_by = puller  # a read, or a decline, frees the holder's blocks
        if count < self.recompute_threshold and puller.startswith("engine-p"):
            self.events.append(Event("decline", puller, {"count": count}))
            return 0
        if not params.get("do_remote_prefill") and (
                n % self.block_size or len(blocks[0]) != n // self.block_size):
            # vLLM end-trims the remote list to the blocks it lacks: any other list length
            # pairs P's positions with the wrong remote blocks.
            self.events.append(Event("wrong_kv", puller, {"reason": "block list mismatch"}))
        if held.tokens[:n] != prompt[:n]:
            self.events.append(Event("wrong_kv", puller, {"n": n}))
        self.events.append(Event("pull", puller, {"tokens": n, "from": key[0]}))
        return max(n, 0)


class FakeNode:
    """One fake vLLM node. `role` is "prefill" or "decode" (both serve every route)."""

    def __init__(self, cluster: FakeCluster, role: str, index: int = 0, *,
                 model: str = "fake-model") -> None:
        self.cluster = cluster
        self.role = role
        self.model = model
        self.engine_id = f"engine-{role[0]}{index}-7f3a9c"
        self.side_host = f"10.66.{index}.{17 if role == 'prefill' else 23}"
        self.side_port = 5600 + index + (0 if role == "prefill" else 50)
        self._internal = [self.engine_id, self.side_host, str(self.side_port)]
        self.healthy = True
        #: Fail the next N completion requests with this status before any byte.
        self.fail_next: list[int] = []
        #: Cut the stream (connection drop) after this many data chunks.
        self.cut_after_chunks: int | None = None
        #: Send an error event (`fail_message`, vLLM's shape) and `[DONE]` after this many
        #: data chunks, as vLLM does when generation fails mid-stream.
        self.error_after_chunks: int | None = None
        #: Hold each completion request this long before any byte of the answer (a node
        #: that takes requests and does not answer).
        self.stall_s = 0.0
        self.echo_errors = False
        self.fail_message = "injected failure"
        self.requests: list[dict[str, Any]] = []
        self.tokenize_requests: list[dict[str, Any]] = []
        #: Chat requests that came with forwarded prompt ids: (those ids, the render).
        self.forwarded_prompts: list[tuple[list[int], list[int]]] = []
        #: D legs that came with P's token (`kvagent_first_token`): (that token, the one
        #: this node samples first for the prompt). The fake answers the same either way.
        self.first_tokens: list[tuple[int, int]] = []
        self.aborted: list[str] = []
        self.in_flight = 0
        self.start_time = time.time()
        self.sequences: deque[list[int]] = deque(maxlen=512)  # local prefix cache (LRU-ish)
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/health", self._health),
            Route("/v1/models", self._models),
            Route("/metrics", self._metrics),
        ])

    def restart(self) -> None:
        """Lose every block this node held (a process restart)."""
        self.start_time += 1
        self.sequences.clear()
        for key in [k for k in self.cluster.retained if k[0] == self.engine_id]:
            del self.cluster.retained[key]

    @property
    def internal_strings(self) -> list[str]:
        """What must never reach a client (the stack adds the node's HTTP port)."""
        return self._internal

    # ------------------------------------------------------------------ routes

    def kv_usage(self) -> float:
        """Blocks this node holds for others (live, unconsumed) over the cluster's
        `kv_blocks`: what `vllm:kv_cache_usage_perc` shows while nothing runs."""
        now = time.monotonic()
        held = sum(-(-r.num_tokens // self.cluster.block_size)
                   for r in self.cluster.retained.values()
                   if r.engine_id == self.engine_id and r.consumed_by is None
                   and r.expiry > now)
        return min(1.0, held / self.cluster.kv_blocks)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm",
             "max_model_len": MAX_MODEL_LEN}]})

    async def _metrics(self, request: Request) -> Response:
        running = self.in_flight
        return PlainTextResponse(
            f"process_start_time_seconds {self.start_time}\n"
            f'vllm:cache_config_info{{block_size="{self.cluster.block_size}",'
            f'cache_dtype="auto",num_gpu_blocks="{self.cluster.kv_blocks}"}} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} {self.kv_usage()}\n'
            f'vllm:num_requests_running{{model_name="{self.model}"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0\n')

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.tokenize_requests.append(body)
        if not self.healthy:
            return JSONResponse({"error": {"message": "down"}}, status_code=503)
        if "messages" in body:
            ids = render_chat(body["messages"], **_template_args(body))
        else:
            ids = render_prompt(body.get("prompt", ""))
        return JSONResponse({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        kwargs = dict(body.get("chat_template_kwargs") or {})
        # vLLM's chat endpoint hands these to the template as arguments; /tokenize does not
        # take them (the router folds them into chat_template_kwargs itself).
        for name in ("documents", "reasoning_effort"):
            if body.get(name) is not None:
                kwargs[name] = body[name]
        if body.get("reasoning_effort") is not None:
            kwargs.setdefault("enable_thinking", body["reasoning_effort"] != "none")
        prompt = render_chat(body.get("messages", []),
                             **_template_args({**body, "chat_template_kwargs": kwargs}))
        forwarded = _forwarded_prompt_ids(body)
        if forwarded is not None:
            self.forwarded_prompts.append((forwarded, prompt))
            prompt = forwarded  # as vLLM: the forwarded ids, not the rendered messages
        given = (body.get("kv_transfer_params") or {}).get(FIRST_TOKEN_KEY)
        if given is not None:
            self.first_tokens.append((given, self.cluster.reply(prompt).generated_ids()[0]))
        return await self._generate(request, body, prompt, chat=True)

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        return await self._generate(request, body, render_prompt(body.get("prompt")), chat=False)

    # ------------------------------------------------------------------ engine

    def _error(self, status: int, message: str) -> Response:
        return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                       "code": status}}, status_code=status)

    def _local_prefix_hit(self, prompt: list[int]) -> int:
        if not self.cluster.prefix_cache:
            return 0
        bs = self.cluster.block_size
        best = max((_common_prefix(seq, prompt) for seq in self.sequences), default=0)
        return min(best // bs * bs, (len(prompt) - 1) // bs * bs)

    def _kv_params(self, request_id: str, num_tokens: int, *, is_p: bool,
                   expiry: float | None, nblocks: int | None = None) -> dict[str, Any]:
        if nblocks is None:
            nblocks = -(-num_tokens // self.cluster.block_size)
        base = 3000 if is_p else 7000
        return {
            "do_remote_prefill": is_p, "do_remote_decode": not is_p,
            "remote_engine_id": self.engine_id, "remote_request_id": request_id,
            "remote_host": self.side_host, "remote_port": self.side_port,
            "remote_block_ids": [list(range(base, base + nblocks))],
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": expiry, "transfer_mode": "pull",
        }

    async def _generate(self, request: Request, body: dict[str, Any], prompt: list[int],
                        *, chat: bool) -> Response:
        self.requests.append(body)
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if not self.healthy:
            return self._error(503, "node unhealthy")
        if self.fail_next:
            status = self.fail_next.pop(0)
            if self.echo_errors:  # like a pydantic validation error echoing its input
                return self._error(status, f"invalid request: input_value={body!r}")
            return self._error(status, self.fail_message)
        if body.get("cache_salt") is not None and not body["cache_salt"]:
            return self._error(400, "Parameter 'cache_salt' must be a non-empty string")
        header_id = request.headers.get("x-request-id")
        request_id = header_id or self.cluster.next_id("req")
        params = body.get("kv_transfer_params") or None
        if params and "kvagent_release" in params:  # the kvagent plugin's early release
            for rid in params["kvagent_release"]:
                held = self.cluster.retained.get((self.engine_id, rid))
                if held is not None and held.consumed_by is None:
                    held.consumed_by = "released"
                    self.cluster.events.append(Event("release", self.engine_id, {"id": rid}))
            params = {k: v for k, v in params.items() if k != "kvagent_release"} or None
        cached = self._local_prefix_hit(prompt)
        if params and params.get("do_remote_decode") and params.get(RETAIN_KEY):
            # The kvagent plugin's `d_pull`: pull as a P leg does, decode and retain as D.
            got = self._pull_offer(params, prompt, cached)
            if got < 0:
                return self._error(500, "KV transfer failed (kv_load_failure_policy=fail)")
            return await self._decode_leg(body, prompt, {"do_remote_decode": False},
                                          max(cached, got), request_id, chat)
        if params and params.get("do_remote_decode"):
            if self.cluster.prefill_delay_s and await _disconnected_within(
                    request, self.cluster.prefill_delay_s):
                self.aborted.append(request_id)  # vLLM aborts a request whose client left
                return Response(status_code=499)
            return await self._prefill_leg(body, prompt, params, cached, request_id, chat)
        if params and params.get("do_remote_prefill"):
            got = self.cluster.pull(self.engine_id, params, prompt)
            if got < 0:
                return self._error(500, "KV transfer failed (kv_load_failure_policy=fail)")
            cached = max(cached, got)
        elif cached:
            self.cluster.events.append(Event("prefix_hit", self.engine_id, {"tokens": cached}))
        return await self._decode_leg(body, prompt, params, cached, request_id, chat)

    def _pull_offer(self, params: dict[str, Any], prompt: list[int], cached: int) -> int:
        """Check an offer's digests as the plugin does (`pull_check`), then pull what it
        still offers; the tokens pulled (-1: the transfer failed)."""
        params = dict(params)
        check_offer(params, prompt, self.cluster.block_size)
        if not params.get("remote_block_ids"):
            return 0
        return self.cluster.pull(self.engine_id, params, prompt, locally_cached=cached)

    async def _prefill_leg(self, body: dict[str, Any], prompt: list[int],
                           params: dict[str, Any], cached: int, request_id: str,
                           chat: bool) -> Response:
        if body.get("stream"):
            return self._error(400, "fake P expects stream=false")
        verified = None
        if self.cluster.pull_check:
            params = dict(params)
            verified = check_offer(params, prompt, self.cluster.block_size)
        else:
            params = {k: v for k, v in params.items() if k != EXPECT_KEY}
        if params.get("remote_block_ids"):
            got = self.cluster.pull(self.engine_id, params, prompt, locally_cached=cached)
            if got < 0:
                return self._error(500, "KV transfer failed (kv_load_failure_policy=fail)")
            cached = max(cached, got)
        lease_id = self.cluster.next_id("p")
        self.cluster.retained[(self.engine_id, lease_id)] = Retained(
            self.engine_id, lease_id, list(prompt), len(prompt),
            time.monotonic() + self.cluster.lease_s)
        self.sequences.append(list(prompt))
        # What a P leg returns: docs/engine.md, "Bidirectional reuse at the request level".
        # Its blocks cover the whole prompt; the router hands P's params to D verbatim and
        # never reads their remote_num_tokens, so the fake's 0 changes nothing.
        kv = self._kv_params(lease_id, 0, is_p=True, expiry=None,
                             nblocks=-(-len(prompt) // self.cluster.block_size))
        if verified is not None:
            kv[VERIFIED_KEY] = verified
        first = self.cluster.reply(prompt).generated_ids()[:1]
        text = decode_ids(first)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "stop_reason": None,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        if body.get("return_token_ids"):
            choice["token_ids"] = first
        out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
               "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": self.model, "choices": [choice],
               "usage": _usage(len(prompt), 1, cached), "kv_transfer_params": kv}
        if body.get("return_token_ids"):
            if chat:
                out["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        return JSONResponse(out)

    def _retain(self, prompt: list[int], generated: list[int],
                params: dict[str, Any] | None) -> dict[str, Any] | None:
        seq = prompt + generated
        self.sequences.append(seq)
        if params is None:  # a plain (non-P/D) request: nothing retained, no params
            return None
        rid = self.cluster.next_id("d")
        expiry = time.monotonic() + self.cluster.decode_ttl_s
        self.cluster.retained[(self.engine_id, rid)] = Retained(
            self.engine_id, rid, seq, len(seq) - 1, expiry)
        return self._kv_params(rid, len(seq) - 1, is_p=False, expiry=expiry)

    async def _decode_leg(self, body: dict[str, Any], prompt: list[int],
                          params: dict[str, Any] | None, cached: int, request_id: str,
                          chat: bool) -> Response:
        reply = self.cluster.reply(prompt)
        generated = reply.generated_ids()
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if max_tokens is not None:
            generated = generated[: int(max_tokens)]
        finish = "tool_calls" if reply.tool_calls else "stop"
        if max_tokens is not None and len(generated) < len(reply.generated_ids()):
            finish = "length"
        want_ids = bool(body.get("return_token_ids"))
        want_lp = bool(body.get("logprobs"))
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        if not body.get("stream"):
            kv = self._retain(prompt, generated, params)
            out = _full_response(oid, self.model, chat, reply, generated, finish, want_lp)
            out["usage"] = _usage(len(prompt), len(generated), cached)
            if want_ids:
                if chat:
                    out["prompt_token_ids"] = prompt
                else:
                    out["choices"][0]["prompt_token_ids"] = prompt
                out["choices"][0]["token_ids"] = generated
            out["kv_transfer_params"] = kv
            return JSONResponse(out)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            self._stream(oid, chat, reply, prompt, generated, finish, cached, params,
                         want_ids, want_lp, include_usage),
            media_type="text/event-stream")

    async def _stream(self, oid: str, chat: bool, reply: Reply, prompt: list[int],
                      generated: list[int], finish: str, cached: int,
                      params: dict[str, Any] | None, want_ids: bool, want_lp: bool,
                      include_usage: bool) -> AsyncIterator[bytes]:
        self.in_flight += 1
        sent = 0
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            nonlocal sent
            sent += 1
            data = {"id": oid, "object": obj, "created": created, "model": self.model,
                    "choices": choices, **extra}
            return f"data: {json.dumps(data)}\n\n".encode()

        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}],
                            **({"prompt_token_ids": prompt} if want_ids else {}))
            body_ids = generated[:-1] if generated and generated[-1] == EOS else generated
            pieces = [body_ids[i:i + self.cluster.chunk_chars]
                      for i in range(0, len(body_ids), self.cluster.chunk_chars)]
            if reply.tool_calls and chat:
                pieces = []
                for k, call in enumerate(reply.tool_calls):
                    delta = {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"],
                                                          "arguments": call["function"][
                                                              "arguments"]}}]}
                    yield chunk([{"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": None}])
            for j, piece in enumerate(pieces):
                if self.cut_after_chunks is not None and sent >= self.cut_after_chunks:
                    raise ConnectionResetError("injected cut")
                if self.error_after_chunks is not None and sent >= self.error_after_chunks:
                    error = {"message": self.fail_message, "type": "InternalServerError",
                             "param": f"{self.side_host}:{self.side_port}",
                             "code": self.engine_id}
                    yield f"data: {json.dumps({'error': error})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                if self.cluster.token_delay_s:
                    await asyncio.sleep(self.cluster.token_delay_s)
                text = decode_ids(piece)
                c: dict[str, Any] = {"index": 0, "logprobs": _logprobs(piece, chat)
                                     if want_lp else None, "finish_reason": None}
                if chat:
                    c["delta"] = {"content": text}
                else:
                    c["text"] = text
                    if j == 0 and want_ids:
                        c["prompt_token_ids"] = prompt
                if want_ids:
                    c["token_ids"] = piece
                yield chunk([c])
            kv = self._retain(prompt, generated, params)
            tail = generated[len(body_ids):]
            last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                                    "stop_reason": None}
            if chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            if want_ids:
                last["token_ids"] = tail
            extra_last: dict[str, Any] = {}
            if self.cluster.kv_params_chunk == "finish" or not include_usage:
                extra_last["kv_transfer_params"] = kv
            yield chunk([last], **extra_last)
            if include_usage:
                extra: dict[str, Any] = {"usage": _usage(len(prompt), len(generated), cached)}
                if self.cluster.kv_params_chunk == "usage":
                    extra["kv_transfer_params"] = kv
                yield chunk([], **extra)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.aborted.append(oid)
            raise
        finally:
            self.in_flight -= 1


async def _disconnected_within(request: Request, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.01)
    return False


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprobs(ids: list[int], chat: bool) -> dict[str, Any]:
    toks = [decode_ids([i]) for i in ids]
    if chat:
        return {"content": [{"token": t, "logprob": -0.25, "bytes": list(t.encode()),
                             "top_logprobs": []} for t in toks]}
    return {"tokens": toks, "token_logprobs": [-0.25] * len(toks),
            "top_logprobs": None, "text_offset": list(range(len(toks)))}


def _full_response(oid: str, model: str, chat: bool, reply: Reply, generated: list[int],
                   finish: str, want_lp: bool) -> dict[str, Any]:
    body_ids = generated[:-1] if generated and generated[-1] == EOS else generated
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None,
                              "logprobs": _logprobs(body_ids, chat) if want_lp else None}
    if chat:
        choice["message"] = {"role": "assistant", "reasoning": None,
                             "content": None if reply.tool_calls else decode_ids(body_ids),
                             "tool_calls": reply.tool_calls or []}
    else:
        choice["text"] = decode_ids(body_ids)
    return {"id": oid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


# ---------------------------------------------------------------------- serving


@contextlib.asynccontextmanager
async def serve(app: Any, settings: Any = None) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on a free 127.0.0.1 port; yields its base URL.
    With router `settings`, served as the router is (its connection limits)."""
    import uvicorn

    port = free_port()
    kw: dict[str, Any] = {"log_level": "warning", "lifespan": "on",
                          "timeout_graceful_shutdown": 1}
    if settings is not None:
        from kvagent_server.router.http.server import uvicorn_config

        config = uvicorn_config(app, settings, host="127.0.0.1", port=port, **kw)
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, **kw)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)


# ---------------------------------------------------------------------- a whole stack


@dataclass
class Stack:
    """Fake P and D nodes plus the router in front, all on 127.0.0.1."""

    cluster: FakeCluster
    prefill: list[FakeNode]
    decode: list[FakeNode]
    url: str
    app: Any
    client: Any  # httpx.AsyncClient with base_url=url

    @property
    def nodes(self) -> list[FakeNode]:
        return [*self.prefill, *self.decode]

    @property
    def router(self) -> Any:
        return self.app.state.router

    def internal_strings(self) -> list[str]:
        return [s for n in self.nodes for s in n.internal_strings]


@contextlib.asynccontextmanager
async def router_stack(*, n_prefill: int = 1, n_decode: int = 1, settings: Any = None,
                       cluster: FakeCluster | None = None,
                       node_tiers: dict[str, dict[str, Any]] | None = None,
                       **settings_kw: Any) -> AsyncIterator[Stack]:
    """Start fake nodes and a router (uvicorn, real sockets) for one test.

    `node_tiers`: `router.engine.kv_tiers` by node name (`p0`, `d0`, ...), as the bundle
    writes them by URL once the nodes' ports are known."""
    import httpx
    from kvagent_server.router.http.app import create_app
    from kvagent_server.router.kv.tiers import NodeTiers
    from kvagent_server.router.settings import RouterSettings

    cluster = cluster or FakeCluster()
    prefill = [FakeNode(cluster, "prefill", i) for i in range(n_prefill)]
    decode = [FakeNode(cluster, "decode", i) for i in range(n_decode)]
    if settings is None:
        # Slow probes by default: tests that exercise health checks set their own interval
        # (a probe timing out on a loaded machine must not decide unrelated tests).
        nodes = {"health_interval_s": 5.0, "kv_recompute_threshold": cluster.recompute_threshold}
        settings_kw["nodes"] = nodes | settings_kw.get("nodes", {})
        settings = RouterSettings(**settings_kw)
    async with contextlib.AsyncExitStack() as stack:
        p_urls = [await stack.enter_async_context(serve(n.app)) for n in prefill]
        d_urls = [await stack.enter_async_context(serve(n.app)) for n in decode]
        for node, url in zip([*prefill, *decode], [*p_urls, *d_urls], strict=True):
            node.internal_strings.append(url.rsplit(":", 1)[1])  # the node's HTTP port
        if node_tiers:
            urls = {**{f"p{i}": u for i, u in enumerate(p_urls)},
                    **{f"d{i}": u for i, u in enumerate(d_urls)}}
            engine = settings.engine.model_copy(update={"kv_tiers": {
                urls[name]: NodeTiers(**t) for name, t in node_tiers.items()}})
            settings = settings.model_copy(update={"engine": engine})
        app = create_app(settings, p_urls, d_urls, model="fake-model")
        url = await stack.enter_async_context(serve(app, settings))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        yield Stack(cluster, prefill, decode, url, app, client)


async def serve_pair(cluster: FakeCluster, p_port: int, d_port: int, *,
                     bounded_logs: bool = False,
                     wrap: Callable[[str, Any], Any] | None = None) -> None:
    """Serve one fake P and one fake D node on loopback ports until cancelled (the
    benchmarks' backends). `bounded_logs` keeps only the last requests (long runs);
    `wrap(role, app)` returns the ASGI app to serve in place of a node's own."""
    import uvicorn

    servers = []
    for role, port in (("prefill", p_port), ("decode", d_port)):
        node = FakeNode(cluster, role, 0)
        if bounded_logs:
            node.requests = deque(maxlen=64)  # type: ignore[assignment]
            node.tokenize_requests = deque(maxlen=64)  # type: ignore[assignment]
        app = wrap(role, node.app) if wrap is not None else node.app
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, backlog=4096)
        servers.append(uvicorn.Server(config))
    await asyncio.gather(*(srv.serve() for srv in servers))
