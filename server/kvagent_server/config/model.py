"""The bundle configuration model: one validated `BundleConfig`.

Everything `kvagent-server` does is a function of a `BundleConfig` plus a few facts about
the host (cores, GPUs, see `bundle.render.HostFacts`). Checks that need only the config live here;
checks that need the host (no GPU, too few cores) live in `bundle.render.plan`. Both raise
`ConfigError`, whose `problems` are one line each, prefixed with the YAML path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvagent_server.common.types import ROLES, Role, Topology
from kvagent_server.engine.tiers import KVTiers
from kvagent_server.router.settings import RouterSettings

DEFAULT_RUN_ROOT = Path("~/.cache/kvagent/run")
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ConfigError(Exception):
    """A bad configuration: `problems` holds one human-readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class RoleConfig(BaseModel):
    """The nodes of one role (prefill or decode)."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=1, ge=1, le=64, description="Number of nodes of this role.")
    port_base: int = Field(
        default=8100, ge=1, le=65535,
        description="HTTP port of node 0; node i listens on port_base + i.",
    )
    ports: list[int] | None = Field(
        default=None, description="Explicit HTTP port per node (overrides port_base).",
    )
    side_channel_port_base: int = Field(
        default=5600, ge=1, le=65535,
        description="NIXL side-channel port of node 0 (VLLM_NIXL_SIDE_CHANNEL_PORT); node i "
        "uses side_channel_port_base + i.",
    )
    side_channel_ports: list[int] | None = Field(
        default=None, description="Explicit NIXL side-channel port per node.",
    )
    hosts: list[str] | None = Field(
        default=None,
        description="Advertised host per node, for nodes run on other machines from "
        "`render` output (default: advertise_host). Must be an address of that machine: "
        "NIXL's side channel binds to it.",
    )
    prefix_caching: bool = Field(
        default=True, description="vLLM automatic prefix caching on this role's nodes.",
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="vLLM --max-num-batched-tokens: the tokens one engine step computes "
        "across its requests (chunked prefill splits a longer prompt into steps). null: "
        "512 on decode nodes on CPU (with `long_prefill_token_threshold` 128: short steps "
        "only while D has other requests); vLLM's default otherwise. vLLM wants it at "
        "least --max-num-seqs (128 on CPU; lower that in extra_args).",
    )
    long_prefill_token_threshold: int | None = Field(
        default=None, ge=0,
        description="vLLM --long-prefill-token-threshold: while other requests share the "
        "engine, one prompt computes at most this many tokens per step; alone, it may use "
        "the whole step. null: 128 on decode nodes on CPU, so a delta D computes itself "
        "(`d_direct`) runs in short steps while D streams answers, and in few steps when D "
        "is idle; vLLM's default (0, off) otherwise.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra vLLM arguments appended to every node.",
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for every node.",
    )
    cpu_binds: list[str] | None = Field(
        default=None,
        description="Explicit VLLM_CPU_OMP_THREADS_BIND per node (e.g. `0-3`), overriding "
        "the automatic partition of cpu_cores.",
    )
    cuda_devices: list[str] | None = Field(
        default=None,
        description="Explicit CUDA_VISIBLE_DEVICES per node (GPU only; default: one GPU "
        "per node, prefill first).",
    )


#: Per-role defaults that differ between prefill and decode.
_ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "prefill": {"port_base": 8100, "side_channel_port_base": 5600},
    "decode": {"port_base": 8200, "side_channel_port_base": 5700},
}


#: vLLM binds its KV event PUB socket only for a wildcard (`*`), an address with `::`
#: or ipc; `tcp://<IPv4>:port` makes it connect instead. The bundle uses `tcp://*:port`
#: (wildcard bind_host) or ipc.
KV_EVENTS_BIND_RULE = "vllm/distributed/kv_events.py:ZmqEventPublisher._is_bind_endpoint"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class KVEventsConfig(BaseModel):
    """vLLM KV cache events from the nodes to the router, for tier-aware P placement."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Nodes publish KV cache events (`--kv-events-config`) and the router "
        "subscribes: a fresh prompt goes to the P node that holds its prefix in any tier, "
        "weighed against load (docs/tiers.md). Unused in topologies single and replicas: "
        "no prefill node to place.")
    transport: Literal["auto", "ipc", "tcp"] = Field(
        default="auto",
        description="`ipc`: a socket file in run_dir (nodes and router on one machine). "
        "`tcp`: `tcp://*:port` (all interfaces; needs a wildcard bind_host). "
        "`auto`: tcp when bind_host is a wildcard, else ipc.")
    port_base: int = Field(
        default=5800, ge=1, le=65535,
        description="tcp only: the k-th publishing node on a host (prefill first) uses "
        "port_base + k.")
    topic: str = Field(default="kvagent", max_length=64,
                       description="ZMQ topic of the events (`--kv-events-config` topic).")
    roles: list[Role] = Field(
        default_factory=lambda: list[Role](("prefill", "decode")),
        description="Roles whose nodes publish (placement uses prefill nodes' events). "
        "Nodes without prefix caching never publish.")


