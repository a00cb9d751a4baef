"""render_kubernetes: structure, Kubernetes schemas, and the commands vLLM and the router get."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from deploy_helpers import NO_PLUGIN, config
from kvagent_server.config import ConfigError
from kvagent_server.deploy import DeployOptions, render_kubernetes
from kvagent_server.router.__main__ import parse_args

K8S_VERSION = "1.30.0"


def objects(cfg: Any, **opts: Any) -> list[dict[str, Any]]:
    text = render_kubernetes(cfg, DeployOptions(**opts), plugin=NO_PLUGIN)
    return [d for d in yaml.safe_load_all(text) if d is not None]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind} {name}: {[(o['kind'], o['metadata']['name']) for o in objs]}")


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_objects_and_counts(cfg: Any) -> None:
    objs = objects(cfg, router_replicas=3)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert kinds == [
        ("Namespace", "kvagent"),
        ("Service", "kvagent-prefill"), ("StatefulSet", "kvagent-prefill"),
        ("Service", "kvagent-decode"), ("StatefulSet", "kvagent-decode"),
        ("Secret", "kvagent-router-settings"), ("Deployment", "kvagent-router"),
        ("Service", "kvagent-router"),
        ("Deployment", "kvagent-redis"), ("Service", "kvagent-redis"),
    ]
    assert find(objs, "StatefulSet", "kvagent-prefill")["spec"]["replicas"] == 2
    assert find(objs, "StatefulSet", "kvagent-decode")["spec"]["replicas"] == 3
    assert find(objs, "Deployment", "kvagent-router")["spec"]["replicas"] == 3
    assert all(o["metadata"].get("namespace", "kvagent") == "kvagent" for o in objs)


def test_every_object_validates_against_kubernetes_schemas(cfg: Any) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for opts in ({}, {"rdma": "efa"}, {"rdma": "ib", "rdma_resource": "rdma/rdma_shared_a",
                                       "model_volume_claim": "models",
                                       "router_service_type": "LoadBalancer",
                                       "hf_token_secret": "hf", "node_selector": {"gpu": "h200"}}):
        for obj in objects(cfg, **opts):
            kv.validate(obj, K8S_VERSION, strict=True)


def test_schema_validation_can_fail(cfg: Any) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    sts = find(objects(cfg), "StatefulSet", "kvagent-prefill")
    container(sts)["readinessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSION, strict=True)


def test_node_pods(cfg: Any) -> None:
    objs = objects(cfg)
    svc = find(objs, "Service", "kvagent-decode")
    assert svc["spec"]["clusterIP"] == "None"
    sts = find(objs, "StatefulSet", "kvagent-decode")
    assert sts["spec"]["serviceName"] == "kvagent-decode"
    pod = sts["spec"]["template"]
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8200",
        "prometheus.io/path": "/metrics"}
    c = container(sts)
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 900
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
    env = env_of(c)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin assigns the GPU
    args = c["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["engine_id"] == "$(POD_NAME)" and kv["kv_role"] == "kv_consumer"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_router_and_redis(cfg: Any) -> None:
    objs = objects(cfg, router_replicas=2, router_session_affinity="ClientIP")
    dep = find(objs, "Deployment", "kvagent-router")
    c = container(dep)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    args = parse_args(c["args"])  # the router's own parser
    assert args.prefill == [
        f"http://kvagent-prefill-{i}.kvagent-prefill.kvagent.svc.cluster.local:8100"
        for i in range(2)]
    assert args.decode == [
        f"http://kvagent-decode-{i}.kvagent-decode.kvagent.svc.cluster.local:8200"
        for i in range(3)]
    assert args.host == "0.0.0.0" and str(args.settings) == "/etc/kvagent/router-settings.json"
    secret = find(objs, "Secret", "kvagent-router-settings")
    settings = json.loads(secret["stringData"]["router-settings.json"])
    assert settings["redis_url"] == "redis://kvagent-redis:6379/0"
    assert settings["nodes"]["block_size"] == 16
    svc = find(objs, "Service", "kvagent-router")
    assert svc["spec"]["sessionAffinity"] == "ClientIP"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8000"


def test_external_redis_and_single_replica() -> None:
    cfg = config(router={"redis_url": "redis://cache.example:6379/1"})
    names = [o["metadata"]["name"] for o in objects(cfg)]
    assert "kvagent-redis" not in names
    assert "kvagent-redis" not in [o["metadata"]["name"] for o in objects(
        config(), router_replicas=1)]


def test_efa(cfg: Any) -> None:
    sts = find(objects(cfg, rdma="efa", rdma_count=4), "StatefulSet", "kvagent-prefill")
    c = container(sts)
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 4
    assert c["resources"]["requests"]["vpc.amazonaws.com/efa"] == 4
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    env = env_of(c)
    assert env["FI_PROVIDER"] == "efa"
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]


def test_infiniband(cfg: Any) -> None:
    c = container(find(objects(cfg, rdma="ib", rdma_resource="rdma/hca"), "StatefulSet",
                       "kvagent-decode"))
    assert env_of(c)["UCX_TLS"].startswith("rc,")
    assert c["resources"]["limits"]["rdma/hca"] == 1
    plain = container(find(objects(cfg), "StatefulSet", "kvagent-decode"))
    assert "rc" not in env_of(plain)["UCX_TLS"].split(",")
    assert "securityContext" not in plain


@pytest.mark.parametrize(("over", "opts", "msg"), [
    ({"model": None}, {}, "model: required for deploy"),
    ({}, {"redis": "none", "router_replicas": 2}, "replicas without Redis"),
    ({}, {"redis": "external"}, "router.redis_url: required"),
])
def test_what_cannot_deploy(over: dict[str, Any], opts: dict[str, Any], msg: str) -> None:
    with pytest.raises(ConfigError) as info:
        render_kubernetes(config(**over), DeployOptions(**opts), plugin=NO_PLUGIN)
    assert msg in str(info.value)


def test_cpu_device_deploys_without_gpus() -> None:
    sts = find(objects(config(device="cpu")), "StatefulSet", "kvagent-prefill")
    c = container(sts)
    assert "limits" not in c["resources"]
    env = env_of(c)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" not in env
