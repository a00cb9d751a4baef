"""Reuse decisions: how much of a decode node's retained KV a new prompt may use, and
which path serves the turn.

The one rule that matters (vLLM #43094): KV is reused only for the longest *verified*
token-level common prefix between the new prompt and the tokens the decode node holds,
rounded down to whole blocks. Whatever the client did to its history (stripped
reasoning, re-rendered tool calls, edits), the worst outcome is a recompute, never KV of
other tokens. Everything here is pure.

How the P leg consumes the rewritten params (vLLM 0.32 NixlConnector, pull mode):
`do_remote_decode=True` with `remote_block_ids`/`remote_engine_id`/`remote_request_id`/
`remote_host`/`remote_port` makes P treat `min(remote_num_tokens, prompt) - cached_locally`
tokens as external; P then END-trims the remote block list to the blocks it still needs.
So the list must hold exactly the reused prefix's blocks: an untruncated list would pair
P's blocks with D's *last* blocks. `do_remote_prefill` must stay False: on P it means
"pull the whole prompt", which would mark uncomputed tokens as computed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.reuse.transfer import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    EXPECT_KEY,
    REMOTE_BLOCK_IDS,
    REMOTE_NUM_TOKENS,
    expect,
)
from kvagent_server.router.settings import FreshPolicy
from kvagent_server.router.store.handle import Handle

#: How a turn was served (`kvagent.path` on the wire; the same names as
#: `kvagent.protocol.PATHS` and the path table in docs/router.md).
Path = Literal["pd_fresh", "pd_reuse", "d_direct", "d_fresh", "recompute", "decode_only"]

#: The paths whose prompt the decode node computes itself (no P leg): they are priced,
#: learned and stall D's streams alike.
ON_DECODE: frozenset[str] = frozenset({"d_direct", "d_fresh"})


class Reason(StrEnum):
    """Why a plan reuses what it reuses. The value is the metric label and the wire name."""

    #: The prompt extends every cached token; the reuse is that, block-aligned.
    HIT = "hit"
    #: The prompt diverged from the cache after some whole blocks.
    PREFIX_PARTIAL = "prefix_partial"
    #: Reuse is switched off in the router's settings.
    REUSE_DISABLED = "reuse_disabled"
    #: The presented cache token was refused; the detail says why.
    TOKEN_REJECTED = "token_rejected"
    #: Nothing to reuse: no token and no handle for the session (a first turn).
    NO_HANDLE = "no_handle"
    OTHER_TENANT = "other_tenant"
    OTHER_SESSION = "other_session"
    EXPIRED = "expired"
    #: The decode node restarted since the handle was made: its blocks are gone.
    STALE_EPOCH = "stale_epoch"
    NODE_UNHEALTHY = "node_unhealthy"
    UNSUPPORTED_KV_LAYOUT = "unsupported_kv_layout"
    DIVERGED_AT_0 = "diverged_at_0"
    BELOW_THRESHOLD = "below_threshold"
    #: The router could not get the prompt's token ids from a node.
    TOKENIZE_FAILED = "tokenize_failed"
    #: The decode node failed before its first byte on a reuse path.
    DECODE_FAILED = "decode_failed"
    #: P could not pull the prefix from D and recomputed.
    PULL_FAILED = "pull_failed"
    #: A request P/D cannot split (see `decode_only`).
    UNSUPPORTED_SHAPE = "unsupported_shape"
    #: The KV was made for another model/adapter or salt (detail `model`, `salt`), or its
    #: handle recorded no identity (`unrecorded`).
    IDENTITY_CHANGED = "identity_changed"
    #: A multimodal item differs (detail `item_<k>`): reuse stops at its placeholder.
    MULTIMODAL_CHANGED = "multimodal_changed"
    #: A request field, or media behind a URL, whose effect on KV the router cannot
    #: verify (detail: the field, or `media_url`).
    UNVERIFIABLE_INPUT = "unverifiable_input"


#: Plans that reuse nothing because the client had nothing to reuse (first turn, or reuse
#: switched off): served as `pd_fresh`. Every other zero-reuse plan is a `recompute`.
FRESH_REASONS = frozenset({Reason.NO_HANDLE, Reason.REUSE_DISABLED})


class ReusePlan(BaseModel):
    """How many prompt tokens to take from the decode node's KV, and why."""

    model_config = ConfigDict(frozen=True)

    reuse_tokens: int = Field(ge=0)
    reason: Reason
    #: More precise cause within `reason` (e.g. why a token was rejected), or None.
    detail: str | None = None
    #: Tokens the prompt shares with the cache before the first difference (for metrics).
    common_prefix: int = Field(default=0, ge=0)
    #: Tokens whose KV the decode node could hand over.
    cached_tokens: int = Field(default=0, ge=0)
    #: False: planned from the messages alone (`extension_plan`), so only `d_direct`
    #: may serve it and `reuse_tokens` is what D holds, not a verified prefix.
    tokenized: bool = True

    @property
    def reuses(self) -> bool:
        return self.reuse_tokens > 0

    @property
    def label(self) -> str:
        """`reason`, or `reason:detail`: what clients and logs see."""
        return f"{self.reason.value}:{self.detail}" if self.detail else self.reason.value


