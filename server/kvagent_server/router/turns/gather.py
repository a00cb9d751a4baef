"""Gather: everything a path policy decides on, as one frozen `TurnFacts`.

The only stage that awaits the store or a node's `/tokenize` (and the tier-aware P
placement's lookup): it names the conversation (by content, for a caller that names
none), claims the session's handle, ranks the nodes, snapshots the learned costs and the
work in flight, and tokenizes the prompt when a reuse must be verified, unless the path
the policy would take does not depend on the real tokens (`Untokenized`).

The prompt is tokenized by the P node picked for the turn, or, with no prefill node (the
`single` topology), by the decode node: vLLM serves `/tokenize` on either.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from kvagent_server.router.auth.cache_token import TokenError, verify_binding
from kvagent_server.router.nodes.prompt_ids import TokenizeError, tokenize
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import content, identity, placement, planner
from kvagent_server.router.reuse.queue import IDLE
from kvagent_server.router.store.base import StoreUnavailable
from kvagent_server.router.store.handle import Handle, KVIdentity
from kvagent_server.router.store.records import CONTENT
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.shapes import TurnFacts, TurnRequest, Untokenized

log = logging.getLogger("kvagent.router.turn")

#: Turns whose prompt tokens per message byte were learned before a turn may estimate its
#: delta from its messages' size (and skip `/tokenize`).
MIN_RATIO_SAMPLES = 3
#: Weight of the newest `/tokenize` round trip in the router's running mean of it.
TOKENIZE_EWMA_ALPHA = 0.2


async def gather(r: Router, req: TurnRequest) -> TurnFacts:
    """The turn's facts; awaits the store and the nodes, decides nothing."""
    if not req.splittable:  # served whole on a decode node: nothing to look up
        return TurnFacts(req=req, session=req.session, source=req.source)
    s = r.settings
    picked_p = placement.pick_prefill(r.registry.states())
    p_first = r.registry.get(picked_p.node_id) if picked_p else None
    session, source, known_ids = req.session, req.source, None
    tokenizer = _tokenizer(r, p_first)
    found: tuple[str, list[int] | None] | None = await _find_by_content(r, req, tokenizer)
    if found is None:
        found = await _find_branch(r, req, tokenizer)
    if found is not None:
        session, known_ids = found
        source = "content"
    handle, rejected = await _claim(r, req, session)
    d_node = r.registry.get(handle.decode_node) if handle is not None else None
    holder = d_node if (handle is not None and d_node is not None and d_node.healthy
                        and d_node.epoch == handle.decode_epoch
                        and not handle.expired(time.time())) else None
    p_first = await _tier_placement(r, req, p_first, holder)
    affinity = handle.decode_node if handle else await _affinity(r, req, session)
    picked_d, d_reason = placement.pick_decode(r.registry.states(), affinity=affinity)
    r.metrics.decode_placements.labels(reason=d_reason).inc()
    if req.span is not None:
        req.span.set_attribute("kvagent.decode_placement", d_reason)
    d_first = r.registry.get(picked_d.node_id) if picked_d else None
    costs = r.costs.snapshot()
    p_work = d_work = None
    if s.queue_aware_paths:
        now = time.monotonic()
        p_work = (r.work.work(p_first.name, now=now, per_token_s=costs.prefill.per_token_s)
                  if p_first is not None else IDLE)
        d_work = (r.work.work(d_first.name, now=now, per_token_s=costs.d_direct.per_token_s)
                  if d_first is not None else IDLE)
    new_ident = _identity_of(r, req, [])
    facts = TurnFacts(
        req=req, session=session, source=source, handle=handle, rejected=rejected,
        handle_node_healthy=bool(d_node and d_node.healthy),
        handle_node_epoch=d_node.epoch if d_node else None, holder=holder,
        p_first=p_first, d_first=d_first,
        d_holds=d_first is not None and d_first is holder,
        d_healthy=d_first is not None and d_first.healthy,
        d_kv_usage=d_first.kv_usage if d_first is not None else None,
        prefill_block_size=s.block_size or (p_first.block_size if p_first else None),
        costs=costs, p_work=p_work, d_work=d_work, new_identity=new_ident,
        identity=_check_identity(r, handle, new_ident),
        est_tokens=r.chars.tokens(req.body_chars))
    return await _prompt_ids(r, facts, known_ids)


