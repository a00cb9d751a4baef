"""Goodput under load, the pure part: the arrival schedule, the SLO from an idle probe,
which sessions met it, one level's summary and the goals. No I/O.

A level N of the sweep offers N concurrent sessions on average: sessions arrive as a
Poisson process at N / (nominal session duration) per second, the same seeded schedule
for every configuration (open arrival: a slow configuration does not slow the arrivals,
its sessions pile up). A session meets the SLO when every one of its turns was answered,
each within its TTFT bound, and the p99 of its inter-token gaps (all turns pooled) is
within the ITL bound; goodput is such sessions per minute of the arrival window.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence

from .results import (
    LevelResult,
    LoadConfigResult,
    LoadReport,
    LoadTargets,
    PairedSessions,
    RequestRecord,
    Slo,
)
from .stats import AGGREGATED, KVAGENT, PD_NOREUSE, distribution, percentile

#: Baselines the goodput goal compares against (those that ran).
BASELINES = (*PD_NOREUSE, AGGREGATED, "pd_noreuse_pcache_on_2p")
FIXED_POLICIES = ("kvagent_always_d_direct", "kvagent_always_pd_reuse")
#: Configurations whose path per turn comes from a cost model (those that ran).
COST_MODELS = (KVAGENT, "kvagent_queue_aware", "kvagent_ttft_lines", "kvagent_stall_cap")
GOODPUT_GOAL = 1.5
THINK_CAP_FACTOR = 4.0  # think times above this many means are cut: a level stays bounded


def level_seed(seed: int, level: int) -> int:
    """Each level its own sessions (documents, system prompt, schedule), reproducibly."""
    return seed * 1000 + level


def nominal_session_s(turns: int, think_mean_s: float, nominal_turn_s: float) -> float:
    """How long a session lasts when every turn takes `nominal_turn_s`."""
    return turns * nominal_turn_s + max(turns - 1, 0) * think_mean_s


def arrival_offsets(level: int, *, session_s: float, window_s: float, max_sessions: int,
                    rng: random.Random) -> list[float]:
    """Poisson arrivals at `level / session_s` per second within [0, window_s), at most
    `max_sessions`, at least one (at 0 when the draw has none)."""
    if level < 1 or session_s <= 0 or window_s <= 0 or max_sessions < 1:
        raise ValueError("level, session_s, window_s and max_sessions must be positive")
    rate = level / session_s
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < window_s and len(out) < max_sessions:
        out.append(t)
        t += rng.expovariate(rate)
    return out or [0.0]


def think_times(turns: int, mean_s: float, rng: random.Random) -> list[float]:
    """Exponential think time before each turn after the first, cut at
    THINK_CAP_FACTOR x the mean; all 0 for a zero mean."""
    if mean_s <= 0:
        return [0.0] * max(turns - 1, 0)
    return [min(rng.expovariate(1 / mean_s), THINK_CAP_FACTOR * mean_s)
            for _ in range(max(turns - 1, 0))]


# ---------------------------------------------------------------------------- SLO


def idle_slo(records: Sequence[RequestRecord], *, probe_config: str, ttft_factor: float = 2.0,
             itl_factor: float = 3.0) -> Slo:
    """The SLO from an idle probe's records (one request at a time): TTFT bound =
    `ttft_factor` x the idle TTFT p90, per turn class (first turn, later turns); ITL bound
    = `itl_factor` x the idle decode step (TPOT p50). ValueError when the probe lacks a
    class or decode times."""
    ok = [r for r in records if r.error is None]
    first = [r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]
    later = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    if not first or not later or not tpot:
        raise ValueError(f"idle probe: need first turns, later turns and decode times; got "
                         f"{len(first)}, {len(later)}, {len(tpot)} of {len(records)} requests")
    return Slo(probe_config=probe_config, probe_requests=len(records),
               idle_ttft_first_p90_s=_p(first, 90), idle_ttft_later_p90_s=_p(later, 90),
               idle_decode_step_s=_p(tpot, 50), ttft_factor=ttft_factor,
               itl_factor=itl_factor)


def _p(values: Sequence[float], q: float) -> float:
    v = percentile(values, q)
    assert v is not None
    return v


def turn_ttft_bound(turn: int, slo: Slo) -> float:
    return slo.ttft_first_s if turn == 0 else slo.ttft_later_s


def turn_meets_ttft(record: RequestRecord, slo: Slo) -> bool:
    """Answered, first token within its turn class's bound."""
    return (record.error is None and record.ttft_s is not None
            and record.ttft_s <= turn_ttft_bound(record.turn, slo))


