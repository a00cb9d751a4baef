"""The supervisor with a fake node: health waiting, restarts, limits, clean stops, the CLI.

The fake node (`fakes/process.py`) is a real process serving /health; it can spawn a child that
ignores SIGTERM (like a stuck engine core), die on request, or never become healthy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.bundle.runstate import load_state
from kvagent_server.bundle.supervisor import Bundle, BundleError, log_tail
from kvagent_server.config import ConfigError, validate_config
from support import free_ports

from .bundle_helpers import fake_inputs, processes_mentioning

pytestmark = pytest.mark.usefixtures("no_leftovers")


def bundle_of(cfg: dict[str, Any]) -> Bundle:
    return Bundle(validate_config(cfg), inputs=fake_inputs())


def record(tmp_path: Path, name: str) -> dict[str, Any]:
    return json.loads((tmp_path / "records" / f"{name}.json").read_text())


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_start_healthy_state_logs_and_clean_stop(fake_config: dict, tmp_path: Path) -> None:
    fake_config["prefill"]["extra_env"].update(
        {"FAKE_SPAWN_CHILD": "1", "FAKE_CHILD_IGNORES_TERM": "1", "FAKE_HEALTH_DELAY_S": "1"})
    mine = os.sched_getaffinity(0)
    with bundle_of(fake_config) as bundle:
        state = load_state(Path(fake_config["run_dir"]))
        assert state is not None and state.phase == "running"
        assert [p.status for p in state.processes] == ["healthy"] * 3
        for p in state.processes:
            assert httpx.get(p.health_url).status_code == 200
            assert Path(p.log).is_file() and "fake-node: pid" in Path(p.log).read_text()
            assert p.pid is not None and alive(p.pid)
        pre, dec, router = state.processes
        assert (pre.port, dec.port, router.port) == (
            fake_config["prefill"]["ports"][0], fake_config["decode"]["ports"][0],
            fake_config["router"]["port"])
        assert pre.side_channel_port == fake_config["prefill"]["side_channel_ports"][0]
        assert state.router_url == bundle.router_url == router.url
        # The router started only after both nodes were healthy, with their URLs.
        assert router.started_at >= max(pre.healthy_at, dec.healthy_at)
        argv = record(tmp_path, "router")["argv"]
        assert argv[argv.index("--prefill") + 1] == pre.url
        assert argv[argv.index("--decode") + 1] == dec.url
        settings = json.loads(Path(argv[argv.index("--settings") + 1]).read_text())
        assert settings["port"] == router.port
        env = record(tmp_path, "prefill-0")["env"]
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(pre.side_channel_port)
        child = record(tmp_path, "prefill-0")["child_pid"]
        assert alive(child)
        # Each node runs wholly on its cores, its children too; the router and the
        # supervisor are not pinned.
        assert os.sched_getaffinity(pre.pid) == os.sched_getaffinity(child) == {0}
        assert os.sched_getaffinity(dec.pid) == {1}
        assert os.sched_getaffinity(router.pid) == os.sched_getaffinity(0) == mine
    # The child ignored SIGTERM: it took the SIGKILL after the grace period.
    assert not alive(child)
    assert load_state(Path(fake_config["run_dir"])).phase == "stopped"


def test_node_that_dies_is_restarted(fake_config: dict) -> None:
    with bundle_of(fake_config) as bundle:
        before = bundle.snapshot().proc("decode-0")
        httpx.post(before.url + "/die")
        wait_for(lambda: bundle.snapshot().proc("decode-0").restarts == 1
                 and bundle.snapshot().proc("decode-0").status == "healthy")
        after = load_state(bundle.run_dir).proc("decode-0")
        assert after.pid != before.pid and after.exit_code is None
        assert after.last_event.startswith("exited with code 7; restart 1/3")
        assert Path(after.log).read_text().count("starting decode-0") == 2
        # a new NIXL engine id per start, so peers handshake with the new process
        assert before.engine_id and after.engine_id and after.engine_id != before.engine_id
        assert after.engine_id.rsplit("-", 1)[0] == before.engine_id.rsplit("-", 1)[0]


def test_restart_limit_gives_up_and_keeps_the_rest(fake_config: dict) -> None:
    fake_config["restart_limit"] = 0
    with bundle_of(fake_config) as bundle:
        httpx.post(bundle.snapshot().proc("prefill-0").url + "/die")
        wait_for(lambda: bundle.snapshot().proc("prefill-0").status == "failed")
        state = load_state(bundle.run_dir)
        assert state.proc("prefill-0").last_event == (
            "exited with code 7; restart limit (0) reached")
        assert state.proc("decode-0").status == "healthy"
        assert httpx.get(state.proc("decode-0").health_url).status_code == 200


def test_crash_loop_during_start_fails_with_log_tail(fake_config: dict) -> None:
    fake_config["restart_limit"] = 1
    fake_config["decode"]["extra_env"]["FAKE_EXIT_AT_START"] = "5"
    bundle = bundle_of(fake_config)
    t0 = time.monotonic()
    with pytest.raises(BundleError) as info:
        bundle.start(wait=True)
    msg = str(info.value)
    assert msg.startswith("decode-0 exited with code 5; restart limit (1) reached")
    assert "fake-node: pid" in msg  # the tail of the node's log
    assert time.monotonic() - t0 < 15
    state = load_state(bundle.run_dir)
    assert state.phase == "stopped" and state.proc("decode-0").restarts == 1
    assert state.proc("router").status == "pending"  # never launched


def test_startup_timeout(fake_config: dict) -> None:
    fake_config["startup_timeout_s"] = 1.5
    fake_config["prefill"]["extra_env"]["FAKE_HEALTH_DELAY_S"] = "60"
    with pytest.raises(BundleError, match=r"^prefill-0 not healthy after 2 s"):
        bundle_of(fake_config).start()


def test_die_once_then_recovers_during_start(fake_config: dict, tmp_path: Path) -> None:
    fake_config["decode"]["extra_env"]["FAKE_DIE_ONCE_FILE"] = str(tmp_path / "once")
    fake_config["decode"]["extra_env"]["FAKE_HEALTH_DELAY_S"] = "2"
    with bundle_of(fake_config) as bundle:
        assert bundle.snapshot().proc("decode-0").restarts == 1
        assert bundle.snapshot().phase == "running"


def test_busy_port_is_reported_before_anything_starts(fake_config: dict) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", fake_config["decode"]["side_channel_ports"][0]))
        s.listen()
        with pytest.raises(ConfigError) as info:
            bundle_of(fake_config).start()
    port = fake_config["decode"]["side_channel_ports"][0]
    assert info.value.problems == [
        (f"decode-0 NIXL side channel: cannot listen on 127.0.0.1:{port} "
        "(Address already in use)")]
    assert load_state(Path(fake_config["run_dir"])) is None


def test_second_bundle_on_same_run_dir_is_refused(fake_config: dict) -> None:
    with bundle_of(fake_config):
        other = dict(fake_config)
        p, d, ps, ds, r = free_ports(5)
        other.update(prefill={"ports": [p], "side_channel_ports": [ps]},
                     decode={"ports": [d], "side_channel_ports": [ds]}, router={"port": r})
        second = bundle_of(other)
        with pytest.raises(BundleError, match="is already running"):
            second.start()
        second.stop()  # never started: must not touch the first bundle's state
        assert load_state(Path(fake_config["run_dir"])).phase == "running"


def test_no_router(fake_config: dict) -> None:
    fake_config["router_enabled"] = False
    with bundle_of(fake_config) as bundle:
        assert bundle.router_url is None
        assert [p.name for p in bundle.snapshot().processes] == ["prefill-0", "decode-0"]


# --------------------------------------------------------------------------- CLI


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagent_server.cli", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def config_file(fake_config: dict, tmp_path: Path) -> Path:
    path = tmp_path / "bundle.yaml"
    path.write_text(yaml.safe_dump(fake_config))
    return path


def test_cli_detach_status_down(config_file: Path, fake_config: dict, tmp_path: Path) -> None:
    fake_config["prefill"]["extra_env"]["FAKE_SPAWN_CHILD"] = "1"
    config_file.write_text(yaml.safe_dump(fake_config))
    run_dir = fake_config["run_dir"]
    up = cli("up", "-c", str(config_file), "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "Ready" in up.stdout and f"down --run-dir {run_dir}" in up.stdout
    assert "topology: pd (set in the config)" in up.stdout
    state = load_state(Path(run_dir))
    assert state.phase == "running" and alive(state.supervisor_pid)

    st = cli("status", "--run-dir", run_dir)
    assert st.returncode == 0, st.stdout + st.stderr
    for p in state.processes:
        assert p.name in st.stdout and p.url in st.stdout
    assert f"Router endpoint: {state.router_url}/v1" in st.stdout
    assert "topology pd" in st.stdout
    js = json.loads(cli("status", "--run-dir", run_dir, "--json").stdout)
    assert js["healthy"] and [p["healthy_now"] for p in js["processes"]] == [True] * 3
    assert js["topology"] == "pd"

    # A node dies: status reports it (exit 1) until the supervisor has restarted it.
    os.kill(state.proc("decode-0").pid, signal.SIGKILL)
    bad = json.loads(cli("status", "-c", str(config_file), "--json").stdout)
    wait_for(lambda: load_state(Path(run_dir)).proc("decode-0").restarts == 1)
    wait_for(lambda: cli("status", "--run-dir", run_dir).returncode == 0)
    assert bad["processes"][1]["name"] == "decode-0"

    child = record(tmp_path, "prefill-0")["child_pid"]
    down = cli("down", "--run-dir", run_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "no process left" in down.stdout
    assert not alive(state.supervisor_pid) and not alive(child)
    assert not processes_mentioning(run_dir)
    assert cli("status", "--run-dir", run_dir).returncode == 1
    again = cli("down", "--run-dir", run_dir)
    assert again.returncode == 0


def test_cli_down_after_supervisor_was_killed(config_file: Path, fake_config: dict) -> None:
    run_dir = fake_config["run_dir"]
    assert cli("up", "-c", str(config_file), "--detach", "--no-router").returncode == 0
    state = load_state(Path(run_dir))
    assert [p.name for p in state.processes] == ["prefill-0", "decode-0"]
    os.kill(state.supervisor_pid, signal.SIGKILL)  # no one to stop the nodes now
    wait_for(lambda: not alive(state.supervisor_pid))
    assert all(alive(p.pid) for p in state.processes)
    down = cli("down", "--run-dir", run_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not processes_mentioning(run_dir)


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """Lines of `proc`'s stdout up to the one holding `marker` (fails after `timeout`)."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        while line := proc.stdout.readline():
            lines.put(line)
            if marker in line:
                return
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {marker!r} after {timeout:.0f} s:\n{seen}") from None
        assert line, f"up exited early:\n{seen}"
        seen += line
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("inherited_sigint", ["default", "ignored"])
def test_cli_foreground_ctrl_c_stops_everything(config_file: Path, fake_config: dict,
                                               inherited_sigint: str) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to `up`'s process group.

    `ignored`: `up` inherited SIGINT as ignored (a background job of a non-interactive
    shell, a CI agent, a test runner that ignores it); Python then leaves Ctrl-C ignored
    unless `up` installs its own handler. This is how the test failed on loaded runs.
    """
    run_dir = Path(fake_config["run_dir"])
    argv = [sys.executable, "-m", "kvagent_server.cli", "up", "-c", str(config_file)]
    if inherited_sigint == "ignored":  # SIG_IGN survives exec, as from a shell would
        argv = [sys.executable, "-c", ("import os, signal, sys; "
                "signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], "
                "sys.argv[1:])"), *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        seen = _read_until(proc, "Ready.", timeout=120)
        pids = [p.pid for p in load_state(run_dir).processes]
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        os.killpg(proc.pid, signal.SIGINT)
        # The stop's own bound: two waves (router, then nodes) of `stop_grace_s` each before
        # SIGKILL; the margin covers a monitor tick in flight (a 2 s health probe at most),
        # the SIGKILLs and interpreter exit on a loaded machine. (The fake nodes exit on
        # SIGTERM, so a healthy stop takes well under a second.)
        grace = float(fake_config["stop_grace_s"])
        bound = 2 * grace + 10.0
        try:
            out, _ = proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
            raise AssertionError(f"up still running {bound:.0f} s after Ctrl-C (stop grace "
                                 f"{grace:g} s):\n{seen}{partial or ''}") from None
        out = seen + out
    finally:
        stop_groups(proc, sig=signal.SIGKILL)  # still running: the test failed, no grace
    assert proc.returncode == 0, out
    assert "Ready." in out and "Stopped." in out and "Traceback" not in out
    assert not any(alive(pid) for pid in pids)
    assert load_state(run_dir).phase == "stopped"


def test_stop_handler_raises_once() -> None:
    """A second Ctrl-C while stopping is ignored instead of aborting the stop."""
    from kvagent_server.bundle.supervisor import _StopOnSignal

    handler = _StopOnSignal()
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    assert handler(signal.SIGINT, None) is None
    assert handler(signal.SIGTERM, None) is None


def test_cli_bad_config_is_one_line_per_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("prefil: {}\ndecode: {count: 0}\n")
    for command in ("up", "render"):
        res = cli(command, "-c", str(path))
        assert res.returncode == 2
        assert "Traceback" not in res.stderr
        assert "prefil: unknown key (did you mean 'prefill'?)" in res.stderr
    res = cli("render", "--prefill", "1", "--set", "decoder_kv_blocks_ttl_s=10")
    assert res.returncode == 2 and "decoder_kv_blocks_ttl_s: 10 s must be above" in res.stderr
    res = cli("up", "--device", "cuda", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2 and "device: cuda requested but no GPU" in res.stderr


def test_cli_render_formats() -> None:
    res = cli("render", "--no-router", "--set", "prefill.extra_args=[--enforce-eager]",
              "--set", "topology=pd", "--format", "json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["router"] is None
    assert data["nodes"][0]["argv"][-1] == "--enforce-eager"
    assert (data["topology"], data["topology_reason"]) == ("pd", "set in the config")
    assert "topology: pd (set in the config)" in res.stderr  # stdout stays pure JSON
    shell = cli("render")
    assert shell.returncode == 0 and shell.stdout.startswith("#!/bin/sh\n")
    assert "vllm.entrypoints.openai.api_server" in shell.stdout
    assert cli("render", "--format", "yaml").returncode == 2


def test_single_topology_starts_one_node_and_a_router_without_prefill(
        fake_config: dict, tmp_path: Path) -> None:
    fake_config["topology"] = "single"
    with bundle_of(fake_config) as bundle:
        state = load_state(Path(fake_config["run_dir"]))
        assert state is not None and state.phase == "running"
        assert (state.topology, state.topology_reason) == ("single", "set in the config")
        assert [(p.name, p.status) for p in state.processes] == [
            ("decode-0", "healthy"), ("router", "healthy")]
        assert bundle.node_urls("prefill") == []
        argv = record(tmp_path, "router")["argv"]
        assert "--prefill" not in argv and argv.count("--decode") == 1
        assert argv[argv.index("--decode") + 1] == state.proc("decode-0").url
        node = record(tmp_path, "decode-0")["argv"]
        kv = json.loads(node[node.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == "kv_both"


def test_missing_engine_command_is_a_clear_error(fake_config: dict) -> None:
    fake_config["engine_command"] = ["/nonexistent/vllm-wrapper"]
    with pytest.raises(BundleError) as info:
        bundle_of(fake_config).start()
    assert str(info.value) == (
        "prefill-0 cannot run '/nonexistent/vllm-wrapper': No such file or directory")


def test_a_core_the_machine_lacks_is_a_clear_error(fake_config: dict) -> None:
    fake_config["decode"]["cpu_binds"] = ["4000"]
    mine = os.sched_getaffinity(0)
    with pytest.raises(BundleError, match=r"decode-0 cannot run .*cores \[4000\]"):
        bundle_of(fake_config).start()
    assert os.sched_getaffinity(0) == mine


def test_missing_router_command_fails_the_start(fake_config: dict) -> None:
    fake_config["router_command"] = ["/nonexistent/router"]
    with pytest.raises(BundleError, match=r"^router cannot run '/nonexistent/router'"):
        bundle_of(fake_config).start()


def test_stop_sweeps_host_regions_a_tiered_bundle_left(fake_config: dict) -> None:
    """vLLM kills its engine core on shutdown, leaving /dev/shm/vllm_offload_*.mmap."""
    fake_config.update(device="cpu", kv_tiers={"cpu": {"size_gib": 0.01}})
    left = Path(f"/dev/shm/vllm_offload_kvagent-test-{os.getpid()}-{time.time_ns()}.mmap")
    if not left.parent.is_dir():
        pytest.skip("no /dev/shm here")
    with bundle_of(fake_config):
        left.write_bytes(b"\0" * 4096)  # as a node killed meanwhile would leave it
    assert not left.exists()


def test_log_tail_drops_the_leak_report_a_node_prints_as_it_exits(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text("\n".join(["ERROR engine core died", "INFO: Finished server process",
                              "nanobind: leaked 4 instances!",
                              *[f' - leaked function "f{i}"' for i in range(600)],
                              " - ... skipped remainder",
                              "See https://nanobind.readthedocs.io/en/latest/refleaks.html"]))
    assert log_tail(log, 2).splitlines() == ["ERROR engine core died",
                                             "INFO: Finished server process"]
