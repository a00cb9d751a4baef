"""The prefill (P) and decode (D) legs of one turn: HTTP calls, retries, clean-up.

Policies (openai-python's, applied per leg):
- A leg is retried on another node only before its first byte (connection errors,
  timeouts, 408/429/5xx). A decode stream that fails later is cut, never replayed.
- A failed pull (a reuse P leg answered 5xx) is not an error: the P leg is re-run fresh.
- A P leg is never orphaned: when its D leg cannot run (D failed everywhere, client
  gone), `release_prefill` makes a decode node read P's leased blocks, so P never reaches
  the lease-expiry path that hangs it (docs/engine.md, "The idle spin and the hang").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvagent_server.router.nodes.client import (
    MAX_BODY_BYTES,
    ConnectFailed,
    NodeClient,
    NodeResponse,
    ReadTimeout,
    StaleConnection,
    UpstreamError,
)
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.nodes.prompt_ids import CHAT_TEMPLATE_FIELDS
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import transfer

log = logging.getLogger("kvagent.router.legs")

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
#: Sampling fields a one-token P leg must not carry (they would fail validation or waste work).
_PREFILL_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "echo",
                 "prompt_logprobs", "max_completion_tokens", "n", "best_of",
                 "return_token_ids")

_background: set[asyncio.Future[bool]] = set()

class LegError(Exception):
    """A leg failed before its first byte on every node tried. `status` is for the client."""

    def __init__(self, message: str, *, status: int = 502, body: dict[str, Any] | None = None,
                 leg: str = "decode", tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.body = body  # the node's own error body when it is the client's fault (4xx)
        self.leg = leg
        #: The nodes the leg was sent to, by name (a retry elsewhere ranks them last).
        self.tried = tried


def _unreachable(leg: str, exc: UpstreamError) -> LegError:
    """A leg's node failed to answer: 504 when it sent nothing in time, else 502."""
    if isinstance(exc, ReadTimeout):
        return LegError(f"{leg} node timed out ({exc})", status=504, leg=leg)
    return LegError(f"{leg} node unreachable ({exc})", leg=leg)


@dataclass
class PrefillResult:
    node: Node
    kv_params: dict[str, Any]
    cached_tokens: int | None  # None: the node does not report it (no prompt_tokens_details)
    prompt_tokens: int
    pull_failed: bool
    elapsed_s: float
    #: The prompt's token ids as P computed them (asked for with `return_token_ids`).
    prompt_token_ids: list[int] | None = None
    #: The token P sampled, when the answer did not stop at it (asked for with the ids).
    first_token: int | None = None


@dataclass
class DecodeStart:
    """An open decode response (streamed or not), before the client has seen a byte."""

    node: Node
    response: NodeResponse
    elapsed_s: float  # time to response headers


def prefill_body(body: Mapping[str, Any], kv_params: dict[str, Any], *,
                 prompt_ids: bool = False) -> dict[str, Any]:
    """The P leg's body: one token, not streamed, with the transfer params; `prompt_ids`
    asks P for the prompt's token ids too."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out.update(stream=False, max_tokens=1, kv_transfer_params=kv_params)
    if prompt_ids:
        out["return_token_ids"] = True
    return out


def token_ids(value: object) -> list[int] | None:
    """`value` if it is a non-empty list of token ids (ints, not bools), else None.
    On the P/D hot path: C-level passes over the list (8k ids in ~0.2 ms, not ~0.4)."""
    if (isinstance(value, list) and value and set(map(type, value)) == {int}
            and min(value) >= 0):
        return value
    return None


def sampled_token(answer: dict[str, Any]) -> int | None:
    """The one token a P leg's answer sampled, if the answer ended only because of its
    one-token limit (`finish_reason` "length"): a token that stopped it (EOS, a stop token
    or string) is not one D may continue from."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids = token_ids(choice.get("token_ids"))
    if choice.get("finish_reason") != "length" or ids is None or len(ids) != 1:
        return None
    return ids[0]