def session_itl_p99(records: Iterable[RequestRecord]) -> float | None:
    """p99 of the gaps between token-bearing chunks over all of a session's turns. Pooled
    per session, not per turn: one turn has only max_tokens - 1 gaps, too few for a p99
    that is not simply its largest gap."""
    return percentile([x for r in records for x in r.itl_s], 99)


def session_outcomes(records: Iterable[RequestRecord], sessions: Sequence[str], turns: int,
                     cancelled: Iterable[str], slo: Slo) -> dict[str, str]:
    """Per session id: `met` (every turn answered within its TTFT bound, the session's
    ITL p99 within the ITL bound), `missed` (all turns answered, outside the SLO),
    `failed` (a turn errored) or `cancelled` (still running at the drain cap)."""
    by: dict[str, list[RequestRecord]] = {s: [] for s in sessions}
    for r in records:
        by.setdefault(r.conversation, []).append(r)
    gone = set(cancelled)
    out = {}
    for sid, rs in by.items():
        itl = session_itl_p99(rs)
        if any(r.error is not None for r in rs):
            out[sid] = "failed"
        elif sid in gone or len({r.turn for r in rs}) < turns:
            out[sid] = "cancelled"
        elif all(turn_meets_ttft(r, slo) for r in rs) and (itl is None or itl <= slo.itl_s):
            out[sid] = "met"
        else:
            out[sid] = "missed"
    return out


def missed_by(records: Iterable[RequestRecord], missed: Iterable[str], slo: Slo
              ) -> dict[str, int]:
    """Why the `missed` sessions missed: how many had a first turn over its TTFT bound,
    a later turn over its bound, the ITL p99 over its bound (one session may count in
    several)."""
    by: dict[str, list[RequestRecord]] = {s: [] for s in missed}
    for r in records:
        if r.conversation in by:
            by[r.conversation].append(r)
    out: Counter[str] = Counter()
    for rs in by.values():
        if any(r.turn == 0 and not turn_meets_ttft(r, slo) for r in rs):
            out["first_turn_ttft"] += 1
        if any(r.turn > 0 and not turn_meets_ttft(r, slo) for r in rs):
            out["later_turn_ttft"] += 1
        itl = session_itl_p99(rs)
        if itl is not None and itl > slo.itl_s:
            out["itl_p99"] += 1
    return dict(sorted(out.items()))


