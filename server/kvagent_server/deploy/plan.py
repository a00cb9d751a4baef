"""The bundle's processes as container specs: one shared core for every deploy target.

The commands come from `bundle.render.plan`, the same function `kvagent-server up` runs, fed a
config rewritten for containers (bind 0.0.0.0, no core pinning, settings under
/etc/kvagent); only what differs per pod is replaced afterwards: the NIXL engine id
becomes the pod name and the side-channel host the pod IP (NIXL binds to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvagent_server.bundle.render import (
    BundlePlan,
    ModelSource,
    PlanInputs,
    ProcessSpec,
    plan,
    with_engine_id,
)
from kvagent_server.bundle.topology import HostFacts, TopologyChoice, resolve_topology
from kvagent_server.common.types import ROLES, Device, Role
from kvagent_server.config import BundleConfig, ConfigError
from kvagent_server.deploy.options import UCX_TLS, DeployOptions

Target = Literal["kubernetes", "compose"]
SETTINGS_DIR = "/etc/kvagent"
CONTAINER_PYTHON = "python3"
#: Placeholders the Kubernetes renderer fills from the downward API ($(VAR) expansion).
POD_NAME = "$(POD_NAME)"
POD_IP = "$(POD_IP)"
PerRole = dict[str, dict[str, str]]


@dataclass(frozen=True)
class RoleSpec:
    """One role's container: argv and env shared by all its pods (Kubernetes) or per node."""

    role: Role
    count: int
    nodes: tuple[ProcessSpec, ...]  # as planned (compose uses them as they are)
    argv: tuple[str, ...]  # pod template argv (Kubernetes: engine id = $(POD_NAME))
    env: dict[str, str]  # pod template env, without the side-channel host
    port: int
    side_channel_port: int
    hosts: tuple[str, ...]  # advertised host per node (k8s: stable pod DNS names)


@dataclass(frozen=True)
class DeployPlan:
    config: BundleConfig
    options: DeployOptions
    device: Device
    topology: TopologyChoice
    bundle: BundlePlan
    roles: dict[str, RoleSpec]
    router_argv: tuple[str, ...] | None
    router_settings: dict[str, Any]
    redis: Literal["bundled", "external", "none"]


