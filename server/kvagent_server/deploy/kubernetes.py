"""Kubernetes manifests for the bundle: P and D StatefulSets (topology single: one decode
StatefulSet of one pod; replicas: one decode StatefulSet of decode.count pods), router
Deployment, Redis.

Nodes are StatefulSets behind headless Services, so every node has a stable DNS name the
router can list (`<release>-prefill-0.<release>-prefill.<ns>.svc.cluster.local`); NIXL's
side channel binds to the pod IP (downward API) and peers learn it from the transfer
parameters. Pure: `render_kubernetes(config, options)` returns one multi-document YAML.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

from kvagent_server.bundle.render import ROUTER_SETTINGS_FILE
from kvagent_server.config import BundleConfig
from kvagent_server.deploy.options import DeployOptions
from kvagent_server.deploy.plan import (
    SETTINGS_DIR,
    DeployPlan,
    PerRole,
    RoleSpec,
    deploy_plan,
)

_PART_OF = "kvagent"


def render_kubernetes(config: BundleConfig, options: DeployOptions | None = None, *,
                      plugin: tuple[PerRole, dict[str, tuple[str, ...]]] | None = None
                      ) -> str:
    """All manifests as one YAML stream (`kubectl apply -f -`)."""
    dp = deploy_plan(config, options or DeployOptions(), target="kubernetes", plugin=plugin)
    return dump_manifests(kubernetes_objects(dp), topology=dp.topology.line())


def dump_manifests(objects: list[dict[str, Any]], *, topology: str | None = None) -> str:
    head = "# Rendered by `kvagent-server deploy --target kubernetes`; edit the config, not this.\n"
    if topology:
        head += f"# {topology}\n"
    return head + str(yaml.safe_dump_all(objects, sort_keys=False, width=100))


def kubernetes_objects(dp: DeployPlan) -> list[dict[str, Any]]:
    o = dp.options
    objs: list[dict[str, Any]] = []
    if o.create_namespace:
        objs.append({"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": o.namespace, "labels": _labels(o, "namespace")}})
    for spec in dp.roles.values():
        objs += [_headless_service(dp, spec), _statefulset(dp, spec)]
    if dp.router_argv is not None:
        objs += [_settings_secret(dp), _router_deployment(dp), _router_service(dp)]
    if dp.redis == "bundled":
        objs += _redis(dp)
    return objs


# ------------------------------------------------------------------------ helpers


def _name(o: DeployOptions, component: str) -> str:
    return f"{o.release}-{component}"


def _labels(o: DeployOptions, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": _PART_OF, "app.kubernetes.io/instance": o.release,
            "app.kubernetes.io/component": component}


def _meta(o: DeployOptions, component: str, name: str | None = None) -> dict[str, Any]:
    return {"name": name or _name(o, component), "namespace": o.namespace,
            "labels": _labels(o, component)}


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def _probe(path: str, port: str, *, period: int, failures: int, delay: int = 0
           ) -> dict[str, Any]:
    probe: dict[str, Any] = {"httpGet": {"path": path, "port": port},
                             "periodSeconds": period, "failureThreshold": failures,
                             "timeoutSeconds": 5}
    if delay:
        probe["initialDelaySeconds"] = delay
    return probe


# -------------------------------------------------------------------------- nodes


def _headless_service(dp: DeployPlan, spec: RoleSpec) -> dict[str, Any]:
    o = dp.options
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(o, spec.role),
        "spec": {
            "clusterIP": "None",
            # The router health-checks nodes itself; DNS must exist while a node loads.
            "publishNotReadyAddresses": True,
            "selector": _labels(o, spec.role),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"},
                      {"name": "nixl", "port": spec.side_channel_port,
                       "targetPort": "nixl"}],
        },
    }


def _statefulset(dp: DeployPlan, spec: RoleSpec) -> dict[str, Any]:
    o, cfg = dp.options, dp.config
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # NIXL binds its side channel to this address, so it must be the pod's own.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    env += [{"name": k, "value": v} for k, v in spec.env.items()]
    if o.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": o.hf_token_secret, "key": "HF_TOKEN"}}})

    requests: dict[str, Any] = {"cpu": o.cpu_request, "memory": o.memory_request}
    limits: dict[str, Any] = {}
    if dp.device == "cuda" and o.gpus_per_node:
        limits["nvidia.com/gpu"] = o.gpus_per_node
    fabric = o.rdma_resource_name()
    if fabric and o.rdma != "none":
        requests[fabric] = o.rdma_count
        limits[fabric] = o.rdma_count
    resources: dict[str, Any] = {"requests": requests}
    if limits:
        resources["limits"] = limits

    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": o.shm_size}}]
    if o.model_volume_claim:
        mounts.append({"name": "model", "mountPath": o.model_mount_path, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": o.model_volume_claim, "readOnly": True}})
    tiers = cfg.kv_tiers
    if tiers.disk is not None and spec.role in tiers.roles:
        mounts.append({"name": "kv-tier", "mountPath": str(tiers.disk.path)})
        volumes.append({"name": "kv-tier", "persistentVolumeClaim": {
            "claimName": o.tier_volume_claim}} if tiers.disk.shared
            else {"name": "kv-tier", "emptyDir": {}})

    container: dict[str, Any] = {
        "name": "vllm", "image": o.image, "imagePullPolicy": o.image_pull_policy,
        "command": list(spec.argv[:3]), "args": list(spec.argv[3:]),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port},
                  {"name": "nixl", "containerPort": spec.side_channel_port}],
        "resources": resources,
        # Model loading can take long: the startup probe allows startup_timeout_s.
        "startupProbe": _probe("/health", "http", period=10,
                               failures=max(1, math.ceil(cfg.startup_timeout_s / 10))),
        "readinessProbe": _probe("/health", "http", period=5, failures=3),
        "livenessProbe": _probe("/health", "http", period=15, failures=4),
        "volumeMounts": mounts,
    }
    if o.rdma != "none":
        # RDMA memory registration pins pages.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": math.ceil(cfg.stop_grace_s),
        "containers": [container], "volumes": volumes,
    }
    if o.node_selector:
        pod["nodeSelector"] = dict(o.node_selector)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(o, spec.role),
        "spec": {
            "serviceName": _name(o, spec.role), "replicas": spec.count,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(o, spec.role)},
            "template": {
                "metadata": {"labels": _labels(o, spec.role),
                             "annotations": _scrape(spec.port)},
                "spec": pod,
            },
        },
    }


# ------------------------------------------------------------------------- router


def _settings_secret(dp: DeployPlan) -> dict[str, Any]:
    o = dp.options
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": _meta(o, "router-settings"),
        "type": "Opaque",
        # Holds the token signing keys: a Secret, not a ConfigMap.
        "stringData": {ROUTER_SETTINGS_FILE: json.dumps(dp.router_settings, indent=2,
                                                        sort_keys=True)},
    }


def _router_port(dp: DeployPlan) -> int:
    return int(dp.router_settings.get("port", dp.config.router.port))


def _router_deployment(dp: DeployPlan) -> dict[str, Any]:
    o = dp.options
    assert dp.router_argv is not None
    argv = list(dp.router_argv)
    port = _router_port(dp)
    labels = _labels(o, "router")
    container = {
        "name": "router", "image": o.router_image or o.image,
        "imagePullPolicy": o.image_pull_policy,
        "command": argv[:3], "args": argv[3:],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": _probe("/ready", "http", period=5, failures=3),
        "livenessProbe": _probe("/health", "http", period=10, failures=3, delay=5),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": [{"name": "settings", "mountPath": SETTINGS_DIR, "readOnly": True}],
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "settings", "secret": {"secretName": _name(o, "router-settings")}}],
        # Spread replicas over machines so one machine loss keeps the endpoint up.
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "labelSelector": {"matchLabels": labels},
                "topologyKey": "kubernetes.io/hostname"}}]}},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(o, "router"),
        "spec": {
            "replicas": o.router_replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels, "annotations": _scrape(port)},
                         "spec": pod},
        },
    }


def _router_service(dp: DeployPlan) -> dict[str, Any]:
    o = dp.options
    port = _router_port(dp)
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(o, "router"),
        "spec": {"type": o.router_service_type, "selector": _labels(o, "router"),
                 "sessionAffinity": o.router_session_affinity,
                 "ports": [{"name": "http", "port": port, "targetPort": "http"}]},
    }


# -------------------------------------------------------------------------- redis


def _redis(dp: DeployPlan) -> list[dict[str, Any]]:
    o = dp.options
    labels = _labels(o, "redis")
    probe = {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5,
             "failureThreshold": 3, "timeoutSeconds": 3}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(o, "redis"),
        "spec": {
            "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                "name": "redis", "image": o.redis_image,
                "imagePullPolicy": o.image_pull_policy,
                # Session state is short-lived (the decode TTL): no persistence needed.
                "args": ["--save", "", "--appendonly", "no"],
                "ports": [{"name": "redis", "containerPort": 6379}],
                "readinessProbe": probe, "livenessProbe": probe,
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
            }]}},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(o, "redis"),
        "spec": {"selector": labels,
                 "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]},
    }
    return [deployment, service]
