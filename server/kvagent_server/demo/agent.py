"""`kvagent demo`: the whole product on one machine, in one command.

Brings up 1 prefill + 1 decode vLLM node and the router: P/D whatever `topology: auto` would
pick on the machine, because the demo shows the mechanism (it says what `auto` would run).
CPU by default, the locally built
demo model unless `--model` is given), runs a multi-turn, tool-using agent with the SDK and
prints, per model call, how many prompt tokens were reused, which path the router took, the
time to first token, and the time to first token of the same request recomputed from scratch
on the prefill node (a fresh `cache_salt` defeats every cache), so the saving is measured,
not claimed.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvagent import KVAgentError, Session, TurnResult
from kvagent.messages import Message, UserMessage
from rich.console import Console, JustifyMethod
from rich.live import Live
from rich.table import Table

from kvagent_server.common.ports import free_port, port_free

console = Console()

Service = Literal["api", "db", "cache", "queue"]
Window = Literal["5m", "1h"]
Topic = Literal["latency", "errors", "capacity"]

_WORDS = ("request", "latency", "shard", "replica", "timeout", "retry", "pool", "queue",
          "backlog", "cache", "miss", "eviction", "connection", "handshake", "upstream",
          "deploy", "rollout", "config", "threshold", "budget", "p99", "saturation")


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def search_logs(service: Service) -> str:
    """Return the latest log lines of a service."""
    rng = random.Random(f"logs-{service}")
    lines = []
    for i in range(12):
        level = rng.choice(("INFO", "INFO", "WARN", "ERROR"))
        lines.append(f"2026-11-30T10:{i:02d}:{rng.randint(0, 59):02d}Z {level} {service} "
                     f"req={rng.randint(10**5, 10**6)} dur_ms={rng.randint(3, 2400)} "
                     f"{_sentence(rng, 6)}")
    return "\n".join(lines)


def get_metrics(service: Service, window: Window) -> str:
    """Return request rate, error rate and latency percentiles of a service."""
    rng = random.Random(f"metrics-{service}-{window}")
    series = {
        "service": service, "window": window,
        "points": [{"t": i, "rps": rng.randint(200, 900), "err": round(rng.random() / 20, 4),
                    "p50_ms": rng.randint(8, 40), "p99_ms": rng.randint(120, 2400)}
                   for i in range(8)],
    }
    return json.dumps(series)


def read_runbook(topic: Topic) -> str:
    """Return the on-call runbook section for a topic."""
    rng = random.Random(f"runbook-{topic}")
    steps = [f"{i + 1}. {_sentence(rng, 14)}" for i in range(8)]
    return f"# Runbook: {topic}\n" + "\n".join(steps)


TOOLS: tuple[Callable[..., str], ...] = (search_logs, get_metrics, read_runbook)

USER_TURNS: tuple[str, ...] = (
    "Checkout latency has been high since 10:00. Start with the API logs.",
    "What do the database metrics say about the last hour?",
    "Is the cache evicting more than usual? Check it.",
    "Read the latency runbook and tell me which step applies.",
    "Summarise the incident for the status page.",
)


def system_prompt(handbook_sentences: int = 36) -> str:
    """A long, stable system prompt: the part every turn shares."""
    rng = random.Random("handbook")
    handbook = "\n".join(_sentence(rng, 12) for _ in range(handbook_sentences))
    return ("You are an on-call assistant for a payments platform. Use the tools to look "
            "at logs, metrics and runbooks before answering. Be brief.\n\n"
            f"## Operations handbook\n{handbook}")


@dataclass
class Row:
    """One model call of the demo, as shown in the table."""

    index: int
    kind: str
    prompt_tokens: int
    reused: int
    path: str
    ttft: float
    ttft_recompute: float | None


def _ttft(result: TurnResult) -> float:
    return result.time_to_first_chunk or result.duration


def recompute_ttft(prefill_url: str, model: str, history: Sequence[Message],
                   options: dict[str, Any]) -> float | None:
    """TTFT of the same request computed from scratch on the prefill node: a fresh
    `cache_salt` makes every prefix-cache lookup miss."""
    extra = {"cache_salt": uuid.uuid4().hex, "parallel_tool_calls": False}
    try:
        with Session(f"{prefill_url}/v1", model, messages=list(history), tools=TOOLS,
                     max_retries=0, timeout=300) as probe:
            result = probe.send(None, **{**options, "max_tokens": 1, "extra_body": extra})
    except KVAgentError as exc:  # the baseline is informative only; never fail the demo
        console.print(f"[yellow]recompute probe failed: {exc}[/]")
        return None
    return _ttft(result)


def table(rows: Sequence[Row]) -> Table:
    table = Table(title="kvagent demo: one row per model call", show_lines=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("#", "right"), ("call", "left"), ("prompt tok", "right"), ("reused", "right"),
        ("path", "left"), ("TTFT", "right"), ("TTFT no reuse", "right"), ("speed-up", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for r in rows:
        speedup = (f"{r.ttft_recompute / r.ttft:.1f}x"
                   if r.ttft_recompute and r.ttft > 0 else "-")
        table.add_row(str(r.index), r.kind, str(r.prompt_tokens), str(r.reused), r.path,
                      f"{r.ttft * 1000:.0f} ms",
                      f"{r.ttft_recompute * 1000:.0f} ms" if r.ttft_recompute else "-",
                      speedup)
    return table


def run_agent(router_url: str, prefill_url: str, model: str, *, turns: int,
              baseline: bool = True) -> list[Row]:
    """The agent: each user turn forces one tool call (random demo weights only emit valid
    calls when forced), runs the tool, then asks for a short answer."""
    rows: list[Row] = []
    session = Session(f"{router_url}/v1", model, system=system_prompt(), tools=TOOLS,
                      temperature=0.0, timeout=600,
                      extra_body={"parallel_tool_calls": False})
    # A live table on a terminal; one line per call otherwise (logs, CI), the table at the end.
    live = Live(table(rows), console=console, refresh_per_second=4,
                transient=not console.is_terminal)
    with session, live:

        def record(kind: str, result: TurnResult, history: Sequence[Message],
                   options: dict[str, Any]) -> None:
            usage = result.usage
            rows.append(Row(
                index=len(rows) + 1, kind=kind,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                reused=result.reused_tokens or (usage.cached_tokens if usage else 0),
                path=result.path or "-", ttft=_ttft(result),
                ttft_recompute=(recompute_ttft(prefill_url, model, history, options)
                                if baseline else None)))
            live.update(table(rows))
            if not console.is_terminal:
                r = rows[-1]
                console.print(f"call {r.index} {r.kind}: prompt {r.prompt_tokens} tok, reused "
                              f"{r.reused}, path {r.path}, TTFT {r.ttft * 1000:.0f} ms"
                              + (f" (recomputed: {r.ttft_recompute * 1000:.0f} ms)"
                                 if r.ttft_recompute else ""))

        for text in USER_TURNS[:turns]:
            before = [*session.messages, UserMessage(content=text)]
            opts: dict[str, Any] = {"tool_choice": "required", "max_tokens": 48}
            run = session.run(text, max_steps=1, parallel_tool_calls=False, **opts)
            call = run.final
            names = ",".join(c.name for c in call.tool_calls) or "text"
            record(f"tool call ({names})", call, before, opts)
            before = list(session.messages)
            opts = {"tool_choice": "none", "max_tokens": 24}
            answer = session.send(None, **opts)
            record("answer", answer, before, opts)
    if not console.is_terminal:
        console.print(table(rows))
    return rows


def summarise(rows: Sequence[Row]) -> None:
    later = rows[1:]
    if not later:
        return
    reused = [r for r in later if r.reused > 0]
    console.print(f"Reuse on {len(reused)} of {len(later)} calls after the first; "
                  f"{sum(r.reused for r in later)} of {sum(r.prompt_tokens for r in later)} "
                  "prompt tokens reused.")
    with_reuse = [r.ttft for r in later]
    without = [r.ttft_recompute for r in later if r.ttft_recompute]
    if without:
        console.print(f"Median TTFT after the first call: {statistics.median(with_reuse)*1000:.0f}"
                      f" ms with kvagent, {statistics.median(without)*1000:.0f} ms recomputed.")


def demo_config(model: str | None, run_dir: Path | None, port: int) -> Any:
    """The demo's bundle: defaults, except ports already taken are replaced by free ones."""
    from kvagent_server.config import validate_config

    def pick(p: int) -> int:
        return p if port_free(p) else free_port()

    data: dict[str, Any] = {
        "name": "demo", "model": model, "topology": "pd",  # the mechanism, on any machine
        "prefill": {"ports": [pick(8100)], "side_channel_ports": [pick(5600)]},
        "decode": {"ports": [pick(8200)], "side_channel_ports": [pick(5700)]},
        "router": {"port": pick(port)},
    }
    if run_dir is not None:
        data["run_dir"] = str(run_dir)
    return validate_config(data)