def deploy_plan(cfg: BundleConfig, options: DeployOptions, *, target: Target,
                plugin: tuple[PerRole, dict[str, tuple[str, ...]]] | None = None
                ) -> DeployPlan:
    """Container specs for `cfg` on `target`; raises `ConfigError` for what cannot deploy."""
    problems: list[str] = []
    if cfg.model is None:
        problems.append("model: required for deploy (the demo model is built on the local "
                        "machine; give a model name or a path inside the image/volume)")
    device: Device = "cpu" if cfg.device == "cpu" else "cuda"
    redis = _redis_mode(cfg, options, target, problems)
    tiers = cfg.kv_tiers
    if (target == "kubernetes" and tiers.disk is not None
            and tiers.disk.shared and options.tier_volume_claim is None):
        problems.append("kv_tiers.disk.shared: needs options tier_volume_claim (a "
                        "ReadWriteMany PersistentVolumeClaim mounted on every node)")
    if problems:
        raise ConfigError(problems)
    assert cfg.model is not None

    role_env, role_args = plugin if plugin is not None else _plugin_needs()
    kv_extra = dict(cfg.kv_connector_extra)
    if options.rdma == "efa":
        kv_extra.setdefault("backends", ["LIBFABRIC"])
    settings_router = cfg.router
    if redis == "bundled":
        settings_router = cfg.router.model_copy(
            update={"redis_url": f"redis://{options.release}-redis:6379/0"})
    if target == "kubernetes":
        settings_router = settings_router.model_copy(update={"host": "0.0.0.0"})
    update: dict[str, Any] = {
        "device": device, "cpu_pinning": False, "run_dir": Path(SETTINGS_DIR),
        "python": CONTAINER_PYTHON, "engine_command": None, "router_command": None,
        "kv_connector_extra": kv_extra, "router": settings_router,
    }
    if target == "compose":
        # Containers share no directory for KV event ipc sockets, and tcp would publish
        # on every host interface: no tier-aware placement here (docs/tiers.md, Limits).
        update["kv_events"] = cfg.kv_events.model_copy(update={"enabled": False})
    if target == "kubernetes":
        update["bind_host"] = "0.0.0.0"
        for role in ROLES:
            rc = cfg.role(role)
            update[role] = rc.model_copy(update={
                "hosts": [pod_dns(options, role, i) for i in range(rc.count)],
                "cuda_devices": None, "cpu_binds": None,
                # Every pod has its own IP: one port per role suffices.
                "ports": [cfg.node_ports(role)[0]] * rc.count,
                "side_channel_ports": [cfg.side_channel_ports(role)[0]] * rc.count,
            })
    n_nodes = sum(cfg.role(r).count for r in ROLES)
    host = HostFacts(cpu_cores=tuple(range(max(n_nodes, 1))),
                     gpu_count=n_nodes * max(options.gpus_per_node, 1)
                     if target == "kubernetes" else options.gpus)
    choice = _topology(cfg.model_copy(update={"device": device}), host, target)
    update["topology"] = choice.topology  # plan() then renders exactly this one
    dcfg = cfg.model_copy(update=update)
    inputs = PlanInputs(
        host=host,
        model=ModelSource(model=cfg.model, served_name=cfg.served_model_name or cfg.model),
        python=CONTAINER_PYTHON, role_env=role_env, role_args=role_args,
    )
    # model_copy skips validation on purpose: pods repeat ports (each has its own IP).
    bundle = plan(dcfg, inputs)

    roles: dict[str, RoleSpec] = {}
    for role in dcfg.roles_of(choice.topology):
        nodes = tuple(n for n in bundle.nodes if n.role == role)
        first = nodes[0]
        env = {k: v for k, v in first.env.items()
               if k not in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "CUDA_VISIBLE_DEVICES",
                            "VLLM_CPU_OMP_THREADS_BIND")}
        if device == "cuda" or options.rdma != "none":
            env["UCX_TLS"] = UCX_TLS[options.rdma]
        if options.rdma == "efa":
            env["FI_PROVIDER"] = "efa"
        argv = (tuple(with_engine_id(first.argv, POD_NAME)) if target == "kubernetes"
                else first.argv)
        roles[role] = RoleSpec(
            role=role, count=len(nodes), nodes=nodes, argv=argv, env=env, port=first.port,
            side_channel_port=first.side_channel_port or 0,
            hosts=tuple(n.host for n in nodes))
    return DeployPlan(
        config=cfg, options=options, device=device, topology=choice, bundle=bundle,
        roles=roles,
        router_argv=bundle.router.argv if bundle.router else None,
        router_settings=bundle.router_settings, redis=redis)


def _topology(cfg: BundleConfig, host: HostFacts, target: Target) -> TopologyChoice:
    """The host rule on compose (one machine, `options.gpus`); on Kubernetes every node
    runs in a pod of its own, so P/D splits no device and `auto` keeps it."""
    if target == "kubernetes" and cfg.topology == "auto":
        return TopologyChoice("pd", "auto: every node runs in a pod of its own")
    return resolve_topology(cfg, host)


def pod_dns(options: DeployOptions, role: str, index: int) -> str:
    """The stable DNS name of a StatefulSet pod behind its headless Service."""
    sts = f"{options.release}-{role}"
    return f"{sts}-{index}.{sts}.{options.namespace}.svc.cluster.local"


def _redis_mode(cfg: BundleConfig, options: DeployOptions, target: Target,
                problems: list[str]) -> Literal["bundled", "external", "none"]:
    replicas = options.router_replicas if target == "kubernetes" else 1
    mode = options.redis
    if mode == "auto":
        if cfg.router.redis_url:
            return "external"
        return "bundled" if replicas > 1 else "none"
    if mode == "external" and not cfg.router.redis_url:
        problems.append("router.redis_url: required with redis: external")
    if mode == "none" and replicas > 1 and not cfg.router.redis_url:
        problems.append(f"router_replicas: {replicas} replicas without Redis would each "
                        "keep their own sessions (a cache token issued by one is unknown "
                        "to the others); use redis: auto/bundled/external or 1 replica")
    if mode == "bundled" and cfg.router.redis_url:
        problems.append("router.redis_url: set while redis: bundled; use redis: external")
    return mode


def _plugin_needs() -> tuple[PerRole, dict[str, tuple[str, ...]]]:
    from kvagent_server.bundle.inputs import plugin_needs

    return plugin_needs()
