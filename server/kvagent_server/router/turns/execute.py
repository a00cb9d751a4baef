"""Execute: run a plan's legs and open the decode leg the client's answer comes from.

`d_direct`, `d_fresh` and `d_pull` are one leg on a decode node; the P/D paths run the
P leg, then the D leg with P's params (P's blocks are released if D never comes);
`decode_only` sends the request whole to a decode node. A leg that fails before its
first byte falls back as `TurnPlan.after_decode_failure` says; a pull P could not make
is a recompute. With no prefill node (the `single` and `replicas` topologies) a
recompute is a `d_fresh` leg: no turn ever needs P there. A turn whose prompt a node
computes while another node holds the handle it claimed (a session that moved) has that
node release it (`_release_elsewhere`).

Every leg carries the transfer params the plan chose (`TurnPlan.prefill_params`,
`decode_params`); execute chooses nothing of its own beyond the fallbacks the plan
describes, and learns nothing (settle does, from the `Turn` it hands on).

Every leg is opened in the router's ledger (`nodes.ledger`) before it is sent, with the
work it carries, and closed once: a P leg here when its answer is in (or it failed), a D
leg by the `Turn` that owns it (`Turn.close`), or here if no turn comes of it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvagent_server.router.nodes.admission import Admitted, NoRoom
from kvagent_server.router.nodes.ledger import blocks_for
from kvagent_server.router.nodes.legs import (
    DecodeStart,
    LegError,
    decode_body,
    usage_stream_options,
)
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.nodes.retention import remote_request_id
from kvagent_server.router.reuse import paths, planner, transfer
from kvagent_server.router.store.handle import Handle, handle_blocks
from kvagent_server.router.telemetry.spans import leg_span
from kvagent_server.router.turns import tier_path
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.shapes import Turn, TurnFacts, TurnPlan, TurnRequest

log = logging.getLogger("kvagent.router.turn")


async def execute(r: Router, facts: TurnFacts, plan: TurnPlan, started: float) -> Turn:
    """Run the plan's legs; the returned turn's D response is open, unread."""
    _record_decision(r, facts, plan)
    if plan.path == "decode_only":
        return await _whole_on_decode(r, facts, plan, started)
    if plan.path in _ONE_LEG:
        try:
            turn = await _run_on_decode(r, facts, plan, started)
        except NoRoom:
            raise  # P would need the same room on D
        except LegError as exc:
            if exc.status < 500:
                raise
            failed = plan.holder if plan.path == "d_direct" else plan.d_first
            log.info("%s on %s failed; %s", plan.path,
                     failed.name if failed else "no decode node",
                     "P computes the prompt" if plan.path == "d_fresh" else "recomputing")
            if _no_prefill(r) and plan.path == "d_fresh":
                raise  # D was all there was (and its leg was retried)
            plan = plan.after_decode_failure(exc.tried)
        else:
            if turn is not None:
                return turn
            if (back := _reloaded(r, facts, plan)) is not None:
                turn = await _run_on_decode(r, facts, back, started)
                assert turn is not None  # it pins no handle, so none is revoked
                return turn
            plan = plan.without_room()
        if _no_prefill(r):  # recompute on D: the one decode node computes the prompt
            return await _recompute_on_decode(r, facts, plan, started)
    return await _run_pd(r, facts, plan, started)


def _reloaded(r: Router, facts: TurnFacts, plan: TurnPlan) -> TurnPlan | None:
    """Where there is no P, a `d_direct` turn whose handle was given up for room while
    it waited loads that prefix from the node's tiers instead (`tier_path.reloaded`)."""
    if not _no_prefill(r) or r.spills is None or plan.holder is None:
        return None
    back = tier_path.reloaded(plan, r.spills.tiers.get(plan.holder.name),
                              threshold=r.settings.nodes.kv_recompute_threshold,
                              now=time.time())
    if back is not None:
        _record_decision(r, facts, dataclasses.replace(back, p_reason=None, d_reason=None))
    return back