_CHUNK = 512


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Compares chunk by chunk (C-speed slice equality) and scans only the chunk that
    differs: long agent histories are compared at list-comparison speed, not per token
    in Python.
    """
    n = min(len(a), len(b))
    a_list = a if isinstance(a, list) else list(a)
    b_list = b if isinstance(b, list) else list(b)
    i = 0
    while i < n:
        j = min(i + _CHUNK, n)
        if a_list[i:j] != b_list[i:j]:
            while a_list[i] == b_list[i]:
                i += 1
            return i
        i = j
    return n


def _block_groups(params: dict[str, Any]) -> tuple[list[list[int]], bool] | None:
    """D's `remote_block_ids` as per-group lists (and whether it came flat), or None."""
    groups = params.get(REMOTE_BLOCK_IDS)
    if not isinstance(groups, list) or not groups:
        return None
    if all(isinstance(b, int) and not isinstance(b, bool) for b in groups):
        return [list(groups)], True  # older vLLM: one flat list for one group
    if all(isinstance(g, list | tuple) for g in groups) and all(
            isinstance(b, int) and not isinstance(b, bool) for g in groups for b in g):
        return [list(g) for g in groups], False
    return None


def retained_tokens(handle: Handle) -> int | None:
    """How many leading tokens of `handle.token_ids` D can hand over; None if unusable.

    Bounded by D's own `remote_num_tokens` (the last sampled token has no KV yet) and by
    the blocks it exported. A group with fewer blocks than the sequence needs (sliding
    window tail, Mamba state) does not map token positions to blocks from position 0,
    so the handle is not reused at all rather than reused wrongly.
    """
    params = handle.kv_transfer_params
    n = params.get(REMOTE_NUM_TOKENS)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    parsed = _block_groups(params)
    if parsed is None:
        return None
    needed = math.ceil(n / handle.block_size)
    if any(len(group) < needed for group in parsed[0]):
        return None
    return min(n, len(handle.token_ids))


