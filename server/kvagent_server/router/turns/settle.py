"""Settle: after the answer is relayed, learn from it and hand the next turn its KV.

The one stage that writes what the router learns (`Router.learned`): from the executed
turn and D's answer (`Capture`) it teaches the costs, the token ratios, the `/tokenize`
round trip, which P node checks its pulls and the tools' pauses; then it counts the
reuse, records D's retained blocks as the session's latest handle with how the turn
ended (or lets D free them when nothing will ever claim them) and mints the cache token
naming that handle.
"""

from __future__ import annotations

import logging
import time

from kvagent_server.router.nodes.legs import usage_cached
from kvagent_server.router.nodes.retention import remote_request_id
from kvagent_server.router.reuse import content, identity, planner, transfer
from kvagent_server.router.store.base import StoreUnavailable
from kvagent_server.router.store.handle import Handle, TurnEnd, new_handle_id
from kvagent_server.router.store.records import CONTENT
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.shapes import Capture, Final, Turn

log = logging.getLogger("kvagent.router.turn")


async def settle(r: Router, turn: Turn, capture: Capture) -> Final:
    """The turn's `kvagent` object (cache token, reuse, path) once D's answer is in."""
    t0 = time.perf_counter()
    try:
        return await _settle(r, turn, capture)
    finally:
        turn.req.budget.add("finalize", time.perf_counter() - t0)


#: The paths that serve a verified prefix of the claimed handle's KV.
_REUSING = ("pd_reuse", "d_direct", "d_pull")


async def _settle(r: Router, turn: Turn, capture: Capture) -> Final:
    req, plan = turn.req, turn.plan
    usage = capture.usage or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    # a P path reuses only what its plan loads from P's own cache and tiers (tier_path)
    planned = plan.reuse.reuse_tokens if plan.path in _REUSING or plan.tier else 0
    # What the serving node reports as not recomputed; the plan when it reports nothing.
    if turn.prefill is not None:
        reported = turn.prefill.cached_tokens
        prompt_tokens = prompt_tokens or turn.prefill.prompt_tokens
    else:
        reported = usage_cached(usage)
    cached = reported if reported is not None else planned
    _learn_from_legs(r, turn)
    if req.chat and prompt_tokens and r.skips_tokenize:
        r.learned.message_chars.observe(identity.message_chars(req.body.get("messages")),
                                        prompt_tokens)
    # A pull (`pd_reuse`, `d_pull`) reuses at most what was offered, a P leg loading its
    # tiers what was planned; D's prefix cache (`d_direct`) what it matched.
    reused = cached if plan.path == "d_direct" else min(planned, cached)
    _account(r, turn, prompt_tokens, cached, reused)
    end = TurnEnd.of(capture.finish_reason, capture.tool_names, time.time())
    _learn_pause(r, turn, end)
    recorded, token, expires_in = await _record(r, turn, capture, end)
    if not recorded:
        _release_unrecorded(r, turn, capture)
    kvagent = {"cache_token": token, "reused_tokens": reused, "expires_in": expires_in,
               "path": plan.path, "reason": plan.reuse.label}
    return Final(kvagent=kvagent, cached_tokens=cached)


def _learn_from_legs(r: Router, turn: Turn) -> None:
    """What the turn's legs taught: the `/tokenize` round trip it made, whether its P
    node checks what it pulls, and tokens per byte of a P prompt it did not tokenize."""
    learned = r.learned
    took = turn.req.budget.stages.get("tokenize")
    if took is not None:
        learned.observe_tokenize(took)
    prefill = turn.prefill
    if prefill is None:
        return
    if transfer.answered_verified(prefill.kv_params) is not None:
        learned.observe_checks_pulls(prefill.node.name, prefill.node.epoch)
    if turn.p_chars and prefill.prompt_tokens:
        learned.chars.observe(turn.p_chars,
                              prefill.prompt_tokens - (prefill.cached_tokens or 0))
        learned.prompt_chars.observe(turn.p_chars, prefill.prompt_tokens)


def _account(r: Router, turn: Turn, prompt_tokens: int, cached: int, reused: int) -> None:
    m, plan = r.metrics, turn.plan
    m.paths.labels(path=plan.path).inc()
    m.reused_tokens.inc(reused)
    m.recomputed_tokens.inc(max(0, prompt_tokens - cached))
    if reused:
        m.reuse_hits.inc()
    elif plan.reuse.reuses:
        m.miss("node_recomputed")  # planned, but the node reports nothing cached
    elif plan.reuse.reason not in planner.FRESH_REASONS:
        m.miss(plan.reuse.reason.value)
    if plan.path == "d_fresh" and prompt_tokens:  # D computed a prompt it was estimated by
        r.learned.chars.observe(turn.req.body_chars, max(0, prompt_tokens - cached))
        r.learned.prompt_chars.observe(turn.req.body_chars, prompt_tokens)
    # a tier load's time is not the path's line (it would read as D's fixed cost)
    if (turn.first_byte_at is not None and prompt_tokens and plan.path != "decode_only"
            and plan.tier is None):
        ttft = turn.first_byte_at - turn.started
        try:
            r.learned.costs.observe(plan.path, max(0, prompt_tokens - cached), ttft,
                            reused_tokens=reused, ahead_tokens=turn.ahead)
        except ValueError:
            pass