#: The paths served by one leg on a decode node, which computes the prompt (or its delta).
_ONE_LEG = paths.ON_DECODE | {"d_pull"}


def _record_decision(r: Router, facts: TurnFacts, plan: TurnPlan) -> None:
    """Count what decide chose: the nodes and why, and a plan made without /tokenize."""
    span = facts.req.span
    if plan.p_reason is not None:
        r.metrics.placements.labels(reason=plan.p_reason).inc()
        if span is not None:
            span.set_attribute("kvagent.placement", plan.p_reason)
    if plan.d_reason is not None:
        r.metrics.decode_placements.labels(reason=plan.d_reason).inc()
        if span is not None:
            span.set_attribute("kvagent.decode_placement", plan.d_reason)
    if plan.tier_source is not None:  # a spilled prefix loaded from a tier (tier_path)
        r.metrics.tier_reuse.labels(source=plan.tier_source).inc()
        if span is not None:
            span.set_attribute("kvagent.reuse_source", plan.tier_source)
    if not plan.reuse.tokenized:
        r.metrics.tokenize_skipped.inc()
        if span is not None:
            span.set_attribute("kvagent.tokenized", False)


def _no_prefill(r: Router) -> bool:
    return not r.registry.has_prefill


async def _recompute_on_decode(r: Router, facts: TurnFacts, plan: TurnPlan,
                               started: float) -> Turn:
    """A `d_direct` or `d_pull` turn whose reuse fell through (D failed it, or gave its
    handle up for room) where there is no P: a decode node computes the prompt whole
    (`d_fresh`, keeping why the reuse did not happen), one that did not fail first."""
    fresh = dataclasses.replace(plan, path="d_fresh",
                                est_tokens=plan.prompt_len or plan.est_tokens)
    turn = await _run_on_decode(r, facts, fresh, started)
    assert turn is not None  # a d_fresh leg pins no handle, so none is revoked
    return turn


#: vLLM's default block size, for a node that has not said its own yet.
_VLLM_BLOCK_SIZE = 16


def _block_size(r: Router, node: Node) -> int:
    return node.block_size or r.settings.nodes.block_size or _VLLM_BLOCK_SIZE


async def _admit(r: Router, node: Node | None, leg: int | None, blocks: int, *,
                 pinned: Handle | None = None, freed_by_p: bool = False) -> Admitted | None:
    """Room for `blocks` blocks on `node` for the D leg `leg` (nodes/admission.py); None
    without a gate. `NoRoom` (a 503) when the node found none in time."""
    if r.gate is None or node is None or leg is None:
        return None
    rid = remote_request_id(pinned) if pinned is not None else None
    return await r.gate.admit(node, leg, blocks, pinned=rid,
                              pinned_blocks=handle_blocks(pinned) if pinned else 0,
                              freed_by_p=freed_by_p)


def _open_decode(r: Router, node: Node | None, tokens: int) -> int | None:
    """The D leg in the ledger, for `node`, before it is admitted and sent: `tokens` of
    prompt for D to compute, then a stream (None: no decode node to open it for)."""
    if node is None:
        return None
    return r.ledger.open(node.name, role="decode", tokens=tokens, stream=True,
                         sent=False, now=time.monotonic())


def _close(r: Router, leg: int | None) -> None:
    if leg is not None:
        r.ledger.close(leg, time.monotonic())


