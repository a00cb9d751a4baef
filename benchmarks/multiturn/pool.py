"""Several recorded load draws taken together: sessions met per configuration, the
pooled goodput ratio, the session-by-session sign test, and how far the ratio moves
when other draws had come out.

One draw (one seed at one hour) moves by more than the changes it is meant to judge, so
the goal is read on draws pooled as registered before they ran. The interval resamples
whole draws (a bootstrap): it says how much the pooled ratio depends on which draws
happened to be taken. Draws run in the same hour share that hour's host, so they are
not quite independent and the interval is, if anything, too narrow.

Each draw's bounds come from its own idle probe, whose figures depend on the seed's
sessions; `--idle` judges every draw's recorded requests against one set of idle figures
instead (the same factors), so draws differ only in how they were served.

`python -m benchmarks.multiturn.pool FOLDER_OR_RESULTS_JSON ...` prints the table;
`--json` writes it as well.
"""

from __future__ import annotations

import argparse
import gzip
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from benchmarks.index import missing_records

from .goodput import paired_sessions, rejudge, sign_test_p
from .results import LevelResult, LoadConfigResult, LoadReport
from .stats import AGGREGATED, KVAGENT

#: The idle probe's figures an SLO's bounds are multiples of.
IDLE_FIGURES = ("idle_ttft_first_p90_s", "idle_ttft_later_p90_s", "idle_decode_step_s")


class Draw(BaseModel):
    """Two configurations on one recorded draw, at the level both ran."""

    source: str  # the results folder (or file) it came from
    created_at: str
    seed: int | None
    level: int
    offered: int  # sessions that arrived
    met_a: int
    met_b: int
    only_a: int  # sessions `a` met and `b` did not
    only_b: int
    foreign_vllm_max: int | None


class Pooled(BaseModel):
    """Draws taken together: `a` (kvagent) against `b` (the baseline)."""

    a: str
    b: str
    draws: list[Draw]
    offered: int
    met_a: int
    met_b: int
    ratio: float | None  # met_a / met_b: the pooled goodput ratio (same windows)
    only_a: int
    only_b: int
    p_value: float
    #: Percentile interval of the pooled ratio over draws resampled with replacement.
    interval: tuple[float, float] | None
    confidence: float
    resamples: int
    #: Draws whose own ratio is at least `goal`, and the goal.
    draws_at_goal: int
    goal: float
    foreign_vllm_max: int | None = Field(description="highest over the draws")
    #: The idle figures every draw was judged against; None: each draw's own probe.
    idle: dict[str, float] | None = None


def draw_of(report: LoadReport, source: str, *, a: str = KVAGENT, b: str = AGGREGATED
            ) -> Draw:
    """`a` and `b` on the highest level both ran in `report`."""
    configs = {c.name: c for c in report.configs}
    missing = [n for n in (a, b) if n not in configs]
    if missing:
        raise ValueError(f"{source}: no configuration {', '.join(missing)} "
                         f"(has {', '.join(configs) or 'none'})")
    la = _levels(configs[a])
    lb = _levels(configs[b])
    common = sorted(la.keys() & lb.keys())
    if not common:
        raise ValueError(f"{source}: {a} and {b} ran no level in common")
    level = common[-1]
    x, y = la[level], lb[level]
    paired = paired_sessions(configs[a].model_copy(update={"levels": [x]}),
                             configs[b].model_copy(update={"levels": [y]}))
    foreign = [v for v in (x.foreign_vllm_max, y.foreign_vllm_max) if v is not None]
    return Draw(
        source=source, created_at=report.created_at, seed=report.load.get("seed"),
        level=level, offered=max(x.sessions, y.sessions),
        met_a=x.sessions_met, met_b=y.sessions_met,
        only_a=paired.only_a if paired else 0, only_b=paired.only_b if paired else 0,
        foreign_vllm_max=max(foreign) if foreign else None)


def median_idle(reports: Sequence[LoadReport]) -> dict[str, float]:
    """Each idle figure's median over the reports' probes."""
    slos = [r.slo for r in reports if r.slo is not None]
    if not slos:
        raise ValueError("no report has an SLO (an idle probe) to take figures from")
    return {k: statistics.median(getattr(s, k) for s in slos) for k in IDLE_FIGURES}


def with_idle(report: LoadReport, idle: dict[str, float]) -> LoadReport:
    """`report`'s requests judged against bounds from `idle` instead of its own probe
    (the same factors)."""
    if report.slo is None:
        raise ValueError("the run has no SLO (its idle probe did not run)")
    unknown = set(idle) - set(IDLE_FIGURES)
    if unknown or any(v <= 0 for v in idle.values()):
        raise ValueError(f"idle figures are positive {', '.join(IDLE_FIGURES)}")
    return rejudge(report, report.slo.model_copy(update=idle))


def _levels(config: LoadConfigResult) -> dict[int, LevelResult]:
    return {lv.level: lv for lv in config.levels}


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def _at_goal(d: Draw, goal: float) -> bool:
    """A draw's own ratio at `goal` or more (a baseline that met nothing: any met)."""
    return d.met_a >= goal * d.met_b if d.met_b else d.met_a > 0


