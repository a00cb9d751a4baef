"""Multi-node rehearsal on one machine: nodes on distinct loopback addresses.

Proves nothing in the rendered commands assumes `localhost`: every NIXL side-channel host,
advertised address, node URL and router argument is one of the configured addresses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.bundle.render import HostFacts, ModelSource, PlanInputs, plan
from kvagent_server.config import validate_config
from kvagent_server.router.__main__ import parse_args
from support import FAKE_NODE, free_ports

P_HOSTS = ["127.0.0.2", "127.0.0.3"]
D_HOSTS = ["127.0.0.4", "127.0.0.5"]
ROUTER = "127.0.0.6"
LOCAL_NAMES = re.compile(r"localhost|127\.0\.0\.1\b|0\.0\.0\.0|::1")


def rehearsal_plan():  # type: ignore[no-untyped-def]
    cfg = validate_config({
        "model": "/models/m", "topology": "pd", "device": "cpu", "run_dir": "/run/rehearsal",
        "bind_host": "0.0.0.0", "advertise_host": "127.0.0.7",
        "prefill": {"count": 2, "hosts": P_HOSTS},
        "decode": {"count": 2, "hosts": D_HOSTS},
        "router": {"host": ROUTER},
    })
    inputs = PlanInputs(host=HostFacts(cpu_cores=(0, 1, 2, 3), gpu_count=0),
                        model=ModelSource(model="/models/m", served_name="m"),
                        python=sys.executable)
    return plan(cfg, inputs)


def test_every_node_address_is_its_configured_one() -> None:
    bp = rehearsal_plan()
    for node, host in zip(bp.nodes, P_HOSTS + D_HOSTS, strict=True):
        assert node.host == host
        assert node.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host
        assert urlsplit(node.url).hostname == host
        # The launcher polls through a configured address too (bind is a wildcard here).
        assert urlsplit(node.health_url).hostname in (host, "127.0.0.7")
        # Nothing else in the node's command or environment names a loopback default.
        text = " ".join(node.argv) + " " + json.dumps(node.env)
        assert not LOCAL_NAMES.search(text.replace("--host 0.0.0.0", "")), text


def test_router_arguments_use_the_configured_addresses() -> None:
    bp = rehearsal_plan()
    assert bp.router is not None
    args = parse_args(list(bp.router.argv[3:]))  # the router's own parser
    assert [urlsplit(u).hostname for u in args.prefill] == P_HOSTS
    assert [urlsplit(u).hostname for u in args.decode] == D_HOSTS
    assert args.host == ROUTER
    assert urlsplit(bp.router.url).hostname == ROUTER
    assert urlsplit(bp.router.health_url).hostname == ROUTER


def test_side_channel_endpoints_are_distinct() -> None:
    bp = rehearsal_plan()
    endpoints = {(n.env["VLLM_NIXL_SIDE_CHANNEL_HOST"], n.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
                 for n in bp.nodes}
    assert len(endpoints) == len(bp.nodes)


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 30.0
                ) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}"
        try:
            last = httpx.get(url, timeout=2)
            if last.status_code == 200:
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready: {last.text if last is not None else 'no answer'}")


@pytest.mark.slow
def test_real_router_reaches_nodes_bound_only_to_their_addresses(tmp_path: Path) -> None:
    """Real processes: each stand-in node binds only its own loopback address, so the
    router becomes ready only if it used exactly the configured addresses."""
    ports = free_ports(5)
    cfg = validate_config({
        "model": "/models/m", "topology": "pd", "device": "cpu",
        "run_dir": str(tmp_path / "run"),
        "bind_host": "0.0.0.0", "block_size": 16,
        "engine_command": [sys.executable, str(FAKE_NODE)],
        "prefill": {"hosts": ["127.0.0.2"], "ports": [ports[0]],
                    "side_channel_ports": [ports[1]]},
        "decode": {"hosts": ["127.0.0.3"], "ports": [ports[2]],
                   "side_channel_ports": [ports[3]]},
        "router": {"host": "127.0.0.4", "port": ports[4]},
    })
    bp = plan(cfg, PlanInputs(host=HostFacts(cpu_cores=(0, 1), gpu_count=0),
                              model=ModelSource(model="/models/m", served_name="m"),
                              python=sys.executable))
    assert bp.router is not None
    bp.router_settings_path.parent.mkdir(parents=True)
    bp.router_settings_path.write_text(json.dumps(bp.router_settings))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node in bp.nodes:
            argv = list(node.argv)
            argv[argv.index("--host") + 1] = node.host  # bind only the node's own address
            procs.append(subprocess.Popen(argv, env={**os.environ, **node.env},
                                          stdout=subprocess.DEVNULL,
                                          start_new_session=True))
        procs.append(subprocess.Popen(list(bp.router.argv), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        ready = _wait_ready(bp.router.url + "/ready", procs)
        nodes = ready.json()["nodes"]
        assert len(nodes) == 2 and all(n["healthy"] for n in nodes.values())
        # Nothing listens on 127.0.0.1 at the nodes' ports: a localhost URL would fail.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{ports[0]}/health", timeout=2)
    finally:
        stop_groups(*procs)