async def _run_on_decode(r: Router, facts: TurnFacts, plan: TurnPlan,
                         started: float) -> Turn | None:
    """The one leg of a turn whose prompt D computes: `d_direct` on the node holding the
    handle (D's prefix cache has the reused prefix), `d_fresh` on the chosen decode node
    (any healthy one on a retry), `d_pull` on the node the session moved to (it pulls the
    prefix from the holder first). D keeps the finished sequence for the next turn.

    None: the handle was given up, while the turn waited for room, to make room for
    another (it recomputes)."""
    req = facts.req
    if plan.path == "d_direct":
        assert plan.holder is not None
        nodes = [plan.holder]
        tokens = plan.prompt_len - plan.reuse.reuse_tokens
        pinned = plan.handle
    else:
        nodes = r.registry.ranked("decode", _healthy(plan.d_first))
        nodes.sort(key=lambda n: n.name in plan.d_failed)  # stable: failed ones last
        tokens, pinned = plan.est_tokens, None
        if plan.path == "d_pull":
            tokens = plan.prompt_len - plan.reuse.reuse_tokens
    target = nodes[0] if nodes else None
    # D frees the handle the turn supersedes or does not reuse when this request ends
    params = plan.decode_params(target)
    # a retained prefix is on D already; one loaded from a tier needs blocks too
    held = tokens if plan.path == "d_direct" and plan.tier is None else _prompt_tokens(
        facts, plan)
    leg = _open_decode(r, target, tokens)
    try:
        admitted = await _admit(r, target, leg, blocks_for(held, _block_size(r, target))
                                if target else 0, pinned=pinned)
        if admitted is not None and admitted.revoked:
            _close(r, leg)
            return None
        body = decode_body(req.body, params)
        if plan.path == "d_pull" and plan.legs.shift_blocks:
            body["cache_salt"] = f"shifted-{uuid.uuid4().hex}"  # as `_run_pd` does
        start = await _send_decode(r, req, nodes, body, leg)
    except BaseException:
        _close(r, leg)
        raise
    r.metrics.leg_latency.labels(leg="decode").observe(start.elapsed_s)
    if plan.path == "d_fresh":
        _release_elsewhere(r, plan, start.node)
    turn = Turn(r.ledger, facts, plan, None, start, started, leg=leg)
    if plan.d_work is not None:
        turn.ahead = paths.tokens_ahead(plan.path, plan.d_work)
    return turn


def _release_elsewhere(r: Router, plan: TurnPlan, served: Node) -> None:
    """A turn computed on `served` while the handle it claimed and does not reuse is held
    by another node (its session moved, or a pull failed): that node frees the blocks at
    the retention guard's next round (without the guard they stay until the TTL). Its
    own node frees them through the leg's params instead (`TurnPlan.decode_params`)."""
    handle, holder = plan.handle, plan.holder
    if (handle is None or holder is None or holder is served or r.retention is None
            or not plan.legs.release_unused):
        return
    rid = remote_request_id(handle)
    if rid is not None:
        r.retention.queue.add(holder.name, [rid])


async def _run_pd(r: Router, facts: TurnFacts, plan: TurnPlan, started: float) -> Turn:
    """The P leg, then the D leg with P's params; P is released if D never comes."""
    req = facts.req
    body = req.dict_body()
    if plan.path == "pd_reuse" and plan.legs.shift_blocks:
        # Wrong KV on purpose: keep it out of the nodes' prefix caches under the
        # tenant's salt, where later requests of the tenant would hit it.
        body["cache_salt"] = f"shifted-{uuid.uuid4().hex}"
    ranked = r.registry.ranked("prefill", _healthy(plan.p_first))
    p_nodes = prefill_candidates(ranked, plan, lambda n: r.learned.checks_pulls(n.name, n.epoch))
    if ranked and not p_nodes:  # no P node left that checks an unverified offer
        assert plan.handle is not None  # only a pd_reuse plan is ever unverified
        plan = plan.recomputed(planner.Reason.NODE_UNHEALTHY, "prefill", release=True)
        p_nodes = ranked
    d_nodes = r.registry.ranked("decode", _healthy(plan.d_first))
    # Stable: the rest keep their rank, the nodes that just failed the prompt go last.
    d_nodes.sort(key=lambda n: n.name in plan.d_failed)
    target = d_nodes[0] if d_nodes else None
    d_leg = _open_decode(r, target, 0)  # D pulls the prompt P computes
    try:
        admitted = await _admit_pd(r, facts, plan, target, d_leg)
        if admitted is not None and admitted.revoked:  # its handle is gone: no reuse
            plan = plan.without_room()
        p_params = plan.prefill_params()
        return await _pd_legs(r, facts, plan, started, body, p_params, p_nodes, d_nodes,
                              d_leg)
    except BaseException:
        _close(r, d_leg)
        raise


