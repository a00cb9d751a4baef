"""The comparison's figures, summary JSON and report, from the records of every run of
every arm. Pure: no I/O, no clock.

SLOs are fixed before the run (from the command's arguments) and a session is judged
against each: `ttft`, the p90 of its later turns' TTFT within the bound; `itl`, the p99 of
its inter-token gaps (all turns pooled: one turn has too few gaps for a p99) within the
bound; `both`. Goodput is the fraction of sessions meeting each, and their count per
minute of the arm's workload time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.multiturn.goodput import session_itl_p99
from benchmarks.multiturn.results import RequestRecord
from benchmarks.multiturn.stats import percentile

#: 2: each arm's `memory` (engine KV, host tier, disk tier), and per run in `order` the
#: disk tier's bytes at the end and the nodes' tier counters. Schema 1 summaries still
#: read (`memory` absent: the report says so).
SCHEMA = 2
SLO_NAMES = ("ttft", "itl", "both")


@dataclass(frozen=True)
class Slo:
    """The bounds, in milliseconds."""

    ttft_ms: float  # a session's later-turn TTFT p90
    itl_ms: float  # a session's inter-token gap p99


@dataclass
class ArmRun:
    """One arm brought up, driven once and stopped."""

    arm: str
    rep: int
    position: int  # in the run order, from 0
    status: str = "ok"  # ok, failed, interrupted
    error: str | None = None
    startup_s: float | None = None
    wall_s: float | None = None
    #: The most vLLM processes of others seen while it ran (None: not watched).
    foreign_vllm: int | None = None
    records: list[RequestRecord] = field(default_factory=list)
    #: A tiered arm's disk tier at the end of the workload, bytes (None: no tier).
    disk_used_bytes: int | None = None
    #: Per node, prompt tokens cached by source and external hits (tiered arms).
    tier_counters: dict[str, dict[str, float]] | None = None


def run_order(arms: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: forward in even repetitions, reversed in odd ones
    (ABBA), so no arm always runs first or last, or always after the same one."""
    if reps < 1:
        raise ValueError(f"repetitions: {reps} < 1")
    return [(rep, a) for rep in range(reps)
            for a in (arms if rep % 2 == 0 else list(reversed(arms)))]


def _ms(values: Sequence[float], q: float) -> float | None:
    v = percentile(values, q)
    return None if v is None else v * 1000


def session_verdicts(records: Sequence[RequestRecord], slo: Slo) -> dict[str, bool]:
    """Per SLO name, whether the session (all its records, all answered) met it."""
    ok = all(r.error is None for r in records) and bool(records)
    later = [r.ttft_s for r in records if r.turn > 0 and r.ttft_s is not None]
    p90 = _ms(later, 90)
    itl = session_itl_p99(records)
    ttft = ok and (p90 is None or p90 <= slo.ttft_ms)
    itl_ok = ok and (itl is None or itl * 1000 <= slo.itl_ms)
    return {"ttft": ttft, "itl": itl_ok, "both": ttft and itl_ok}


def later_ttft_p50_ms(run: ArmRun) -> float | None:
    """One run's later-turn TTFT p50: read along the run order, it shows drift (the
    machine, other load) that the ABBA order is there to balance."""
    return _ms([r.ttft_s for r in run.records
                if r.turn > 0 and r.error is None and r.ttft_s is not None], 50)


def arm_figures(runs: Sequence[ArmRun], slo: Slo) -> dict[str, Any]:
    """One arm's figures over all its runs (records pooled; sessions are per run)."""
    recs = [r for run in runs for r in run.records]
    ok = [r for r in recs if r.error is None]
    first = [r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]
    later = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.itl_s]
    sessions: dict[tuple[int, str], list[RequestRecord]] = {}
    for run in runs:
        for r in run.records:
            sessions.setdefault((run.rep, r.conversation), []).append(r)
    verdicts = [session_verdicts(rs, slo) for rs in sessions.values()]
    minutes = sum(run.wall_s or 0.0 for run in runs) / 60
    goodput = {}
    for name in SLO_NAMES:
        met = sum(1 for v in verdicts if v[name])
        goodput[name] = {"sessions_met": met, "sessions": len(verdicts),
                         "fraction": met / len(verdicts) if verdicts else None,
                         "per_min": met / minutes if minutes > 0 else None}
    later_ok = [r for r in ok if r.turn > 0]
    prompt = sum(r.prompt_tokens or 0 for r in later_ok)
    reused = [r.reused_tokens for r in later_ok if r.reused_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in later_ok)
    return {
        "runs": len(runs), "failed_runs": sum(1 for r in runs if r.status != "ok"),
        "requests": len(recs), "errors": len(recs) - len(ok),
        "startup_s": [r.startup_s for r in runs],
        "wall_s": [r.wall_s for r in runs],
        "ttft_first_ms": {"p50": _ms(first, 50), "p90": _ms(first, 90), "n": len(first)},
        "ttft_later_ms": {"p50": _ms(later, 50), "p90": _ms(later, 90), "n": len(later)},
        "turn_e2e_ms": {"p50": _ms(e2e, 50), "p90": _ms(e2e, 90), "n": len(e2e)},
        "itl_p99_ms": _ms(gaps, 99),
        "goodput": goodput,
        # later turns' prompt tokens the router reused (None: the arm reports none) and
        # that the engine did not compute (prefix cache and reuse alike)
        "reuse_ratio": sum(reused) / prompt if reused and prompt else None,
        "cached_ratio": cached / prompt if prompt else None,
    }