class LoraModule(BaseModel):
    """A LoRA adapter both roles serve (`--enable-lora --lora-modules name=path`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=_NAME_RE,
        description="The model name clients send to use the adapter.")
    path: str | None = Field(
        default=None,
        description="Adapter directory (PEFT format); null: the built-in adapter of that "
        "name, built on first use (`kvagent-demo-lora`, for the demo model).")


def _prefill_default() -> RoleConfig:
    return RoleConfig(**_ROLE_DEFAULTS["prefill"])


def _decode_default() -> RoleConfig:
    return RoleConfig(**_ROLE_DEFAULTS["decode"])


#: What `topology: auto` resolves to, and why, is decided with the host's facts:
#: `bundle.topology.resolve_topology` (docs/server.md, "Topology").
TopologySetting = Literal["auto", "pd", "single", "replicas"]


class BundleConfig(BaseModel):
    """The whole server bundle: its vLLM nodes (one, or P and D with NIXL) and the router."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        default="default", pattern=_NAME_RE,
        description="Bundle name: names the run directory and the NIXL engine ids.",
    )
    model: str | None = Field(
        default=None,
        description="Model path or name passed to vLLM, or a built-in model id "
        "(`kvagent-demo`, `kvagent-demo-tekken`, `kvagent-demo-vlm`: built locally on first "
        "use, see docs/models.md); null serves `kvagent-demo`.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model name clients send; default: the demo model's name, else `model`.",
    )
    lora_modules: list[LoraModule] = Field(
        default_factory=list,
        description="LoRA adapters served by every node (P and D must agree: P computes "
        "the KV that D decodes with). Empty: LoRA off.",
    )
    max_lora_rank: int | None = Field(
        default=None, ge=1,
        description="vLLM --max-lora-rank when lora_modules is set; null: vLLM's default.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="`auto` picks cuda when a GPU is visible, else cpu.",
    )
    bind_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address the nodes' HTTP servers bind to.",
    )
    advertise_host: str = Field(
        default="127.0.0.1", min_length=1,
        description="Address others use to reach the nodes (router → node HTTP, node → node "
        "NIXL side channel). NIXL binds its side channel to it, so it must be local.",
    )
    topology: TopologySetting = Field(
        default="auto",
        description="`pd`: prefill and decode nodes with NIXL KV transfer between them. "
        "`single`: one node (the `decode` section, decode.count 1) serves every turn, "
        "keeping a finished turn's KV for the next; the `prefill` section is ignored. "
        "`replicas`: decode.count (at least 2) such nodes, each session served by one and "
        "moved to another when its node is busy, its KV pulled over NIXL from the node that "
        "holds it; the `prefill` section is ignored. `auto` never picks it. "
        "`auto`: `pd` when the config asks for more than one node of a role or places "
        "prefill nodes (prefill.hosts, cuda_devices, cpu_binds), or on cuda with a GPU per "
        "node; otherwise `single` (one GPU, or a CPU machine, where P/D would split one "
        "device's compute). `up` and `render` print the choice and why.",
    )
    prefill: RoleConfig = Field(
        default_factory=_prefill_default,
        description="Prefill nodes (topology pd; ignored in single and replicas).")
    decode: RoleConfig = Field(
        default_factory=_decode_default,
        description="Decode nodes; in topology single, the one node; in replicas, the "
        "symmetric nodes.")
    kv_cache_gib: int = Field(
        default=2, ge=1,
        description="KV cache size per node in GiB (VLLM_CPU_KVCACHE_SPACE on CPU, "
        "--kv-cache-memory-bytes on GPU).",
    )
    max_model_len: int | None = Field(
        default=None, ge=16,
        description="vLLM --max-model-len; null: the model's (demo model: 16384).",
    )
    block_size: int | None = Field(
        default=None, ge=1,
        description="vLLM --block-size (KV block, in tokens); null: vLLM's platform default "
        "(128 on CPU, 16 on GPU), passed explicitly. The router gets the same value: reuse "
        "is block-aligned.",
    )
    decoder_kv_blocks_ttl_s: int = Field(
        default=480, ge=1,
        description="How long D keeps a finished turn's KV blocks for the next turn "
        "(`decoder_kv_blocks_ttl`).",
    )
    kv_recompute_threshold: int = Field(
        default=64, ge=0,
        description="P recomputes instead of pulling when fewer tokens than this are "
        "reusable (`kv_recompute_threshold`).",
    )
    kv_connector_extra: dict[str, Any] = Field(
        default_factory=dict,
        description="More `kv_connector_extra_config` entries, merged over the defaults.",
    )
    cpu_pinning: bool = Field(
        default=True,
        description="On CPU, give every node its own cores (VLLM_CPU_OMP_THREADS_BIND). "
        "Off: vLLM's `auto` binding (nodes then contend).",
    )
    pin_processes: bool = Field(
        default=True,
        description="With cpu_pinning, every thread of a node runs on its cores (its HTTP "
        "server, tokenizer, detokenizer), not only the threads that compute: one node's "
        "request handling then never preempts another node's steps. Off: those threads "
        "float over all cores.",
    )
    cpu_cores: list[int] | None = Field(
        default=None,
        description="Cores to partition between the nodes, prefill first; default: all "
        "cores this process may run on.",
    )
    restart_limit: int = Field(
        default=3, ge=0,
        description="Restarts per process after an unexpected exit before it is given up.",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0, description="How long to wait for each process to be healthy.",
    )
    stop_grace_s: float = Field(
        default=15.0, ge=0, description="SIGTERM → SIGKILL grace period when stopping.",
    )
    run_dir: Path | None = Field(
        default=None,
        description="State JSON and per-process logs; default ~/.cache/kvagent/run/<name>.",
    )
    python: str | None = Field(
        default=None,
        description="Python interpreter for nodes and router; default: the one running "
        "kvagent-server.",
    )
    engine_command: list[str] | None = Field(
        default=None,
        description="Command that starts one vLLM node, before its arguments; default "
        "`<python> -m vllm.entrypoints.openai.api_server` (e.g. add a numactl or container "
        "wrapper).",
    )
    router_command: list[str] | None = Field(
        default=None,
        description="Command that starts the router, before its arguments; default "
        "`<python> -m kvagent_server.router`.",
    )
    router_enabled: bool = Field(
        default=True, description="Start the router in front of the nodes (`--no-router`).",
    )
    router: RouterSettings = Field(
        default_factory=RouterSettings, description="Router settings (see below).",
    )
    kv_tiers: KVTiers = Field(
        default_factory=KVTiers,
        description="KV tiers below GPU memory (CPU, disk, shared filesystem): see "
        "docs/tiers.md. Off by default.",
    )

    kv_events: KVEventsConfig = Field(
        default_factory=KVEventsConfig,
        description="KV cache events for tier-aware prefill placement (see below).",
    )

    @model_validator(mode="before")
    @classmethod
    def _role_defaults(cls, data: Any) -> Any:
        """A partly given role keeps its own role's port defaults, not RoleConfig's."""
        if isinstance(data, dict):
            data = dict(data)
            for role, defaults in _ROLE_DEFAULTS.items():
                given = data.get(role)
                if isinstance(given, dict):
                    data[role] = {**defaults, **given}
        return data

    @model_validator(mode="after")
    def _check(self) -> BundleConfig:
        problems: list[str] = []
        for role in ROLES:
            rc: RoleConfig = getattr(self, role)
            for field in ("ports", "side_channel_ports", "hosts", "cpu_binds", "cuda_devices"):
                values = getattr(rc, field)
                if values is not None and len(values) != rc.count:
                    problems.append(
                        f"{role}.{field}: {len(values)} given for {rc.count} node(s) "
                        f"({role}.count)"
                    )
            for field in ("ports", "side_channel_ports"):
                for i, port in enumerate(getattr(rc, field) or []):
                    if not 1 <= port <= 65535:
                        problems.append(f"{role}.{field}[{i}]: {port} is not a port (1-65535)")
            for attr, base in (("port_base", rc.port_base),
                               ("side_channel_port_base", rc.side_channel_port_base)):
                if base + rc.count - 1 > 65535:
                    problems.append(f"{role}.{attr}: {base} + {rc.count} nodes exceeds 65535")
        if self.topology == "single" and self.decode.count != 1:
            problems.append(
                f"decode.count: topology single runs exactly one node (got "
                f"{self.decode.count}); set decode.count: 1, or topology: pd for several")
        if self.topology == "replicas" and self.decode.count < 2:
            problems.append(
                f"decode.count: topology replicas runs at least two nodes (got "
                f"{self.decode.count}); set decode.count: 2 or more, or topology: single "
                "for one")
        if problems:
            raise ValueError("\n".join(problems))
        problems += _port_clashes(self)
        names = [m.name for m in self.lora_modules]
        served = self.served_model_name or self.model
        for twice in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"lora_modules: {twice!r} listed twice")
        if served is not None and served in names:
            problems.append(f"lora_modules: {served!r} is also the base model's served name")
        ev = self.kv_events
        if ev.enabled and ev.transport == "tcp" and not _binds_tcp(self.bind_host):
            problems.append(
                f"kv_events.transport: tcp needs a wildcard bind_host (got "
                f"{self.bind_host!r}): vLLM binds its event socket only for those and "
                f"connects for any other address ({KV_EVENTS_BIND_RULE}); use ipc (one "
                "machine) or bind_host 0.0.0.0")
        if ev.enabled and len(set(ev.roles)) != len(ev.roles):
            problems.append("kv_events.roles: listed twice")
        if ev.enabled and self.kv_events_transport == "tcp":
            last = max(self.kv_event_ports().values(), default=0)
            if last > 65535:
                problems.append(f"kv_events.port_base: {ev.port_base} + "
                                f"{last - ev.port_base + 1} nodes on one host exceeds 65535")
        margin = self.router.token_safety_margin_s
        if self.decoder_kv_blocks_ttl_s <= margin:
            problems.append(
                f"decoder_kv_blocks_ttl_s: {self.decoder_kv_blocks_ttl_s} s must be above "
                f"router.token_safety_margin_s ({margin} s), or every cache token would be "
                "expired when issued"
            )
        if self.cpu_cores is not None:
            if not self.cpu_cores:
                problems.append("cpu_cores: empty list (omit it to use all cores)")
            dup = sorted({c for c in self.cpu_cores if self.cpu_cores.count(c) > 1})
            if dup:
                problems.append(f"cpu_cores: core(s) {dup} listed twice")
            if any(c < 0 for c in self.cpu_cores):
                problems.append("cpu_cores: core ids are >= 0")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # ----------------------------------------------------------------- derived values

    def roles_of(self, topology: Topology | Literal["auto"]) -> tuple[Role, ...]:
        """The roles whose nodes may run in `topology` (single and replicas: the decode
        role's nodes; `auto`, not yet resolved against a host: both)."""
        return ("decode",) if topology in ("single", "replicas") else ROLES

    def role(self, role: Role) -> RoleConfig:
        return self.prefill if role == "prefill" else self.decode

    def node_ports(self, role: Role) -> list[int]:
        rc = self.role(role)
        return list(rc.ports) if rc.ports is not None else [
            rc.port_base + i for i in range(rc.count)]

    def side_channel_ports(self, role: Role) -> list[int]:
        rc = self.role(role)
        return list(rc.side_channel_ports) if rc.side_channel_ports is not None else [
            rc.side_channel_port_base + i for i in range(rc.count)]

    def node_hosts(self, role: Role) -> list[str]:
        rc = self.role(role)
        return list(rc.hosts) if rc.hosts is not None else [self.advertise_host] * rc.count

    @property
    def kv_events_transport(self) -> Literal["ipc", "tcp"]:
        t = self.kv_events.transport
        return t if t != "auto" else ("tcp" if self.bind_host in _WILDCARD_HOSTS else "ipc")

    def kv_event_nodes(self) -> list[tuple[Role, int]]:
        """The nodes that publish KV events, in port order (prefill first)."""
        ev = self.kv_events
        # Events inform P placement: single and replicas have no prefill node to place.
        if not ev.enabled or self.topology in ("single", "replicas"):
            return []
        return [(role, i) for role in ROLES if role in ev.roles
                and self.role(role).prefix_caching for i in range(self.role(role).count)]

    def kv_event_ports(self) -> dict[tuple[Role, int], int]:
        """tcp only: each publishing node's event port, port_base + the number of
        publishing nodes before it on the same host (nodes on hosts of their own, like
        Kubernetes pods, all use port_base)."""
        if self.kv_events_transport != "tcp":
            return {}
        on_host: dict[str, int] = {}
        out: dict[tuple[Role, int], int] = {}
        for role, i in self.kv_event_nodes():
            host = self.node_hosts(role)[i]
            out[(role, i)] = self.kv_events.port_base + on_host.get(host, 0)
            on_host[host] = on_host.get(host, 0) + 1
        return out

    def resolved_run_dir(self) -> Path:
        """The run directory, `~` expanded (absolute)."""
        path = self.run_dir if self.run_dir is not None else DEFAULT_RUN_ROOT / self.name
        return path.expanduser().absolute()


def _binds_tcp(host: str) -> bool:
    return host in _WILDCARD_HOSTS


def _port_clashes(cfg: BundleConfig) -> list[str]:
    """Every pair of listeners that would share a port, one line per clash."""
    owners: dict[int, list[str]] = {}
    for role in cfg.roles_of(cfg.topology):
        for i, port in enumerate(cfg.node_ports(role)):
            owners.setdefault(port, []).append(f"{role}[{i}].port")
        for i, port in enumerate(cfg.side_channel_ports(role)):
            owners.setdefault(port, []).append(f"{role}[{i}].side_channel_port")
    kv_ports: set[int] = set()
    for (role, i), port in cfg.kv_event_ports().items():
        if port not in kv_ports:  # a repeated event port is on another host by design
            kv_ports.add(port)
            owners.setdefault(port, []).append(f"{role}[{i}].kv_events port")
    if cfg.router_enabled:
        owners.setdefault(cfg.router.port, []).append("router.port")
    return [
        f"ports: {port} is used by both {names[0]} and {names[1]}" if len(names) == 2 else
        f"ports: {port} is used by {', '.join(names[:-1])} and {names[-1]}"
        for port, names in sorted(owners.items()) if len(names) > 1
    ]
