"""The multi-host rehearsal and the Kubernetes/compose renderers wire the same ports.

The rehearsal starts what `kvagent-server render` prints for each namespace "host"; the
manifests and the compose file are rendered from the same config. Every port, flag and
environment variable that connects the pieces must agree, so the rehearsal exercises
what a cluster would run. Renders with the real CLI (a subprocess per host).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kvagent_server.config import validate_config
from kvagent_server.deploy import DeployOptions, render_compose, render_kubernetes
from kvagent_server.router.__main__ import parse_args

from benchmarks.api import (
    REDIS_PORT,
    ROUTER_PORT,
    Topology,
    flag,
    node_argv_differences,
    parse_ss_listening,
    rehearsal_config,
    render_hosts,
)

TOPO = Topology("t1")
#: Flags that legitimately differ between a pod and a namespace host: where it binds,
#: the model's location and its serving args (the demo model vs an image's model, including
#: the built-in models' bounded default answer length), the engine id (the pod name).
_PER_PLACE = {"--host", "--model", "--served-model-name", "--kv-transfer-config",
              "--enable-auto-tool-choice", "--tool-call-parser", "--structured-outputs-config",
              "--dtype", "--override-generation-config"}
#: Environment that is the rehearsal's own: the side-channel host (a pod's comes from the
#: downward API), core pinning, and the demo model's serving env.
_PER_PLACE_ENV = {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_CPU_OMP_THREADS_BIND",
                  "VLLM_ENFORCE_STRICT_TOOL_CALLING"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return render_hosts(TOPO, tmp_path_factory.mktemp("render"))


def _deploy_config() -> Any:
    data = rehearsal_config(TOPO, "/unused")
    data["model"] = "/models/demo"
    data["router"] = {k: v for k, v in data["router"].items() if k != "redis_url"}
    return validate_config(data)


def _k8s() -> list[dict[str, Any]]:
    text = render_kubernetes(_deploy_config(), DeployOptions(redis="bundled"))
    return [d for d in yaml.safe_load_all(text) if d]


def _find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _kv_config(argv: list[str]) -> dict[str, Any]:
    kv = json.loads(flag(argv, "--kv-transfer-config")[0])
    kv.pop("engine_id")
    return dict(kv)


def test_each_host_runs_its_own_address_and_renders_differ_only_in_the_bind(
        rendered: dict[str, dict[str, Any]]) -> None:
    p, d = rendered["p"]["nodes"][0], rendered["d"]["nodes"][1]
    assert flag(p["argv"], "--host") == [TOPO.addr("p")]
    assert flag(d["argv"], "--host") == [TOPO.addr("d")]
    assert p["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == TOPO.addr("p")
    assert d["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == TOPO.addr("d")
    for i in (0, 1):
        diff = node_argv_differences(rendered["p"]["nodes"][i]["argv"],
                                     rendered["d"]["nodes"][i]["argv"])
        assert [k for k, _, _ in diff] == ["--host"], diff
        assert rendered["p"]["nodes"][i]["env"] == rendered["d"]["nodes"][i]["env"]
    # P and D are pinned to different cores, as the bundle does.
    assert p["env"]["VLLM_CPU_OMP_THREADS_BIND"] != d["env"]["VLLM_CPU_OMP_THREADS_BIND"]


def test_both_routers_reach_the_same_nodes_and_redis(
        rendered: dict[str, dict[str, Any]]) -> None:
    for host in ("ra", "rb"):
        router = rendered[host]["router"]
        args = parse_args(router["argv"][3:])  # the router's own parser
        assert args.host == TOPO.addr(host) and args.port == ROUTER_PORT
        assert [urlsplit(u).hostname for u in args.prefill] == [TOPO.addr("p")]
        assert [urlsplit(u).hostname for u in args.decode] == [TOPO.addr("d")]
        redis = urlsplit(router["settings"]["redis_url"])
        assert (redis.hostname, redis.port) == (TOPO.addr("redis"), REDIS_PORT)


def test_ports_match_the_kubernetes_manifests(rendered: dict[str, dict[str, Any]]) -> None:
    objs = _k8s()
    nodes = {"prefill": rendered["p"]["nodes"][0], "decode": rendered["d"]["nodes"][1]}
    for role, node in nodes.items():
        sts = _find(objs, "StatefulSet", f"kvagent-{role}")
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": node["port"], "nixl": node["side_channel_port"]}
        svc = _find(objs, "Service", f"kvagent-{role}")
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
        env = {e["name"]: e.get("value") for e in c["env"]}
        # Every variable the rehearsal sets reaches the pod (the plugin's included).
        for key, value in node["env"].items():
            if key in _PER_PLACE_ENV:
                assert env.get(key) is None, key
            else:
                assert env[key] == value, key
        pod_args = list(c["command"]) + list(c["args"])
        diff = node_argv_differences(node["argv"], pod_args)
        assert {k for k, _, _ in diff} <= _PER_PLACE, diff
        assert _kv_config(pod_args) == _kv_config(node["argv"])
    router = _find(objs, "Deployment", "kvagent-router")
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["ports"] == [{"name": "http", "containerPort": ROUTER_PORT}]
    args = parse_args(list(rc["args"]))
    assert args.port == rendered["ra"]["router"]["port"] == ROUTER_PORT
    assert [urlsplit(u).port for u in args.prefill + args.decode] == [
        nodes["prefill"]["port"], nodes["decode"]["port"]]
    redis_svc = _find(objs, "Service", "kvagent-redis")
    assert [p["port"] for p in redis_svc["spec"]["ports"]] == [REDIS_PORT]
    secret = json.loads(_find(objs, "Secret", "kvagent-router-settings")["stringData"][
        "router-settings.json"])
    assert urlsplit(secret["redis_url"]).port == REDIS_PORT
    given = rendered["ra"]["router"]["settings"]
    assert secret["policy"] == given["policy"]
    for section, key in (("nodes", "block_size"), ("retention", "decode_blocks_ttl_s"),
                         ("nodes", "kv_recompute_threshold")):
        assert secret[section][key] == given[section][key], key


def test_ports_match_the_compose_file(rendered: dict[str, dict[str, Any]]) -> None:
    text = render_compose(_deploy_config(), DeployOptions(redis="bundled"))
    services = yaml.safe_load(text)["services"]
    for role, node in (("prefill", rendered["p"]["nodes"][0]),
                       ("decode", rendered["d"]["nodes"][1])):
        svc = services[f"{role}-0"]
        diff = node_argv_differences(node["argv"], svc["command"])
        assert {k for k, _, _ in diff} <= _PER_PLACE, diff
        assert flag(svc["command"], "--port") == [str(node["port"])]
        assert svc["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(
            node["side_channel_port"])
        # Compose keeps the config's hosts: the node advertises the same address.
        assert svc["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == node["host"]
    assert flag(services["redis"]["command"], "--port") == [str(REDIS_PORT)]
    assert flag(services["router"]["command"], "--port") == [str(ROUTER_PORT)]


def test_ss_listening_lines_parse() -> None:
    text = (
        'LISTEN 0      4096   10.213.0.11:8100  0.0.0.0:*  users:(("python",pid=5,fd=3))\n'
        "LISTEN 0      128    [::]:22   [::]:*\n"
        'LISTEN 0      511    [fe80::1%eth0]:6379 [::]:* users:(("redis-server",pid=7,fd=6))\n')
    got = [(x.address, x.port, x.process) for x in parse_ss_listening(text)]
    assert got == [("10.213.0.11", 8100, "python"), ("::", 22, ""),
                   ("fe80::1", 6379, "redis-server")]


def test_topology_names_fit_linux_limits() -> None:
    t = Topology("9999")
    for host in ("p", "d", "ra", "rb", "redis", "client"):
        assert all(len(name) <= 15 for name in t.veth(host))
    assert len(set(t.namespaces)) == 7 and all(n.startswith("kvmh-9999-") for n in t.namespaces)
    assert len({t.addr(h) for h in ("p", "d", "ra", "rb", "redis", "client")}) == 6


def test_the_tier_plan_renders_one_tier_for_every_host(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """What lets one host read what another wrote: the tier's config, its directory's
    namespace inputs (hash algorithm, seed) and the environment are the same in every
    host's render; only the bind address differs (the rehearsal's tier phase runs these)."""
    disk = "/shared/kv-tier"
    plans = render_hosts(TOPO, tmp_path_factory.mktemp("render-tiers"), kv_tiers={
        "cpu": {"size_gib": 0.0625}, "disk": {"path": disk, "shared": True},
        "hash_seed": 11}, tag="-tiers")
    for i in (0, 1):
        p, d = plans["p"]["nodes"][i], plans["d"]["nodes"][i]
        assert [k for k, _, _ in node_argv_differences(p["argv"], d["argv"])] == ["--host"]
        assert {k: v for k, v in p["env"].items() if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"} \
            == {k: v for k, v in d["env"].items() if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"}
        assert p["env"]["PYTHONHASHSEED"] == "11"
        assert disk in flag(p["argv"], "--kv-transfer-config")[0]