def auto_note(config: Any, host: Any) -> str:
    """One line: what `kvagent-server up` (topology auto) would run here instead, and why."""
    from kvagent_server.bundle.topology import resolve_topology

    choice = resolve_topology(config.model_copy(update={"topology": "auto"}), host)
    return (f"The demo runs P/D to show the mechanism; on this machine `kvagent-server up` "
            f"would run {choice.line()}.")


#: Another driver of the demo's agent than kvagent's SDK: (router URL, served model, user
#: turns) -> one row per model call (`openai_agents.run_agent`: a stock framework's
#: agent that knows nothing of kvagent).
Driver = Callable[[str, str, int], Sequence[Row]]


def run_demo(*, model: str | None = None, keep_running: bool = False, turns: int = 5,
             port: int = 8000, run_dir: Path | None = None, baseline: bool = True,
             driver: Driver | None = None) -> int:
    """Start the bundle, run the agent, print the table, stop everything (also on Ctrl-C)."""
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.supervisor import Bundle, BundleError
    from kvagent_server.config import ConfigError

    if not 1 <= turns <= len(USER_TURNS):
        console.print(f"[red]--turns must be between 1 and {len(USER_TURNS)}[/]")
        return 2
    try:
        import vllm  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:
        console.print(f"[red]The vLLM engine is not importable ({exc}).[/] Install it with "
                      "`kvagent-server install-engine` (the README's `./dev demo` does).")
        return 1
    try:
        config = demo_config(model, run_dir, port)
        if config.model is None:
            console.print("[dim]Preparing the demo model (built once, then cached)…[/]")
        inputs = gather_inputs(config)
        bundle = Bundle(config, inputs=inputs, on_event=lambda m: console.print(
            f"[dim]{time.strftime('%H:%M:%S')}[/] {m}"))
    except ConfigError as exc:
        console.print(f"[red]Bad configuration:[/] {exc}")
        return 2
    console.print("[bold]Starting 1 prefill node, 1 decode node and the router[/] "
                  "(first start warms up vLLM: a minute or two on CPU)…")
    console.print(f"[dim]{auto_note(config, inputs.host)}[/]", soft_wrap=True)
    t0 = time.monotonic()
    try:
        with console.status("waiting for the nodes to become healthy…"):
            bundle.start(wait=True)
        console.print(f"[green]Ready in {time.monotonic() - t0:.0f} s.[/] Router at "
                      f"{bundle.router_url}/v1, logs in {config.resolved_run_dir()}")
        served = config.served_model_name or _served_name(config)
        if driver is not None:
            rows = list(driver(bundle.router_url or "", served, turns))
        else:
            rows = run_agent(bundle.router_url or "", bundle.node_urls("prefill")[0], served,
                             turns=turns, baseline=baseline)
        summarise(rows)
        if keep_running:
            console.print(f"[bold]Still running[/] at {bundle.router_url}/v1 (model "
                          f"{served!r}). Ctrl-C stops everything.")
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        console.print("Interrupted.")
    except BundleError as exc:
        console.print(f"[red]The bundle failed:[/] {exc}")
        return 1
    finally:
        with console.status("stopping everything…"):
            bundle.stop()
        console.print("Stopped; no process left running.")
    return 0


def _served_name(config: Any) -> str:
    from kvagent_server.models.demo import DEMO_MODEL_NAME

    return DEMO_MODEL_NAME if config.model is None else str(config.model)