def decode_body(body: Mapping[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The D leg's body: the client's, plus the params and the fields the router reads."""
    out = dict(body)
    out["return_token_ids"] = True
    if kv_params is not None:
        out["kv_transfer_params"] = kv_params
    if out.get("stream"):
        out["stream_options"] = usage_stream_options(out.get("stream_options"))
    return out


def usage_stream_options(opts: dict[str, Any] | None) -> dict[str, Any]:
    """D's `stream_options`: usage always (the router reads it), per-chunk usage only if
    the client asked for usage and for it (vLLM ignores `continuous_usage_stats` without
    `include_usage`, so the client must not get it because the router forced usage)."""
    out = dict(opts or {})
    if not out.get("include_usage"):
        out.pop("continuous_usage_stats", None)
    out["include_usage"] = True
    return out


def _error_body(resp: NodeResponse) -> dict[str, Any] | None:
    try:
        data = resp.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def usage_cached(usage: dict[str, Any] | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`, None when the node does not report it
    (vLLM needs `--enable-prompt-tokens-details`)."""
    details = (usage or {}).get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


def pulls_kv(body: dict[str, Any]) -> bool:
    """Whether the request reads another node's KV blocks (a reuse P leg, a D leg).

    Such a request must never be sent twice with the same params once it may have reached
    a node: the first read frees the blocks on the holder (its "done" notification), and
    a second read of freed, maybe reallocated blocks is wrong KV. After an ambiguous
    failure (the connection broke, a timeout, a 5xx) a P leg recomputes instead, and a D
    leg fails before its first byte (the client's retry starts a new turn)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return False
    if params.get(transfer.DO_REMOTE_PREFILL):
        return True
    return bool(params.get(transfer.DO_REMOTE_DECODE) and params.get(transfer.REMOTE_BLOCK_IDS)
                and (params.get(transfer.REMOTE_NUM_TOKENS) or 0) > 0)


class Legs:
    """Runs legs on candidate nodes, in the order placement ranked them.

    Every completion it sends is a leg in `ledger` (the registry's): a caller that owns the
    leg (opened it, closes it once it is over) names it by its ticket (`leg=`), and each
    try marks it sent to the node tried; a request sent with no leg named (a drain of
    P's blocks) is a leg of its own for as long as its answer takes."""

    def __init__(self, *, max_retries: int, timeout_s: float,
                 on_node_error: Callable[[Node, str], None] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 ledger: LegLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else LegLedger()
        self.max_body_bytes = max_body_bytes
        self.clients: dict[str, NodeClient] = {}
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.on_node_error = on_node_error or (lambda node, reason: node.mark_down(reason))

    def client(self, node: Node) -> NodeClient:
        """One connection pool per node (also used for the node's `/tokenize`)."""
        client = self.clients.get(node.name)
        if client is None:
            client = self.clients[node.name] = NodeClient(
                timeout_s=self.timeout_s, max_body_bytes=self.max_body_bytes)
        return client

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()

    async def _post(self, node: Node, path: str, body: dict[str, Any],
                    *, stream: bool, leg: int | None = None) -> NodeResponse:
        """POST once more on the same node if the connection dropped before any response
        (a pooled keep-alive connection the node had just closed) — unless the request
        pulls KV (see `pulls_kv`). A node that refuses connections is marked down at once;
        one slow to accept (overloaded) is left to the health checks."""
        own = leg is None
        if leg is None:
            leg = self.ledger.open(node.name, role=node.role, now=time.monotonic())
        else:
            self.ledger.sent(leg, node.name, time.monotonic())
        try:
            client = self.client(node)
            url = f"{node.url}{path}"
            for attempt in (0, 1):
                try:
                    return await client.post(url, body, stream=stream)
                except StaleConnection:
                    if attempt or pulls_kv(body):
                        raise
                except ConnectFailed as exc:
                    if not exc.timed_out:
                        self.on_node_error(node, str(exc))
                    raise
            raise AssertionError("unreachable")
        finally:
            if own:
                self.ledger.close(leg, time.monotonic())

    async def prefill(self, candidates: Sequence[Node], path: str, body: Mapping[str, Any],
                      kv_params: dict[str, Any], *, prompt_ids: bool = False,
                      leg: int | None = None) -> PrefillResult:
        """Run the P leg on the first candidate that answers; a failed pull re-runs fresh.
        `prompt_ids`: also return the prompt's token ids as P computed them; `leg`: its
        ticket in the ledger (the caller closes it)."""
        reuse = transfer.offers_remote_blocks(kv_params)
        pull_failed = False
        last: LegError | None = None
        for node in list(candidates)[: self.max_retries + 1]:
            started = time.perf_counter()
            params = transfer.fresh() if pull_failed else kv_params
            try:
                resp = await self._post(node, path,
                                        prefill_body(body, params, prompt_ids=prompt_ids),
                                        stream=False, leg=leg)
            except UpstreamError as exc:
                last = _unreachable("prefill", exc)
                if reuse and not isinstance(exc, ConnectFailed):
                    pull_failed = True  # it may have read D's blocks: never offer them again
                continue
            if resp.status_code >= 500 and reuse and not pull_failed:
                # The pull from D failed (blocks gone, D down): recompute on the same node.
                pull_failed = True
                log.info("reuse pull failed on %s (%d); recomputing", node.name,
                         resp.status_code)
                try:
                    resp = await self._post(node, path,
                                            prefill_body(body, transfer.fresh(),
                                                         prompt_ids=prompt_ids),
                                            stream=False, leg=leg)
                except UpstreamError as exc:
                    last = _unreachable("prefill", exc)
                    continue
            if resp.status_code != 200:
                if resp.status_code in RETRYABLE_STATUS:
                    last = LegError(f"prefill failed ({resp.status_code})", leg="prefill")
                    continue
                raise LegError("request rejected", status=resp.status_code,
                               body=_error_body(resp), leg="prefill")
            data = resp.json()
            params_out = data.get("kv_transfer_params")
            if not isinstance(params_out, dict):
                raise LegError("prefill node returned no kv_transfer_params (is it a P/D node?)",
                               leg="prefill")
            usage = data.get("usage") or {}
            return PrefillResult(node=node, kv_params=params_out,
                                 cached_tokens=usage_cached(usage),
                                 prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                 pull_failed=pull_failed,
                                 elapsed_s=time.perf_counter() - started,
                                 prompt_token_ids=(token_ids(data.get("prompt_token_ids"))
                                                   if prompt_ids else None),
                                 first_token=sampled_token(data) if prompt_ids else None)
        raise last or LegError("no healthy prefill node", status=503, leg="prefill")

    async def decode(self, candidates: Sequence[Node], path: str, body: dict[str, Any],
                     *, stream: bool, leg: int | None = None) -> DecodeStart:
        """Open the D leg on the first candidate that answers 200 (headers only when
        streamed); `leg`: its ticket in the ledger (the caller closes it)."""
        last: LegError | None = None
        pulls = pulls_kv(body)
        tried: list[str] = []
        for node in list(candidates)[: self.max_retries + 1]:
            tried.append(node.name)
            started = time.perf_counter()
            try:
                resp = await self._post(node, path, body, stream=stream, leg=leg)
            except UpstreamError as exc:
                last = _unreachable("decode", exc)
                if pulls and not isinstance(exc, ConnectFailed):
                    break  # it may have read P's blocks: no second reader (see pulls_kv)
                continue
            if resp.status_code == 200:
                return DecodeStart(node=node, response=resp,
                                   elapsed_s=time.perf_counter() - started)
            if resp.status_code in RETRYABLE_STATUS:
                last = LegError(f"decode failed ({resp.status_code})")
                if pulls and resp.status_code != 503:
                    break
                continue
            raise LegError("request rejected", status=resp.status_code, body=_error_body(resp),
                           tried=tuple(tried))
        failed = last or LegError("no healthy decode node", status=503)
        failed.tried = tuple(tried)
        raise failed

    async def release_prefill(self, candidates: Sequence[Node], path: str,
                              body: Mapping[str, Any], prefill: PrefillResult) -> bool:
        """Finish an orphaned P leg: a one-token, non-streamed D read of P's leased blocks.

        Runs shielded from cancellation (the client may be gone); returns True once a
        decode node has read (and so freed) P's blocks.
        """
        # Only what renders the same prompt: sampling fields that made D refuse the real
        # leg must not make it refuse the drain too.
        keep = ("model", "messages", "prompt", "cache_salt", *CHAT_TEMPLATE_FIELDS)
        drain = {k: body[k] for k in keep if k in body}
        # A salt of its own: if a failed D leg did read P's blocks after all, this read
        # gets freed blocks, and they must not enter D's prefix cache under the real
        # prompt's hashes (its output is discarded; KV content does not depend on the salt).
        drain.update(stream=False, max_tokens=1, kv_transfer_params=prefill.kv_params,
                     cache_salt=f"kvagent-drain-{uuid.uuid4().hex}")

        async def run() -> bool:
            for node in candidates:
                try:
                    resp = await self._post(node, path, drain, stream=False)
                except UpstreamError:
                    continue
                if resp.status_code == 200:
                    return True
            log.warning("could not release prefill lease on %s", prefill.node.name)
            return False

        task = asyncio.ensure_future(run())
        _background.add(task)  # keep it alive if our caller is cancelled meanwhile
        task.add_done_callback(_background.discard)
        return await asyncio.shield(task)
