"""A docker compose file for one GPU host: every node and the router as a service.

Host networking: the nodes keep the addresses and ports of the plan (`kvagent-server
render` prints the same commands), NIXL's side channel binds to them, and UCX can use
shared memory and CUDA IPC between containers (`ipc: host`). Pure:
`render_compose(config, options)` returns the YAML.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from kvagent_server.bundle.render import ROUTER_SETTINGS_FILE, ProcessSpec
from kvagent_server.config import BundleConfig
from kvagent_server.deploy.options import DeployOptions
from kvagent_server.deploy.plan import SETTINGS_DIR, DeployPlan, PerRole, deploy_plan

_SETTINGS = "router-settings"


def render_compose(config: BundleConfig, options: DeployOptions | None = None, *,
                   plugin: tuple[PerRole, dict[str, tuple[str, ...]]] | None = None) -> str:
    """The compose file (`docker compose -f - up`)."""
    dp = deploy_plan(config, options or DeployOptions(), target="compose", plugin=plugin)
    head = ("# Rendered by `kvagent-server deploy --target compose`; edit the config, not this.\n"
            f"# {dp.topology.line()}\n")
    return head + str(yaml.safe_dump(_escape(compose_document(dp)), sort_keys=False, width=100))


def _escape(value: Any) -> Any:
    """Compose interpolates `$`: escape every literal one, keep our `${VAR}` references."""
    if isinstance(value, str):
        if value in _INTERPOLATED:
            return value
        out = value.replace("$", "$$")
        for ref in _REFS:
            out = out.replace(ref.replace("$", "$$"), ref)
        return out
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


#: The only interpolations the file relies on (set in the shell that runs compose).
_REFS = ("${HOME}", "${HF_TOKEN}")
_INTERPOLATED = {"${HF_TOKEN}"}


def compose_document(dp: DeployPlan) -> dict[str, Any]:
    o = dp.options
    services: dict[str, Any] = {}
    for spec in dp.roles.values():
        for node in spec.nodes:
            services[node.name] = _node_service(dp, node, spec.env)
    doc: dict[str, Any] = {"name": o.release, "services": services}
    if dp.redis == "bundled":
        services["redis"] = {
            "image": o.redis_image, "network_mode": "host", "restart": "unless-stopped",
            "command": ["redis-server", "--bind", "127.0.0.1", "--port", "6379",
                        "--save", "", "--appendonly", "no"],
            "healthcheck": {"test": ["CMD", "redis-cli", "ping"], "interval": "5s",
                            "retries": 5},
        }
    if dp.bundle.router is not None:
        router = dp.bundle.router
        depends = {name: {"condition": "service_healthy"} for name in services}
        services["router"] = {
            "image": o.router_image or o.image, "network_mode": "host",
            "restart": "unless-stopped",
            "command": list(router.argv),
            "configs": [{"source": _SETTINGS,
                         "target": f"{SETTINGS_DIR}/{ROUTER_SETTINGS_FILE}"}],
            "depends_on": depends,
            "healthcheck": _health(router.health_url.removesuffix("/health") + "/ready"),
        }
        # Holds the token signing keys: keep the rendered file private (0600).
        doc["configs"] = {_SETTINGS: {"content": json.dumps(
            dp.router_settings, indent=2, sort_keys=True) + "\n"}}
    return doc


def _node_service(dp: DeployPlan, node: ProcessSpec, role_env: dict[str, str]
                  ) -> dict[str, Any]:
    o, cfg = dp.options, dp.config
    env = dict(node.env)
    env.update({k: v for k, v in role_env.items() if k in ("UCX_TLS", "FI_PROVIDER")})
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the device reservation exposes one GPU as 0
    svc: dict[str, Any] = {
        "image": o.image, "network_mode": "host", "ipc": "host",
        "restart": "unless-stopped", "command": list(node.argv), "environment": env,
        "healthcheck": _health(node.health_url, start=int(cfg.startup_timeout_s)),
        "stop_grace_period": f"{int(cfg.stop_grace_s)}s",
    }
    if node.cuda_device is not None:
        svc["deploy"] = {"resources": {"reservations": {"devices": [{
            "driver": "nvidia", "device_ids": [node.cuda_device],
            "capabilities": ["gpu"]}]}}}
    volumes: list[str] = []
    model = cfg.model or ""
    if model.startswith("/"):
        volumes.append(f"{model}:{model}:ro")
    else:
        volumes.append("${HOME}/.cache/huggingface:/root/.cache/huggingface")
    tiers = cfg.kv_tiers
    if tiers.disk is not None and node.role in tiers.roles:
        volumes.append(f"{tiers.disk.path}:{tiers.disk.path}")
    svc["volumes"] = volumes
    if o.hf_token_secret:
        env["HF_TOKEN"] = "${HF_TOKEN}"
    return svc


def _health(url: str, *, start: int = 0) -> dict[str, Any]:
    """A health check that needs only Python (vLLM images have no curl)."""
    check: dict[str, Any] = {
        "test": ["CMD", "python3", "-c",
                 f"import urllib.request; urllib.request.urlopen({url!r}, timeout=4)"],
        "interval": "10s", "timeout": "5s", "retries": 3,
    }
    if start:
        check["start_period"] = f"{start}s"
    return check