def _learn_pause(r: Router, turn: Turn, end: TurnEnd) -> None:
    """The gap since the session's last turn ended on tool calls is their pause (what
    retention expects of them next time); then this turn's end is the session's last."""
    session, tenant = turn.facts.session, turn.req.tenant.name
    if session is None:
        return
    claimed = turn.facts.handle
    r.learned.pauses.resumed(tenant, session, turn.facts.now,
                             claimed.end if claimed is not None else None)
    r.learned.pauses.ended(tenant, session, end)


def _release_unrecorded(r: Router, turn: Turn, capture: Capture) -> None:
    """D retained this turn's blocks, but no handle records them (no session, reuse
    off, store down...): nobody can ever reuse them, so let D free them now."""
    params = capture.kv_params
    rid = params.get(transfer.REMOTE_REQUEST_ID) if isinstance(params, dict) else None
    if r.retention is not None and isinstance(rid, str) and rid:
        r.retention.queue.add(turn.decode.node.name, [rid])


async def _release_evicted(r: Router, handles: list[Handle] | None) -> None:
    """Handles the store evicted to make room (the tenant's quota, its bounds) are
    claimed, so nobody can reuse them: let their decode nodes free the blocks now (their
    conversations spilled to those nodes' tiers, where they have some)."""
    if handles and r.spills is not None:
        await r.spills.record(handles)
    if not handles or r.retention is None:
        return  # without the retention guard they are freed at D's TTL
    for handle in handles:
        node = r.registry.get(handle.decode_node)
        rid = remote_request_id(handle)
        if node is not None and node.epoch == handle.decode_epoch and rid is not None:
            r.retention.queue.add(node.name, [rid])


async def _record(r: Router, turn: Turn, capture: Capture,
                  end: TurnEnd) -> tuple[bool, str | None, int]:
    """Record D's retained blocks as the session's latest handle: whether it was
    recorded, and the cache token naming it (none for a session the client did not
    name: found by content, it has nothing to carry) with its lifetime."""
    facts, req = turn.facts, turn.req
    s = r.settings
    ttl = int(s.retention.decode_blocks_ttl_s - s.token_safety_margin_s)
    sequence = capture.sequence
    if (facts.session is None or capture.kv_params is None or not sequence or ttl <= 0
            or not s.reuse):
        return False, None, 0
    node = turn.decode.node
    block_size = s.nodes.block_size or node.block_size
    if block_size is None:
        log.warning("block size of %s unknown: set router.nodes.block_size", node.name)
        return False, None, 0
    now = time.time()
    ident = identity.identity_of(
        req.body, chat=req.chat, prompt_ids=capture.prompt_token_ids or [],
        placeholder_ids=s.identity.mm_placeholder_token_ids,
        extra_unverifiable=s.identity.unverifiable_fields,
        history=r.skips_tokenize)
    handle = Handle(handle_id=new_handle_id(), tenant=req.tenant.name, session=facts.session,
                    decode_node=node.name, decode_epoch=node.epoch,
                    kv_transfer_params=capture.kv_params, token_ids=sequence,
                    block_size=block_size, created_at=now, expires_at=now + ttl,
                    identity=ident, end=end,
                    # what a tiered node's tiers keep of it once given up (nodes.spills);
                    # only then, as a router of an earlier version cannot read the field
                    prompt_tokens=(len(capture.prompt_token_ids or ()) or None)
                    if r.spills is not None else None)
    if transfer.retained_tokens(handle) is None:
        log.warning("decode node %s returned unusable kv_transfer_params", node.name)
        return False, None, 0
    try:
        evicted = await r.store.put(handle)
    except StoreUnavailable as exc:
        log.warning("session store unavailable (%s): no cache token this turn",
                    type(exc).__name__)
        r.metrics.miss("store_unavailable")
        return False, None, 0
    await _release_evicted(r, evicted)
    if facts.source == "content":
        await _index_content(r, turn, handle, len(capture.prompt_token_ids or ()))
        return True, None, 0
    token = r.codec.encode(tenant=req.tenant.name, session=facts.session,
                           handle=handle.handle_id, iat=int(now), exp=int(now) + ttl)
    return True, token, ttl


async def _index_content(r: Router, turn: Turn, handle: Handle, prompt_len: int) -> None:
    """Index a held turn of a caller that names no conversation under its tokens, so its
    next turn finds the session (`reuse.content`). Best effort: a lost update (another
    replica writing the same key at once) or a store down costs that turn a recompute."""
    tenant = turn.req.tenant
    keys = [content.caller_key(tenant.caller, k)
            for k in content.held_keys(prompt_len, handle.token_ids, tenant.cache_salt)]
    try:
        items = [(key, content.add_entry(
            await r.store.get_record(tenant.name, CONTENT, key), prompt_len,
            handle.session)) for key in keys]
        await r.store.put_records(tenant.name, CONTENT, items,
                                  handle.expires_at - time.time())
    except StoreUnavailable:
        r.metrics.miss("store_unavailable")