def plan_reuse(
    prompt_ids: Sequence[int],
    handle: Handle | None,
    *,
    threshold: int,
    now: float,
    tenant: str | None = None,
    session: str | None = None,
    node_healthy: bool = True,
    node_epoch: str | None = None,
    enabled: bool = True,
    rejected: str | None = None,
    prefill_block_size: int | None = None,
    identity: IdentityCheck | None = None,
) -> ReusePlan:
    """The longest verified, block-aligned prefix of `prompt_ids` to reuse from `handle`.

    - `threshold`: below this many reusable tokens, recompute (pulling costs more); use
      the nodes' `kv_recompute_threshold` so the router and P agree.
    - `tenant`/`session`: when given, a handle of another tenant or session is refused.
    - `node_healthy`/`node_epoch`: the holding decode node's health and current epoch; a
      handle from an earlier incarnation names blocks that no longer exist.
    - `rejected`: why the presented token was refused (`TOKEN_REJECTED`, detail `rejected`).
    - `prefill_block_size`: when P's block size differs, align to both.
    - `identity`: the handle's KV identity checked against the prompt's (reuse.identity);
      a cap of 0 refuses reuse, a positive cap ends it before the first differing media
      item. None: not checked (pure token-level planning).
    At least one prompt token is always left to compute: vLLM needs one to sample from.
    """
    if not enabled:
        return ReusePlan(reuse_tokens=0, reason=Reason.REUSE_DISABLED)
    if rejected is not None:
        return ReusePlan(reuse_tokens=0, reason=Reason.TOKEN_REJECTED, detail=rejected)
    if handle is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.NO_HANDLE)
    if tenant is not None and handle.tenant != tenant:
        return ReusePlan(reuse_tokens=0, reason=Reason.OTHER_TENANT)
    if session is not None and handle.session != session:
        return ReusePlan(reuse_tokens=0, reason=Reason.OTHER_SESSION)
    if identity is not None and identity.cap == 0:
        return _identity_plan(identity, 0)
    if handle.expired(now):
        return ReusePlan(reuse_tokens=0, reason=Reason.EXPIRED)
    if node_epoch is not None and node_epoch != handle.decode_epoch:
        return ReusePlan(reuse_tokens=0, reason=Reason.STALE_EPOCH)
    if not node_healthy:
        return ReusePlan(reuse_tokens=0, reason=Reason.NODE_UNHEALTHY)
    retained = retained_tokens(handle)
    if retained is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.UNSUPPORTED_KV_LAYOUT)
    cached = handle.token_ids[:retained]
    common = common_prefix_len(prompt_ids, cached)
    cut = identity if (identity is not None and identity.cap is not None
                       and identity.cap < common) else None
    if cut is not None:
        common = min(common, cut.cap or 0)
    if common == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.DIVERGED_AT_0, cached_tokens=retained)
    reuse = _aligned(min(common, len(prompt_ids) - 1), handle.block_size,
                     prefill_block_size, threshold)
    if cut is not None:  # the media check, not the tokens, ended the prefix
        return _identity_plan(cut, reuse, common_prefix=common, cached_tokens=retained)
    if reuse == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.BELOW_THRESHOLD, common_prefix=common,
                         cached_tokens=retained)
    reason = Reason.HIT if common == retained else Reason.PREFIX_PARTIAL
    return ReusePlan(reuse_tokens=reuse, reason=reason, common_prefix=common,
                     cached_tokens=retained)


def _aligned(tokens: int, block_size: int, prefill_block_size: int | None,
             threshold: int) -> int:
    """`tokens` rounded down to whole blocks of D (and of P, when its size differs);
    0 below `threshold`."""
    align = block_size
    if prefill_block_size is not None:
        if prefill_block_size < 1:
            raise ValueError("prefill_block_size must be positive")
        align = math.lcm(align, prefill_block_size)
    reuse = tokens // align * align
    return reuse if reuse >= threshold else 0


def extension_plan(handle: Handle, *, threshold: int) -> ReusePlan:
    """The plan for a prompt known, from its messages, to extend everything `handle`
    holds (reuse.identity.extension_chars), without its token ids: every whole block D
    retains. A `d_direct` leg may act on it, since D's prefix cache then matches the
    real tokens itself; a pull only on a P node that checks what it pulls
    (`untokenized_path`), since the router has not verified the tokens.
    The caller has made `plan_reuse`'s other checks (tenant, expiry, epoch, identity)."""
    retained = retained_tokens(handle)
    if retained is None:
        return ReusePlan(reuse_tokens=0, reason=Reason.UNSUPPORTED_KV_LAYOUT)
    reuse = _aligned(retained, handle.block_size, None, threshold)  # D's blocks only
    if reuse == 0:
        return ReusePlan(reuse_tokens=0, reason=Reason.BELOW_THRESHOLD,
                         common_prefix=retained, cached_tokens=retained)
    return ReusePlan(reuse_tokens=reuse, reason=Reason.HIT, common_prefix=retained,
                     cached_tokens=retained, tokenized=False)


