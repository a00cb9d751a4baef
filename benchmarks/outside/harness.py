"""The outside harness, pure: the `aiperf` command line for a multi-turn run, and its
per-request records read back and summed up.

aiperf (NVIDIA's load generator, from PyPI) is the harness here because it is someone
else's: it builds its own synthetic conversations, keeps each conversation's history
(every turn resends the earlier turns and the answers it got back), carries one session
id per conversation in a header, and measures time to first token and the time per
output token on its side of the socket. Nothing of kvagent's own benchmark client is in
the loop, so a flaw in that client cannot flatter kvagent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.multiturn.stats import percentile

#: The harness's version, pinned: a new one is a new harness (its synthetic prompts and
#: its metrics may change), so a recorded run names the one it ran.
AIPERF_VERSION = "0.13.0"
#: The header that carries each conversation's id (the router's session id).
SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True)
class Shape:
    """What the harness sends: `conversations` of `turns` turns each, `concurrency`
    requests in flight at most, each user message `isl` tokens (so a later turn's prompt
    is every earlier message and answer plus a new one), answers of exactly `osl` tokens
    (`ignore_eos`), `delay_ms` between a conversation's answer and its next turn."""

    conversations: int = 16
    turns: int = 5
    concurrency: int = 4
    isl: int = 800
    osl: int = 64
    delay_ms: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name not in ("seed", "delay_ms") and value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0 (got {self.delay_ms})")

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


def aiperf_argv(exe: str, shape: Shape, *, url: str, model: str, tokenizer: str,
                artifact_dir: Path) -> list[str]:
    """One `aiperf profile` run of `shape` against the OpenAI-compatible server at `url`
    (its root, without `/v1`): streamed chat, greedy, every turn of every conversation."""
    return [
        exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", tokenizer,
        "--conversation-num", str(shape.conversations),
        "--conversation-turn-mean", str(shape.turns), "--conversation-turn-stddev", "0",
        "--conversation-turn-delay-mean", str(shape.delay_ms),
        "--conversation-turn-delay-stddev", "0",
        "--prompt-input-tokens-mean", str(shape.isl), "--prompt-input-tokens-stddev", "0",
        "--output-tokens-mean", str(shape.osl), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--concurrency", str(shape.concurrency),
        "--request-count", str(shape.requests),
        "--session-header", SESSION_HEADER, "--random-seed", str(shape.seed),
        "--artifact-dir", str(artifact_dir), "--ui-type", "none",
    ]


@dataclass(frozen=True)
class Record:
    """One request as the harness measured it."""

    conversation: str
    turn: int  # 0: the conversation's first turn
    ttft_ms: float | None
    tpot_ms: float | None  # aiperf's `inter_token_latency`: (latency - ttft) / (osl - 1)
    prompt_tokens: int | None  # as the server counted them (`usage`)
    cached_tokens: int | None  # `usage.prompt_tokens_details.cached_tokens`
    error: str | None = None


def _value(metrics: dict[str, Any], name: str) -> Any:
    entry = metrics.get(name)
    return entry.get("value") if isinstance(entry, dict) else None


def parse_record(line: str) -> Record | None:
    """One line of aiperf's `profile_export.jsonl`; None for a warm-up or cancelled one."""
    raw = json.loads(line)
    meta, metrics = raw.get("metadata") or {}, raw.get("metrics") or {}
    if meta.get("benchmark_phase", "profiling") != "profiling" or meta.get("was_cancelled"):
        return None
    err = raw.get("error")
    prompt, cached = (_value(metrics, "usage_prompt_tokens"),
                      _value(metrics, "usage_prompt_cache_read_tokens"))
    return Record(
        conversation=str(meta.get("conversation_id")), turn=int(meta.get("turn_index") or 0),
        ttft_ms=_value(metrics, "time_to_first_token"),
        tpot_ms=_value(metrics, "inter_token_latency"),
        prompt_tokens=int(prompt) if prompt is not None else None,
        cached_tokens=int(cached) if cached is not None else None,
        error=(err.get("message") or str(err)) if isinstance(err, dict) else
        (str(err) if err else None))


