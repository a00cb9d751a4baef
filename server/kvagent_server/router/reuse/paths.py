"""Which path serves a turn, and what each path costs: pure.

`choose_path` and `fresh_path` price the paths with the learned lines of `CostModel`
(time to first token per path, fitted online from the turns the router serves) and the
work in flight on each node (`queue.NodeWork`). docs/router.md ("Paths") gives the table.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.kv.tiers import TierCosts
from kvagent_server.router.reuse.planner import FRESH_REASONS, ReusePlan
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.reuse.spill import TierReuse

#: How a turn was served (`kvagent.path` on the wire; the same names as
#: `kvagent.protocol.PATHS` and the path table in docs/router.md).
Path = Literal["pd_fresh", "pd_reuse", "d_direct", "d_fresh", "d_pull", "recompute",
              "decode_only"]

#: The paths whose prompt the decode node computes itself (no P leg): they are priced,
#: learned and stall D's streams alike.
ON_DECODE: frozenset[str] = frozenset({"d_direct", "d_fresh"})

#: Where a turn with nothing to reuse computes its prompt (`cost_model`'s
#: `fresh_on_decode`): as the costs say, always on P, or always on D.
FreshPolicy = Literal["auto", "never", "always"]


class LinearCost(BaseModel):
    """seconds = fixed_s + per_token_s * tokens."""

    model_config = ConfigDict(frozen=True)

    fixed_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    samples: int = Field(default=0, ge=0)

    def __call__(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


# Priors from early CPU measurements (~0.8 s for a 2.1k-token recompute, ~0.15 s for
# the same turn with reuse); measurements replace them within a few turns.
_PRIOR_PREFILL = LinearCost(fixed_s=0.05, per_token_s=4e-4)
_PRIOR_PULL = LinearCost(fixed_s=0.03, per_token_s=2e-5)
# D computing a delta itself competes with its running decodes: priced above P.
_PRIOR_D_DIRECT = LinearCost(fixed_s=0.0, per_token_s=6e-4)


class PathCosts(BaseModel):
    """Measured time-to-first-token models per path (see `CostModel`).

    - pd_fresh / recompute: `prefill(prompt_tokens)`
    - pd_reuse: `prefill(computed_tokens) + pull(reused_tokens)`
    - d_direct: `d_direct(computed_tokens)`; d_fresh (no reuse) likewise: D computes

    With the nodes' work in flight (`queued_*`), the prefill and d_direct lines are
    evaluated at the tokens ahead on the node plus the turn's own: the lines are then
    learned the same way (`CostModel.observe(ahead_tokens=...)`), so they price a token
    of the node's work, not an average queue.
    """

    model_config = ConfigDict(frozen=True)

    prefill: LinearCost = _PRIOR_PREFILL
    pull: LinearCost = _PRIOR_PULL
    d_direct: LinearCost = _PRIOR_D_DIRECT

    def estimate(self, path: Path, prompt_len: int, reuse_tokens: int) -> float:
        computed = prompt_len - reuse_tokens
        if path == "pd_reuse":
            return self.prefill(computed) + self.pull(reuse_tokens)
        if path in ON_DECODE:
            return self.d_direct(computed)
        return self.prefill(prompt_len)

    def queued_ttft(self, path: Path, prompt_len: int, reuse_tokens: int,
                    work: NodeWork) -> float:
        """TTFT on `path` behind `work`, the node's work in flight (P's for the P/D paths,
        D's for `d_direct` and `d_fresh`): the wait for the tokens ahead, then the turn's
        own compute (and the pull on `pd_reuse`); see `tokens_ahead`."""
        computed = prompt_len - reuse_tokens
        ahead = tokens_ahead(path, work)
        if path in ON_DECODE:
            return self.d_direct(ahead + computed)
        if path == "pd_reuse":
            return self.prefill(ahead + computed) + self.pull(reuse_tokens)
        return self.prefill(ahead + prompt_len)

    def queued_cost(self, path: Path, prompt_len: int, reuse_tokens: int,
                    work: NodeWork) -> float:
        """`queued_ttft` plus the stall its compute puts on the streams decoding on the
        same node: on `d_direct` and `d_fresh` each of D's streams waits for the prompt
        (their inter-token gap); a P leg stalls no stream. Seconds of delay added, summed
        over every request affected."""
        ttft = self.queued_ttft(path, prompt_len, reuse_tokens, work)
        if path not in ON_DECODE:
            return ttft
        return ttft + work.streams * self.d_direct.per_token_s * (prompt_len - reuse_tokens)


def tokens_ahead(path: Path, work: NodeWork) -> float:
    """The tokens of `work` a turn on `path` waits for: the prompt tokens queued on the
    node, and on D (`d_direct`, `d_fresh`) one per stream decoding there (each adds one to
    every step)."""
    return work.prefill_tokens + (work.streams if path in ON_DECODE else 0)


def choose_path(
    plan: ReusePlan,
    prompt_len: int,
    costs: PathCosts,
    *,
    skip_prefill_max_tokens: int | None,
    d_healthy: bool,
    p_work: NodeWork | None = None,
    d_work: NodeWork | None = None,
    d_stall_max_s: float | None = None,
) -> Path:
    """How to serve the turn.

    No reuse: `pd_fresh` when there was nothing to reuse, else `recompute`. With reuse,
    `d_direct` (skip P; D extends the prefix it holds) when D is healthy and either the
    uncached delta is at most `skip_prefill_max_tokens`, or that setting is None and the
    costs say D alone is cheaper; otherwise `pd_reuse`. 0 never skips P.

    The costs: with the work in flight on the P node and on the holding D node
    (`p_work`, `d_work`), `PathCosts.queued_cost` (the wait for that work, the turn's own
    compute, and the stall a `d_direct` delta puts on D's streams); without them, each
    path's learned TTFT line alone. With `d_stall_max_s` and streams decoding on D, or
    about to (P legs in flight, whose D legs start while D computes), a delta whose
    compute on D (its `d_direct` line) is longer goes to P whatever the sums say: the
    sums weigh seconds of delay, while one long stall is a stream's worst gap.
    """
    if not plan.reuses:
        return "pd_fresh" if plan.reason in FRESH_REASONS else "recompute"
    if plan.reuse_tokens >= prompt_len:
        raise ValueError("a plan must leave at least one prompt token to compute")
    if not d_healthy:
        return "pd_reuse"
    delta = prompt_len - plan.reuse_tokens
    if skip_prefill_max_tokens is not None:
        return "d_direct" if 0 < delta <= skip_prefill_max_tokens else "pd_reuse"
    d_cost, p_cost = _path_costs(plan, prompt_len, costs, p_work, d_work, d_stall_max_s)
    return "d_direct" if d_cost < p_cost else "pd_reuse"


def fresh_path(prompt_tokens: float, costs: PathCosts, *, policy: FreshPolicy,
               d_healthy: bool, p_work: NodeWork | None = None,
               d_work: NodeWork | None = None,
               d_stall_max_s: float | None = None,
               d_prompt_step_tokens: int | None = None) -> Path:
    """Where a turn with nothing to reuse computes its prompt: `pd_fresh` (P computes, D
    pulls and decodes) or `d_fresh` (the decode node computes it itself, as an aggregated
    node would, and keeps the KV for the next turn).

    `never`/`always` are fixed policies. `auto` is conditional disaggregation: P exists so
    that long prompts do not stall D's streams, but a prompt queued behind seconds of
    other work on P waits longer than it would take D to compute it beside its streams.
    So only while P has prompt work queued (`p_work`; None: not counted, so never) is D
    considered, priced as `choose_path` prices `d_direct` against `pd_reuse`
    (`PathCosts.queued_cost`: each node's work in flight, the prompt's own compute, the
    stall on D's streams; `d_stall_max_s` caps a stall as there). An idle P computes every
    fresh prompt: the few ms a short one might save on D do not pay for the stall it would
    put on streams that start meanwhile, which no line prices.

    With `d_prompt_step_tokens` (D computes at most that many tokens of a prompt per step
    while other requests share it), D takes the prompt whenever P is computing other legs
    (`p_work.prompts`, a fact where P's estimated queue reads empty once P runs late) and
    D computes no prompt of its own: its streams then wait one short step per chunk, not
    the whole prompt, and a first turn's chunks attend to a short context. Neither the
    sums nor the stall cap see that (the `d_direct` line is learned on deltas at long
    contexts, whose short steps are slower).
    `prompt_tokens`: the estimated tokens to compute (the router does not tokenize a first
    turn)."""
    if prompt_tokens < 0:
        raise ValueError("prompt_tokens must be non-negative")
    if not d_healthy or policy == "never":
        return "pd_fresh"
    if policy == "always":
        return "d_fresh"
    if p_work is None or (p_work.prefill_tokens <= 0 and p_work.prompts == 0):
        return "pd_fresh"
    d_work = d_work or IDLE
    if d_prompt_step_tokens is not None and p_work.prompts > 0 and d_work.prompts == 0:
        return "d_fresh"
    n = math.ceil(prompt_tokens)
    if _past_stall_cap(costs, n, d_work, d_stall_max_s):
        return "pd_fresh"
    d_cost = costs.queued_cost("d_fresh", n, 0, d_work)
    return "d_fresh" if d_cost < costs.queued_cost("pd_fresh", n, 0, p_work) else "pd_fresh"


#: Where a spilled turn's prompt is computed (`spill_path`): on the node whose tiers hold
#: it (`d_direct`, loading its host or disk tier), on P loading what its own cache and
#: tiers hold of it (a shared disk included), or on P from scratch.
SpillChoice = Literal["d_direct", "p_tier", "recompute"]


def tier_load_s(tier: TierReuse, costs: TierCosts) -> float:
    """Seconds to load `tier`'s prefix: its host-tier part at the host price, the rest of
    its disk part at the disk price (a disk chunk is promoted through the host tier)."""
    host = tier.host_tokens
    return host * costs.cpu_s_per_token + max(0, tier.disk_tokens - host) * costs.disk_s_per_token


def spill_path(tier: TierReuse | None, prompt_len: int, costs: PathCosts,
               tier_costs: TierCosts, *, d_ok: bool, p_tier: TierReuse | None = None,
               p_work: NodeWork | None = None, d_work: NodeWork | None = None,
               d_stall_max_s: float | None = None) -> SpillChoice:
    """Where a turn whose session spilled to a decode node's tiers computes its prompt.

    Three prices, as `choose_path` prices the others (the lines at the node's work ahead,
    the stall on D's streams and its cap): `d_direct` on the holding node (`tier`; `d_ok`:
    placed there, healthy, same epoch, not at its watermark), which loads the prefix from
    its tiers (`tier_load_s`) and computes the rest; `p_tier`, P loading what its own
    cache and tiers hold (`p_tier`: `spill.plan_on_prefill`) and computing the rest;
    `recompute`, P computing it all. A load is worth it only where it is cheaper than
    computing those tokens on that node: otherwise the option is the recompute it would
    be, so a short prefix, or a tier slower than prefill, never pays a promotion."""
    for t in (tier, p_tier):
        if t is not None and not 0 < t.tokens < prompt_len:
            raise ValueError("a tier reuse must leave at least one prompt token to compute")
    p_work, idle_d = p_work or IDLE, d_work or IDLE
    best: SpillChoice = "recompute"
    best_s = costs.queued_cost("recompute", prompt_len, 0, p_work)
    if p_tier is not None:
        load = tier_load_s(p_tier, tier_costs)
        if load < costs.prefill.per_token_s * p_tier.tokens:
            p_s = load + costs.queued_cost("recompute", prompt_len - p_tier.tokens, 0, p_work)
            if p_s < best_s:
                best, best_s = "p_tier", p_s
    if d_ok and tier is not None:
        load = tier_load_s(tier, tier_costs)
        delta = prompt_len - tier.tokens
        soon = 1 if p_work.prompts > 0 else 0
        if (load < costs.d_direct.per_token_s * tier.tokens
                and not _past_stall_cap(costs, delta, idle_d, d_stall_max_s,
                                        streams_soon=soon)):
            d_s = load + costs.queued_cost("d_direct", prompt_len, tier.tokens, idle_d)
            if d_s < best_s:
                best = "d_direct"
    return best


def skip_tokenize_pays(plan: ReusePlan, deltas: tuple[int, int], costs: PathCosts,
                       tokenize_s: float, *, skip_prefill_max_tokens: int | None,
                       p_work: NodeWork | None = None,
                       d_work: NodeWork | None = None,
                       d_stall_max_s: float | None = None) -> bool:
    """May a turn whose uncached delta is only known to lie in `deltas` (from..to tokens)
    go `d_direct` without the router's `/tokenize` (which takes `tokenize_s`)?

    With a fixed `skip_prefill_max_tokens`, only when every delta in the range is within
    it. With the cost model, when `d_direct` costs at most `tokenize_s` more than
    `pd_reuse` anywhere in the range: tokenizing to choose would cost that much itself.
    Every cost is linear in the delta, so the two ends decide."""
    low, high = deltas
    if not 0 < low <= high:
        raise ValueError("deltas must be positive and ordered")
    if skip_prefill_max_tokens is not None:
        return high <= skip_prefill_max_tokens
    for delta in (low, high):
        d_cost, p_cost = _path_costs(plan, plan.reuse_tokens + delta, costs, p_work, d_work,
                                     d_stall_max_s)
        if d_cost - p_cost > tokenize_s:
            return False
    return True


def untokenized_path(plan: ReusePlan, deltas: tuple[int, int], costs: PathCosts,
                     tokenize_s: float, *, skip_prefill_max_tokens: int | None,
                     prefill_checks_pulls: bool, p_work: NodeWork | None = None,
                     d_work: NodeWork | None = None,
                     d_stall_max_s: float | None = None) -> Path | None:
    """The path of a turn whose uncached delta is only known to lie in `deltas`, when it
    may skip the router's `/tokenize`; None when it must tokenize to choose.

    `d_direct` when `skip_tokenize_pays`. `pd_reuse` when it is the path at both ends of
    the range and the P node checks what it pulls (`prefill_checks_pulls`: the plugin's
    `pull_check` pulls only the blocks whose digests its own prompt repeats, so the
    unverified plan cannot become wrong KV)."""
    if skip_tokenize_pays(plan, deltas, costs, tokenize_s,
                          skip_prefill_max_tokens=skip_prefill_max_tokens,
                          p_work=p_work, d_work=d_work, d_stall_max_s=d_stall_max_s):
        return "d_direct"
    if not prefill_checks_pulls:
        return None
    low, high = deltas
    paths = {choose_path(plan, plan.reuse_tokens + delta, costs,
                         skip_prefill_max_tokens=skip_prefill_max_tokens, d_healthy=True,
                         p_work=p_work, d_work=d_work, d_stall_max_s=d_stall_max_s)
             for delta in (low, high)}
    return "pd_reuse" if paths == {"pd_reuse"} else None


def _path_costs(plan: ReusePlan, prompt_len: int, costs: PathCosts,
                p_work: NodeWork | None, d_work: NodeWork | None,
                d_stall_max_s: float | None = None) -> tuple[float, float]:
    """(`d_direct`, `pd_reuse`) costs of the turn, as `choose_path` compares them;
    `d_direct` is infinite when it would stall D's streams past `d_stall_max_s`."""
    if p_work is not None or d_work is not None:
        d_cost = costs.queued_cost("d_direct", prompt_len, plan.reuse_tokens, d_work or IDLE)
        # P's legs in flight are streams about to start on D: a delta D computes in
        # short steps from now would stall them too. Counted by P's reports, not its
        # estimated queue, which reads empty whenever P runs slower than its line.
        soon = 1 if p_work is not None and p_work.prompts > 0 else 0
        if _past_stall_cap(costs, prompt_len - plan.reuse_tokens, d_work or IDLE,
                           d_stall_max_s, streams_soon=soon):
            d_cost = math.inf
        return (d_cost,
                costs.queued_cost("pd_reuse", prompt_len, plan.reuse_tokens, p_work or IDLE))
    return (costs.estimate("d_direct", prompt_len, plan.reuse_tokens),
            costs.estimate("pd_reuse", prompt_len, plan.reuse_tokens))


def _past_stall_cap(costs: PathCosts, tokens: int, d_work: NodeWork,
                    d_stall_max_s: float | None, *, streams_soon: int = 0) -> bool:
    """Would D computing `tokens` stall its streams past the cap (none without streams,
    counting `streams_soon` that will start meanwhile)?"""
    return (d_stall_max_s is not None and d_work.streams + streams_soon > 0
            and costs.d_direct(tokens) > d_stall_max_s)


class _Ewma:
    """Exponentially weighted sums for an online least-squares line y = a + b x."""

    __slots__ = ("alpha", "n", "x", "xx", "xy", "y")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.n = 0
        self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        if self.n == 0:
            self.x, self.y, self.xx, self.xy = x, y, x * x, x * y
        else:
            a = self.alpha
            self.x += a * (x - self.x)
            self.y += a * (y - self.y)
            self.xx += a * (x * x - self.xx)
            self.xy += a * (x * y - self.xy)
        self.n += 1

    def fit(self, prior: LinearCost, min_samples: int) -> LinearCost:
        if self.n == 0:
            return prior
        var = self.xx - self.x * self.x
        # Too few samples or too little spread in size to tell fixed from per-token
        # cost: keep the prior slope and fit only the intercept.
        if self.n >= min_samples and var > max(1.0, 0.0025 * self.x * self.x):  # CV > 5%
            slope = max(0.0, (self.xy - self.x * self.y) / var)
        else:
            slope = prior.per_token_s
        fixed = max(0.0, self.y - slope * self.x)
        return LinearCost(fixed_s=fixed, per_token_s=slope, samples=self.n)


class CostModel:
    """Learns per-path TTFT lines from observed turns (EWMA least squares); pure."""

    def __init__(self, *, alpha: float = 0.1, min_samples: int = 5,
                 prior: PathCosts | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._prior = prior or PathCosts()
        self._min = min_samples
        self._prefill = _Ewma(alpha)
        self._pull = _Ewma(alpha)
        self._d = _Ewma(alpha)

    def observe(self, path: Path, tokens: int, seconds: float, *,
                reused_tokens: int = 0, ahead_tokens: float = 0.0) -> None:
        """Record one turn: `tokens` computed (not reused), `seconds` to first token.

        For `pd_reuse`, pass `reused_tokens` too: the part of `seconds` the prefill line
        does not explain is attributed to the pull. `ahead_tokens`: the work that was in
        flight on the node when the turn was sent there (`PathCosts.queued_ttft`'s
        tokens ahead), so the line learns the cost of a token of work, queue included.
        """
        if (tokens < 0 or reused_tokens < 0 or seconds < 0 or not math.isfinite(seconds)
                or ahead_tokens < 0 or not math.isfinite(ahead_tokens)):
            raise ValueError("tokens, reused_tokens, ahead_tokens and seconds must be "
                             "non-negative")
        work = tokens + ahead_tokens
        if path in ("pd_fresh", "recompute"):
            self._prefill.add(work, seconds)
        elif path == "pd_reuse":
            prefill = self._prefill.fit(self._prior.prefill, self._min)
            self._pull.add(reused_tokens, max(0.0, seconds - prefill(work)))
        elif path in ON_DECODE:
            self._d.add(work, seconds)
        else:
            raise ValueError(f"unknown path {path!r}")

    def snapshot(self) -> PathCosts:
        return PathCosts(prefill=self._prefill.fit(self._prior.prefill, self._min),
                         pull=self._pull.fit(self._prior.pull, self._min),
                         d_direct=self._d.fit(self._prior.d_direct, self._min))