def summarize_level(level: int, records: Sequence[RequestRecord], *, sessions: Sequence[str],
                    turns: int, cancelled: Sequence[str], window_s: float, wall_s: float,
                    slo: Slo, max_error_rate: float) -> LevelResult:
    """One level's figures; `broken` when no session met the SLO or more than
    `max_error_rate` of the requests failed."""
    by_session = session_outcomes(records, sessions, turns, cancelled, slo)
    outcomes = Counter(by_session.values())
    ok = [r for r in records if r.error is None]
    errors = len(records) - len(ok)
    error_rate = errors / len(records) if records else 0.0
    minutes = window_s / 60
    goodput = outcomes["met"] / minutes
    first = distribution(r.ttft_s for r in ok if r.turn == 0)
    later = distribution(r.ttft_s for r in ok if r.turn > 0)
    itl = distribution(x for r in ok for x in r.itl_s)
    level_ok = (all(d.p90 is None or d.p90 <= turn_ttft_bound(t, slo)
                    for t, d in ((0, first), (1, later)))
                and (itl.p99 is None or itl.p99 <= slo.itl_s) and bool(ok))
    reason = None
    if outcomes["met"] == 0:
        reason = "no session met the SLO"
    elif error_rate > max_error_rate:
        reason = f"{error_rate:.0%} of requests failed (limit {max_error_rate:.0%})"
    return LevelResult(
        level=level, window_s=window_s, wall_s=wall_s, sessions=len(sessions),
        sessions_finished=outcomes["met"] + outcomes["missed"],
        sessions_met=outcomes["met"], sessions_cancelled=outcomes["cancelled"],
        offered_sessions_per_min=len(sessions) / minutes, goodput_sessions_per_min=goodput,
        requests=len(records), errors=errors, error_rate=error_rate,
        turns_within_ttft=sum(1 for r in ok if turn_meets_ttft(r, slo)),
        ttft_s=distribution(r.ttft_s for r in ok), ttft_first_s=first, ttft_later_s=later,
        itl_s=itl, tpot_s=distribution(r.tpot_s for r in ok),
        turns_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        output_tokens_per_s=(sum(r.completion_tokens or 0 for r in ok) / wall_s
                             if wall_s > 0 else 0.0),
        paths=dict(sorted(Counter(r.path for r in ok if r.path).items())),
        slo_met_level=level_ok, broken=reason is not None, broken_reason=reason,
        missed_by=missed_by(records, [k for k, v in by_session.items() if v == "missed"], slo),
        session_outcome=by_session, records=list(records))


def rescore_level(lv: LevelResult, slo: Slo, *, turns: int, max_error_rate: float
                  ) -> LevelResult:
    """The level judged against another SLO, from its records. Sessions cancelled at
    the drain cap stay cancelled; in runs recorded before outcomes were kept per session,
    those that left no record (cancelled before their first answer) count as cancelled."""
    if lv.session_outcome:
        ids = list(lv.session_outcome)
        gone = [s for s, o in lv.session_outcome.items() if o == "cancelled"]
    else:
        seen = sorted({r.conversation for r in lv.records})
        gone = [f"(no record {i})" for i in range(lv.sessions - len(seen))]
        ids = seen + gone
    out = summarize_level(lv.level, lv.records, sessions=ids, turns=turns, cancelled=gone,
                          window_s=lv.window_s, wall_s=lv.wall_s, slo=slo,
                          max_error_rate=max_error_rate)
    return out.model_copy(update={"foreign_vllm_max": lv.foreign_vllm_max,
                                  "load_avg_max": lv.load_avg_max,
                                  "steal_s": lv.steal_s, "other_cpu_s": lv.other_cpu_s,
                                  "placements": lv.placements})


def rejudge(report: LoadReport, slo: Slo) -> LoadReport:
    """The whole run's recorded requests judged against `slo`. Levels a configuration
    did not reach (its sweep stopped earlier) stay unmeasured."""
    turns = int(report.load["turns"])
    limit = float(report.load["max_error_rate"])
    configs = [c.model_copy(update={"levels": [
        rescore_level(lv, slo, turns=turns, max_error_rate=limit) for lv in c.levels]})
        for c in report.configs]
    return report.model_copy(update={"slo": slo, "configs": configs,
                                     "targets": load_targets(configs)})


def rescore(report: LoadReport, *, ttft_factor: float, itl_factor: float) -> LoadReport:
    """The whole run judged against the same idle probe with other factors."""
    if report.slo is None:
        raise ValueError("the run has no SLO (its idle probe did not run)")
    slo = report.slo.model_copy(update={"ttft_factor": ttft_factor,
                                        "itl_factor": itl_factor})
    return rejudge(report, slo).model_copy(update={
        "rescored": {"ttft_factor": ttft_factor, "itl_factor": itl_factor,
                     "original": {"ttft_factor": report.slo.ttft_factor,
                                  "itl_factor": report.slo.itl_factor}}})


# ---------------------------------------------------------------------------- placement

PLACEMENT_METRICS = {"kvagent_router_prefill_placements": "prefill",
                     "kvagent_router_decode_placements": "decode"}