async def _prompt_ids(r: Router, facts: TurnFacts,
                      known_ids: list[int] | None) -> TurnFacts:
    """The facts with the prompt's token ids where a reuse must be verified: the ids a
    content lookup already has, else a node's `/tokenize` (skipped for an extension
    whose path does not depend on them)."""
    ident, handle = facts.identity, facts.handle
    # A refusal that positions cannot change (model, salt, a field) needs no ids.
    final = ident is not None and ident.cap == 0 and ident.detail != "media_url" and (
        ident.reason != "multimodal_changed")
    if facts.holder is None or final:
        return facts
    assert handle is not None and facts.new_identity is not None  # a holder holds one
    if facts.d_holds and known_ids is None:
        skip = _untokenized(r, facts, handle, facts.new_identity)
        if skip is not None:
            r.metrics.tokenize_skipped.inc()
            if facts.req.span is not None:
                facts.req.span.set_attribute("kvagent.tokenized", False)
            return dataclasses.replace(facts, untokenized=skip)
    if known_ids is None:
        tokenizer = _tokenizer(r, facts.p_first, facts.d_first)
        if tokenizer is None:
            return facts
        try:
            known_ids = await _tokenize(r, facts.req, tokenizer)
        except TokenizeError as exc:
            log.info("no reuse this turn: %s", exc)
            return dataclasses.replace(facts, tokenize_failed=True)
    return dataclasses.replace(
        facts, prompt_ids=tuple(known_ids), identity=_check_identity(
            r, handle, identity.with_positions(facts.new_identity, known_ids,
                                               r.settings.mm_placeholder_token_ids)))