#: (figure, how to read it from an arm's figures, lower is better).
METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float | None], bool], ...] = (
    ("later-turn TTFT p50", lambda f: f["ttft_later_ms"]["p50"], True),
    ("later-turn TTFT p90", lambda f: f["ttft_later_ms"]["p90"], True),
    ("first-turn TTFT p90", lambda f: f["ttft_first_ms"]["p90"], True),
    ("turn time p50", lambda f: f["turn_e2e_ms"]["p50"], True),
    ("ITL p99", lambda f: f["itl_p99_ms"], True),
    *((f"goodput ({n})", (lambda f, n=n: f["goodput"][n]["fraction"]), False)
      for n in SLO_NAMES),
)


def comparisons(figures: dict[str, dict[str, Any]], subject: str) -> dict[str, Any]:
    """Per metric: the best baseline (any arm but `subject`), its value, the subject's and
    subject ÷ best (for goodput, > 1 is better; for times, < 1)."""
    out: dict[str, Any] = {}
    if subject not in figures:
        return out
    for name, get, lower in METRICS:
        mine = get(figures[subject])
        base: dict[str, float] = {}
        for a, f in figures.items():
            v = get(f)
            if a != subject and v is not None:
                base[a] = v
        if not base:
            continue
        best = (min if lower else max)(base, key=base.__getitem__)
        ref = base[best]
        out[name] = {"best_baseline": best, "baseline": ref, "subject": mine,
                     "ratio": mine / ref if mine is not None and ref else None,
                     "lower_is_better": lower}
    return out


def paired_later_ttft(runs: Sequence[ArmRun], subject: str) -> dict[str, dict[str, Any]]:
    """Per baseline: the subject's later turns against the same turn of the same
    conversation in the same repetition (every arm runs the same conversations): how
    many pairs, the median of subject − baseline TTFT, and how often the subject was
    faster. Pooled percentiles move with whichever slow turns land where; a paired
    difference shows what the subject adds to one turn."""
    def later(arm: str) -> dict[tuple[int, str, int], float]:
        return {(run.rep, r.conversation, r.turn): r.ttft_s for run in runs if run.arm == arm
                for r in run.records
                if r.turn > 0 and r.error is None and r.ttft_s is not None}

    mine = later(subject)
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(run.arm for run in runs):
        if arm == subject:
            continue
        theirs = later(arm)
        diffs = [mine[k] - theirs[k] for k in mine.keys() & theirs.keys()]
        if diffs:
            out[arm] = {"n": len(diffs), "median_diff_ms": percentile(diffs, 50) * 1000,
                        "subject_faster": sum(d < 0 for d in diffs) / len(diffs)}
    return out


