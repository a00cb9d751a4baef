"""The node trace's events as requests and turns, and where each turn's time went (pure).

A request is known on a node by its API id (`chatcmpl-…`, once `rendered`) and inside the
engine by that id plus a suffix (`chatcmpl-…-1a2b3c4d`). A D request that read P's blocks
(`read_start` on a decode node) closes a P/D turn whose P leg is the latest P request
that finished before D's began: `pd_reuse` when P started from cached or pulled tokens,
else `pd_fresh`. A D request that read nothing computed its prompt itself: a `d_direct`
turn when it started from cached tokens, a `d_fresh` turn when it started from none
(traces that did not note what was cached count as `d_direct`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Stages of a P/D turn, in order; each is the time between two events (ms).
PD_STAGES = ("p_render", "p_to_engine", "p_pull", "p_compute", "p_to_api", "p_answer", "hop", "d_render",
             "d_to_engine", "d_pull", "d_first_token", "d_to_api")
D_DIRECT_STAGES = ("d_render", "d_to_engine", "d_compute", "d_to_api")
DESCRIPTIONS = {
    "p_render": "P: request arrival to its prompt rendered (parse, template, tokenize)",
    "p_to_engine": "P: rendered to the scheduler's add (input processing, IPC)",
    "p_pull": "P: scheduler add to the pulled KV's arrival (0 without a pull)",
    "p_compute": "P: scheduled to its one token (the delta's compute)",
    "p_to_api": "P: its token in the engine core to the API server's output processing",
    "p_answer": ("P: the API server's output processing to the handler's whole answer "
                 "(traces without `api_output`: from P's token)"),
    "hop": ("P's answer to D's request arrival (P's serialization and HTTP, the router, "
            "D's body parse; older traces: from P's token)"),
    "d_render": "D: request arrival to its prompt rendered",
    "d_to_engine": "D: rendered to the scheduler's add",
    "d_pull": "D: scheduler add to the step that reports P's KV arrived",
    "d_first_token": ("D: P's KV arrived to its first token (P's token: the same step; "
                      "else the next schedule and one step)"),
    "d_compute": "D: scheduled to its first token (the delta's compute)",
    "d_to_api": "D: its first token in the engine core to the API server's output processing",
}


@dataclass
class NodeRequest:
    """One request on one node: event name -> wall-clock time (s), and what was noted."""

    node: str
    api_id: str
    times: dict[str, float] = field(default_factory=dict)
    computed: int | None = None  # prompt tokens cached or pulled when first scheduled
    tokens: int | None = None  # prompt tokens computed in the first step

    @property
    def decode(self) -> bool:
        return self.node.startswith("decode")

    def at(self, ev: str) -> float | None:
        return self.times.get(ev)


def api_id(engine_id: str) -> str:
    """`chatcmpl-abc-1a2b3c4d` -> `chatcmpl-abc` (the engine's suffix is 8 hex digits)."""
    head, sep, tail = engine_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return engine_id


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every event of every `*.jsonl` in `folder`, by time (a torn last line is skipped)."""
    events = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(events, key=lambda e: e["t"])


def requests(events: Iterable[dict[str, Any]]) -> list[NodeRequest]:
    """The events grouped per (node, API id), in order of arrival."""
    out: dict[tuple[str, str], NodeRequest] = {}
    for e in events:
        key = (e["node"], api_id(str(e["req"])))
        req = out.setdefault(key, NodeRequest(node=e["node"], api_id=key[1]))
        ev = e["ev"]
        if e.get("arrived") is not None:
            req.times.setdefault("arrived", float(e["arrived"]))
        if ev == "sched_new" and ev not in req.times:
            req.computed, req.tokens = e.get("computed"), e.get("tokens")
        req.times.setdefault(ev, float(e["t"]))
    return sorted(out.values(), key=lambda r: r.at("arrived") or r.at("sched_add") or 0.0)


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000


def turns(reqs: list[NodeRequest]) -> list[dict[str, Any]]:
    """One row per turn: its path (`pd_reuse`, `pd_fresh`, `d_direct` or `d_fresh`)
    and its stages in ms."""
    rows: list[dict[str, Any]] = []
    prefills = [r for r in reqs if not r.decode and r.at("first_token") is not None]
    for d in (r for r in reqs if r.decode and r.at("first_token") is not None):
        arrived = d.at("arrived")
        if d.at("read_start") is None:
            rows.append({"path": "d_fresh" if d.computed == 0 else "d_direct",
                         "d_render": _ms(arrived, d.at("rendered")),
                         "d_to_engine": _ms(d.at("rendered"), d.at("sched_add")),
                         "d_compute": _ms(d.at("sched_new"), d.at("first_token")),
                         "d_to_api": _ms(d.at("first_token"), d.at("api_output")),
                         "total": _ms(arrived, d.at("first_token"))})
            continue
        before = [p for p in prefills if arrived is not None
                  and (p.at("first_token") or 0.0) <= arrived]
        if not before:
            continue
        p = before[-1]
        pulled = p.at("remote_kv_done")
        # The step that reported D's load done (older traces: the schedule after it).
        d_kv = d.at("kv_received") or d.at("remote_kv_done")
        rows.append({
            "path": "pd_reuse" if p.computed else "pd_fresh",
            "p_render": _ms(p.at("arrived"), p.at("rendered")),
            "p_to_engine": _ms(p.at("rendered"), p.at("sched_add")),
            "p_pull": _ms(p.at("sched_add"), pulled) if pulled is not None else 0.0,
            "p_compute": _ms(pulled if pulled is not None else p.at("sched_new"),
                             p.at("first_token")),
            "p_to_api": _ms(p.at("first_token"), p.at("api_output")),
            "p_answer": _ms(p.at("api_output") or p.at("first_token"), p.at("responded")),
            "hop": _ms(p.at("responded") or p.at("first_token"), arrived),
            "d_render": _ms(arrived, d.at("rendered")),
            "d_to_engine": _ms(d.at("rendered"), d.at("sched_add")),
            "d_pull": _ms(d.at("sched_add"), d_kv),
            "d_first_token": _ms(d_kv, d.at("first_token")),
            "d_to_api": _ms(d.at("first_token"), d.at("api_output")),
            "total": _ms(p.at("arrived"), d.at("first_token")),
            "p_tokens": p.tokens, "p_computed": p.computed,
        })
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per path: n, and per stage (and `total`) the mean and median in ms."""
    out: dict[str, dict[str, Any]] = {}
    for path, stages in (("pd_reuse", PD_STAGES), ("pd_fresh", PD_STAGES),
                         ("d_direct", D_DIRECT_STAGES), ("d_fresh", D_DIRECT_STAGES)):
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        entry: dict[str, Any] = {"n": len(mine)}
        for stage in (*stages, "total"):
            vals = [r[stage] for r in mine if r.get(stage) is not None]
            if vals:
                entry[stage] = {"mean": statistics.fmean(vals),
                                "p50": statistics.median(vals)}
        out[path] = entry
    return out


def markdown(summ: dict[str, dict[str, Any]]) -> str:
    """The summary as a table: one row per stage, mean and p50 per path."""
    lines = ["| path | stage | what | mean ms | p50 ms |", "|---|---|---|---|---|"]
    for path, entry in summ.items():
        for stage, vals in entry.items():
            if stage == "n":
                continue
            what = DESCRIPTIONS.get(stage, "arrival at the first node to D's first token")
            lines.append(f"| {path} (n={entry['n']}) | {stage} | {what} | "
                         f"{vals['mean']:.1f} | {vals['p50']:.1f} |")
    return "\n".join(lines)
