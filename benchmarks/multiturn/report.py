"""Write a run's results: `results.json`, `ttft_by_turn.png`, `time_budget.png`,
`summary.md`; for the load mode `results.json`, `goodput.png`, `summary.md`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .budget import LABELS, SEGMENTS, markdown_table
from .floor import DELTA_BINS, bin_key, summarise
from .results import (
    BenchmarkReport,
    ConfigResult,
    LevelResult,
    LoadReport,
    PathBudget,
    TokenTotals,
)

JSON_NAME = "results.json"
PLOT_NAME = "ttft_by_turn.png"
BUDGET_PLOT_NAME = "time_budget.png"
SUMMARY_NAME = "summary.md"
GOODPUT_PLOT_NAME = "goodput.png"
#: The load report without per-request records: small enough to keep with the docs.
LEVELS_JSON_NAME = "levels.json"


def write_all(report: BenchmarkReport, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / JSON_NAME, "plot": out_dir / PLOT_NAME,
             "budget_plot": out_dir / BUDGET_PLOT_NAME, "summary": out_dir / SUMMARY_NAME}
    paths["json"].write_text(report.model_dump_json(indent=2) + "\n")
    plot_ttft_by_turn(report, paths["plot"])
    plot_time_budget(report.time_budget, paths["budget_plot"])
    paths["summary"].write_text(markdown_summary(report))
    return paths


def plot_ttft_by_turn(report: BenchmarkReport, path: Path) -> None:
    """Median TTFT per turn index, one line per configuration (p90 as a shaded band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for c in report.configs:
        rows = [t for t in c.per_turn if t.ttft_s.p50 is not None]
        if not rows:
            continue
        xs = [t.turn for t in rows]
        p50 = [t.ttft_s.p50 * 1000 for t in rows]
        p90 = [t.ttft_s.p90 * 1000 for t in rows]
        (line,) = ax.plot(xs, p50, marker="o", label=c.name)
        ax.fill_between(xs, p50, p90, color=line.get_color(), alpha=0.12)
    ax.set_xlabel("turn index (0 = first request of a conversation)")
    ax.set_ylabel("TTFT (ms): median, band up to p90")
    ax.set_title(f"Multi-turn agent workload: TTFT by turn ({report.workload_source})")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_time_budget(rows: list[PathBudget], path: Path) -> None:
    """One stacked bar per (configuration, path): mean ms per segment of TTFT, turns
    after the first; a dot marks the TTFT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5 + 0.1 * len(rows)), dpi=110)
    names = [f"{b.config}\n{b.path} (n={b.n})" for b in rows]
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(rows)
    for i, seg in enumerate(SEGMENTS):
        widths = [max(0.0, b.segments_s.get(seg, 0.0)) * 1000 for b in rows]
        if not any(widths):
            continue
        ax.barh(names, widths, left=left, color=colors[i % len(colors)], label=LABELS[seg])
        left = [a + w for a, w in zip(left, widths, strict=True)]
    p50 = [(n, b.ttft_p50_s * 1000) for n, b in zip(names, rows, strict=True)
           if b.ttft_p50_s is not None]
    if p50:
        ax.scatter([v for _, v in p50], [n for n, _ in p50], color="black", zorder=3,
                   s=14, label="TTFT p50")
    ax.invert_yaxis()
    ax.set_xlabel("mean ms to first token, by stage (turns after the first)")
    ax.set_title("Where the time to first token goes, per configuration and path")
    ax.grid(True, axis="x", alpha=0.3)
    if rows:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def reused_share(tokens: TokenTotals) -> float | None:
    """Reused prompt tokens over all prompt tokens; None without prompt tokens."""
    return tokens.reused / tokens.prompt if tokens.prompt else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _header(title: str, report: BenchmarkReport | LoadReport) -> list[str]:
    """Title, command, machine and versions: what every summary opens with."""
    return [
        f"# {title} — {report.created_at}",
        "",
        f"Command: `{' '.join(report.command)}`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in report.machine.items()),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
        "",
    ]


def markdown_summary(report: BenchmarkReport) -> str:
    lines = [
        *_header("Multi-turn agent benchmark", report),
        f"Workload: {report.workload_source}, fingerprint `{report.workload_fingerprint}`, "
        + ", ".join(f"{k}={v}" for k, v in report.workload.items()),
        "",
        ("TTFT, ITL (gap between chunks), TPOT (time per output token after the first) and "
         "E2E in ms; \"later\" = turns after the first. Reuse = share of later turns with "
         "`kvagent.reused_tokens > 0`; cache hit = share with `cached_tokens > 0`."),
        "",
        ("| config | status | req | err | TTFT p50 | TTFT p90 | TTFT p99 | later TTFT p50 | "
         "later TTFT p90 | ITL p50 | TPOT p50 | E2E p50 | reuse | cache hit | reused tok | recomputed tok "
         "| req/s | answers = ref |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.configs:
        lines.append(_row(c))
    lines += ["", "Median TTFT (ms) by turn index:", ""]
    turns = sorted({t.turn for c in report.configs for t in c.per_turn})
    lines.append("| config | " + " | ".join(str(t) for t in turns) + " |")
    lines.append("|---|" + "---|" * len(turns))
    for c in report.configs:
        by = {t.turn: t for t in c.per_turn}
        lines.append(f"| {c.name} | " + " | ".join(
            _ms(by[t].ttft_s.p50) if t in by else "–" for t in turns) + " |")
    lines += ["", ("Share of prompt tokens reused (`kvagent.reused_tokens` / prompt "
                   "tokens) by turn index:"), ""]
    lines.append("| config | " + " | ".join(str(t) for t in turns) + " |")
    lines.append("|---|" + "---|" * len(turns))
    for c in report.configs:
        by = {t.turn: t for t in c.per_turn}
        lines.append(f"| {c.name} | " + " | ".join(
            _pct(reused_share(by[t].tokens)) if t in by else "–" for t in turns) + " |")
    lines += api_lines(report)
    tg = report.targets
    lines += ["", "Targets (measured, not asserted): "
              + ", ".join(f"{k} = {_num(v)}" for k, v in tg.ratios.items())
              + f", kvagent reuse rate = {_pct(tg.kvagent_reuse_rate)}; met: "
              + ", ".join(f"{k}: {'–' if v is None else ('yes' if v else 'no')}"
                          for k, v in tg.met.items()), ""]
    if report.time_budget:
        lines += [("Time to first token by stage, mean ms, turns after the first "
                   "(`time_budget.png`; segments add up to the mean TTFT):"), "",
                  *markdown_table(report.time_budget), ""]
    lines += floor_lines(report)
    busy = [f"{c.name} ({c.foreign_vllm_max})" for c in report.configs if c.foreign_vllm_max]
    if busy:
        lines += ["Contention: vLLM processes not started by the benchmark ran during "
                  "the workload of " + ", ".join(busy) + "; those numbers include it.", ""]
    for c in report.configs:
        if c.error:
            lines += [f"**{c.name}** {c.status}: {c.error}", ""]
    return "\n".join(lines)


def api_lines(report: BenchmarkReport) -> list[str]:
    """Which client API each row used, when any was not chat: later-turn TTFT and reuse
    side by side, and what ran through chat only."""
    if report.apis == ["chat"] and all(c.api == "chat" for c in report.configs):
        return []
    lines = ["", ("Client APIs (`--api " + ",".join(report.apis) + "`): each reusing "
                  "configuration ran once per API, on a bundle of its own; reuse = share of "
                  "later turns with `kvagent.reused_tokens > 0`, reused tok % = reused / "
                  "prompt tokens of later turns, cached = the API's own usage field (chat "
                  "`prompt_tokens_details.cached_tokens`, Messages `cache_read_input_tokens`, "
                  "Responses `input_tokens_details.cached_tokens`). Same prompt / answer as "
                  "chat: requests whose prompt token count / greedy answer equal the chat "
                  "row's for the same turn."),
             "", ("| row | API | later TTFT p50 | later TTFT p90 | reuse | reused tok % (later) "
                  "| cached tok (later) | paths (later) | errors | same prompt as chat "
                  "| same answer as chat |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_name = {c.name: c for c in report.configs}
    for c in report.configs:
        later = [r for r in c.records if r.turn > 0 and r.error is None]
        prompt = sum(r.prompt_tokens or 0 for r in later)
        reused = sum(r.reused_tokens or 0 for r in later)
        cached = sum(r.cached_tokens or 0 for r in later)
        paths: dict[str, int] = {}
        for r in later:
            if r.path:
                paths[r.path] = paths.get(r.path, 0) + 1
        s = c.summary
        lines.append(
            f"| {c.name} | {c.api} | {_ms(s.ttft_later_turns_s.p50) if s else '–'} | "
            f"{_ms(s.ttft_later_turns_s.p90) if s else '–'} | "
            f"{_pct(s.reuse_rate_later_turns) if s else '–'} | "
            f"{_pct(reused / prompt if prompt else None)} | {cached} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(paths.items())) or '–'} | "
            f"{s.errors if s else '–'} | {_same_as_chat(c, by_name)} |")
    chat_only = [c.name for c in report.configs if c.api == "chat"
                 and not any(o.name.startswith(c.name + ":") for o in report.configs)]
    if chat_only and report.apis != ["chat"]:
        lines += ["", "Ran through chat only (baselines): " + ", ".join(chat_only) + "."]
    return lines


def _same_as_chat(c: ConfigResult, by_name: dict[str, ConfigResult]) -> str:
    """`prompts | answers` equal to the chat row's of the same configuration, as m/n cells."""
    chat = by_name.get(c.name.rsplit(":", 1)[0]) if c.api != "chat" else None
    if chat is None or chat.api != "chat":
        return "– | –"
    ref = {(r.conversation, r.turn): r for r in chat.records if r.error is None}
    pairs = [(r, ref[(r.conversation, r.turn)]) for r in c.records
             if r.error is None and (r.conversation, r.turn) in ref]
    prompts = sum(1 for a, b in pairs if a.prompt_tokens == b.prompt_tokens)
    answers = sum(1 for a, b in pairs if a.answer == b.answer)
    return f"{prompts}/{len(pairs)} | {answers}/{len(pairs)}"


def floor_lines(report: BenchmarkReport) -> list[str]:
    """The paired floor (`--paired-floor`): measured ÷ floor per path, also by new tokens."""
    rows = []
    for c in report.configs:
        for path, s in summarise(c.floor).items():
            bins = s["by_new_tokens"]
            rows.append(f"| {c.name} | {path} | {s['n']} | {_ms(s['measured_ttft_p50_s'])} | "
                        f"{_ms(s['floor_p50_s'])} | **{s['ratio_p50']:.2f}** | "
                        f"{s['ratio_mean']:.2f} | " + " | ".join(
                            (f"{b['ratio_p50']:.2f} (n={b['n']}, "
                             f"+{_ms(b['excess_p50_s'])})") if (b := bins.get(key)) else "–"
                            for key in (bin_key(lo, hi) for lo, hi in DELTA_BINS)) + " |")
    if not rows:
        return []
    heads = " | ".join(f"{lo}–{hi} new" if hi else f"≥ {lo} new" for lo, hi in DELTA_BINS)
    return [("Measured ÷ floor, each reused turn against its floor taken right after it "
             "(`--paired-floor`; per range of new tokens: p50 ratio, n, p50 ms over the floor):"),
            "", f"| config | path | n | TTFT p50 | floor p50 | ratio p50 | mean | {heads} |",
            "|---|---|---|---|---|---|---|" + "---|" * len(DELTA_BINS), *rows, ""]


def _row(c: ConfigResult) -> str:
    s = c.summary
    if s is None:
        return f"| {c.name} | {c.status} |" + " – |" * 16
    agree = ("–" if s.answers_compared is None
             else f"{s.answers_matching_reference}/{s.answers_compared}")
    return (f"| {c.name} | {c.status} | {s.requests} | {s.errors} | {_ms(s.ttft_s.p50)} | "
            f"{_ms(s.ttft_s.p90)} | {_ms(s.ttft_s.p99)} | {_ms(s.ttft_later_turns_s.p50)} | "
            f"{_ms(s.ttft_later_turns_s.p90)} | {_ms(s.itl_s.p50)} | {_ms(s.tpot_s.p50)} | "
            f"{_ms(s.e2e_s.p50)} | "
            f"{_pct(s.reuse_rate_later_turns)} | {_pct(s.cache_hit_rate_later_turns)} | "
            f"{s.tokens.reused} | {s.tokens.recomputed} | {_num(s.requests_per_s)} | {agree} |")


# =========================================================================== load mode


def write_load(report: LoadReport, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / JSON_NAME, "levels_json": out_dir / LEVELS_JSON_NAME,
             "plot": out_dir / GOODPUT_PLOT_NAME, "summary": out_dir / SUMMARY_NAME}
    data = _rounded(report.model_dump(mode="json"))
    paths["json"].write_text(json.dumps(data, separators=(",", ":")) + "\n")
    for c in data["configs"]:
        for lv in c["levels"]:
            lv["records"] = []
    data["idle_probe"] = []
    paths["levels_json"].write_text(json.dumps(data, indent=1) + "\n")
    plot_goodput(report, paths["plot"])
    paths["summary"].write_text(load_markdown(report))
    return paths


def _rounded(value: Any, digits: int = 6) -> Any:
    """Floats to microseconds (of seconds): a sweep holds thousands of chunk gaps, and
    their 17-digit reprs would triple the file."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def plot_goodput(report: LoadReport, path: Path) -> None:
    """Goodput (left) and ITL p99 (right) against offered concurrent sessions, one line
    per configuration; a cross marks a broken level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    for c in report.configs:
        if not c.levels:
            continue
        xs = [lv.level for lv in c.levels]
        (line,) = ax.plot(xs, [lv.goodput_sessions_per_min for lv in c.levels], marker="o",
                          label=c.name)
        ax2.plot(xs, [(lv.itl_s.p99 or 0) * 1000 for lv in c.levels], marker="o",
                 color=line.get_color(), label=c.name)
        broken = [lv for lv in c.levels if lv.broken]
        ax.scatter([lv.level for lv in broken],
                   [lv.goodput_sessions_per_min for lv in broken], marker="x", s=80,
                   color=line.get_color(), zorder=3)
    offered = {lv.level: lv.offered_sessions_per_min for c in report.configs
               for lv in c.levels}
    if offered:
        xs = sorted(offered)
        ax.plot(xs, [offered[x] for x in xs], linestyle=":", color="grey", label="offered")
    if report.slo is not None:
        ax2.axhline(report.slo.itl_s * 1000, linestyle=":", color="grey", label="ITL bound")
    levels = sorted({lv.level for c in report.configs for lv in c.levels})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(x) for x in levels])
        a.minorticks_off()
        a.set_xlabel("offered concurrent sessions")
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    ax.set_ylabel("goodput: sessions/min with every turn within the SLO")
    ax.set_title("Goodput under load (x: broken level, sweep stopped)")
    ax2.set_ylabel("ITL p99 (ms), all turns of the level")
    ax2.set_title("Inter-token latency p99 under load")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _msu(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


def _paths_text(paths: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in paths.items()) or "–"


def _level_row(name: str, lv: LevelResult) -> str:
    return (f"| {name} | {lv.level} | {lv.sessions} | {lv.sessions_met} | "
            f"{lv.sessions_cancelled} | **{lv.goodput_sessions_per_min:.1f}** | "
            f"{lv.offered_sessions_per_min:.1f} | {_ms(lv.ttft_s.p50)} | {_ms(lv.ttft_s.p90)} | "
            f"{_ms(lv.ttft_later_s.p90)} | {_ms(lv.itl_s.p50)} | {_ms(lv.itl_s.p99)} | "
            f"{lv.turns_per_s:.2f} | {lv.output_tokens_per_s:.0f} | {lv.errors}/{lv.requests} | "
            f"{_paths_text(lv.paths)} | {_missed_text(lv)} | "
            f"{'yes' if lv.slo_met_level else 'no'} | {lv.broken_reason or ''} |")


def _missed_text(lv: LevelResult) -> str:
    m = lv.missed_by
    if not m:
        return "–"
    return " / ".join(str(m.get(k, 0)) for k in ("first_turn_ttft", "later_turn_ttft",
                                                 "itl_p99"))


def _outside(lv: LevelResult) -> str:
    steal = "steal ?" if lv.steal_s is None else f"steal {lv.steal_s:.1f} s"
    other = lv.other_cpu_s or {}
    top = ", ".join(f"{name} {s:.1f}" for name, s in list(other.items())[:3])
    return f"{steal}, others {sum(other.values()):.1f} s" + (f" ({top})" if top else "")


def load_markdown(report: LoadReport) -> str:
    ld = report.load
    lines = [
        *_header("Multi-turn agent benchmark under load", report),
        "Load: " + ", ".join(f"{k}={v}" for k, v in ld.items()),
        "",
    ]
    if report.rescored is not None:
        lines += [(f"**Re-judged** from the recorded requests with other SLO factors: "
                   f"{report.rescored}. Levels past where the recorded sweep stopped were "
                   "not run."), ""]
    slo = report.slo
    if slo is None:
        lines += ["SLO: none (the idle probe did not run); no goodput.", ""]
    else:
        lines += [
            (f"SLO, from an idle probe on `{slo.probe_config}` ({slo.probe_requests} requests, "
             f"one session at a time): first-turn TTFT ≤ {slo.ttft_factor:g} × "
             f"{_msu(slo.idle_ttft_first_p90_s)} = **{_msu(slo.ttft_first_s)}**, later-turn "
             f"TTFT ≤ {slo.ttft_factor:g} × {_msu(slo.idle_ttft_later_p90_s)} = "
             f"**{_msu(slo.ttft_later_s)}** (idle TTFT p90 of the class), the session's ITL "
             f"p99 (all its turns' gaps) ≤ {slo.itl_factor:g} × "
             f"{_msu(slo.idle_decode_step_s)} = **{_msu(slo.itl_s)}** (idle decode step: TPOT "
             "p50). A session meets the SLO when every turn was answered within those "
             "bounds; goodput = such sessions per minute of the arrival window."), ""]
    lines += [
        ("| config | level | sessions | met | cancelled | goodput /min | offered /min | "
         "TTFT p50 | TTFT p90 | later TTFT p90 | ITL p50 | ITL p99 | turns/s | out tok/s | "
         "errors | paths | missed by: 1st TTFT / later TTFT / ITL | level within SLO | "
         "broken |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.configs:
        for lv in c.levels:
            lines.append(_level_row(c.name, lv))
        if not c.levels:
            lines.append(f"| {c.name} | {c.status} |" + " – |" * 17)
    placed = [f"{c.name} level {lv.level}: " + ", ".join(f"{k} {v:g}"
                                                        for k, v in lv.placements.items())
              for c in report.configs for lv in c.levels if lv.placements]
    if placed:
        lines += ["", "Router placements by reason, per level (P and D choices):", "",
                  *(f"- {p}" for p in placed)]
    tg = report.targets
    lines += ["", "Peak goodput (sessions/min, best level): " + ", ".join(
        f"{k} {v:.1f}" for k, v in tg.peak_goodput.items()), ""]
    lines += ["Targets (measured, not asserted): "
              f"kvagent / best baseline ({tg.best_baseline or '–'}) peak goodput = "
              f"{_num(tg.kvagent_over_best_baseline)}; ITL p99 at level "
              f"{tg.itl_p99_level or '–'}: kvagent {_msu(tg.kvagent_itl_p99_s)}, aggregated "
              f"{_msu(tg.aggregated_itl_p99_s)}; cost model / fixed policy peak goodput: "
              + (", ".join(f"{k} {_num(v)}" for k, v in tg.cost_model_over.items()) or "–")
              + "; met: " + ", ".join(f"{k}: {'–' if v is None else ('yes' if v else 'no')}"
                                      for k, v in tg.met.items()), ""]
    if tg.paired:
        lines += [
            ("Session by session (the same sessions in both, levels both ran): sessions "
             "that met the SLO in one configuration only, and the two-sided exact sign test "
             "on them: p is how often a split at least this uneven comes from two equally "
             "good configurations."), "",
            "| a | b | levels | sessions | met in both | a only | b only | neither | p |",
            "|---|---|---|---|---|---|---|---|---|",
            *(f"| {p.a} | {p.b} | {', '.join(map(str, p.levels))} | {p.sessions} | {p.both} | "
              f"{p.only_a} | {p.only_b} | {p.neither} | {p.p_value:.3f} |" for p in tg.paired),
            ""]
    busy = [f"{c.name} level {lv.level} ({lv.foreign_vllm_max})" for c in report.configs
            for lv in c.levels if lv.foreign_vllm_max]
    if busy:
        lines += ["Contention: vLLM processes not started by the benchmark ran during "
                  + ", ".join(busy) + "; those numbers include it.", ""]
    else:
        lines += ["foreign_vllm_max = 0 in every level.", ""]
    loads = [f"{c.name} {lv.level}: {lv.load_avg_max:.1f}" for c in report.configs
             for lv in c.levels if lv.load_avg_max is not None]
    if loads:
        lines += [f"Highest 1-minute load average per level (cores: "
                  f"{report.machine.get('cores', '?')}): " + ", ".join(loads), ""]
    outside = [f"{c.name} {lv.level}: {_outside(lv)}" for c in report.configs
               for lv in c.levels if lv.steal_s is not None or lv.other_cpu_s is not None]
    if outside:
        lines += ["CPU outside the benchmark per level (stolen by the hypervisor; used by "
                  "other processes, the busiest named): " + "; ".join(outside), ""]
    for c in report.configs:
        if c.error:
            lines += [f"**{c.name}** {c.status}: {c.error}", ""]
    return "\n".join(lines)
