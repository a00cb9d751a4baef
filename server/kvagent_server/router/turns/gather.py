"""Gather: everything a path policy decides on, as one frozen `TurnFacts`.

The only stage that awaits the store or a node's `/tokenize` (and the tier-aware P
placement's lookup): it names the conversation (by content, for a caller that names
none), claims the session's handle, collects every node as a candidate with its work
in flight (decide places the turn), and snapshots what earlier turns taught
(`Router.learned`). It decides nothing, and learns nothing (settle does).

The prompt's token ids are gathered when decide asks for them (`with_prompt_ids`: a
reuse to verify, whose path depends on the real tokens), or along the way when a content
lookup or the tier lookup needed them; a turn is tokenized at most once. The prompt is
tokenized by the least loaded P node, or, with no prefill node (the `single` and
`replicas` topologies), by the least loaded decode node: vLLM serves `/tokenize` on either.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from kvagent_server.router.auth.cache_token import TokenError, verify_binding
from kvagent_server.router.kv.tiers import NodeTierHits
from kvagent_server.router.nodes.prompt_ids import TokenizeError, tokenize
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.nodes.tier_placement import KeyMemo
from kvagent_server.router.reuse import content, identity, placement
from kvagent_server.router.reuse.paths import PathCosts
from kvagent_server.router.reuse.spill import Spilled
from kvagent_server.router.store.base import StoreUnavailable
from kvagent_server.router.store.handle import Handle, KVIdentity
from kvagent_server.router.store.records import CONTENT
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.shapes import NodeFacts, TierFacts, TurnFacts, TurnRequest

log = logging.getLogger("kvagent.router.turn")


async def gather(r: Router, req: TurnRequest) -> TurnFacts:
    """The turn's facts; awaits the store and the nodes, decides nothing."""
    if not req.splittable:  # served whole on a decode node: nothing to look up
        return TurnFacts(req=req, session=req.session, source=req.source)
    s = r.settings
    session, source, known_ids = req.session, req.source, None
    tokenizer = _tokenizer(r)
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
    tiers = await _tier_facts(r, req, tokenizer, holder, known_ids)
    spilled = await _spilled(r, req, session) if handle is None else None
    affinity = handle.decode_node if handle else (
        spilled.spill.node if spilled else await _affinity(r, req, session))
    costs, learned = r.learned.costs.snapshot(), r.learned.view()
    new_ident = _identity_of(r, req, [])
    facts = TurnFacts(
        req=req, session=session, source=source, handle=handle, rejected=rejected,
        handle_node_healthy=bool(d_node and d_node.healthy),
        handle_node_epoch=d_node.epoch if d_node else None, holder=holder,
        candidates=_candidates(r, costs), affinity=affinity, tiers=tiers, spilled=spilled,
        counts_work=r.counts_work, prefill_block_size=s.nodes.block_size,
        costs=costs, learned=learned, est_tokens=learned.estimate_tokens(req.body_chars),
        new_identity=new_ident, identity=_check_identity(r, _held(handle, spilled), new_ident),
        tokenizable=tokenizer is not None)
    if known_ids is not None and facts.ids_matter:
        # what the content lookup tokenized is the prompt: no second /tokenize
        return _with_ids(r, facts, known_ids)
    return facts


async def with_prompt_ids(r: Router, facts: TurnFacts) -> TurnFacts:
    """The facts with the prompt's token ids, which decide asked for (a reuse to
    verify): tokenized by the node that would tokenize it, or why there are none."""
    tokenizer = _tokenizer(r)
    if tokenizer is None:
        return dataclasses.replace(facts, ids_gathered=True)
    try:
        ids = await _tokenize(r, facts.req, tokenizer)
    except TokenizeError as exc:
        log.info("no reuse this turn: %s", exc)
        return dataclasses.replace(facts, tokenize_failed=True, ids_gathered=True)
    return _with_ids(r, facts, ids)


def _with_ids(r: Router, facts: TurnFacts, ids: list[int]) -> TurnFacts:
    """The facts with the prompt's ids, and the identity checked with their positions."""
    new = facts.new_identity
    assert new is not None
    return dataclasses.replace(
        facts, prompt_ids=tuple(ids), ids_gathered=True,
        spilled=_spill_reach(r, facts, ids), identity=_check_identity(
            r, _held(facts.handle, facts.spilled), identity.with_positions(
                new, ids, r.settings.identity.mm_placeholder_token_ids)))


def _held(handle: Handle | None, spilled: Spilled | None) -> Handle | None:
    """The handle whose KV identity the prompt's is checked against: the claimed one, or
    the one a spill kept."""
    return handle if handle is not None else (spilled.handle if spilled else None)


async def _spilled(r: Router, req: TurnRequest, session: str | None) -> Spilled | None:
    """The session's spill to a decode node's KV tiers (nodes.spills), for a turn that
    claimed no handle; None: none recorded, or nothing spills here."""
    if r.spills is None or session is None or not r.settings.reuse:
        return None
    found = await r.spills.find(req.tenant.name, session)
    if found is None:
        return None
    return Spilled(found[0], found[1], costs=r.tier_costs.costs())


