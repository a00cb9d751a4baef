"""Pure statistics over request records: percentiles, per-turn and overall summaries,
answer agreement, target ratios."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from .results import (
    ConfigResult,
    Distribution,
    RequestRecord,
    Summary,
    Targets,
    TokenTotals,
    TurnStats,
)

KVAGENT = "kvagent"
PD_NOREUSE = ("pd_noreuse_pcache_off", "pd_noreuse_pcache_on")
AGGREGATED = "aggregated"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0-100")
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Iterable[float | None]) -> Distribution:
    xs = [v for v in values if v is not None]
    if not xs:
        return Distribution(n=0)
    return Distribution(n=len(xs), mean=sum(xs) / len(xs), p50=percentile(xs, 50),
                        p90=percentile(xs, 90), p99=percentile(xs, 99), min=min(xs),
                        max=max(xs))


def _ok(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.error is None]


def token_totals(records: Iterable[RequestRecord]) -> TokenTotals:
    t = TokenTotals()
    for r in _ok(records):
        prompt, cached = r.prompt_tokens or 0, r.cached_tokens or 0
        t.prompt += prompt
        t.cached += cached
        t.reused += r.reused_tokens or 0
        t.recomputed += max(prompt - cached, 0)
        t.completion += r.completion_tokens or 0
    return t


def reuse_rate(records: Sequence[RequestRecord]) -> float | None:
    """Share of successful requests with reused_tokens > 0; None if none reported reuse."""
    rs = [r for r in _ok(records) if r.reused_tokens is not None]
    if not rs:
        return None
    return sum(1 for r in rs if r.reused_tokens > 0) / len(rs)


def cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    rs = [r for r in _ok(records) if r.cached_tokens is not None]
    if not rs:
        return None
    return sum(1 for r in rs if r.cached_tokens > 0) / len(rs)


def _paths(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.path for r in _ok(records) if r.path).items()))


def per_turn(records: Sequence[RequestRecord]) -> list[TurnStats]:
    """One row per turn index, in order."""
    out = []
    for turn in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == turn]
        ok = _ok(rs)
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        out.append(TurnStats(
            turn=turn, requests=len(rs), errors=len(rs) - len(ok),
            ttft_s=distribution(r.ttft_s for r in ok),
            itl_s=distribution(x for r in ok for x in r.itl_s),
            tpot_s=distribution(r.tpot_s for r in ok),
            e2e_s=distribution(r.e2e_s for r in ok),
            prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
            tokens=token_totals(rs), reuse_rate=reuse_rate(rs),
            cache_hit_rate=cache_hit_rate(rs), paths=_paths(rs)))
    return out


def summarize(records: Sequence[RequestRecord], wall_s: float) -> Summary:
    ok = _ok(records)
    later = [r for r in records if r.turn > 0]
    later_ok = _ok(later)
    tokens = token_totals(records)

    def rate(x: float) -> float | None:
        return x / wall_s if wall_s > 0 else None

    return Summary(
        requests=len(records), errors=len(records) - len(ok), wall_s=wall_s,
        ttft_s=distribution(r.ttft_s for r in ok),
        ttft_later_turns_s=distribution(r.ttft_s for r in later_ok),
        itl_s=distribution(x for r in ok for x in r.itl_s),
        tpot_s=distribution(r.tpot_s for r in ok),
        e2e_s=distribution(r.e2e_s for r in ok),
        e2e_later_turns_s=distribution(r.e2e_s for r in later_ok),
        tokens=tokens, reuse_rate_later_turns=reuse_rate(later),
        cache_hit_rate_later_turns=cache_hit_rate(later),
        requests_per_s=rate(len(ok)), output_tokens_per_s=rate(tokens.completion),
        prompt_tokens_per_s=rate(tokens.prompt), paths=_paths(records))


def answer_agreement(records: Sequence[RequestRecord], reference: Sequence[RequestRecord]
                     ) -> tuple[int, int]:
    """(matching, compared): answers equal to the reference's for the same conversation and
    turn, over the pairs where both succeeded."""
    ref = {(r.conversation, r.turn): r.answer for r in _ok(reference)}
    pairs = [(r.answer, ref[(r.conversation, r.turn)]) for r in _ok(records)
             if (r.conversation, r.turn) in ref]
    return sum(1 for a, b in pairs if a == b), len(pairs)


#: Goals of the full run: (baseline, bound on kvagent's later-turn median TTFT ratio).
#: The 1/4 goal is against AWS's setup (P without prefix cache); the P-cache-on variant is
#: reported without a goal.
RATIO_GOALS = ((PD_NOREUSE[0], 0.25), (AGGREGATED, 1.3))
REUSE_RATE_GOAL = 0.95


def targets(results: Sequence[ConfigResult]) -> Targets:
    """Later-turn median TTFT ratios of kvagent against the baselines that ran."""
    med = {c.name: c.summary.ttft_later_turns_s.p50 for c in results
           if c.status == "ok" and c.summary is not None}
    kva = med.get(KVAGENT)
    t = Targets()
    for base in (*PD_NOREUSE, AGGREGATED):
        ref = med.get(base)
        t.ratios[f"{KVAGENT}/{base}"] = kva / ref if kva is not None and ref else None
    for c in results:
        if c.name == KVAGENT and c.status == "ok" and c.summary is not None:
            t.kvagent_reuse_rate = c.summary.reuse_rate_later_turns
    for base, bound in RATIO_GOALS:
        ratio = t.ratios[f"{KVAGENT}/{base}"]
        t.met[f"{KVAGENT}/{base} <= {bound}"] = None if ratio is None else ratio <= bound
    rr = t.kvagent_reuse_rate
    t.met[f"reuse rate >= {REUSE_RATE_GOAL}"] = None if rr is None else rr >= REUSE_RATE_GOAL
    return t