def bootstrap_interval(draws: Sequence[Draw], *, resamples: int, confidence: float,
                       seed: int) -> tuple[float, float] | None:
    """Percentile interval of sum(met_a) / sum(met_b) over draws resampled with
    replacement; None with fewer than two draws. A resample whose baseline met nothing
    counts as an unbounded ratio (it sorts above every finite one)."""
    if len(draws) < 2:
        return None
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError("need 0 < confidence < 1 and resamples >= 1")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        pick = [rng.choice(draws) for _ in draws]
        met_b = sum(d.met_b for d in pick)
        ratios.append(sum(d.met_a for d in pick) / met_b if met_b else float("inf"))
    ratios.sort()
    tail = (1 - confidence) / 2
    lo = ratios[int(tail * (resamples - 1))]
    hi = ratios[round((1 - tail) * (resamples - 1))]
    return lo, hi


def pool(draws: Sequence[Draw], *, a: str = KVAGENT, b: str = AGGREGATED, goal: float = 1.5,
         resamples: int = 10_000, confidence: float = 0.95, seed: int = 0,
         idle: dict[str, float] | None = None) -> Pooled:
    """The draws taken together (pure: the resampling is seeded)."""
    if not draws:
        raise ValueError("no draws to pool")
    met_a = sum(d.met_a for d in draws)
    met_b = sum(d.met_b for d in draws)
    only_a = sum(d.only_a for d in draws)
    only_b = sum(d.only_b for d in draws)
    foreign = [d.foreign_vllm_max for d in draws if d.foreign_vllm_max is not None]
    return Pooled(
        a=a, b=b, draws=list(draws), offered=sum(d.offered for d in draws),
        met_a=met_a, met_b=met_b, ratio=_ratio(met_a, met_b), only_a=only_a, only_b=only_b,
        p_value=sign_test_p(only_a, only_a + only_b),
        interval=bootstrap_interval(draws, resamples=resamples, confidence=confidence,
                                    seed=seed),
        confidence=confidence, resamples=resamples,
        draws_at_goal=sum(_at_goal(d, goal) for d in draws),
        goal=goal, foreign_vllm_max=max(foreign) if foreign else None, idle=idle)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def markdown(p: Pooled) -> str:
    """One row per draw, then the pooled row and the interval."""
    lines = [(f"| seed | results | offered | {p.b} met | {p.a} met | ratio | "
             f"only {p.a} / only {p.b} |"), "|---|---|---|---|---|---|---|"]
    for d in p.draws:
        lines.append(f"| {d.seed} | {d.source} | {d.offered} | {d.met_b} | {d.met_a} | "
                     f"{_fmt(_ratio(d.met_a, d.met_b))} | {d.only_a} / {d.only_b} |")
    lines.append(f"| pooled ({len(p.draws)} draws) | | {p.offered} | {p.met_b} | {p.met_a} | "
                 f"**{_fmt(p.ratio)}** | {p.only_a} / {p.only_b} (p = {p.p_value:.2g}) |")
    if p.idle is not None:
        lines.append("")
        lines.append("Every draw judged against one set of idle figures (its own factors): "
                     + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in p.idle.items()) + ".")
    if p.interval is not None:
        lo, hi = p.interval
        lines.append("")
        lines.append(f"{p.confidence:.0%} interval of the pooled ratio over draws resampled "
                     f"({p.resamples} resamples): {_fmt(lo)}–{_fmt(hi)}. Draws at "
                     f"{p.goal:g}x or more: {p.draws_at_goal} of {len(p.draws)}. "
                     f"foreign_vllm_max over the draws: {p.foreign_vllm_max}.")
    return "\n".join(lines) + "\n"


def read_report(path: Path) -> LoadReport:
    """A results folder or its results.json (gzipped or not). A committed run keeps only its
    summary in the tree: the error then says which commit has the records."""
    files = [path / "results.json", path / "results.json.gz"] if path.is_dir() else [path]
    file = next((f for f in files if f.is_file()), None)
    if file is None:
        raise missing_records(path)
    data = file.read_bytes()
    return LoadReport.model_validate_json(gzip.decompress(data) if file.suffix == ".gz" else data)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.pool",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path,
                   help="load results folders (or their results.json), one per draw")
    p.add_argument("--a", default=KVAGENT, help="configuration judged (default %(default)s)")
    p.add_argument("--b", default=AGGREGATED, help="baseline (default %(default)s)")
    p.add_argument("--goal", type=float, default=1.5)
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="the resampling's seed")
    p.add_argument("--idle", metavar="median|FIRST_MS,LATER_MS,STEP_MS",
                   help="judge every draw against these idle figures (first-turn and "
                   "later-turn TTFT p90, decode step), or the medians of the draws' probes, "
                   "instead of each draw's own probe")
    p.add_argument("--json", type=Path, help="also write the pooled result here")
    return p


def parse_idle(text: str, reports: Sequence[LoadReport]) -> dict[str, float]:
    if text == "median":
        return median_idle(reports)
    try:
        values = [float(v) / 1000 for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(IDLE_FIGURES):
        raise ValueError(f"--idle takes 'median' or {len(IDLE_FIGURES)} numbers in ms, "
                         f"got {text!r}")
    return dict(zip(IDLE_FIGURES, values, strict=True))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        reports = [read_report(r) for r in args.results]
        idle = None if args.idle is None else parse_idle(args.idle, reports)
        if idle is not None:
            reports = [with_idle(r, idle) for r in reports]
        draws = [draw_of(rep, r.name if r.is_dir() else str(r), a=args.a, b=args.b)
                 for rep, r in zip(reports, args.results, strict=True)]
        pooled = pool(draws, a=args.a, b=args.b, goal=args.goal, resamples=args.resamples,
                      confidence=args.confidence, seed=args.seed, idle=idle)
    except (OSError, ValueError) as e:
        print(f"pool: {e}", file=sys.stderr)
        return 2
    print(markdown(pooled), end="")
    if args.json is not None:
        args.json.write_text(pooled.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
