"""Where a turn's time to first token goes, per configuration and path (I/O-free).

Each record's TTFT splits into segments that add up to it exactly:
the router's own stages from its `Server-Timing` header (receive, tokenize, plan, the P
leg, D's time to headers), the router's time between those stages (`router_other`),
the HTTP time outside the router (`outside`: sending the request, the headers' way back),
and D's work after its headers up to the first token (`first_token`: for vLLM that is the
KV pull, queueing and computing the new tokens). A configuration without the router
(one aggregated node) has only `outside` (its time to headers) and `first_token`.
Means, not medians, so the segments of a bar add up to the mean TTFT.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .results import PathBudget, RequestRecord
from .stats import percentile

ROUTER_STAGES = ("receive", "tokenize", "plan", "prefill", "decode")
SEGMENTS = (*ROUTER_STAGES, "router_other", "outside", "first_token")
LABELS = {
    "receive": "router: receive (auth, body, checks)",
    "tokenize": "router: /tokenize",
    "plan": "router: plan (claim, placement)",
    "prefill": "P leg (queue, pull, compute)",
    "decode": "D: time to headers",
    "router_other": "router: between stages",
    "outside": "HTTP outside the router",
    "first_token": "D: headers to first token (pull, queue, compute)",
}


def segments(rec: RequestRecord) -> dict[str, float] | None:
    """The record's TTFT split into SEGMENTS (None: an error, or not measured)."""
    if rec.error is not None or rec.ttft_s is None or rec.headers_s is None:
        return None
    st = rec.stages_s
    out = {s: st.get(s, 0.0) for s in ROUTER_STAGES}
    total = st.get("total")
    if total is None:  # no router in front (or its header is off)
        out["router_other"] = 0.0
        out["outside"] = rec.headers_s
    else:
        out["router_other"] = max(0.0, total - sum(out.values()))
        out["outside"] = rec.headers_s - total  # may dip below 0 by clock granularity
    out["first_token"] = rec.ttft_s - rec.headers_s
    return out


def budgets(records: Iterable[RequestRecord], *, later_turns: bool = True
            ) -> list[PathBudget]:
    """One budget per (configuration, path); `later_turns`: turns after the first only
    (where reuse can happen)."""
    groups: dict[tuple[str, str], list[tuple[RequestRecord, dict[str, float]]]] = {}
    for rec in records:
        if later_turns and rec.turn == 0:
            continue
        seg = segments(rec)
        if seg is None:
            continue
        key = (rec.config, rec.path or "direct")
        groups.setdefault(key, []).append((rec, seg))
    out = []
    for (config, path), rows in groups.items():
        n = len(rows)
        means = {s: sum(seg[s] for _, seg in rows) / n for s in SEGMENTS}
        ttfts = [r.ttft_s for r, _ in rows if r.ttft_s is not None]
        out.append(PathBudget(config=config, path=path, n=n, segments_s=means,
                              ttft_mean_s=sum(ttfts) / n, ttft_p50_s=percentile(ttfts, 50)))
    return out


def markdown_table(rows: Sequence[PathBudget]) -> list[str]:
    lines = ["| config | path | n | " + " | ".join(SEGMENTS) + " | TTFT mean | TTFT p50 |",
             "|---|---|---|" + "---|" * (len(SEGMENTS) + 2)]
    for b in rows:
        cells = " | ".join(f"{b.segments_s[s] * 1000:.1f}" for s in SEGMENTS)
        p50 = "–" if b.ttft_p50_s is None else f"{b.ttft_p50_s * 1000:.0f}"
        lines.append(f"| {b.config} | {b.path} | {b.n} | {cells} | "
                     f"{b.ttft_mean_s * 1000:.0f} | {p50} |")
    return lines