def _identity_plan(check: IdentityCheck, reuse: int, *, common_prefix: int = 0,
                   cached_tokens: int = 0) -> ReusePlan:
    assert check.reason is not None  # a cap always comes with its reason
    return ReusePlan(reuse_tokens=reuse, reason=Reason(check.reason), detail=check.detail,
                     common_prefix=common_prefix, cached_tokens=cached_tokens)


def reuse_transfer_params(handle: Handle, reuse_tokens: int) -> dict[str, Any]:
    """D's params rewritten so P pulls exactly the first `reuse_tokens` tokens' blocks.

    Every group's block list is cut to `reuse_tokens // block_size` blocks (P end-trims
    it to what it lacks locally), `remote_num_tokens` becomes `reuse_tokens`, and the
    flags say "P node, pull from D": do_remote_decode=True, do_remote_prefill=False.
    The blocks' token digests go along (`transfer.EXPECT_KEY`): P pulls only the leading
    blocks its own prompt repeats, whether or not the router tokenized the prompt.
    """
    retained = retained_tokens(handle)
    if retained is None:
        raise ValueError("the handle's KV layout cannot be reused")
    if reuse_tokens <= 0 or reuse_tokens % handle.block_size:
        raise ValueError(f"reuse_tokens={reuse_tokens} is not a positive multiple of "
                         f"block_size={handle.block_size}")
    if reuse_tokens > retained:
        raise ValueError(f"reuse_tokens={reuse_tokens} exceeds the {retained} retained tokens")
    params = copy.deepcopy(handle.kv_transfer_params)
    parsed = _block_groups(params)
    assert parsed is not None  # retained_tokens checked the layout
    groups, flat = parsed
    n_blocks = reuse_tokens // handle.block_size
    cut = [group[:n_blocks] for group in groups]
    params[REMOTE_BLOCK_IDS] = cut[0] if flat else cut
    params[REMOTE_NUM_TOKENS] = reuse_tokens
    params[DO_REMOTE_DECODE] = True
    params[DO_REMOTE_PREFILL] = False
    params[EXPECT_KEY] = expect(handle.token_ids[:reuse_tokens], handle.block_size)
    return params


def shifted_blocks(params: dict[str, Any]) -> dict[str, Any]:
    """Test-only negative control: shift the block slots by half their number, so slot i
    gets block i-k (k = n//2; the first block fills the slots before it, the last k blocks
    are dropped). P then reads real KV of this prompt at the wrong places: wrong KV that
    no identity check can see.

    Keys carry their positions (RoPE is applied before caching) and every reused token
    lies before the new ones, so what P attends to is the *multiset* of blocks: a rotation
    changes nothing, and a shift by one slot changes one block in n, which a random model's
    greedy answer missed in about one turn in four. Half of the blocks wrong is not missed.
    """
    out = copy.deepcopy(params)
    parsed = _block_groups(out)
    if parsed is None:
        return out
    groups, flat = parsed
    shifted = []
    for g in groups:
        k = max(1, len(g) // 2)
        shifted.append([g[max(0, i - k)] for i in range(len(g))])
    out[REMOTE_BLOCK_IDS] = shifted[0] if flat else shifted
    return out


def release_transfer_params(handle: Handle) -> dict[str, Any]:
    """P leg params that compute the whole prompt AND tell D to free the handle's blocks.

    With `remote_num_tokens=0` P takes no external tokens but still sends D the
    "done" notification for its blocks, so a claimed handle that is not reused does
    not pin D's memory until the TTL. Use only while D is healthy and of the handle's
    epoch (P must reach D's side channel).
    """
    params = copy.deepcopy(handle.kv_transfer_params)
    params[REMOTE_NUM_TOKENS] = 0
    params[DO_REMOTE_DECODE] = True
    params[DO_REMOTE_PREFILL] = False
    return params


# ------------------------------------------------------------------ path choice


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