def placement_counts(metrics_text: str) -> dict[str, float]:
    """The router's placement counters from its Prometheus text, as `role:reason`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        role = PLACEMENT_METRICS.get(family.name)
        if role is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[f"{role}:{sample.labels.get('reason', '')}"] = sample.value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the counters added between two scrapes (non-zero entries, sorted)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v - before.get(k, 0.0) > 0}


# ---------------------------------------------------------------------------- goals


def peak_goodput(config: LoadConfigResult) -> float | None:
    return max((lv.goodput_sessions_per_min for lv in config.levels), default=None)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isinf(b):
        return None
    return a / b


def sign_test_p(k: int, n: int) -> float:
    """Two-sided exact binomial test of k successes in n trials at p = 1/2."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_sessions(a: LoadConfigResult, b: LoadConfigResult) -> PairedSessions | None:
    """`a` against `b` on the sessions of the levels both ran; None without any
    (runs recorded before outcomes were kept per session have none until rescored)."""
    la = {lv.level: lv.session_outcome for lv in a.levels if lv.session_outcome}
    lb = {lv.level: lv.session_outcome for lv in b.levels if lv.session_outcome}
    levels = sorted(set(la) & set(lb))
    pairs: Counter[tuple[bool, bool]] = Counter()
    for level in levels:
        for sid in la[level].keys() & lb[level].keys():
            pairs[la[level][sid] == "met", lb[level][sid] == "met"] += 1
    if not pairs:
        return None
    only_a, only_b = pairs[True, False], pairs[False, True]
    return PairedSessions(a=a.name, b=b.name, levels=levels, sessions=sum(pairs.values()),
                          both=pairs[True, True], only_a=only_a, only_b=only_b,
                          neither=pairs[False, False],
                          p_value=sign_test_p(only_a, only_a + only_b))


def load_targets(configs: Sequence[LoadConfigResult]) -> LoadTargets:
    """kvagent's peak goodput against the best baseline's (goal >= 1.5x), its ITL p99
    against the aggregated node's at the highest level both ran, the cost model's peak
    goodput against each fixed policy's, and each cost model against each fixed policy
    (and kvagent against the best baseline) session by session."""
    peaks = {c.name: p for c in configs if (p := peak_goodput(c)) is not None}
    t = LoadTargets(peak_goodput=peaks)
    kva = peaks.get(KVAGENT)
    base = {n: peaks[n] for n in BASELINES if n in peaks}
    if base:
        t.best_baseline = max(base, key=lambda n: base[n])
        best = base[t.best_baseline]
        t.kvagent_over_best_baseline = _ratio(kva, best)
        t.met[f"kvagent peak goodput >= {GOODPUT_GOAL}x best baseline"] = (
            None if kva is None else (kva > 0 if best == 0 else kva >= GOODPUT_GOAL * best))
    by = {c.name: {lv.level: lv for lv in c.levels if lv.itl_s.p99 is not None}
          for c in configs}
    common = sorted(set(by.get(KVAGENT, {})) & set(by.get(AGGREGATED, {})))
    if common:
        lvl = common[-1]
        t.itl_p99_level = lvl
        t.kvagent_itl_p99_s = by[KVAGENT][lvl].itl_s.p99
        t.aggregated_itl_p99_s = by[AGGREGATED][lvl].itl_s.p99
        assert t.kvagent_itl_p99_s is not None and t.aggregated_itl_p99_s is not None
        t.met["kvagent ITL p99 < aggregated's under load"] = (
            t.kvagent_itl_p99_s < t.aggregated_itl_p99_s)
    for policy in FIXED_POLICIES:
        if policy in peaks:
            t.cost_model_over[policy] = _ratio(kva, peaks[policy])
            t.met[f"cost model peak goodput >= {policy}"] = (
                None if kva is None else kva >= peaks[policy])
    named = {c.name: c for c in configs}
    versus = [(m, p) for m in COST_MODELS for p in FIXED_POLICIES if m in named and p in named]
    if t.best_baseline is not None and KVAGENT in named:
        versus.append((KVAGENT, t.best_baseline))
    t.paired = [p for a, b in versus if (p := paired_sessions(named[a], named[b])) is not None]
    return t