def _spill_reach(r: Router, facts: TurnFacts, ids: list[int]) -> Spilled | None:
    """The spill with what the nodes' KV events show of this prompt's prefix, in tokens:
    still in the holding node's tiers (the host tier's reach, then the disk's), and in
    each P node's cache and tiers; unknown (None, or a P node left out) where a node
    publishes no events or none from its tiers yet."""
    spilled = facts.spilled
    if spilled is None or r.tiers is None:
        return spilled
    salt = facts.req.body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    bs = spilled.handle.block_size
    memo: KeyMemo = {}  # the holder and the P nodes hash alike: the prompt is hashed once
    p_reach: dict[str, NodeTierHits] = {}
    for node in r.registry.nodes.values():
        hits = r.tiers.reach(node.name, ids, block_size=node.block_size or bs,
                             cache_salt=salt, memo=memo) if node.role == "prefill" else None
        if hits is not None:
            p_reach[node.name] = hits
    reach = r.tiers.reach(spilled.spill.node, ids, block_size=bs, cache_salt=salt, memo=memo)
    if reach is not None:
        spilled = dataclasses.replace(spilled, host_reach=reach.cpu, disk_reach=reach.disk)
    return dataclasses.replace(spilled, p_reach=p_reach)


def _tokenizer(r: Router) -> Node | None:
    """The node that tokenizes the turn's prompt: the least loaded healthy P node, or with
    no prefill node (`single`, `replicas`) the least loaded decode node."""
    if r.registry.has_prefill:
        picked = placement.pick_prefill(r.registry.states())
        return r.registry.get(picked.node_id) if picked is not None else None
    ranked = r.registry.ranked("decode")
    return ranked[0] if ranked else None


def _candidates(r: Router, costs: PathCosts) -> tuple[NodeFacts, ...]:
    """Every node as placement weighs it: its state (legs in flight), work in flight (where
    the policy reads it: `Router.counts_work`), KV usage and block size: plain values read
    from the router's ledger of legs now, which decide reads and cannot change."""
    s, now = r.settings, time.monotonic()
    out = []
    for node in r.registry.nodes.values():
        work = None
        if r.counts_work:
            line = costs.prefill if node.role == "prefill" else costs.d_direct
            work = r.ledger.work(node.name, now=now, per_token_s=line.per_token_s)
        out.append(NodeFacts(node=node, state=r.registry.state(node), work=work, kv_usage=node.kv_usage,
                             block_size=s.nodes.block_size or node.block_size))
    return tuple(out)


async def _tier_facts(r: Router, req: TurnRequest, tokenizer: Node | None,
                      holder: Node | None, known_ids: list[int] | None) -> TierFacts | None:
    """With no D handle to reuse, where each P node's KV cache (any tier) holds the
    prompt's prefix (`nodes.tier_placement`), when matching can change the P choice; the
    prompt is tokenized for it unless a content lookup already did. None: not looked up."""
    if (holder is not None or r.tiers is None or tokenizer is None
            or not r.registry.has_prefill):
        return None
    states = r.registry.states()
    if not r.tiers.wants(states):
        return None
    ids = known_ids
    if ids is None:
        try:
            ids = await _tokenize(r, req, tokenizer)
        except TokenizeError as exc:
            log.info("tier placement skipped: %s", exc)
            return None
    salt = req.body.get("cache_salt")
    hits, bs = r.tiers.hits(states, ids, cache_salt=salt if isinstance(salt, str) else None,
                            default_block_size=tokenizer.block_size)
    return TierFacts(hits=hits, block_size=bs, prompt_tokens=len(ids),
                     costs=r.tier_costs.costs())


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
    branch = f"{req.session}~{uuid.uuid4().hex[:16]}"
    prompt_ids = None
    if r.settings.content_reuse and tokenizer is not None:
        try:
            prompt_ids = await _tokenize(r, req, tokenizer)
        except TokenizeError as exc:
            log.info("no branch lookup this turn: %s", exc)
    if prompt_ids is not None:
        try:  # never the session it branches from: that handle is the owner's
            branch = await _held_session(r, req, prompt_ids, exclude=req.session) or branch
        except StoreUnavailable:
            pass
    # INFO: why a named session's turn gets no cache token (a branch is found by content)
    log.info("session %s: the turn does not continue the session's latest held turn; "
             "served as its branch %s", req.session, branch)
    return branch, prompt_ids


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
    """The prompt's token ids from `node`, timed into the turn's budget (settle learns
    the round trip from it: what a turn that skips it saves)."""
    t0 = time.perf_counter()
    try:
        return await tokenize(r.legs.client(node), node.url, req.body, chat=req.chat)
    finally:
        req.budget.add("tokenize", time.perf_counter() - t0)


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
                                placeholder_ids=s.identity.mm_placeholder_token_ids,
                                extra_unverifiable=s.identity.unverifiable_fields)


def _check_identity(r: Router, handle: Handle | None,
                    new: KVIdentity) -> identity.IdentityCheck | None:
    """The handle's KV identity against this prompt's (None: no handle to check)."""
    if handle is None:
        return None
    return identity.check(handle.identity, new, trust_urls=r.settings.identity.trust_media_urls)
