"""Goodput under load: the multi-turn agent workload with sessions arriving over time.

    python -m benchmarks.multiturn.load                          # the default sweep
    python -m benchmarks.multiturn.load --configs aggregated,kvagent --levels 1,2

For each configuration, one at a time: up, warm, then levels of offered concurrent
sessions (1, 2, 4, 8 by default), each a seeded open arrival of sessions over `--level-s`
with think time between a session's turns, drained for at most `--drain-s`. A
configuration's sweep stops at its first broken level (no session met the SLO, or too
many errors). The SLO comes from an idle probe (one session at a time) on the first
configuration, the aggregated node by default. Results go to
`benchmarks/multiturn/results/<UTC timestamp>-load/` (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import signal
import sys
import time
from pathlib import Path

import httpx

from . import goodput
from . import report as report_mod
from .driver import ScheduledSession, run_sessions, run_workload
from .nodes import (
    ALL_CONFIGS,
    BenchConfig,
    ContentionWatch,
    Endpoint,
    log_tails,
    serve,
    wait_until_alone,
)
from .results import LevelResult, LoadConfigResult, LoadReport, RequestRecord, Slo
from .run import (
    RESULTS_ROOT,
    _log,
    _pair,
    _sigterm,
    _text_with_tool_calls,
    _warmup,
    add_device_args,
    machine,
)
from .run import versions as versions_of
from .stats import AGGREGATED
from .workload import WorkloadSpec, generate

DEFAULT_CONFIGS = ("aggregated", "kvagent", "kvagent_always_d_direct",
                   "kvagent_always_pd_reuse", "pd_noreuse_pcache_on", "pd_noreuse_pcache_off",
                   "kvagent_2p")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None
    if not levels or any(n < 1 for n in levels) or levels != sorted(set(levels)):
        raise argparse.ArgumentTypeError(f"levels must be increasing positive integers: {text}")
    return levels


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.load",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated (default: {','.join(DEFAULT_CONFIGS)}; also: "
                   f"{','.join(n for n in ALL_CONFIGS if n not in DEFAULT_CONFIGS)}). The "
                   "aggregated node, when listed, runs first: it hosts the idle probe")
    p.add_argument("--out", type=Path, help="output directory (default: results/<ts>-load)")
    p.add_argument("--rescore", type=Path, metavar="RESULTS_JSON",
                   help="start nothing: re-judge a recorded run's requests against "
                   "--ttft-factor/--itl-factor (same idle probe); writes to --out "
                   "(default: next to it, rescored-<ttft>x-<itl>x/)")
    lv = p.add_argument_group("load")
    lv.add_argument("--levels", type=_levels, default=[1, 2, 4, 8],
                    help="offered concurrent sessions, increasing (default: 1,2,4,8)")
    lv.add_argument("--level-s", type=float, default=30.0,
                    help="arrival window of each level, seconds (default: 30)")
    lv.add_argument("--drain-s", type=float, default=20.0,
                    help="after the window, cancel sessions still running after this long "
                    "(default: 20)")
    lv.add_argument("--max-sessions", type=int, default=40,
                    help="most sessions arriving in one level (default: 40)")
    lv.add_argument("--think-s", type=float, default=1.5,
                    help="mean think time before each later turn, exponential (default: 1.5)")
    lv.add_argument("--nominal-turn-s", type=float, default=0.5,
                    help="turn time assumed to turn a level into an arrival rate: "
                    "rate = level / (turns x this + (turns - 1) x think) (default: 0.5)")
    lv.add_argument("--idle-sessions", type=int, default=8,
                    help="sessions of the idle probe, one at a time (default: 8)")
    lv.add_argument("--ttft-factor", type=float, default=2.0,
                    help="TTFT bound = this x the idle TTFT p90 of the turn class (default: 2)")
    lv.add_argument("--itl-factor", type=float, default=3.0,
                    help="ITL bound = this x the idle decode step (default: 3)")
    lv.add_argument("--max-error-rate", type=float, default=0.1,
                    help="a level with more failed requests is broken (default: 0.1)")
    lv.add_argument("--settle-s", type=float, default=3.0,
                    help="pause between levels, for cancelled requests to clear (default: 3)")
    w = p.add_argument_group("sessions (the multi-turn generator's knobs, smaller defaults)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--turns", type=int, default=4, help="requests per session (default: 4)")
    w.add_argument("--system-tokens", type=int, default=200,
                   help="shared system prompt, besides ~1.1k tokens of tools (default: 200)")
    w.add_argument("--context-tokens", type=int, default=800,
                   help="per-session document in the first turn (default: 800)")
    w.add_argument("--tool-result-tokens", type=_pair, default=(60, 200), metavar="MIN,MAX")
    w.add_argument("--max-tokens", type=int, default=32, help="answer length (default: 32)")
    s = p.add_argument_group("servers")
    s.add_argument("--model", default=None, help="built-in model id (default: kvagent-demo)")
    add_device_args(s)
    s.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per vLLM node")
    s.add_argument("--startup-timeout", type=float, default=900.0)
    s.add_argument("--wait-alone", type=float, default=0.0, metavar="SECONDS",
                   help="before each configuration, wait this long for vLLM processes not "
                   "started here to exit (fail if they remain); 0: do not check")
    return p


def parse_configs(text: str) -> list[BenchConfig]:
    """The configurations in run order, the aggregated node (the probe's host) first."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown or not names:
        raise SystemExit(f"--configs: unknown {unknown or 'empty'}; choose from "
                         f"{', '.join(ALL_CONFIGS)}")
    names.sort(key=lambda n: n != AGGREGATED)
    return [ALL_CONFIGS[n] for n in names]


def session_spec(args: argparse.Namespace, seed: int, sessions: int) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, conversations=sessions, turns=args.turns, concurrency=1,
                        system_prompt_tokens=args.system_tokens,
                        context_tokens=args.context_tokens,
                        tool_result_tokens=args.tool_result_tokens, max_tokens=args.max_tokens)