def where_it_does_not_help(cmp: dict[str, Any], subject: str) -> str:
    """The metrics on which a baseline beat `subject`, in plain words."""
    lost = []
    for name, c in cmp.items():
        if c["subject"] is None:
            lost.append(f"{name}: {subject} has no figure")
        elif (c["subject"] > c["baseline"]) if c["lower_is_better"] else (
                c["subject"] < c["baseline"]):
            lost.append(f"{name}: {c['best_baseline']} ({_fmt(c['baseline'])} vs "
                        f"{_fmt(c['subject'])})")
    if not cmp:
        return f"No comparison: {subject} or every baseline is missing."
    if not lost:
        return f"{subject} was at least as good as every baseline on every figure here."
    return f"Where {subject} does not help: " + "; ".join(lost) + "."


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def summary(*, command: list[str], commit: str | None, machine: dict[str, Any], date: str,
            workload: dict[str, Any], slo: Slo, arms: dict[str, str],
            order: list[dict[str, Any]],
            flags: list[dict[str, str]], runs: Sequence[ArmRun], subject: str,
            raw_records: str | None, memory: dict[str, dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """The summary JSON (schema `SCHEMA`): what ran, under which SLOs, each arm's figures
    and the subject's ratios against the best baseline. No per-request records."""
    figures = {a: arm_figures([r for r in runs if r.arm == a], slo) for a in arms}
    cmp = comparisons({a: f for a, f in figures.items() if f["requests"]}, subject)
    return {
        "schema": SCHEMA, "command": command, "commit": commit, "machine": machine,
        "date": date, "workload": workload,
        "slo": {"ttft_later_p90_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_ms,
                "judged": "per session; goodput = sessions meeting the SLO"},
        "arms": {a: {"description": d, "figures": figures[a],
                     "memory": _memory_used((memory or {}).get(a),
                                            [r for r in runs if r.arm == a])}
                 for a, d in arms.items()},
        "order": order, "flags": flags, "subject": subject,
        "vs_best_baseline": cmp, "does_not_help": where_it_does_not_help(cmp, subject),
        "paired_later_ttft": paired_later_ttft(runs, subject),
        "raw_records": raw_records,
        # Quiet: no vLLM process but the arms' own ran during any arm's workload.
        "foreign_vllm_max": max((r.foreign_vllm or 0 for r in runs), default=0),
    }


def _memory_used(budget: dict[str, Any] | None, runs: Sequence[ArmRun]
                 ) -> dict[str, Any] | None:
    """An arm's memory budget with what its disk tier held at the end of each run (the
    engine KV and host tier are allocated whole at start-up: their budget is their use)."""
    if budget is None:
        return None
    used = [r.disk_used_bytes for r in runs if r.disk_used_bytes is not None]
    return {**budget, "disk_used_gib_max": max(used) / (1 << 30) if used else None}


def memory_lines(s: dict[str, Any]) -> list[str]:
    """The report's memory table: what each arm held, summed over its nodes."""
    rows = [(n, a.get("memory")) for n, a in s["arms"].items()]
    if not any(m for _, m in rows):
        return ["Memory per arm: not recorded (a summary before schema 2)."]
    lines = [("| arm | nodes | engine KV | host tier | disk tier (budget) | disk used at the "
             "end (max) | total budget |"), "|---|---|---|---|---|---|---|"]
    for name, m in rows:
        if not m:
            lines.append(f"| {name} | - | - | - | - | - | - |")
            continue
        kv = f"{m['engine_kv_gib']:g} GiB" + (
            f" (≤ {m['engine_kv_tokens']:,} tokens)" if m.get("engine_kv_tokens") else "")
        disk = (f"{m['disk_tier_gib']:g} GiB" + (" shared" if m.get("disk_shared") else "")
                if m["disk_tier_gib"] else "none")
        host = f"{m['host_tier_gib']:g} GiB" if m["host_tier_gib"] else "none"
        used = m.get("disk_used_gib_max")
        used_s = "-" if used is None else f"{used:.2f} GiB"
        total = m["engine_kv_gib"] + m["host_tier_gib"] + m["disk_tier_gib"]
        nodes = f"{m['nodes']}" + (f" ({m['topology']})" if m.get("topology") else "")
        lines.append(f"| {name} | {nodes} | {kv} | {host} | {disk} | {used_s} | "
                     f"{total:g} GiB |")
    lines += ["", ("Engine KV and the host tier are allocated whole when a node starts (split "
              "evenly between an arm's nodes); the disk tier grows up to its budget.")]
    return lines


DEFAULTS_NOTE = ("`default`: vLLM's own (on CPU a 2,048-token step budget, no cap per prompt, "
                 "as many blocks as the space holds); `unset` for `KVAGENT_SPIN_NAP_US`: the "
                 "plugin's CPU default (100 µs).")


def report_md(s: dict[str, Any]) -> str:
    """The report: SLOs first (they were fixed before the run), then figures, ratios, the
    plain-words line, the flags each node ran with and the run order."""
    slo = s["slo"]
    lines = [
        "# Comparison: " + ", ".join(s["arms"]), "",
        f"- command: `{' '.join(s['command'])}`",
        (f"- commit: `{s['commit']}`; date: {s['date']}; foreign vLLM processes during the "
         f"workloads: {s.get('foreign_vllm_max', 'not watched')}"),
        (f"- machine: {s['machine'].get('cpu')}, {s['machine'].get('cores')} cores, "
         f"{s['machine'].get('memory_gib')} GiB, GPU {s['machine'].get('gpu')}"),
        (f"- SLOs (set before the run): **ttft**: a session's later-turn TTFT p90 ≤ "
         f"{slo['ttft_later_p90_ms']:g} ms; **itl**: its inter-token gap p99 ≤ "
         f"{slo['itl_p99_ms']:g} ms; **both**. Goodput: sessions meeting each."),
        f"- workload `{s['workload']['name']}`: {s['workload']['why']}; KV budget of every "
        f"arm, split evenly between its nodes: {s['workload']['kv_gib']} GiB"
        + (f", at most {s['workload']['kv_tokens']:,} tokens" if s['workload']['kv_tokens']
           else ""),
        "",
        *memory_lines(s),
        "",
        ("| arm | runs | requests (errors) | first TTFT p50 / p90 ms | later TTFT p50 / p90 "
         "ms | turn time p50 / p90 ms | ITL p99 ms | goodput ttft | goodput itl | goodput "
         "both | reused | cached |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in s["arms"].items():
        f = a["figures"]
        g = f["goodput"]
        lines.append(
            f"| {name} | {f['runs'] - f['failed_runs']}/{f['runs']} | {f['requests']} "
            f"({f['errors']}) | {_fmt(f['ttft_first_ms']['p50'])} / "
            f"{_fmt(f['ttft_first_ms']['p90'])} | {_fmt(f['ttft_later_ms']['p50'])} / "
            f"{_fmt(f['ttft_later_ms']['p90'])} | {_fmt(f['turn_e2e_ms']['p50'])} / "
            f"{_fmt(f['turn_e2e_ms']['p90'])} | {_fmt(f['itl_p99_ms'])} | "
            + " | ".join(f"{g[n]['sessions_met']}/{g[n]['sessions']}" for n in SLO_NAMES)
            + f" | {_pct(f['reuse_ratio'])} | {_pct(f['cached_ratio'])} |")
    lines += ["", f"## {s['subject']} against the best baseline", "",
              "| figure | best baseline | its value | " + s["subject"] + " | ratio |",
              "|---|---|---|---|---|"]
    for name, c in s["vs_best_baseline"].items():
        lines.append(f"| {name} | {c['best_baseline']} | {_fmt(c['baseline'])} | "
                     f"{_fmt(c['subject'])} | {_fmt(c['ratio'])} |")
    lines += ["", "Times: ratio < 1 is better for " + s["subject"] + "; goodput: > 1.", ""]
    for arm, p in (s.get("paired_later_ttft") or {}).items():
        lines.append(f"- Paired with {arm} (the same later turn of the same conversation "
                     f"and repetition, {p['n']} pairs): {s['subject']} − {arm} TTFT median "
                     f"{p['median_diff_ms']:+,.0f} ms; {s['subject']} faster in "
                     f"{p['subject_faster'] * 100:.0f} % of them.")
    lines += ["", s["does_not_help"], "", "## Flags each node ran with", ""]
    if s["flags"]:  # side by side: one column per node
        cols = s["flags"]
        lines += ["| | " + " | ".join(f"{c['arm']} {c['node']}" for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        lines += [f"| `{k}` | " + " | ".join(c[k] for c in cols) + " |"
                  for k in cols[0] if k not in ("arm", "node")]
        lines += ["", DEFAULTS_NOTE]
    lines += ["", "## Run order", "",
              "| # | repetition | arm | status | up (s) | workload (s) | later TTFT p50 ms |",
              "|---|---|---|---|---|---|---|"]
    for o in s["order"]:
        lines.append(f"| {o['position']} | {o['rep']} | {o['arm']} | {o['status']}"
                     f"{': ' + o['error'] if o.get('error') else ''} | "
                     f"{_fmt(o.get('startup_s'))} | {_fmt(o.get('wall_s'))} | "
                     f"{_fmt(o.get('ttft_later_p50_ms'))} |")
    tiered = [o for o in s["order"] if o.get("tier_counters")]
    if tiered:
        lines += ["", ("Tier counters at the end of each tiered run (prompt tokens cached "
                  "by source, `vllm:prompt_tokens_cached_by_source`; external hits, "
                  "`vllm:external_prefix_cache_hits`):"), ""]
        for o in tiered:
            nodes = "; ".join(f"{n}: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c.items()))
                              for n, c in o["tier_counters"].items())
            lines.append(f"- #{o['position']} {o['arm']}: {nodes}")
    lines += ["", "Descriptions:", ""]
    lines += [f"- `{n}`: {a['description']}" for n, a in s["arms"].items()]
    if s.get("raw_records"):
        lines += ["", f"Per-request records (not part of the report): `{s['raw_records']}`"]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f} %"