def _untokenized(r: Router, facts: TurnFacts, handle: Handle,
                 new_ident: KVIdentity) -> Untokenized | None:
    """The plan, estimated prompt length and path of a turn that may skip `/tokenize`,
    or None (then it is tokenized and verified as usual).

    It may when its messages repeat the held turn's exactly under the same rendering
    inputs (`identity.extension_chars`), identities agree with no media involved (media
    positions need the ids), and, for any delta from half to twice what the new messages'
    size suggests (past D's last whole block), the policy would take one path
    (`PathPolicy.untokenized_path`): `d_direct`, or `pd_reuse` on a P node that checks
    what it pulls. Either way the node matches the real tokens itself (D's prefix cache;
    P's `pull_check` against the blocks' digests), so the answer is the one a recompute
    gives; a wrong estimate costs time, not correctness."""
    s, req, ident = r.settings, facts.req, facts.identity
    if (not s.skip_tokenize_extensions or not req.chat or ident is None
            or ident.reason is not None or new_ident.media or handle.identity is None
            or handle.identity.media or r.message_chars.samples < MIN_RATIO_SAMPLES
            or r.tokenize_s is None):
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
    path = r.policy.untokenized_path(facts, plan, (tail + max(1, new // 2), tail + 2 * new),
                                     r.tokenize_s)
    if path is None:
        return None
    return Untokenized(plan=plan, prompt_len=plan.reuse_tokens + tail + new, path=path)


def _tokenizer(r: Router, p_first: Node | None, d_first: Node | None = None) -> Node | None:
    """The node that tokenizes the turn's prompt: the P node picked for it, or with no
    prefill node (`single`) the decode node (`d_first`, else the least loaded)."""
    if p_first is not None or r.registry.topology != "single":
        return p_first
    if d_first is not None:
        return d_first
    ranked = r.registry.ranked("decode")
    return ranked[0] if ranked else None


async def _tier_placement(r: Router, req: TurnRequest, p_first: Node | None,
                          holder: Node | None) -> Node | None:
    """With no D handle to reuse, a P node whose KV cache (any tier) holds the prompt's
    prefix may beat the least loaded one (`turns.kv_placement`). With no prefill node
    there is nothing to place."""
    if r.registry.topology == "single":
        return None
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
    return p_first


async def _find_by_content(r: Router, req: TurnRequest,
                           tokenizer: Node | None) -> tuple[str, list[int]] | None:
    """For a turn that names no conversation: tokenize the prompt and name the session of
    the caller's held turn it extends, else a new one (the turn's handle starts it).

    Returns the session and the prompt's token ids (the plan verifies the handle against
    them), or None: the turn names its conversation, content reuse is off, or the prompt
    could not be tokenized (the turn then runs without a session)."""
    if (req.session is not None or req.source is not None or not r.settings.reuse
            or not r.settings.content_reuse or tokenizer is None):
        return None
    try:
        prompt_ids = await _tokenize(r, req, tokenizer)
    except TokenizeError as exc:
        log.info("no content lookup this turn: %s", exc)
        return None
    try:
        session = await _held_session(r, req, prompt_ids)
    except StoreUnavailable:
        r.metrics.miss("store_unavailable")
        session = None
    if req.span is not None:
        req.span.set_attribute("kvagent.content_hit", session is not None)
    name = session or req.tenant.session_key(f"anon-{uuid.uuid4().hex}")
    assert name is not None  # session_key names any given id
    return name, prompt_ids


async def _find_branch(r: Router, req: TurnRequest,
                       tokenizer: Node | None) -> tuple[str, list[int] | None] | None:
    """For a turn of a named session, sent without a cache token, that does not continue
    the session's latest held turn (it chains onto an earlier response than the latest,
    or another conversation shares the session id): its own branch, so it neither claims
    nor replaces the owner's handle. The branch's earlier turn is found by content, as for
    a caller that names no conversation; else the turn starts a new branch. None: the turn
    continues the latest (or nothing tells), and claims it as before."""
    if (req.session is None or req.token is not None or not req.chat
            or not r.settings.reuse):
        return None
    try:
        held = await r.store.peek_latest(req.tenant.name, req.session)
    except StoreUnavailable:
        return None
    if held is None or identity.continues(held.identity, req.body) is not False:
        return None
    log.debug("turn does not continue its session's latest handle: a branch")
    branch = f"{req.session}~{uuid.uuid4().hex[:16]}"
    if not r.settings.content_reuse or tokenizer is None:
        return branch, None
    try:
        prompt_ids = await _tokenize(r, req, tokenizer)
    except TokenizeError as exc:
        log.info("no branch lookup this turn: %s", exc)
        return branch, None
    try:  # never the session it branches from: that handle is the owner's
        found = await _held_session(r, req, prompt_ids, exclude=req.session)
    except StoreUnavailable:
        found = None
    return found or branch, prompt_ids


async def _held_session(r: Router, req: TurnRequest, prompt_ids: list[int],
                        exclude: str | None = None) -> str | None:
    """The session of the caller's held turn this prompt extends: the longest indexed
    prefix of the prompt, then the newest turn under it whose whole prompt the new one
    repeats (`content.extends`); never `exclude`."""
    tenant = req.tenant
    keys = [content.caller_key(tenant.caller, k)
            for k in content.lookup_keys(prompt_ids, tenant.cache_salt)]
    found = await r.store.find_record(tenant.name, CONTENT, keys) if keys else None
    for prompt_len, session in content.entries(found[1]) if found is not None else ():
        if session == exclude:
            continue
        held = await r.store.peek_latest(tenant.name, session)
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


async def _claim(r: Router, req: TurnRequest,
                 session: str | None) -> tuple[Handle | None, str | None]:
    """The handle this turn may reuse, or why there is none (never raises)."""
    if session is None or not r.settings.reuse:
        return None, None
    try:
        return await _claim_from_store(r, req, session)
    except StoreUnavailable as exc:
        log.warning("session store unavailable (%s): recomputing this turn", type(exc).__name__)
        return None, "store_unavailable"


async def _claim_from_store(r: Router, req: TurnRequest,
                            session: str) -> tuple[Handle | None, str | None]:
    tenant = req.tenant.name
    if req.token is None:
        return await r.store.claim_latest(tenant, session), None
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
    mismatch = verify_binding(claims, tenant, session)
    if mismatch is not None:
        return None, mismatch
    handle = await r.store.claim(tenant, claims.handle)
    if handle is not None and (handle.tenant, handle.session) != (tenant, session):
        # Only a holder of the signing key can name another session's handle: use it
        # neither for reuse nor to release its blocks (reliability.md, Hostile input).
        return None, "other_session"
    return handle, None if handle is not None else "already_used"


async def _affinity(r: Router, req: TurnRequest, session: str | None) -> str | None:
    """Without a claimable handle, keep the session on the node it used last."""
    if session is None:
        return None
    try:
        latest = await r.store.peek_latest(req.tenant.name, session)
    except StoreUnavailable:
        return None  # affinity is an optimisation; the store being down must not fail a turn
    return latest.decode_node if latest is not None else None


def _identity_of(r: Router, req: TurnRequest, prompt_ids: list[int]) -> KVIdentity:
    s = r.settings
    return identity.identity_of(req.body, chat=req.chat, prompt_ids=prompt_ids,
                                placeholder_ids=s.mm_placeholder_token_ids,
                                extra_unverifiable=s.identity_unverifiable_fields)


def _check_identity(r: Router, handle: Handle | None,
                    new: KVIdentity) -> identity.IdentityCheck | None:
    """The handle's KV identity against this prompt's (None: no handle to check)."""
    if handle is None:
        return None
    return identity.check(handle.identity, new, trust_urls=r.settings.trust_media_urls)
