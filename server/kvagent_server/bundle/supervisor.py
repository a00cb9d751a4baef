"""The supervisor: start the bundle's processes, wait until healthy, restart, stop cleanly.

    with Bundle(config) as bundle:          # start(wait=True) ... stop()
        print(bundle.router_url, bundle.node_urls("decode"))

`kvagent-server up` is this class plus signal handling; `up --detach` runs it in a daemon
(`python -m kvagent_server.bundle.supervisor --config FILE`) and waits on the state file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from kvagent_server.bundle import processes
from kvagent_server.bundle.render import (
    BundlePlan,
    PlanInputs,
    ProcessSpec,
    incarnation_engine_id,
    ipc_socket_dirs,
    plan,
    with_engine_id,
)
from kvagent_server.bundle.runstate import (
    CONFIG_FILE,
    LOG_DIR,
    ProcState,
    RunState,
    load_state,
    restart_delay,
    save_state,
)
from kvagent_server.config import BundleConfig, ConfigError, dump_config, validate_config
from kvagent_server.vllm_plugin.tier_files import sweep_stale_regions

_TICK_S = 0.25
_HEALTH_EVERY_S = 0.5


class BundleError(RuntimeError):
    """The bundle could not start (a process failed or timed out) or is already running."""


class LaunchError(BundleError):
    """A process could not even be executed (`why` says why, without the process name)."""

    def __init__(self, name: str, why: str) -> None:
        self.why = why
        super().__init__(f"{name} {why}")


def probe(url: str, timeout: float = 2.0) -> bool:
    """GET `url`; True on HTTP 200."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


#: What a vLLM node prints as its interpreter exits: triton's bindings list every object
#: they leaked (hundreds of lines), which would fill a tail and hide why the node stopped.
_EXIT_NOISE = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind")