def level_sessions(args: argparse.Namespace, level: int) -> list[ScheduledSession]:
    """The level's sessions: identical for every configuration (seeded by level)."""
    seed = goodput.level_seed(args.seed, level)
    rng = random.Random(seed)
    offsets = goodput.arrival_offsets(
        level, session_s=goodput.nominal_session_s(args.turns, args.think_s,
                                                   args.nominal_turn_s),
        window_s=args.level_s, max_sessions=args.max_sessions, rng=rng)
    wl = generate(session_spec(args, seed, len(offsets)))
    return [ScheduledSession(conv, off, goodput.think_times(args.turns, args.think_s, rng))
            for conv, off in zip(wl.conversations, offsets, strict=True)]


def idle_probe(ep: Endpoint, args: argparse.Namespace, run_id: str, config: str
               ) -> list[RequestRecord]:
    """Sessions one at a time, no think time: what the machine does with nothing else."""
    wl = generate(session_spec(args, goodput.level_seed(args.seed, 0), args.idle_sessions))
    records, _ = asyncio.run(run_workload(
        ep.base_url, ep.model, wl, config=config, run_id=f"{run_id}-idle",
        text_with_tool_calls=_text_with_tool_calls(args.model)))
    return records


def _placements(ep: Endpoint, config: BenchConfig) -> dict[str, float]:
    """The router's placement counters now ({} for the aggregated node or on failure:
    they are context, not what the level measures)."""
    if config.kind != "bundle":
        return {}
    try:
        r = httpx.get(ep.base_url.removesuffix("/v1") + "/metrics", timeout=10.0)
        r.raise_for_status()
        return goodput.placement_counts(r.text)
    except (httpx.HTTPError, ValueError):
        return {}


def run_level(ep: Endpoint, config: BenchConfig, level: int, slo: Slo,
              args: argparse.Namespace, run_id: str) -> LevelResult:
    sessions = level_sessions(args, level)
    before = _placements(ep, config)
    with ContentionWatch() as watch:
        records, cancelled, wall = asyncio.run(run_sessions(
            ep.base_url, ep.model, sessions, args.max_tokens, config=config.name,
            run_id=f"{run_id}-l{level}", deadline_s=args.level_s + args.drain_s,
            timeout_s=args.level_s + args.drain_s + 60,
            text_with_tool_calls=_text_with_tool_calls(args.model)))
    result = goodput.summarize_level(
        level, records, sessions=[s.conversation.id for s in sessions], turns=args.turns,
        cancelled=cancelled, window_s=args.level_s, wall_s=wall, slo=slo,
        max_error_rate=args.max_error_rate)
    result.foreign_vllm_max = watch.max
    result.load_avg_max = watch.load_max
    result.steal_s = watch.steal_s
    result.other_cpu_s = {name: round(s, 2) for name, s in watch.other_cpu.items()}
    result.placements = goodput.counter_delta(before, _placements(ep, config))
    return result


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


