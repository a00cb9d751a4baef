"""What a cluster or container deployment needs beyond the bundle config.

The bundle config says what the nodes are (roles, counts, ports, KV settings, tiers);
these options say where they run (images, namespace, GPUs, RDMA, volumes, replicas).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvagent_server.config import ConfigError

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$"

#: UCX transports per fabric: TCP and shared memory always; RDMA verbs (rc) over
#: InfiniBand/RoCE; EFA is reached through libfabric, so UCX keeps TCP and NIXL's
#: LIBFABRIC backend is chosen for it.
UCX_TLS = {
    "none": "tcp,self,sm,cuda_copy,cuda_ipc",
    "ib": "rc,ud,self,sm,cuda_copy,cuda_ipc",
    "efa": "tcp,self,sm,cuda_copy,cuda_ipc",
}


class DeployOptions(BaseModel):
    """Where and how the bundle's processes run in containers."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(
        default="kvagent-server:latest",
        description="Image with vLLM, NIXL and kvagent installed (docs/deployment.md has a "
        "Dockerfile); runs the nodes and, unless router_image is set, the router.")
    router_image: str | None = Field(default=None, description="Image for the router.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    release: str = Field(default="kvagent", pattern=_DNS_LABEL,
                         description="Prefix of every object name.")
    namespace: str = Field(default="kvagent", pattern=_DNS_LABEL)
    create_namespace: bool = Field(default=True, description="Emit the Namespace object.")
    router_replicas: int = Field(default=2, ge=1, le=256)
    router_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    router_session_affinity: Literal["None", "ClientIP"] = Field(
        default="None",
        description="Service-level affinity. Not needed for correctness when the "
        "replicas share Redis; ClientIP keeps a client on one replica.")
    redis: Literal["auto", "bundled", "external", "none"] = Field(
        default="auto",
        description="Session state for router replicas: `auto` bundles a Redis when "
        "router_replicas > 1 and router.redis_url is unset; `external` uses "
        "router.redis_url; `none` keeps state per replica (one replica only).")
    redis_image: str = "redis:7-alpine"
    gpus_per_node: int = Field(default=1, ge=0, le=16,
                               description="`nvidia.com/gpu` per vLLM pod (cuda only).")
    cpu_request: str = Field(default="8", description="CPU request per vLLM pod.")
    memory_request: str = Field(default="64Gi", description="Memory request per vLLM pod.")
    shm_size: str = Field(default="16Gi",
                          description="Size of the /dev/shm memory volume per vLLM pod.")
    rdma: Literal["none", "ib", "efa"] = Field(
        default="none",
        description="Fabric for NIXL: `ib` (InfiniBand/RoCE verbs), `efa` (AWS EFA), or "
        "`none` (TCP).")
    rdma_resource: str | None = Field(
        default=None,
        description="Extended resource to request for the fabric, e.g. "
        "`rdma/rdma_shared_device_a` (k8s-rdma-shared-dev-plugin) or "
        "`vpc.amazonaws.com/efa`; default: the EFA resource for efa, none for ib.")
    rdma_count: int = Field(default=1, ge=1, le=32, description="How many of it per pod.")
    model_volume_claim: str | None = Field(
        default=None,
        description="PersistentVolumeClaim holding the model, mounted read-only at "
        "model_mount_path (then config.model is a path below it).")
    model_mount_path: str = "/models"
    tier_volume_claim: str | None = Field(
        default=None,
        description="ReadWriteMany claim mounted at kv_tiers.disk.path when the disk tier "
        "is shared; required then. A private disk tier gets an emptyDir.")
    hf_token_secret: str | None = Field(
        default=None, description="Secret with key HF_TOKEN, passed to the nodes.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    gpus: int = Field(default=1, ge=0, le=16,
                      description="Compose: GPUs on the host (one per node unless the "
                      "config's cuda_devices say otherwise).")

    def rdma_resource_name(self) -> str | None:
        if self.rdma_resource:
            return self.rdma_resource
        return "vpc.amazonaws.com/efa" if self.rdma == "efa" else None


def load_options(path: Path | None = None, overrides: dict[str, Any] | None = None
                 ) -> DeployOptions:
    """Options from a YAML file (optional) with flag overrides; `ConfigError` when invalid."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError([f"{path}: cannot read deploy options ({exc})"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of keys"])
        data = dict(loaded or {})
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return DeployOptions.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "<options>"
            msg = "unknown option" if e["type"] == "extra_forbidden" else e["msg"]
            problems.append(f"deploy options: {where}: {msg}")
        raise ConfigError(problems) from None