def log_tail(path: str | Path, lines: int = 30) -> str:
    """A process log's last `lines` lines, without the exit noise."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if not line.startswith(_EXIT_NOISE)]
    return "\n".join(kept[-lines:])


class Bundle:
    """P and D vLLM nodes plus the router, as child process groups of this process."""

    def __init__(self, config: BundleConfig, *, inputs: PlanInputs | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        if inputs is None:
            from kvagent_server.bundle.inputs import gather_inputs

            inputs = gather_inputs(config)
        self.config = config
        self.plan: BundlePlan = plan(config, inputs)
        self.run_dir = self.plan.run_dir
        self._on_event = on_event or (lambda msg: None)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._popens: dict[str, subprocess.Popen[bytes]] = {}
        self._next_probe: dict[str, float] = {}
        self._restart_at: dict[str, float] = {}
        self._monitor: threading.Thread | None = None
        self._started = False
        now = time.time()
        self.state = RunState(
            name=self.plan.name, run_dir=str(self.run_dir), device=self.plan.device,
            topology=self.plan.topology, topology_reason=self.plan.topology_reason,
            supervisor_pid=os.getpid(), supervisor_create_time=processes.create_time(os.getpid()),
            started_at=now, updated_at=now, model=inputs.model.served_name
            if config.served_model_name is None else config.served_model_name,
            router_url=self.plan.router.url if self.plan.router else None,
            processes=[self._proc_state(s) for s in self.plan.processes],
        )

    def _proc_state(self, spec: ProcessSpec) -> ProcState:
        return ProcState(
            name=spec.name, role=spec.role, url=spec.url, health_url=spec.health_url,
            port=spec.port, side_channel_port=spec.side_channel_port, engine_id=spec.engine_id,
            cpu_bind=spec.cpu_bind, cuda_device=spec.cuda_device,
            log=str(self.run_dir / LOG_DIR / f"{spec.name}.log"),
        )

    # ------------------------------------------------------------------ public API

    @property
    def router_url(self) -> str | None:
        return self.plan.router.url if self.plan.router else None

    def node_urls(self, role: str) -> list[str]:
        return [n.url for n in self.plan.nodes if n.role == role]

    def snapshot(self) -> RunState:
        with self._lock:
            return self.state.model_copy(deep=True)

    def start(self, wait: bool = True, *, timeout: float | None = None) -> Bundle:
        """Launch every process; with `wait`, return once all are healthy.

        Raises `BundleError` (after stopping what it started) when a process fails for good
        or does not become healthy in time; Ctrl-C while waiting also stops everything.
        """
        self.check_can_start()
        self._started = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for folder in ipc_socket_dirs(self.plan):  # may be outside run_dir (render.py)
            folder.mkdir(parents=True, exist_ok=True)
        self._write_files()
        try:
            with self._lock:
                for spec in self.plan.nodes:
                    self._launch(spec)
                self._save()
            self._monitor = threading.Thread(target=self._run_monitor, name="kvagent-monitor",
                                             daemon=True)
            self._monitor.start()
            if wait:
                self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until every process is healthy; `BundleError` if one fails or time runs out."""
        limit = timeout if timeout is not None else self.config.startup_timeout_s * 2
        deadline = time.monotonic() + limit
        with self._changed:
            while True:
                if self.state.phase == "running":
                    return
                if self.state.phase == "failed":
                    raise BundleError(self.state.error or "the bundle failed to start")
                if self.state.phase in ("stopping", "stopped"):
                    raise BundleError("the bundle was stopped while starting")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BundleError(f"the bundle was not healthy after {limit:.0f} s")
                self._changed.wait(min(left, 1.0))

    def stop(self) -> list[int]:
        """Stop every process (SIGTERM, SIGKILL after the grace period); returns pids that
        could not be stopped (empty on success)."""
        with self._lock:
            if not self._started or self.state.phase == "stopped":
                return []
            self.state.phase = "stopping"
            self._save()
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10)
        # The router first (no requests into half-stopped nodes), then all nodes at once.
        survivors: list[int] = []
        waves = [[p for p in self.plan.processes if p.role == "router"], list(self.plan.nodes)]
        for wave in waves:
            if not wave:
                continue
            popens = [self._popens[s.name] for s in wave if s.name in self._popens]
            name = "router" if wave[0].role == "router" else None
            survivors += processes.terminate(
                [p.pid for p in popens], self.run_dir, name=name,
                grace=self.config.stop_grace_s, reap=popens)
            with self._lock:
                for spec in wave:
                    ps = self.state.proc(spec.name)
                    if ps.status != "pending":
                        ps.status = "stopped"
                        popen = self._popens.get(spec.name)
                        if popen is not None:
                            ps.exit_code = popen.poll()
        survivors += processes.terminate([], self.run_dir, grace=self.config.stop_grace_s)
        if self.config.kv_tiers.enabled:
            # vLLM's own shutdown kills its engine core without a grace period, so a
            # stopped node leaves its host-tier region in /dev/shm: delete the unowned ones
            sweep_stale_regions()
        with self._lock:
            self.state.phase = "stopped"
            if survivors:
                self.state.error = f"could not stop pids {sorted(set(survivors))}"
            self._save()
            self._changed.notify_all()
        return sorted(set(survivors))

    def __enter__(self) -> Bundle:  # noqa: PYI034 - final in practice
        return self.start(wait=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ----------------------------------------------------------------- internals

    def check_can_start(self) -> None:
        """Raise `BundleError` if this run dir's bundle is running (or left processes), and
        `ConfigError` if a listener's port is taken or its host is not an address here."""
        existing = load_state(self.run_dir)
        if existing is not None and existing.phase not in ("stopped", "failed") and \
                processes.is_alive(existing.supervisor_pid, existing.supervisor_create_time):
            raise BundleError(
                f"bundle '{existing.name}' is already running (supervisor pid "
                f"{existing.supervisor_pid}, {self.run_dir}); run `kvagent-server down` first")
        leftovers = processes.marked(self.run_dir)
        if leftovers:
            raise BundleError(
                f"processes of an earlier run are still alive (pids "
                f"{[p.pid for p in leftovers]}); run `kvagent-server down` first")
        problems = []
        for spec in self.plan.processes:
            problems += _port_problem(spec.bind_host, spec.port, f"{spec.name} HTTP")
            if spec.side_channel_port is not None:
                problems += _port_problem(spec.host, spec.side_channel_port,
                                          f"{spec.name} NIXL side channel")
        if problems:
            raise ConfigError(problems)

    def _write_files(self) -> None:
        write_private(self.run_dir / CONFIG_FILE,
                       json.dumps(dump_config(self.config), indent=2))
        if self.plan.router is not None:
            write_private(self.plan.router_settings_path,
                           json.dumps(self.plan.router_settings, indent=2))

    def _save(self) -> None:
        save_state(self.run_dir, self.state)

    def _event(self, msg: str) -> None:
        self._on_event(msg)

    def _launch(self, spec: ProcessSpec) -> None:
        ps = self.state.proc(spec.name)
        argv = list(spec.argv)
        if spec.engine_id:  # a new NIXL identity per start: peers handshake with it anew
            ps.engine_id = incarnation_engine_id(spec.engine_id)
            argv = with_engine_id(argv, ps.engine_id)
        try:
            popen = processes.launch(argv, env=spec.env, log_path=Path(ps.log),
                                     run_dir=self.run_dir, name=spec.name,
                                     cpu_affinity=spec.cpu_affinity)
        except OSError as exc:  # e.g. engine_command not found
            raise LaunchError(spec.name, f"cannot run {spec.argv[0]!r}: "
                                         f"{exc.strerror or exc}") from None
        self._popens[spec.name] = popen
        ps.pid = popen.pid
        ps.pid_create_time = processes.create_time(popen.pid)
        ps.status = "starting"
        ps.exit_code = None
        ps.started_at = time.time()
        ps.healthy_at = None
        self._next_probe[spec.name] = time.monotonic() + _HEALTH_EVERY_S
        self._event(f"{spec.name}: started (pid {popen.pid})")

    def _run_monitor(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - keep supervising; report it
                self._event(f"supervisor error: {exc!r}")
            self._stop.wait(_TICK_S)

    def _tick(self) -> None:
        """One supervision step: notice exits, probe health, restart, launch the router."""
        now = time.monotonic()
        to_probe: list[ProcState] = []
        with self._lock:
            if self._stop.is_set():
                return
            for ps in self.state.processes:
                popen = self._popens.get(ps.name)
                if ps.status in ("starting", "healthy") and popen is not None:
                    code = popen.poll()
                    if code is not None:
                        self._on_exit(ps, code)
                        continue
                if ps.status == "starting" and now >= self._next_probe.get(ps.name, 0):
                    to_probe.append(ps)
                if ps.status == "restarting" and now >= self._restart_at.get(ps.name, 0):
                    try:
                        self._launch(self.plan.by_name(ps.name))
                    except LaunchError as exc:
                        self._give_up(ps, exc.why)
                    self._save()
        for ps in to_probe:
            ok = probe(ps.health_url, timeout=2.0)
            with self._lock:
                if self._stop.is_set() or ps.status != "starting":
                    continue
                self._next_probe[ps.name] = time.monotonic() + _HEALTH_EVERY_S
                if ok:
                    ps.status = "healthy"
                    ps.healthy_at = time.time()
                    self._event(f"{ps.name}: healthy at {ps.url}")
                    self._save()
                elif ps.started_at and time.time() - ps.started_at > self.config.startup_timeout_s:
                    self._give_up(ps, f"not healthy after {self.config.startup_timeout_s:.0f} s")
        with self._lock:
            self._advance_phase()

    def _on_exit(self, ps: ProcState, code: int) -> None:
        ps.exit_code = code
        # The leader is gone; its engine-core children are orphans with no state worth
        # saving: kill the rest of the group now.
        processes.terminate([ps.pid] if ps.pid else [], self.run_dir, name=ps.name, grace=1.0)
        delay = restart_delay(ps.restarts, self.config.restart_limit)
        if delay is None:
            self._give_up(ps, f"exited with code {code}; restart limit "
                              f"({self.config.restart_limit}) reached")
            return
        ps.restarts += 1
        ps.status = "restarting"
        ps.last_event = (f"exited with code {code}; restart {ps.restarts}/"
                         f"{self.config.restart_limit} in {delay:.0f} s")
        self._restart_at[ps.name] = time.monotonic() + delay
        self._event(f"{ps.name}: {ps.last_event} (log: {ps.log})")
        self._save()

    def _give_up(self, ps: ProcState, why: str) -> None:
        popen = self._popens.get(ps.name)
        if popen is not None and popen.poll() is None:
            processes.terminate([popen.pid], self.run_dir, name=ps.name, grace=2.0,
                                reap=[popen])
        ps.status = "failed"
        ps.last_event = why
        self._event(f"{ps.name}: FAILED, {why} (log: {ps.log})")
        if self.state.phase == "starting":
            self.state.phase = "failed"
            tail = log_tail(ps.log)
            self.state.error = f"{ps.name} {why}; last lines of {ps.log}:\n{tail}"
        self._save()

    def _advance_phase(self) -> None:
        nodes = [p for p in self.state.processes if p.role != "router"]
        router = next((p for p in self.state.processes if p.role == "router"), None)
        changed = False
        if self.state.phase == "starting" and all(p.status == "healthy" for p in nodes):
            if router is not None and router.status == "pending":
                try:
                    self._launch(self.plan.by_name("router"))
                except LaunchError as exc:
                    self._give_up(router, exc.why)
                changed = True
            elif router is None or router.status == "healthy":
                self.state.phase = "running"
                self._event("bundle: all processes healthy")
                changed = True
        if changed:
            self._save()
        self._changed.notify_all()


def _port_problem(host: str, port: int, what: str) -> list[str]:
    """A line when `host:port` cannot be bound here (in use, or not a local address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return [f"{what}: cannot listen on {host}:{port} ({exc.strerror})"]
    return []


def write_private(path: Path, text: str) -> None:
    """Write a file only the owner can read (it may hold signing keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


# ---------------------------------------------------------------- daemon entry point


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: What `signal.signal` returns and takes back: a function, SIG_DFL/SIG_IGN, or None.
_Handler = Callable[[int, FrameType | None], Any] | int | None


class _StopOnSignal:
    """Signal handler: the first SIGINT/SIGTERM/SIGHUP raises `KeyboardInterrupt` in the
    main thread; later ones are ignored, so a second Ctrl-C cannot cut the stop short.

    Installed for SIGINT too, not left to Python's default: a process started with SIGINT
    ignored (a background job of a non-interactive shell, some test runners and CI agents)
    keeps it ignored across exec, and Python then installs no KeyboardInterrupt handler:
    Ctrl-C would do nothing and leave every node running.
    """

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.requested:
            return
        self.requested = True
        raise KeyboardInterrupt

    def install(self) -> dict[int, _Handler]:
        previous: dict[int, _Handler] = {}
        for s in _STOP_SIGNALS:
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                continue  # started under nohup: closing the terminal must not stop it
            previous[s] = signal.signal(s, self)
        return previous


def shielded_stop(bundle: Bundle) -> list[int]:
    """`bundle.stop()` that a second Ctrl-C or SIGTERM cannot interrupt half-way."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
    try:
        return bundle.stop()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_foreground(bundle: Bundle, *, wait: Callable[[Bundle], None] | None = None,
                   on_ready: Callable[[Bundle], None] | None = None,
                   on_error: Callable[[str], None] | None = None) -> int:
    """Start `bundle`, supervise it until SIGINT/SIGTERM/SIGHUP, then stop everything.

    `wait` blocks until the bundle is healthy (default `Bundle.wait_healthy`; the CLI passes
    one that shows progress). Returns 0 after a clean stop, 1 when the start failed or a
    process could not be stopped.
    """
    report = on_error or (lambda msg: print(f"kvagent-server: {msg}", file=sys.stderr,
                                            flush=True))
    # Our handler stays installed until everything is stopped: restoring the previous ones
    # first would open a window where a second signal escapes before the stop begins.
    previous = _StopOnSignal().install()
    failed = False
    survivors: list[int] = []
    try:
        try:
            bundle.start(wait=False)
            (wait or Bundle.wait_healthy)(bundle)
            if on_ready is not None:
                on_ready(bundle)
            while True:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        except (BundleError, ConfigError) as exc:
            report(str(exc))
            failed = True
        finally:
            survivors = shielded_stop(bundle)
            if survivors:
                report(f"could not stop pids {survivors}")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 1 if failed or survivors else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvagent_server.bundle.supervisor --config FILE`: the detached daemon."""
    parser = argparse.ArgumentParser(prog="python -m kvagent_server.bundle.supervisor")
    parser.add_argument("--config", required=True, type=Path,
                        help="a config JSON written by `kvagent-server up --detach`")
    args = parser.parse_args(argv)
    try:
        cfg = validate_config(json.loads(args.config.read_text()))
        bundle = Bundle(cfg, on_event=lambda m: print(
            f"{time.strftime('%H:%M:%S')} {m}", flush=True))
    except ConfigError as exc:
        print(f"kvagent-server: bad config:\n{exc}", file=sys.stderr, flush=True)
        return 2
    return run_foreground(bundle)


if __name__ == "__main__":
    sys.exit(main())