def run_config(config: BenchConfig, args: argparse.Namespace, run_id: str, work_dir: Path,
               slo: Slo | None) -> tuple[LoadConfigResult, Slo | None, list[RequestRecord]]:
    """Up, warm, (idle probe when there is no SLO yet), the sweep, down. A failure is
    recorded, not raised. Returns the result, the SLO, and the probe's records."""
    if args.wait_alone > 0:
        wait_until_alone(args.wait_alone, log=_log)
    cdir = work_dir / config.name
    result = LoadConfigResult(name=config.name, description=config.description, status="ok")
    probe: list[RequestRecord] = []
    t0 = time.perf_counter()
    try:
        _log(f"{config.name}: starting ({config.description})")
        with serve(config, cdir, kv_cache_gib=args.kv_cache_gib,
                   startup_timeout_s=args.startup_timeout, model=args.model,
                   device=args.device, engine_args=args.engine_args) as ep:
            result.startup_s = time.perf_counter() - t0
            _log(f"{config.name}: up in {result.startup_s:.0f} s")
            _warmup(ep.base_url, ep.model)
            if slo is None:
                probe = idle_probe(ep, args, run_id, config.name)
                slo = goodput.idle_slo(probe, probe_config=config.name,
                                       ttft_factor=args.ttft_factor,
                                       itl_factor=args.itl_factor)
                _log(f"idle probe on {config.name}: SLO first-turn TTFT <= "
                     f"{_ms(slo.ttft_first_s)}, later TTFT <= {_ms(slo.ttft_later_s)}, "
                     f"ITL p99 <= {_ms(slo.itl_s)}")
            for level in args.levels:
                lv = run_level(ep, config, level, slo, args, run_id)
                result.levels.append(lv)
                result.stopped_at = level
                _log(f"{config.name} level {level}: {lv.sessions} sessions, "
                     f"{lv.sessions_met} met, {lv.sessions_cancelled} cancelled, goodput "
                     f"{lv.goodput_sessions_per_min:.1f}/min, TTFT p90 {_ms(lv.ttft_s.p90)}, "
                     f"ITL p99 {_ms(lv.itl_s.p99)}, errors {lv.errors}/{lv.requests}"
                     + (f", foreign vLLM {lv.foreign_vllm_max}" if lv.foreign_vllm_max
                        else "") + f", load avg max {lv.load_avg_max:.1f}")
                if lv.broken:
                    _log(f"{config.name}: broken at level {level} ({lv.broken_reason})")
                    break
                time.sleep(args.settle_s)
        _log(f"{config.name}: done, stopped")
    except Exception as exc:  # noqa: BLE001 - one broken configuration must not lose the rest
        _log(f"{config.name}: FAILED: {exc}")
        result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        result.logs = log_tails(cdir / "run" / "logs") or None
    return result, slo, probe


def run_load(configs: list[BenchConfig], args: argparse.Namespace, out_dir: Path,
             command: list[str]) -> LoadReport:
    now = dt.datetime.now(dt.UTC)
    run_id = f"ld{now:%H%M%S}"
    slo: Slo | None = None
    probe: list[RequestRecord] = []
    results: list[LoadConfigResult] = []
    for config in configs:
        if slo is None and results:
            results.append(LoadConfigResult(name=config.name, description=config.description,
                                            status="failed",
                                            error="no SLO: the idle probe did not run"))
            continue
        res, slo, got = run_config(config, args, run_id, out_dir / "work", slo)
        probe = probe or got
        results.append(res)
    load = {
        **session_spec(args, args.seed, 1).model_dump(
            mode="json", exclude={"seed", "conversations", "concurrency"}),
        "levels": args.levels, "level_s": args.level_s, "drain_s": args.drain_s,
        "max_sessions": args.max_sessions, "think_mean_s": args.think_s,
        "think_cap_s": goodput.THINK_CAP_FACTOR * args.think_s,
        "nominal_turn_s": args.nominal_turn_s,
        "nominal_session_s": goodput.nominal_session_s(args.turns, args.think_s,
                                                       args.nominal_turn_s),
        "seed": args.seed, "max_error_rate": args.max_error_rate,
        "idle_sessions": args.idle_sessions,
    }
    return LoadReport(created_at=now.isoformat(timespec="seconds"), command=command,
                      machine=machine(args.device),
                      versions=versions_of(), load=load, slo=slo,
                      idle_probe=probe, configs=results,
                      targets=goodput.load_targets(results))


def rescore_main(args: argparse.Namespace) -> int:
    from .pool import read_report  # a committed run's records are in git history: it says so

    try:
        rep = read_report(args.rescore)
    except FileNotFoundError as e:
        print(f"load: {e}", file=sys.stderr)
        return 2
    out = rep.model_copy() if rep.slo is None else goodput.rescore(
        rep, ttft_factor=args.ttft_factor, itl_factor=args.itl_factor)
    out_dir = args.out or args.rescore.parent / (
        f"rescored-{args.ttft_factor:g}x-{args.itl_factor:g}x")
    paths = report_mod.write_load(out, out_dir)
    print(paths["summary"].read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rescore is not None:
        return rescore_main(args)
    configs = parse_configs(args.configs)
    out_dir = args.out or RESULTS_ROOT / (dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
                                          + "-load")
    command = ["python", "-m", "benchmarks.multiturn.load",
               *(argv if argv is not None else sys.argv[1:])]
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        rep = run_load(configs, args, out_dir, command)
    finally:
        signal.signal(signal.SIGTERM, previous)
    paths = report_mod.write_load(rep, out_dir)
    _log(f"wrote {', '.join(str(p) for p in paths.values())}")
    print(paths["summary"].read_text())
    return 0 if all(c.status == "ok" for c in rep.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