async def _admit_pd(r: Router, facts: TurnFacts, plan: TurnPlan,
                    target: Node | None, leg: int | None) -> Admitted | None:
    """Room on the decode node for a P/D turn's D leg, before its P leg leases P's blocks
    to it. The handle it reuses or releases is freed by its own P leg before its D leg
    allocates (when the same node holds it)."""
    if target is None:
        return None
    handle = plan.handle if plan.holder is target else None
    return await _admit(r, target, leg, blocks_for(_prompt_tokens(facts, plan),
                                                   _block_size(r, target)),
                        pinned=handle, freed_by_p=handle is not None)


def _prompt_tokens(facts: TurnFacts, plan: TurnPlan) -> int:
    """The whole prompt's tokens: as tokenized, or estimated from the body's size by the
    ratio of whole prompts (`est_tokens` counts only what P computes)."""
    return plan.prompt_len or facts.learned.estimate_prompt(facts.req.body_chars)


async def _pd_legs(r: Router, facts: TurnFacts, plan: TurnPlan, started: float,
                   body: dict[str, Any], p_params: dict[str, Any], p_nodes: list[Node],
                   d_nodes: list[Node], d_leg: int | None) -> Turn:
    req = facts.req
    chars = 0
    if plan.path == "pd_reuse" or plan.tier is not None:  # pulled, or loaded from its tiers
        p_tokens = plan.prompt_len - plan.reuse.reuse_tokens
    elif plan.prompt_len:
        p_tokens = plan.prompt_len
    else:  # not tokenized: estimated from the body's size
        chars = req.body_chars
        p_tokens = facts.learned.estimate_tokens(chars)
    p_leg = (r.ledger.open(p_nodes[0].name, role="prefill", tokens=max(p_tokens, 0),
                           sent=False, now=time.monotonic()) if p_nodes else None)
    with leg_span(req.span, "prefill") as span:
        t0 = time.perf_counter()
        try:
            prefill = await r.legs.prefill(p_nodes, req.endpoint, body, p_params,
                                           prompt_ids=plan.legs.forward_prompt_ids, leg=p_leg)
        finally:
            req.budget.add("prefill", time.perf_counter() - t0)
            _close(r, p_leg)
        span.set_attribute("kvagent.node", prefill.node.name)
        span.set_attribute("kvagent.pull_failed", prefill.pull_failed)
        verified = transfer.answered_verified(prefill.kv_params)
        if verified is not None:
            span.set_attribute("kvagent.p_verified_tokens", verified)
    r.metrics.leg_latency.labels(leg="prefill").observe(prefill.elapsed_s)
    if p_nodes and prefill.node is not p_nodes[0]:
        r.metrics.retries.labels(leg="prefill").inc()
    if prefill.pull_failed and plan.path == "pd_reuse":
        plan = plan.recomputed(planner.Reason.PULL_FAILED)
    if d_leg is not None and prefill.prompt_tokens:
        # the prompt's real size, where the promise may have been an estimate
        grown = r.ledger.resize(d_leg, blocks_for(prefill.prompt_tokens,
                                                  _block_size(r, d_nodes[0])))
        if grown and r.gate is not None:
            await r.gate.top_up(d_nodes[0], grown)
    # P's lease on its blocks started about now: a D that sees the leg later recomputes.
    read_by = time.time() + plan.legs.read_within_s
    d_params = transfer.with_read_by(prefill.kv_params, read_by)
    if d_params.get(transfer.DO_REMOTE_PREFILL):
        d_params = transfer.pulled_over_nixl(d_params)
    if prefill.prompt_token_ids is not None:
        d_params = transfer.with_prompt_ids(d_params, prefill.prompt_token_ids)
        r.metrics.prompt_ids_forwarded.inc()
        if prefill.first_token is not None and plan.legs.forward_first_token:
            d_params = transfer.with_first_token(d_params, prefill.first_token)
            r.metrics.first_tokens_forwarded.inc()
    try:
        with leg_span(req.span, "decode") as span:
            t0 = time.perf_counter()
            try:
                start = await r.legs.decode(d_nodes, req.endpoint, decode_body(body, d_params),
                                            stream=req.stream, leg=d_leg)
            finally:
                req.budget.add("decode", time.perf_counter() - t0)
            span.set_attribute("kvagent.node", start.node.name)
    except BaseException:
        # Never leave P's blocks leased for a D leg that will not come: an expired lease
        # can hang P (docs/engine.md, "The idle spin and the hang").
        everyone = r.registry.ranked("decode") + [
            n for n in r.registry.role("decode") if not n.healthy]
        ok = await r.legs.release_prefill(everyone, req.endpoint, body, prefill)
        r.metrics.prefill_releases.labels(ok=str(ok).lower()).inc()
        raise
    r.metrics.leg_latency.labels(leg="decode").observe(start.elapsed_s)
    if d_nodes and start.node is not d_nodes[0]:
        r.metrics.retries.labels(leg="decode").inc()
    turn = Turn(r.ledger, facts, plan, prefill, start, started, leg=d_leg)
    if plan.p_work is not None and p_nodes:  # costs learned against the work ahead
        turn.p_chars = chars  # settle learns tokens per byte from P's answer
        turn.ahead = paths.tokens_ahead(plan.path, plan.p_work)
    return turn


