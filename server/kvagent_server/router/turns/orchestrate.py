"""One turn through the router: choose a plan, run the legs, mint the next token.

The decisions come from the pure core (`planner`, `placement`); this module only wires
them to the legs and the store, in the order of docs/architecture.md's "One turn".
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvagent_server.router.auth.cache_token import TokenCodec, TokenError, verify_binding
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.common import fastjson
from kvagent_server.router.reuse import content, identity, placement, planner, transfer
from kvagent_server.router.reuse.queue import IDLE, CharsPerToken, NodeWork, WorkLedger
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore, StoreUnavailable
from kvagent_server.router.store.factory import KeySync
from kvagent_server.router.store.handle import Handle, KVIdentity, new_handle_id
from kvagent_server.router.store.records import CONTENT
from kvagent_server.router.telemetry.budget import TurnBudget
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.telemetry.spans import leg_span
from kvagent_server.router.turns.kv_placement import TierPlacement
from kvagent_server.router.turns.legs import (
    DecodeStart,
    LegError,
    Legs,
    PrefillResult,
    decode_body,
    usage_cached,
    usage_stream_options,
)
from kvagent_server.router.turns.nodes import Node, NodeRegistry
from kvagent_server.router.turns.prompt_ids import TokenizeError, tokenize
from kvagent_server.router.turns.relay import Capture, Final
from kvagent_server.router.turns.retention import RetentionGuard, remote_request_id

log = logging.getLogger("kvagent.router.turn")

#: Turns whose prompt tokens per message byte were learned before a turn may estimate its
#: delta from its messages' size (and skip `/tokenize`).
MIN_RATIO_SAMPLES = 3
#: Weight of the newest `/tokenize` round trip in the router's running mean of it.
TOKENIZE_EWMA_ALPHA = 0.2


@dataclass
class Router:
    """Everything a turn needs, built once by `create_app`."""

    settings: RouterSettings
    registry: NodeRegistry
    legs: Legs
    store: SessionStore
    codec: TokenCodec
    metrics: RouterMetrics
    client: httpx.AsyncClient
    costs: planner.CostModel = field(default_factory=planner.CostModel)
    #: The legs in flight per node, in tokens of work (what a new leg queues behind).
    work: WorkLedger = field(default_factory=WorkLedger)
    #: Tokens per body character of P legs whose prompt the router did not tokenize.
    chars: CharsPerToken = field(default_factory=CharsPerToken)
    #: Prompt tokens per byte of a chat turn's messages (a turn that skips `/tokenize`
    #: estimates its delta from its new messages with it).
    message_chars: CharsPerToken = field(default_factory=CharsPerToken)
    #: The `/tokenize` round trip, seconds (running mean; None until one was made): what
    #: a turn that skips it saves.
    tokenize_s: float | None = None
    #: Tier-aware P placement from the nodes' KV events (None: by load only).
    tiers: TierPlacement | None = None
    #: Bounds what decode nodes retain (router/retention.py; None: TTL only).
    retention: RetentionGuard | None = None
    #: Shares signing keys with other replicas through Redis (None: configured keys).
    key_sync: KeySync | None = None


@dataclass
class TurnRequest:
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]  # cleaned: no body session forms, tenant cache_salt set
    tenant: Tenant
    session: str | None
    token: str | None
    stream: bool
    span: Any = None  # the turn's OpenTelemetry span (parent of the leg spans)
    #: What named the conversation (`http.conversation.Source`); None: nothing did, and
    #: with `content_reuse` the router finds it by the prompt's tokens (`content`).
    source: str | None = None
    #: Test-only: shift the pulled blocks (settings.test_shift_blocks_header).
    shift_blocks: bool = False
    budget: TurnBudget = field(default_factory=TurnBudget)  # time per stage

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("chat/completions")


@dataclass
class Turn:
    """A planned turn whose decode leg is open; `finalize` mints the next token."""

    router: Router
    req: TurnRequest
    path: planner.Path
    plan: planner.ReusePlan
    prefill: PrefillResult | None
    decode: DecodeStart
    started: float
    first_byte_at: float | None = None
    reused: int = 0  # set by finalize
    #: Tokens of work ahead on the node that computed the prompt when the turn was sent
    #: (what `CostModel.observe` learns the TTFT against; 0 without queue-aware costs).
    ahead: float = 0.0
    #: The D leg in the router's `WorkLedger` (None: not counted).
    d_ticket: int | None = None
    #: A `d_fresh` prompt's body size: with D's usage it teaches `Router.chars`.
    body_chars: int = 0

    def mark_first_byte(self) -> float:
        """The client's first byte: D's prompt work is done, it decodes from now on."""
        self.first_byte_at = time.perf_counter()
        if self.d_ticket is not None:
            self.router.work.prefilled(self.d_ticket, time.monotonic())
        return self.first_byte_at

    def end_work(self) -> None:
        """The D leg is over (idempotent): it no longer counts as a stream on D."""
        if self.d_ticket is not None:
            self.router.work.end(self.d_ticket, time.monotonic())
            self.d_ticket = None

    async def finalize(self, capture: Capture) -> Final:
        t0 = time.perf_counter()
        try:
            return await self._finalize(capture)
        finally:
            self.req.budget.add("finalize", time.perf_counter() - t0)

    async def _finalize(self, capture: Capture) -> Final:
        usage = capture.usage or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        planned = self.plan.reuse_tokens if self.path in ("pd_reuse", "d_direct") else 0
        # What the serving node reports as not recomputed; the plan when it reports nothing.
        if self.prefill is not None:
            reported = self.prefill.cached_tokens
            prompt_tokens = prompt_tokens or self.prefill.prompt_tokens
        else:
            reported = usage_cached(usage)
        cached = reported if reported is not None else planned
        r = self.router
        if self.req.chat and prompt_tokens and r.settings.skip_tokenize_extensions:
            r.message_chars.observe(identity.message_chars(self.req.body.get("messages")),
                                    prompt_tokens)
        reused = min(planned, cached) if self.path == "pd_reuse" else (
            cached if self.path == "d_direct" else 0)
        self._account(prompt_tokens, cached, reused)
        recorded, token, expires_in = await self._record(capture)
        if not recorded:
            self._release_unrecorded(capture)
        kvagent = {"cache_token": token, "reused_tokens": reused, "expires_in": expires_in,
                   "path": self.path, "reason": self.plan.label}
        self.reused = reused
        return Final(kvagent=kvagent, cached_tokens=cached)

    def _account(self, prompt_tokens: int, cached: int, reused: int) -> None:
        m = self.router.metrics
        m.paths.labels(path=self.path).inc()
        m.reused_tokens.inc(reused)
        m.recomputed_tokens.inc(max(0, prompt_tokens - cached))
        if reused:
            m.reuse_hits.inc()
        elif self.plan.reuses:
            m.miss("node_recomputed")  # planned, but the node reports nothing cached
        elif self.plan.reason not in planner.FRESH_REASONS:
            m.miss(self.plan.reason.value)
        if self.body_chars and prompt_tokens:
            self.router.chars.observe(self.body_chars, max(0, prompt_tokens - cached))
        if (self.first_byte_at is not None and prompt_tokens
                and self.path != "decode_only"):
            ttft = self.first_byte_at - self.started
            try:
                self.router.costs.observe(self.path, max(0, prompt_tokens - cached), ttft,
                                          reused_tokens=reused, ahead_tokens=self.ahead)
            except ValueError:
                pass

    def _release_unrecorded(self, capture: Capture) -> None:
        """D retained this turn's blocks, but no handle records them (no session, reuse
        off, store down...): nobody can ever reuse them, so let D free them now."""
        params = capture.kv_params
        rid = params.get(transfer.REMOTE_REQUEST_ID) if isinstance(params, dict) else None
        if self.router.retention is not None and isinstance(rid, str) and rid:
            self.router.retention.queue.add(self.decode.node.name, [rid])

    def _release_evicted(self, handles: list[Handle] | None) -> None:
        """Handles the store evicted to make room (the tenant's quota, its bounds) are
        claimed, so nobody can reuse them: let their decode nodes free the blocks now."""
        r = self.router
        if not handles or r.retention is None:
            return  # without the retention guard they are freed at D's TTL
        for handle in handles:
            node = r.registry.get(handle.decode_node)
            rid = remote_request_id(handle)
            if node is not None and node.epoch == handle.decode_epoch and rid is not None:
                r.retention.queue.add(node.name, [rid])

    async def _record(self, capture: Capture) -> tuple[bool, str | None, int]:
        """Record D's retained blocks as the session's latest handle: whether it was
        recorded, and the cache token naming it (none for a session the client did not
        name: found by content, it has nothing to carry) with its lifetime."""
        r, req = self.router, self.req
        s = r.settings
        ttl = int(s.decode_blocks_ttl_s - s.token_safety_margin_s)
        sequence = capture.sequence
        if (req.session is None or capture.kv_params is None or not sequence or ttl <= 0
                or not s.reuse):
            return False, None, 0
        node = self.decode.node
        block_size = s.block_size or node.block_size
        if block_size is None:
            log.warning("block size of %s unknown: set router.block_size", node.name)
            return False, None, 0
        now = time.time()
        handle = Handle(handle_id=new_handle_id(), tenant=req.tenant.name, session=req.session,
                        decode_node=node.name, decode_epoch=node.epoch,
                        kv_transfer_params=capture.kv_params, token_ids=sequence,
                        block_size=block_size, created_at=now, expires_at=now + ttl,
                        identity=_identity_of(r, req, capture.prompt_token_ids or [],
                                              history=True))
        if planner.retained_tokens(handle) is None:
            log.warning("decode node %s returned unusable kv_transfer_params", node.name)
            return False, None, 0
        try:
            evicted = await r.store.put(handle)
        except StoreUnavailable as exc:
            log.warning("session store unavailable (%s): no cache token this turn",
                        type(exc).__name__)
            r.metrics.miss("store_unavailable")
            return False, None, 0
        self._release_evicted(evicted)
        if req.source == "content":
            await _index_content(r, req, handle, len(capture.prompt_token_ids or ()))
            return True, None, 0
        token = r.codec.encode(tenant=req.tenant.name, session=req.session,
                               handle=handle.handle_id, iat=int(now), exp=int(now) + ttl)
        return True, token, ttl


async def _index_content(r: Router, req: TurnRequest, handle: Handle, prompt_len: int) -> None:
    """Index a held turn of a caller that names no conversation under its tokens, so its
    next turn finds the session (`reuse.content`). Best effort: a lost update (another
    replica writing the same key at once) or a store down costs that turn a recompute."""
    keys = [_content_key(req, k)
            for k in content.held_keys(prompt_len, handle.token_ids, req.tenant.cache_salt)]
    try:
        items = [(key, content.add_entry(
            await r.store.get_record(req.tenant.name, CONTENT, key), prompt_len,
            handle.session)) for key in keys]
        await r.store.put_records(req.tenant.name, CONTENT, items,
                                  handle.expires_at - time.time())
    except StoreUnavailable:
        r.metrics.miss("store_unavailable")


def _content_key(req: TurnRequest, key: str) -> str:
    """Content keys are the caller's own (one API key never finds another's turns)."""
    return f"{req.tenant.caller}/{key}"


async def _find_by_content(r: Router, req: TurnRequest, p_first: Node | None) -> list[int] | None:
    """For a turn that names no conversation: tokenize the prompt and name the session of
    the caller's held turn it extends, else a new one (the turn's handle starts it).

    Returns the prompt's token ids (the plan verifies the handle against them), or None
    when the prompt could not be tokenized (the turn then runs without a session)."""
    if (req.session is not None or req.source is not None or not r.settings.reuse
            or not r.settings.content_reuse or p_first is None):
        return None
    try:
        prompt_ids = await _tokenize(r, req, p_first)
    except TokenizeError as exc:
        log.info("no content lookup this turn: %s", exc)
        return None
    try:
        session = await _held_session(r, req, prompt_ids)
    except StoreUnavailable:
        r.metrics.miss("store_unavailable")
        session = None
    req.source = "content"
    req.session = session or req.tenant.session_key(f"anon-{uuid.uuid4().hex}")
    if req.span is not None:
        req.span.set_attribute("kvagent.content_hit", session is not None)
    return prompt_ids


async def _held_session(r: Router, req: TurnRequest, prompt_ids: list[int]) -> str | None:
    """The session of the caller's held turn this prompt extends: the longest indexed
    prefix of the prompt, then the newest turn under it whose whole prompt the new one
    repeats (`content.extends`)."""
    keys = content.lookup_keys(prompt_ids, req.tenant.cache_salt)
    found = await r.store.find_record(req.tenant.name, CONTENT,
                                      [_content_key(req, k) for k in keys]) if keys else None
    for prompt_len, session in content.entries(found[1]) if found is not None else ():
        held = await r.store.peek_latest(req.tenant.name, session)
        if held is not None and content.extends(prompt_ids, held.token_ids, prompt_len):
            return session
    return None


async def _tokenize(r: Router, req: TurnRequest, node: Node) -> list[int]:
    """The prompt's token ids from `node`, timed into the turn's budget and the router's
    running mean of the round trip (what a turn that skips it saves)."""
    t0 = time.perf_counter()
    try:
        return await tokenize(r.legs.client(node), node.url, req.body, chat=req.chat)
    finally:
        took = time.perf_counter() - t0
        req.budget.add("tokenize", took)
        r.tokenize_s = took if r.tokenize_s is None else (
            r.tokenize_s + TOKENIZE_EWMA_ALPHA * (took - r.tokenize_s))


async def _claim(r: Router, req: TurnRequest) -> tuple[Handle | None, str | None]:
    """The handle this turn may reuse, or why there is none (never raises)."""
    if req.session is None or not r.settings.reuse:
        return None, None
    try:
        return await _claim_from_store(r, req)
    except StoreUnavailable as exc:
        log.warning("session store unavailable (%s): recomputing this turn", type(exc).__name__)
        return None, "store_unavailable"


async def _claim_from_store(r: Router, req: TurnRequest) -> tuple[Handle | None, str | None]:
    tenant = req.tenant.name
    assert req.session is not None  # the caller checked: handles belong to sessions
    if req.token is None:
        return await r.store.claim_latest(tenant, req.session), None
    try:
        claims = r.codec.decode(req.token, now=time.time())
    except TokenError as exc:
        if not (exc.reason == "unknown_key" and r.key_sync is not None
                and await r.key_sync.refresh_for_unknown_key()):
            return None, exc.reason
        try:  # another replica's key, learned just now
            claims = r.codec.decode(req.token, now=time.time())
        except TokenError as again:
            return None, again.reason
    mismatch = verify_binding(claims, tenant, req.session)
    if mismatch is not None:
        return None, mismatch
    handle = await r.store.claim(tenant, claims.handle)
    if handle is not None and (handle.tenant, handle.session) != (tenant, req.session):
        # Only a holder of the signing key can name another session's handle: use it
        # neither for reuse nor to release its blocks (reliability.md, Hostile input).
        return None, "other_session"
    return handle, None if handle is not None else "already_used"


def _pd_shape(body: dict[str, Any]) -> bool:
    """One sequence from one prompt: what a P/D transfer (one handle per request) serves.
    Several samples (`n`, `best_of`) or a batch of prompts go to one node whole."""
    prompt = body.get("prompt")
    batch = (isinstance(prompt, list) and len(prompt) > 1
             and not all(isinstance(t, int) for t in prompt))
    return (body.get("n") or 1) == 1 and (body.get("best_of") or 1) == 1 and not batch


@dataclass
class _Choice:
    """What the core decided for a turn, before any leg ran."""

    handle: Handle | None
    plan: planner.ReusePlan
    path: planner.Path
    holder: Node | None  # the decode node holding the handle's blocks, if alive and current
    p_first: Node | None
    d_first: Node | None
    #: Prompt tokens as the router tokenized them (0: not tokenized, a first turn).
    prompt_len: int = 0
    #: Work in flight on `p_first` and `d_first` when the turn was planned (None: the
    #: choice does not use it).
    p_work: NodeWork | None = None
    d_work: NodeWork | None = None
    #: A prompt the router did not tokenize: its body's JSON size and the tokens to
    #: compute estimated from it (0: not estimated).
    body_chars: int = 0
    est_tokens: int = 0
    #: Decode nodes a failed `d_fresh` or `d_direct` leg was sent to: the P/D retry
    #: tries them last.
    d_failed: tuple[str, ...] = ()


async def _choose(r: Router, req: TurnRequest) -> _Choice:
    """Claim the handle, verify the prompt against it, pick nodes and the path."""
    picked_p = placement.pick_prefill(r.registry.states())
    p_first = r.registry.get(picked_p.node_id) if picked_p else None
    known_ids = await _find_by_content(r, req, p_first)
    handle, rejected = await _claim(r, req)
    d_node = r.registry.get(handle.decode_node) if handle is not None else None
    holder = d_node if (handle is not None and d_node is not None and d_node.healthy
                        and d_node.epoch == handle.decode_epoch
                        and not handle.expired(time.time())) else None
    # -- tier-aware P placement: no D handle to reuse, so a P node whose KV
    # -- cache (any tier) holds the prompt's prefix may beat the least loaded one.
    p_reason: placement.PrefillReason = "least_loaded" if p_first else "no_healthy_node"
    if holder is None and p_first is not None and r.tiers is not None:
        states = r.registry.states()
        if r.tiers.wants(states):
            name, p_reason = await r.tiers.place(r.legs.client(p_first), p_first, states,
                                                 req.body, chat=req.chat)
            p_first = r.registry.get(name) if name else p_first
    r.metrics.placements.labels(reason=p_reason).inc()
    if req.span is not None:
        req.span.set_attribute("kvagent.placement", p_reason)
    # -- end tier-aware P placement
    affinity = handle.decode_node if handle else await _affinity(r, req)
    picked_d, d_reason = placement.pick_decode(r.registry.states(), affinity=affinity)
    r.metrics.decode_placements.labels(reason=d_reason).inc()
    if req.span is not None:
        req.span.set_attribute("kvagent.decode_placement", d_reason)
    d_first = r.registry.get(picked_d.node_id) if picked_d else None
    d_healthy = d_first is not None and d_first is holder
    costs = r.costs.snapshot()
    p_work = d_work = None
    if r.settings.queue_aware_paths:
        now = time.monotonic()
        p_work = (r.work.work(p_first.name, now=now, per_token_s=costs.prefill.per_token_s)
                  if p_first is not None else IDLE)
        d_work = (r.work.work(d_first.name, now=now, per_token_s=costs.d_direct.per_token_s)
                  if d_first is not None else IDLE)
    prompt_ids: list[int] = []
    plan: planner.ReusePlan | None = None
    new_ident = _identity_of(r, req, [])
    ident = _check_identity(r, handle, new_ident)
    # A refusal that positions cannot change (model, salt, a field) needs no /tokenize.
    final = ident is not None and ident.cap == 0 and ident.detail != "media_url" and (
        ident.reason != "multimodal_changed")
    if holder is not None and d_healthy and not final and known_ids is None:
        assert handle is not None  # a holder holds a handle
        fast = _extension(r, req, handle, ident, new_ident, costs, p_first, p_work, d_work)
        if fast is not None:
            plan, prompt_len, fast_path = fast
            r.metrics.tokenize_skipped.inc()
            if req.span is not None:
                req.span.set_attribute("kvagent.tokenized", False)
            return _Choice(handle, plan, fast_path, holder, p_first, d_first, prompt_len,
                           p_work, d_work)
    if holder is not None and known_ids is not None and not final:
        prompt_ids = known_ids
        ident = _check_identity(r, handle, identity.with_positions(
            new_ident, prompt_ids, r.settings.mm_placeholder_token_ids))
    elif holder is not None and p_first is not None and not final:
        try:
            prompt_ids = await _tokenize(r, req, p_first)
        except TokenizeError as exc:
            log.info("no reuse this turn: %s", exc)
            plan = planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.TOKENIZE_FAILED)
        else:
            ident = _check_identity(r, handle, identity.with_positions(
                new_ident, prompt_ids, r.settings.mm_placeholder_token_ids))
    if plan is None:
        plan = planner.plan_reuse(
            prompt_ids, handle, threshold=r.settings.kv_recompute_threshold, now=time.time(),
            tenant=req.tenant.name, session=req.session,
            node_healthy=bool(d_node and d_node.healthy),
            node_epoch=d_node.epoch if d_node else None, enabled=r.settings.reuse,
            rejected=rejected,
            prefill_block_size=r.settings.block_size or (p_first.block_size if p_first else None),
            identity=ident)
    path = planner.choose_path(
        plan, len(prompt_ids), costs,
        skip_prefill_max_tokens=r.settings.skip_prefill_max_tokens,
        d_healthy=d_healthy, p_work=p_work, d_work=d_work,
        d_stall_max_s=_stall_max_s(r.settings))
    choice = _Choice(handle, plan, path, holder, p_first, d_first, len(prompt_ids), p_work,
                     d_work)
    # Not with reuse switched off: D's prefix cache would then reuse earlier turns' KV
    # by the back door, and `reuse: false` is the P/D-without-reuse baseline.
    if (path == "pd_fresh" and plan.reason == planner.Reason.NO_HANDLE
            and r.settings.fresh_on_decode != "never"):
        # Not tokenized: the tokens to compute are estimated from the body's size.
        choice.body_chars = len(fastjson.dumps(req.body))
        choice.est_tokens = r.chars.tokens(choice.body_chars)
        choice.path = planner.fresh_path(
            choice.est_tokens, costs, policy=r.settings.fresh_on_decode,
            d_healthy=d_first is not None and d_first.healthy,
            p_work=p_work if p_first is not None else None, d_work=d_work,
            d_stall_max_s=_stall_max_s(r.settings),
            d_prompt_step_tokens=r.settings.decode_prompt_step_tokens)
    return choice


def _extension(r: Router, req: TurnRequest, handle: Handle,
               ident: identity.IdentityCheck | None, new_ident: KVIdentity,
               costs: planner.PathCosts, p_first: Node | None, p_work: NodeWork | None,
               d_work: NodeWork | None) -> tuple[planner.ReusePlan, int, planner.Path] | None:
    """The plan, estimated prompt length and path of a turn that may skip `/tokenize`,
    or None (then it is tokenized and verified as usual).

    It may when its messages repeat the held turn's exactly under the same rendering
    inputs (`identity.extension_chars`), identities agree with no media involved (media
    positions need the ids), and, for any delta from half to twice what the new messages'
    size suggests (past D's last whole block), one path is the choice
    (`planner.untokenized_path`): `d_direct`, or `pd_reuse` on a P node that checks what
    it pulls. Either way the node matches the real tokens itself (D's prefix cache; P's
    `pull_check` against the blocks' digests), so the answer is the one a recompute
    gives; a wrong estimate costs time, not correctness."""
    s = r.settings
    if (not s.skip_tokenize_extensions or not req.chat or ident is None
            or ident.reason is not None or new_ident.media or handle.identity is None
            or handle.identity.media or r.message_chars.samples < MIN_RATIO_SAMPLES):
        return None
    chars = identity.extension_chars(handle.identity, req.body)
    if chars is None:
        return None
    plan = planner.extension_plan(handle, threshold=s.kv_recompute_threshold)
    if not plan.reuses:
        return None
    # The delta: D's retained tokens past the last whole block (known), then the new
    # messages' tokens (estimated; their bytes include the answer D already holds).
    tail = plan.cached_tokens - plan.reuse_tokens
    new = max(1, r.message_chars.tokens(chars))
    if r.tokenize_s is None:
        return None
    path = planner.untokenized_path(
        plan, (tail + max(1, new // 2), tail + 2 * new), costs, r.tokenize_s,
        skip_prefill_max_tokens=s.skip_prefill_max_tokens,
        prefill_checks_pulls=p_first is not None and p_first.checks_pulls,
        p_work=p_work, d_work=d_work, d_stall_max_s=_stall_max_s(s))
    if path is None:
        return None
    return plan, plan.reuse_tokens + tail + new, path


def _stall_max_s(settings: RouterSettings) -> float | None:
    ms = settings.d_direct_stall_max_ms
    return None if ms is None else ms / 1000


def _identity_of(r: Router, req: TurnRequest, prompt_ids: list[int], *,
                 history: bool = False) -> KVIdentity:
    s = r.settings
    return identity.identity_of(req.body, chat=req.chat, prompt_ids=prompt_ids,
                                placeholder_ids=s.mm_placeholder_token_ids,
                                extra_unverifiable=s.identity_unverifiable_fields,
                                history=history and s.skip_tokenize_extensions)


def _check_identity(r: Router, handle: Handle | None,
                    new: KVIdentity) -> identity.IdentityCheck | None:
    """The handle's KV identity against this prompt's (None: no handle to check)."""
    if handle is None:
        return None
    return identity.check(handle.identity, new, trust_urls=r.settings.trust_media_urls)


async def plan_turn(r: Router, req: TurnRequest) -> Turn:
    """Decide the path, run the P leg (if any) and open the D leg."""
    started = time.perf_counter()
    budget = req.budget
    budget.add("receive", started - budget.arrived)
    if not _pd_shape(req.body):
        return await _whole_on_decode(r, req, started)
    c = await _choose(r, req)
    # planning is what `_choose` spent besides the node's /tokenize
    budget.add("plan", time.perf_counter() - started - budget.stages.get("tokenize", 0.0))
    if c.path in planner.ON_DECODE:
        try:
            return await _run_on_decode(r, req, c, started)
        except LegError as exc:
            if exc.status < 500:
                raise
            c.d_failed = exc.tried
            if c.path == "d_fresh":
                log.info("d_fresh on %s failed; P computes the prompt",
                         c.d_first.name if c.d_first else "no decode node")
                c.path = "pd_fresh"
            else:
                log.info("d_direct on %s failed; recomputing",
                         c.holder.name if c.holder else "its node")
                c.plan = planner.ReusePlan(reuse_tokens=0,
                                           reason=planner.Reason.DECODE_FAILED)
                c.path, c.holder, c.d_first = "recompute", None, None
    return await _run_pd(r, req, c, started)


async def _run_on_decode(r: Router, req: TurnRequest, c: _Choice, started: float) -> Turn:
    """The one leg of a turn whose prompt D computes: `d_direct` on the node holding the
    handle (D's prefix cache has the reused prefix), `d_fresh` on the chosen decode node
    (any healthy one on a retry). D keeps the finished sequence for the next turn."""
    if c.path == "d_direct":
        assert c.holder is not None
        nodes = [c.holder]
        # The superseded handle is released when this request finishes (the kvagent
        # plugin): never offered again, it must not pin D until its TTL.
        rid = remote_request_id(c.handle) if c.handle is not None else None
        params = transfer.with_release(transfer.d_direct(), [rid] if rid else [])
        tokens = c.prompt_len - c.plan.reuse_tokens
    else:
        nodes = r.registry.ranked("decode", c.d_first if c.d_first and c.d_first.healthy
                                  else None)
        params, tokens = transfer.d_direct(), c.est_tokens
    with leg_span(req.span, "decode") as span:
        t0 = time.perf_counter()
        try:
            start = await r.legs.decode(nodes, req.endpoint, decode_body(req.body, params),
                                        stream=req.stream)
        finally:
            req.budget.add("decode", time.perf_counter() - t0)
        span.set_attribute("kvagent.node", start.node.name)
    r.metrics.leg_latency.labels(leg="decode").observe(start.elapsed_s)
    turn = Turn(r, req, c.path, c.plan, None, start, started, body_chars=c.body_chars)
    if c.d_work is not None:
        turn.ahead = planner.tokens_ahead(c.path, c.d_work)
        turn.d_ticket = r.work.begin(start.node.name, prefill_tokens=tokens, stream=True,
                                     now=time.monotonic())
    return turn


async def _run_pd(r: Router, req: TurnRequest, c: _Choice, started: float) -> Turn:
    """The P leg, then the D leg with P's params; P is released if D never comes."""
    if c.path == "pd_reuse":
        assert c.handle is not None
        p_params = planner.reuse_transfer_params(c.handle, c.plan.reuse_tokens)
        if req.shift_blocks and r.settings.test_shift_blocks_header:
            p_params = planner.shifted_blocks(p_params)
            # Wrong KV on purpose: keep it out of the nodes' prefix caches under the
            # tenant's salt, where later requests of the tenant would hit it.
            req.body["cache_salt"] = f"shifted-{uuid.uuid4().hex}"
    elif c.handle is not None and c.holder is not None and r.settings.release_unused_handles:
        p_params = planner.release_transfer_params(c.handle)  # P tells D to free them
    else:
        p_params = transfer.fresh()
    ranked = r.registry.ranked("prefill", c.p_first if c.p_first and c.p_first.healthy
                               else None)
    p_nodes = prefill_candidates(ranked, c.plan, c.path)
    if ranked and not p_nodes:  # no P node left that checks an unverified offer
        assert c.handle is not None  # only a pd_reuse plan is ever unverified
        c.path = "recompute"
        c.plan = planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.NODE_UNHEALTHY,
                                   detail="prefill")
        p_params, p_nodes = planner.release_transfer_params(c.handle), ranked
    queued = c.p_work is not None and bool(p_nodes)
    chars = 0
    if not queued:
        p_tokens = 0
    elif c.path == "pd_reuse":
        p_tokens = c.prompt_len - c.plan.reuse_tokens
    elif c.prompt_len:
        p_tokens = c.prompt_len
    else:  # not tokenized: estimated from the body's size
        chars = c.body_chars or len(fastjson.dumps(req.body))
        p_tokens = r.chars.tokens(chars)
    p_ticket = (r.work.begin(p_nodes[0].name, prefill_tokens=p_tokens, stream=False,
                             now=time.monotonic()) if queued else None)
    forward_ids = forwards_prompt_ids(r.settings, req)
    with leg_span(req.span, "prefill") as span:
        t0 = time.perf_counter()
        try:
            prefill = await r.legs.prefill(p_nodes, req.endpoint, req.body, p_params,
                                           prompt_ids=forward_ids)
        finally:
            req.budget.add("prefill", time.perf_counter() - t0)
            if p_ticket is not None:
                r.work.end(p_ticket, time.monotonic())
        span.set_attribute("kvagent.node", prefill.node.name)
        span.set_attribute("kvagent.pull_failed", prefill.pull_failed)
        verified = prefill.kv_params.get(transfer.VERIFIED_KEY)
        if isinstance(verified, int) and not isinstance(verified, bool):
            prefill.node.checks_pulls_epoch = prefill.node.epoch
            span.set_attribute("kvagent.p_verified_tokens", verified)
    r.metrics.leg_latency.labels(leg="prefill").observe(prefill.elapsed_s)
    if chars and prefill.prompt_tokens:
        r.chars.observe(chars, prefill.prompt_tokens - (prefill.cached_tokens or 0))
    if p_nodes and prefill.node is not p_nodes[0]:
        r.metrics.retries.labels(leg="prefill").inc()
    path, plan = c.path, c.plan
    if prefill.pull_failed and path == "pd_reuse":
        path, plan = "recompute", planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.PULL_FAILED)
    d_nodes = r.registry.ranked("decode", c.d_first if c.d_first and c.d_first.healthy
                                else None)
    # Stable: the rest keep their rank, the nodes that just failed the prompt go last.
    d_nodes.sort(key=lambda n: n.name in c.d_failed)
    # P's lease on its blocks started about now: a D that sees the leg later recomputes.
    read_by = time.time() + r.settings.prefill_lease_s - r.settings.prefill_lease_margin_s
    d_params = transfer.with_read_by(prefill.kv_params, read_by)
    if prefill.prompt_token_ids is not None:
        d_params = transfer.with_prompt_ids(d_params, prefill.prompt_token_ids)
        r.metrics.prompt_ids_forwarded.inc()
        if prefill.first_token is not None and forwards_first_token(r.settings, req):
            d_params = transfer.with_first_token(d_params, prefill.first_token)
            r.metrics.first_tokens_forwarded.inc()
    try:
        with leg_span(req.span, "decode") as span:
            t0 = time.perf_counter()
            try:
                start = await r.legs.decode(d_nodes, req.endpoint,
                                            decode_body(req.body, d_params),
                                            stream=req.stream)
            finally:
                req.budget.add("decode", time.perf_counter() - t0)
            span.set_attribute("kvagent.node", start.node.name)
    except BaseException:
        # Never leave P's blocks leased for a D leg that will not come: an expired lease
        # can hang P (docs/engine.md, "The idle spin and the hang").
        everyone = r.registry.ranked("decode") + [
            n for n in r.registry.role("decode") if not n.healthy]
        ok = await r.legs.release_prefill(everyone, req.endpoint, req.body, prefill)
        r.metrics.prefill_releases.labels(ok=str(ok).lower()).inc()
        raise
    r.metrics.leg_latency.labels(leg="decode").observe(start.elapsed_s)
    if d_nodes and start.node is not d_nodes[0]:
        r.metrics.retries.labels(leg="decode").inc()
    turn = Turn(r, req, path, plan, prefill, start, started)
    if queued:
        assert c.p_work is not None
        turn.ahead = planner.tokens_ahead(path, c.p_work)
        turn.d_ticket = r.work.begin(start.node.name, prefill_tokens=0, stream=True,
                                     now=time.monotonic())
    return turn


#: Bytes of JSON per prompt token id in P's answer, at most ("151935," is 7).
_ID_JSON_BYTES = 8
#: Tokens a chat template may add beyond the text of the body it renders.
_TEMPLATE_TOKENS = 4096


def forwards_prompt_ids(settings: RouterSettings, req: TurnRequest) -> bool:
    """Whether a turn's D leg takes P's prompt token ids (`forward_prompt_ids`): chat
    requests only, and not where vLLM renders the messages anyway (media, `echo`).

    The ids make P's answer larger, and an answer over `max_upstream_body_bytes` would
    leave P's blocks leased with nobody told where they are; so they are asked for only
    when even one token per byte of the body (a bound: a token covers at least one byte
    of the text it encodes) keeps them within half the cap."""
    if not (settings.forward_prompt_ids and req.chat and not req.body.get("echo")
            and not identity.media_parts(req.body)):
        return False
    tokens_at_most = len(fastjson.dumps(req.body)) + _TEMPLATE_TOKENS
    return tokens_at_most * _ID_JSON_BYTES <= settings.max_upstream_body_bytes // 2


def forwards_first_token(settings: RouterSettings, req: TurnRequest) -> bool:
    """Whether a turn's D leg may take P's token (`forward_first_token`): not for `n` > 1,
    whose samples vLLM draws as separate requests that would all start with it."""
    return settings.forward_first_token and req.body.get("n") in (None, 1)


def prefill_candidates(ranked: list[Node], plan: planner.ReusePlan,
                       path: planner.Path) -> list[Node]:
    """The P nodes, in rank order, that a turn's P leg may try: an offer the router did
    not verify (a `pd_reuse` plan made without `/tokenize`) goes only to nodes seen
    checking what they pull (`Node.checks_pulls`), also on a retry."""
    if path != "pd_reuse" or plan.tokenized:
        return ranked
    return [n for n in ranked if n.checks_pulls]


async def _whole_on_decode(r: Router, req: TurnRequest, started: float) -> Turn:
    """Serve a request P/D cannot split on the least loaded decode node, aggregated."""
    body = {k: v for k, v in req.body.items() if k != "kv_transfer_params"}
    body["return_token_ids"] = True
    if req.stream:
        body["stream_options"] = usage_stream_options(body.get("stream_options"))
    with leg_span(req.span, "decode") as span:
        t0 = time.perf_counter()
        try:
            start = await r.legs.decode(r.registry.ranked("decode"), req.endpoint, body,
                                        stream=req.stream)
        finally:
            req.budget.add("decode", time.perf_counter() - t0)
        span.set_attribute("kvagent.node", start.node.name)
    plan = planner.ReusePlan(reuse_tokens=0, reason=planner.Reason.UNSUPPORTED_SHAPE)
    return Turn(r, req, "decode_only", plan, None, start, started)


async def _affinity(r: Router, req: TurnRequest) -> str | None:
    """Without a claimable handle, keep the session on the node it used last."""
    if req.session is None:
        return None
    try:
        latest = await r.store.peek_latest(req.tenant.name, req.session)
    except StoreUnavailable:
        return None  # affinity is an optimisation; the store being down must not fail a turn
    return latest.decode_node if latest is not None else None