def read_records(lines: Iterable[str]) -> list[Record]:
    return [r for line in lines if line.strip() and (r := parse_record(line)) is not None]


def _pcts(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in qs}


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """The figures the comparison reads: later-turn TTFT (p50, p90), TPOT (p50, p99) over
    every answer, first-turn TTFT, and the share of later turns' prompt tokens the server
    reported as cached."""
    ok = [r for r in records if r.error is None]
    later = [r for r in ok if r.turn > 0]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "later_ttft_ms": _pcts([r.ttft_ms for r in later if r.ttft_ms is not None], (50, 90)),
        "first_ttft_ms": _pcts([r.ttft_ms for r in ok if r.turn == 0
                                and r.ttft_ms is not None], (50, 90)),
        "tpot_ms": _pcts([r.tpot_ms for r in ok if r.tpot_ms is not None], (50, 99)),
        "later_cached_ratio": (sum(r.cached_tokens or 0 for r in later) / prompt
                               if prompt else None),
    }


#: The figures a ratio is taken of: (summary key, percentile).
RATIO_FIGURES = (("later_ttft_ms", "p50"), ("later_ttft_ms", "p90"), ("tpot_ms", "p99"))


def ratios(subject: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """subject / baseline for each figure of `RATIO_FIGURES` (< 1: the subject is faster)."""
    out: dict[str, float | None] = {}
    for key, q in RATIO_FIGURES:
        a, b = subject[key][q], baseline[key][q]
        out[f"{key}.{q}"] = a / b if a is not None and b else None
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def _machine(m: dict[str, Any] | None) -> str:
    if not m:
        return "unknown"
    return f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, GPU {m.get('gpu')}"


def markdown(report: dict[str, Any]) -> str:
    """The report: how it ran, one row per arm, the subject's ratios to each baseline."""
    shape, arms = report["shape"], report["arms"]
    lines = [
        f"# Outside harness: aiperf {report['aiperf']} — {report['date']}", "",
        f"`{report['command']}`", "",
        f"- machine: {_machine(report['machine'])}", (f"- commit: `{report['commit']}`; foreign vLLM "
        f"processes during the runs: {report['foreign_vllm_max']}"),
        (f"- shape: {shape['conversations']} conversations x {shape['turns']} turns, "
        f"{shape['concurrency']} requests in flight, {shape['isl']}-token user messages, "
        f"{shape['osl']}-token answers, {shape['delay_ms']} ms between turns, seed "
        f"{shape['seed']}"), "",
        ("| arm | later TTFT p50 / p90 ms | first TTFT p50 ms | TPOT p50 / p99 ms | "
        "later cached | errors |"), "|---|---|---|---|---|---|"]
    for name, a in arms.items():
        s = a.get("summary")
        if s is None:
            lines.append(f"| {name} | failed: {a.get('error')} | | | | |")
            continue
        cached = s["later_cached_ratio"]
        lines.append(
            f"| {name} | {_ms(s['later_ttft_ms']['p50'])} / {_ms(s['later_ttft_ms']['p90'])} "
            f"| {_ms(s['first_ttft_ms']['p50'])} | {_ms(s['tpot_ms']['p50'])} / "
            f"{_ms(s['tpot_ms']['p99'])} | {'-' if cached is None else f'{cached:.0%}'} | "
            f"{s['errors']}/{s['requests']} |")
    runs = [r for r in report.get("runs", []) if r.get("summary")]
    if len(runs) > len(arms):
        lines += ["", "Each run (in run order; the arms alternate, ABBA):", "",
                  "| rep | arm | later TTFT p50 / p90 ms | TPOT p99 ms |", "|---|---|---|---|"]
        for r in runs:
            s = r["summary"]
            lines.append(f"| {r['rep']} | {r['arm']} | {_ms(s['later_ttft_ms']['p50'])} / "
                         f"{_ms(s['later_ttft_ms']['p90'])} | {_ms(s['tpot_ms']['p99'])} |")
    for base, r in report.get("ratios", {}).items():
        cells = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in r.items())
        lines += ["", (f"{report['subject']} / {base}: {cells} (< 1: {report['subject']} "
                  "is faster)")]
    return "\n".join(lines) + "\n"
