"""The `kv_events` setting: what every node publishes and what the router is told."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.bundle.render import HostFacts, ModelSource, PlanInputs, plan
from kvagent_server.config import ConfigError
from kvagent_server.router.settings import RouterSettings
from support import pd_config


def inputs(gpus: int = 0) -> PlanInputs:
    return PlanInputs(host=HostFacts(cpu_cores=(0, 1, 2, 3), gpu_count=gpus),
                      model=ModelSource(model="/models/m", served_name="m"),
                      python=sys.executable)


def events_of(argv: tuple[str, ...]) -> dict[str, Any] | None:
    if "--kv-events-config" not in argv:
        return None
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def test_default_is_ipc_in_the_run_dir_for_every_node(tmp_path: Path) -> None:
    bp = plan(pd_config({"run_dir": str(tmp_path), "prefill": {"count": 2}}), inputs())
    sources = bp.router_settings["engine"]["kv_events"]
    assert len(bp.nodes) == 3 and len(sources) == 3
    for node in bp.nodes:
        ev = events_of(node.argv)
        path = tmp_path / f"kv-events-{node.role}-{node.index}.ipc"
        assert ev == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"ipc://{path}", "topic": "kvagent"}
        assert sources[node.url] == {"endpoint": f"ipc://{path}", "topic": "kvagent",
                                     "hash_algo": "sha256", "hash_seed": None}
    RouterSettings.model_validate(bp.router_settings)  # what the router will load


def test_wildcard_bind_publishes_on_tcp_ports(tmp_path: Path) -> None:
    cfg = pd_config({"run_dir": str(tmp_path), "bind_host": "0.0.0.0",
                           "advertise_host": "10.1.2.3", "prefill": {"count": 2},
                           "decode": {"hosts": ["10.1.2.9"]},
                           "kv_events": {"port_base": 6100, "topic": "t"}})
    bp = plan(cfg, inputs())
    got = {n.name: (events_of(n.argv)["endpoint"], bp.router_settings["engine"]["kv_events"][n.url]
                    ["endpoint"]) for n in bp.nodes}
    assert got == {"prefill-0": ("tcp://*:6100", "tcp://10.1.2.3:6100"),
                   "prefill-1": ("tcp://*:6101", "tcp://10.1.2.3:6101"),
                   "decode-0": ("tcp://*:6100", "tcp://10.1.2.9:6100")}  # its own host


def test_disabled_roles_and_nodes_without_prefix_caching_do_not_publish(tmp_path: Path) -> None:
    off = plan(pd_config({"run_dir": str(tmp_path), "kv_events": {"enabled": False}}),
               inputs())
    assert all(events_of(n.argv) is None for n in off.nodes)
    assert off.router_settings["engine"]["kv_events"] == {}
    some = plan(pd_config({"run_dir": str(tmp_path), "kv_events": {"roles": ["prefill"]},
                                 "prefill": {"count": 2, "prefix_caching": False}}), inputs())
    assert all(events_of(n.argv) is None for n in some.nodes)
    only_p = plan(pd_config({"run_dir": str(tmp_path),
                                   "kv_events": {"roles": ["prefill"]}}), inputs())
    assert [n.role for n in only_p.nodes if events_of(n.argv)] == ["prefill"]


def test_the_router_learns_each_nodes_hash_algo_and_seed(tmp_path: Path) -> None:
    cfg = pd_config({
        "run_dir": str(tmp_path / "run"), "device": "cuda",
        "kv_tiers": {"cpu": {"size_gib": 8}, "hash_algo": "sha256_cbor", "hash_seed": 42},
        "decode": {"extra_env": {"PYTHONHASHSEED": "7"}}})
    bp = plan(cfg, inputs(gpus=2))
    p, d = bp.nodes
    src = bp.router_settings["engine"]["kv_events"]
    assert (src[p.url]["hash_algo"], src[p.url]["hash_seed"]) == ("sha256_cbor", "42")
    assert (src[d.url]["hash_algo"], src[d.url]["hash_seed"]) == ("sha256_cbor", "7")
    # The offload tier announces every block of a chunk, so prefixes match block by block.
    kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
    tier = kv["kv_connector_extra_config"]["connectors"][1]
    assert tier["kv_connector_extra_config"]["self_describing_kv_events"] is True
    algo_flag = pd_config({"run_dir": str(tmp_path), "prefill": {
        "extra_args": ["--prefix-caching-hash-algo=sha256_cbor"]}})
    src = plan(algo_flag, inputs()).router_settings["engine"]["kv_events"]
    assert sorted(s["hash_algo"] for s in src.values()) == ["sha256", "sha256_cbor"]


def test_bad_kv_events_settings_are_explained(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="kv_events.transport: tcp needs a wildcard"):
        pd_config({"kv_events": {"transport": "tcp"}})
    with pytest.raises(ConfigError, match="5700 is used by both"):
        pd_config({"bind_host": "0.0.0.0", "kv_events": {"port_base": 5699},
                         "prefill": {"count": 1}})
    with pytest.raises(ConfigError, match="exceeds 65535"):
        pd_config({"bind_host": "0.0.0.0", "kv_events": {"port_base": 65535}})
    with pytest.raises(ConfigError, match="listed twice"):
        pd_config({"kv_events": {"roles": ["prefill", "prefill"]}})
    with pytest.raises(ConfigError, match="kv_events.endpoint: unknown key"):
        pd_config({"kv_events": {"endpoint": "tcp://x:1"}})
    long_dir = tmp_path / ("d" * 120)
    long_dir.mkdir()  # gettempdir() only takes a TMPDIR that exists
    monkeypatch.setenv("TMPDIR", str(long_dir))
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        with pytest.raises(ConfigError, match="set TMPDIR shorter"):
            plan(pd_config({"run_dir": str(long_dir)}), inputs())
    finally:
        monkeypatch.delenv("TMPDIR")
        tempfile.tempdir = None
    given = pd_config({"run_dir": str(tmp_path), "router": {
        "engine": {"kv_events": {"http://x:1": {"endpoint": "ipc:///x"}}}}})
    with pytest.raises(ConfigError, match="router.engine.kv_events"):
        plan(given, inputs())
    given.kv_events.enabled = False
    assert "http://x:1" in plan(given, inputs()).router_settings["engine"]["kv_events"]


def test_shell_output_creates_the_socket_directory_first(tmp_path: Path) -> None:
    from kvagent_server.bundle.render import render_shell

    run = tmp_path / "run"
    text = render_shell(plan(pd_config({"run_dir": str(run)}), inputs()))
    assert text.index(f"mkdir -p {run}") < text.index("--kv-events-config")
    off = pd_config({"run_dir": str(run), "kv_events": {"enabled": False}})
    assert "KV event sockets" not in render_shell(plan(off, inputs()))


def test_deployments_publish_only_where_the_router_can_listen() -> None:
    from kvagent_server.deploy.options import DeployOptions
    from kvagent_server.deploy.plan import deploy_plan

    cfg = pd_config({"model": "/m", "prefill": {"count": 2}, "decode": {"count": 2}})
    k8s = deploy_plan(cfg, DeployOptions(), target="kubernetes", plugin=({}, {}))
    for role in ("prefill", "decode"):  # every pod runs the role's argv: one port per role
        assert events_of(k8s.roles[role].argv)["endpoint"] == "tcp://*:5800"
    sources = k8s.router_settings["engine"]["kv_events"]
    assert len(sources) == 4
    for node in k8s.bundle.nodes:
        assert sources[node.url]["endpoint"] == f"tcp://{node.host}:5800"
    compose = deploy_plan(cfg, DeployOptions(gpus=4), target="compose", plugin=({}, {}))
    assert all(events_of(n.argv) is None for n in compose.bundle.nodes)
    assert compose.router_settings["engine"]["kv_events"] == {}


def test_the_disk_tier_publishes_its_blocks_when_events_are_on(tmp_path: Path) -> None:
    """vLLM's fs tier emits BlockStored (medium STORAGE) only with `enable_kv_events` on
    its own entry; without it the router would never see a prefix that survives on disk."""
    for on in (True, False):
        cfg = pd_config({
            "run_dir": str(tmp_path / "run"), "device": "cuda", "kv_events": {"enabled": on},
            "kv_tiers": {"cpu": {"size_gib": 8}, "disk": {"path": str(tmp_path / "kv")}}})
        p = plan(cfg, inputs(gpus=2)).nodes[0]
        kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
        (fs,) = kv["kv_connector_extra_config"]["connectors"][1][
            "kv_connector_extra_config"]["secondary_tiers"]
        assert fs.get("enable_kv_events", False) is on


def test_a_deep_run_dir_puts_the_sockets_in_a_short_temp_dir(tmp_path: Path) -> None:
    """A unix socket address holds at most 107 bytes: a deep run dir (a pytest tmp dir, a
    long home) moves the sockets to one short directory per run dir, which the router's
    settings name too, and which `Bundle.start` and the shell script create."""
    from kvagent_server.bundle.render import IPC_PATH_MAX, ipc_socket_dirs, render_shell

    deep = tmp_path / ("d" * 120)
    bp = plan(pd_config({"run_dir": str(deep)}), inputs())
    endpoints = [src["endpoint"] for src in bp.router_settings["engine"]["kv_events"].values()]
    assert endpoints and all(e.startswith("ipc://") for e in endpoints)
    paths = [Path(e[len("ipc://"):]) for e in endpoints]
    assert all(len(str(p)) <= IPC_PATH_MAX and deep not in p.parents for p in paths)
    assert len({p.parent for p in paths}) == 1 and ipc_socket_dirs(bp) == [paths[0].parent]
    for spec, path in zip(bp.nodes, paths, strict=True):
        assert any(f"ipc://{path}" in arg for arg in spec.argv)
    assert f"mkdir -p {paths[0].parent}" in render_shell(bp)
    again = plan(pd_config({"run_dir": str(deep)}), inputs())
    assert ipc_socket_dirs(again) == ipc_socket_dirs(bp)  # every process agrees
    other = plan(pd_config({"run_dir": str(tmp_path / ("e" * 120))}), inputs())
    assert ipc_socket_dirs(other) != ipc_socket_dirs(bp)


def test_the_router_is_told_each_tiered_nodes_tiers(tmp_path: Path) -> None:
    """Where a decode node's given-up blocks go (router/reuse/spill.py): the bundle writes
    each tiered node's tiers into the router's settings by URL, as it does KV events."""
    cfg = pd_config({
        "run_dir": str(tmp_path / "run"), "device": "cuda",
        "kv_tiers": {"cpu": {"size_gib": 8}, "min_prefix_tokens": 256,
                     "disk": {"path": str(tmp_path / "kv"), "shared": True},
                     "roles": ["decode"]}})
    bp = plan(cfg, inputs(gpus=2))
    p, d = bp.nodes
    assert bp.router_settings["engine"]["kv_tiers"] == {d.url: {
        "host": True, "disk": True, "shared": True, "chunk_tokens": 256,
        "prompt_only": True}}
    settings = RouterSettings.model_validate(bp.router_settings)
    assert settings.engine.kv_tiers[d.url].shared and p.url not in settings.engine.kv_tiers
    no_tiers = plan(pd_config({"run_dir": str(tmp_path / "run")}), inputs())
    assert no_tiers.router_settings["engine"]["kv_tiers"] == {}