async def _whole_on_decode(r: Router, facts: TurnFacts, plan: TurnPlan,
                           started: float) -> Turn:
    """Serve a request P/D cannot split on the least loaded decode node, aggregated."""
    req = facts.req
    body: dict[str, Any] = {k: v for k, v in req.body.items() if k != "kv_transfer_params"}
    body["return_token_ids"] = True
    if req.stream:
        body["stream_options"] = usage_stream_options(body.get("stream_options"))
    nodes = r.registry.ranked("decode")
    leg = _open_decode(r, nodes[0] if nodes else None, plan.prompt_len)
    try:
        start = await _send_decode(r, req, nodes, body, leg)
    except BaseException:
        _close(r, leg)
        raise
    return Turn(r.ledger, facts, plan, None, start, started, leg=leg)


async def _send_decode(r: Router, req: TurnRequest, nodes: list[Node], body: dict[str, Any],
                       leg: int | None) -> DecodeStart:
    """Send a D leg (trying `nodes` in order) inside its span, timing it in the budget."""
    with leg_span(req.span, "decode") as span:
        t0 = time.perf_counter()
        try:
            start = await r.legs.decode(nodes, req.endpoint, body, stream=req.stream, leg=leg)
        finally:
            req.budget.add("decode", time.perf_counter() - t0)
        span.set_attribute("kvagent.node", start.node.name)
    return start


def _healthy(node: Node | None) -> Node | None:
    return node if node is not None and node.healthy else None


def prefill_candidates(ranked: list[Node], plan: TurnPlan,
                       checks_pulls: Callable[[Node], bool]) -> list[Node]:
    """The P nodes, in rank order, that a turn's P leg may try: an offer the router did
    not verify (a `pd_reuse` plan made without `/tokenize`) goes only to nodes seen
    checking what they pull (`checks_pulls`: `Learned.checks_pulls`), also on a retry."""
    if plan.path != "pd_reuse" or plan.reuse.tokenized:
        return ranked
    return [n for n in ranked if checks_pulls(n)]
