"""From config to processes: the exact command and environment of every node and the router.

`plan()` is a pure function of a `BundleConfig` and `PlanInputs` (host facts, model, the
vLLM plugin's per-role env and args); `kvagent-server up` launches what it returns and
`kvagent-server render` prints it, so what operators copy is what the bundle runs.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kvagent_server.bundle.topology import (
    HostFacts,  # the plan's input (tests and tools import it from here too)
    TopologyChoice,
    ignored_settings,
    resolve_device,
    resolve_topology,
)
from kvagent_server.common.types import Device, Role, Topology
from kvagent_server.config import BundleConfig, ConfigError, reveal_secrets
from kvagent_server.engine.tiers import (
    LMCACHE_DEFAULT_CHUNK,
    KVTiers,
    TierConfigError,
    render_tiers,
)
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns.policy import POLICIES

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "kvagent_server.router"
ROUTER_SETTINGS_FILE = "router-settings.json"
#: UCX transports that work for NIXL on CPU (`sm,self` alone fails with NIXL_ERR_BACKEND).
CPU_UCX_TLS = "tcp,self,sm"
_WILDCARDS = ("0.0.0.0", "::", "")
#: vLLM's default KV block size per device, passed explicitly so the router's block
#: alignment always matches the nodes.
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}
#: A decode node's vLLM token budget per step, and its cap per prompt while other requests
#: share the engine (vLLM's long-prefill threshold), per device, when the config sets
#: none. On CPU a step's time grows with its tokens: capped at 128, a delta computed on D
#: (`d_direct`) holds each stream D decodes for tens of milliseconds per step, not for the
#: whole delta (docs/benchmarks.md, "Run 17"); alone on D it takes steps of 512, each
#: step's fixed cost paid fewer times ("Run 19"). GPUs: vLLM's own defaults.
DEFAULT_DECODE_STEP_TOKENS: dict[str, int] = {"cpu": 512}
DEFAULT_DECODE_PROMPT_CAP: dict[str, int] = {"cpu": 128}
#: The answer length of a request that sets no `max_tokens`, on the built-in models
#: (`kvagent-demo` and its siblings): vLLM's `max_new_tokens` default, rendered as
#: `--override-generation-config`. Their weights are random, so they almost never sample
#: their end-of-turn token, and vLLM's own default is the rest of the context: a first turn
#: of ~16k tokens (minutes on a CPU) after which the next turn's prompt exceeds the context
#: (HTTP 400). A request's own `max_tokens` still wins; a role's `extra_args` may override.
BUILTIN_DEFAULT_MAX_TOKENS = 256

ProcessRole = Literal["prefill", "decode", "router"]


@dataclass(frozen=True)
class ModelSource:
    """The model to serve: what `--model` gets, its served name and extra vLLM args."""

    model: str
    served_name: str
    extra_args: tuple[str, ...] = ()
    default_max_model_len: int | None = None
    extra_env: tuple[tuple[str, str], ...] = ()
    #: (served name, adapter directory) of each LoRA adapter, paths resolved.
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Its multimodal placeholder token ids, from its config.json (empty if unknown).
    mm_placeholder_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlanInputs:
    """Everything besides the config that decides the commands (gathered by `inputs.py`)."""

    host: HostFacts
    model: ModelSource
    python: str
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the bundle: a vLLM node or the router."""

    name: str  # "prefill-0", "decode-1", "router"
    role: ProcessRole
    index: int
    argv: tuple[str, ...]
    env: dict[str, str]  # added to the launcher's environment
    host: str  # advertised
    bind_host: str
    port: int
    url: str  # advertised base URL (what the router uses)
    health_url: str  # what the local launcher polls
    side_channel_port: int | None = None
    engine_id: str | None = None
    cpu_bind: str | None = None
    #: The cores every thread of the process runs on (`pin_processes`); None: any.
    cpu_affinity: tuple[int, ...] | None = None
    cuda_device: str | None = None


@dataclass(frozen=True)
class BundlePlan:
    name: str
    device: Device
    run_dir: Path
    nodes: tuple[ProcessSpec, ...]
    router: ProcessSpec | None
    router_settings_path: Path
    router_settings: dict[str, Any]  # secrets revealed: write it 0600, print it masked
    topology: Topology = "pd"
    topology_reason: str = ""
    #: Settings of the config this topology does not use, one line each (to print).
    notes: tuple[str, ...] = ()

    @property
    def topology_line(self) -> str:
        """`topology: single (auto: …)`: what `up` and `render` print."""
        return TopologyChoice(self.topology, self.topology_reason).line()

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return self.nodes + ((self.router,) if self.router else ())

    def by_name(self, name: str) -> ProcessSpec:
        for spec in self.processes:
            if spec.name == name:
                return spec
        raise KeyError(name)


# ------------------------------------------------------------------------ plan


def plan(cfg: BundleConfig, inputs: PlanInputs) -> BundlePlan:
    """The processes `cfg` describes on this host. Raises `ConfigError` for impossible
    combinations that depend on the host (no GPU, too few cores or GPUs)."""
    device = resolve_device(cfg, inputs.host)
    topology, why = resolve_topology(cfg, inputs.host)
    roles = [(role, i) for role in cfg.roles_of(topology) for i in range(cfg.role(role).count)]
    binds = _cpu_binds(cfg, inputs.host, roles) if device == "cpu" else {}
    gpus = _cuda_devices(cfg, inputs.host, roles) if device == "cuda" else {}
    served = cfg.served_model_name or inputs.model.served_name
    max_len = cfg.max_model_len or inputs.model.default_max_model_len
    block_size = cfg.block_size or DEFAULT_BLOCK_SIZE[device]
    run_dir = cfg.resolved_run_dir()
    # No P node to place in single and replicas: no events (and no publisher work).
    event_nodes = set(cfg.kv_event_nodes()) if topology == "pd" else set()
    event_ports = cfg.kv_event_ports()
    event_sources: dict[str, dict[str, Any]] = {}
    tier_facts: dict[str, dict[str, Any]] = {}

    nodes: list[ProcessSpec] = []
    d_prompt_caps: set[int] = set()  # each decode node's --long-prefill-token-threshold
    for role, i in roles:
        rc = cfg.role(role)
        port = cfg.node_ports(role)[i]
        side_port = cfg.side_channel_ports(role)[i]
        host = cfg.node_hosts(role)[i]
        engine_id = f"{cfg.name}-{role}-{i}"
        kv_cfg = {
            "kv_connector": "NixlConnector",
            # single, replicas: a node both keeps a finished turn's blocks and computes
            # prompts (a replica also pulls a moved session's blocks from another).
            "kv_role": ("kv_both" if topology in ("single", "replicas") else
                        "kv_producer" if role == "prefill" else "kv_consumer"),
            "kv_buffer_device": device,
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                "kv_recompute_threshold": cfg.kv_recompute_threshold,
                "decoder_kv_blocks_ttl": cfg.decoder_kv_blocks_ttl_s,
                **cfg.kv_connector_extra,
            },
        }
        args = [
            "--model", inputs.model.model,
            "--served-model-name", served,
            "--host", cfg.bind_host,
            "--port", str(port),
        ]
        if max_len is not None:
            args += ["--max-model-len", str(max_len)]
        args += ["--block-size", str(block_size)]
        args.append("--enable-prefix-caching" if rc.prefix_caching
                    else "--no-enable-prefix-caching")
        step_tokens = _step_setting(rc.max_num_batched_tokens, DEFAULT_DECODE_STEP_TOKENS,
                                    role, device)
        if step_tokens is not None:
            args += ["--max-num-batched-tokens", str(step_tokens)]
        prompt_cap = _step_setting(rc.long_prefill_token_threshold, DEFAULT_DECODE_PROMPT_CAP,
                                   role, device)
        if prompt_cap:  # 0: off
            args += ["--long-prefill-token-threshold", str(prompt_cap)]
        try:  # KV tiers: a MultiConnector around NIXL, hash flags (see tiers.py)
            tiers = render_tiers(cfg.kv_tiers, role=role, device=device,
                                 base_kv_transfer_config=kv_cfg, block_size=block_size,
                                 kv_events=(role, i) in event_nodes)
        except TierConfigError as exc:
            raise ConfigError([str(exc)]) from None
        args += ["--kv-transfer-config",
                 json.dumps(tiers.kv_transfer_config, separators=(",", ":")), *tiers.args]
        if device == "cuda":
            args += ["--kv-cache-memory-bytes", str(cfg.kv_cache_gib * 1024**3)]
        events = None
        if (role, i) in event_nodes:  # KV events for tier-aware placement (see router/kv/index.py)
            events = _kv_events_endpoints(cfg, role, i, run_dir, host, event_ports)
            args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[0],
                "topic": cfg.kv_events.topic}, separators=(",", ":"))]
        args += [*builtin_answer_args(cfg, inputs.model), *inputs.model.extra_args,
                 *lora_args(cfg, inputs.model),
                 *inputs.role_args.get(role, ()), *rc.extra_args]

        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        }
        if device == "cpu":
            env["UCX_TLS"] = CPU_UCX_TLS
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds.get((role, i), "auto")
        else:
            env["CUDA_VISIBLE_DEVICES"] = gpus[(role, i)]
        env.update(tiers.env)
        env.update(inputs.model.extra_env)
        env.update(inputs.role_env.get(role, {}))
        env.update(rc.extra_env)

        if role == "decode":
            d_prompt_caps.add(int(last_flag(args, "--long-prefill-token-threshold") or 0))
        if cfg.kv_tiers.enabled and role in cfg.kv_tiers.roles:
            tier_facts[http_url(host, port)] = router_tier_facts(cfg.kv_tiers, block_size)
        if events is not None:
            event_sources[http_url(host, port)] = {
                "endpoint": events[1], "topic": cfg.kv_events.topic,
                "hash_algo": last_flag(args, "--prefix-caching-hash-algo") or "sha256",
                "hash_seed": env.get("PYTHONHASHSEED")}
        engine = cfg.engine_command or [inputs.python, "-m", VLLM_MODULE]
        bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
        affinity = parse_cpu_list(bind) if (device == "cpu" and cfg.cpu_pinning
                                            and cfg.pin_processes and bind) else None
        nodes.append(ProcessSpec(
            name=f"{role}-{i}", role=role, index=i, argv=(*engine, *args), env=env,
            host=host, bind_host=cfg.bind_host, port=port, url=http_url(host, port),
            health_url=http_url(_connect_host(cfg.bind_host, cfg.advertise_host), port)
            + "/health",
            side_channel_port=side_port, engine_id=engine_id,
            cpu_bind=bind, cpu_affinity=affinity, cuda_device=gpus.get((role, i)),
        ))

    # Every decode node gets its role's arguments: one cap (0, off: None).
    d_prompt_cap = next(iter(d_prompt_caps)) if len(d_prompt_caps) == 1 else None
    router_settings = _router_settings(cfg, block_size, inputs.model,
                                       d_prompt_cap=d_prompt_cap or None)
    if event_sources:
        if cfg.router.engine.kv_events:
            raise ConfigError([("router.engine.kv_events: the bundle fills it from "
                                "kv_events; set kv_events.enabled: false to list sources "
                                "yourself")])
        router_settings["engine"]["kv_events"] = event_sources
    if tier_facts:  # where a decode node's given-up blocks go (router/reuse/spill.py)
        if cfg.router.engine.kv_tiers:
            raise ConfigError([("router.engine.kv_tiers: the bundle fills it from kv_tiers")])
        router_settings["engine"]["kv_tiers"] = tier_facts
    settings_path = run_dir / ROUTER_SETTINGS_FILE
    router = None
    if cfg.router_enabled:
        rs = cfg.router
        argv = [*(cfg.router_command or [inputs.python, "-m", ROUTER_MODULE]),
                "--host", rs.host, "--port", str(rs.port)]
        for node in nodes:
            argv += [f"--{node.role}", node.url]
        argv += ["--model", served, "--settings", str(settings_path)]
        connect = _connect_host(rs.host, cfg.advertise_host)
        router = ProcessSpec(
            name="router", role="router", index=0, argv=tuple(argv), env={},
            host=connect, bind_host=rs.host, port=rs.port, url=http_url(connect, rs.port),
            health_url=http_url(connect, rs.port) + "/health",
        )
    return BundlePlan(
        name=cfg.name, device=device, run_dir=run_dir, nodes=tuple(nodes), router=router,
        router_settings_path=settings_path,
        router_settings=router_settings,
        topology=topology, topology_reason=why,
        notes=tuple(ignored_settings(cfg, topology)),
    )


KV_TRANSFER_FLAG = "--kv-transfer-config"


def with_engine_id(argv: list[str] | tuple[str, ...], engine_id: str) -> list[str]:
    """`argv` with its KV connector's `engine_id` replaced (unchanged without one).

    A node started again must not reuse its engine id: its peers cache the NIXL agent
    they handshook with per engine id, so a restarted node under the old id would get
    every transfer sent to its dead predecessor (`NIXL_ERR_REMOTE_DISCONNECT`, and the
    KV recomputed) until the peers restart too. Under a new id they handshake again.
    """
    out = list(argv)
    if KV_TRANSFER_FLAG not in out:
        return out
    i = out.index(KV_TRANSFER_FLAG) + 1
    kv = json.loads(out[i])
    if "engine_id" in kv:
        kv["engine_id"] = engine_id
        out[i] = json.dumps(kv, separators=(",", ":"))
    return out


def incarnation_engine_id(base: str) -> str:
    """`base` with a suffix that is new every time a node process starts."""
    return f"{base}-{secrets.token_hex(4)}"


def builtin_answer_args(cfg: BundleConfig, model: ModelSource) -> list[str]:
    """Every node's default answer length when `model` is the built-in model `cfg` names
    (`BUILTIN_DEFAULT_MAX_TOKENS`); nothing for any other model, whose own generation
    config (or vLLM's default) applies."""
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(cfg.model)
    if builtin is None or model.served_name != builtin.name:
        return []
    return ["--override-generation-config",
            json.dumps({"max_new_tokens": BUILTIN_DEFAULT_MAX_TOKENS}, separators=(",", ":"))]


def router_tier_facts(tiers: KVTiers, block_size: int) -> dict[str, Any]:
    """What the router is told of one tiered node's tiers (`router.engine.kv_tiers`)."""
    chunk = tiers.min_prefix_tokens or (LMCACHE_DEFAULT_CHUNK if tiers.backend == "lmcache"
                                        else block_size)
    return {"host": tiers.cpu is not None, "disk": tiers.disk is not None,
            "shared": tiers.disk is not None and tiers.disk.shared,
            "chunk_tokens": chunk, "prompt_only": tiers.offload_prompt_only}


def lora_args(cfg: BundleConfig, model: ModelSource) -> list[str]:
    """The LoRA flags of every node: P and D serve the same adapters, or P would compute
    KV under one adapter that D decodes under another."""
    if not model.lora_modules:
        return []
    args = ["--enable-lora", "--lora-modules",
            *(f"{name}={path}" for name, path in model.lora_modules)]
    if cfg.max_lora_rank is not None:
        args += ["--max-lora-rank", str(cfg.max_lora_rank)]
    return args


def _step_setting(value: int | None, decode_defaults: dict[str, int], role: str,
                  device: str) -> int | None:
    """A node's per-step vLLM setting: the config's, else the device's default on a
    decode node (None: vLLM's own)."""
    if value is not None:
        return value
    return decode_defaults.get(device) if role == "decode" else None


#: Longest ipc socket path (sockaddr_un.sun_path, less the final NUL).
IPC_PATH_MAX = 107


def _kv_events_endpoints(cfg: BundleConfig, role: Role, i: int, run_dir: Path, host: str,
                         ports: dict[tuple[Role, int], int]) -> tuple[str, str]:
    """(the node's `--kv-events-config` endpoint, the one the router connects to)."""
    if cfg.kv_events_transport == "tcp":
        port = ports[(role, i)]
        return f"tcp://*:{port}", (f"tcp://[{host}]:{port}" if ":" in host
                                   else f"tcp://{host}:{port}")
    path = ipc_socket_path(run_dir, f"kv-events-{role}-{i}.ipc")
    return f"ipc://{path}", f"ipc://{path}"


def ipc_socket_path(run_dir: Path, name: str) -> Path:
    """Where a socket of the bundle lives: in its run dir, or, when that path would not fit
    in a unix socket address (a deep run dir), in a short per-run-dir directory under the
    temp dir (named by a hash of the run dir, so every process of the bundle agrees)."""
    path = run_dir / name
    if len(str(path)) <= IPC_PATH_MAX:
        return path
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"kvagent-{digest}" / name
    if len(str(short)) > IPC_PATH_MAX:
        raise ConfigError([(f"kv_events: no ipc socket path under {IPC_PATH_MAX} bytes for "
                            f"{name} (temp dir {tempfile.gettempdir()}); set TMPDIR shorter "
                            "or use kv_events.transport: tcp")])
    return short


def ipc_socket_dirs(plan: BundlePlan) -> list[Path]:
    """The directories the nodes' ipc sockets need (created before the nodes start)."""
    dirs = {Path(arg.split("ipc://", 1)[1].split('"', 1)[0]).parent
            for spec in plan.nodes for arg in spec.argv if "ipc://" in arg}
    return sorted(dirs)


def last_flag(args: Sequence[str], flag: str) -> str | None:
    """The value the last `flag VALUE` / `flag=VALUE` in `args` gives (argparse: last wins)."""
    value = None
    for k, arg in enumerate(args):
        if arg == flag and k + 1 < len(args):
            value = args[k + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _router_settings(cfg: BundleConfig, block_size: int, model: ModelSource, *,
                     d_prompt_cap: int | None) -> dict[str, Any]:
    """The router's settings with the node facts it must agree on filled in by the bundle
    (`d_prompt_cap`: the decode nodes' --long-prefill-token-threshold as they run it)."""
    router = cfg.router
    dumped: dict[str, Any] = router.model_dump(mode="python")
    if "mm_placeholder_token_ids" not in router.identity.model_fields_set:
        # Known placeholders let a changed image stop reuse at its position instead of
        # recomputing the whole turn; unknown ones keep the safe default.
        dumped["identity"]["mm_placeholder_token_ids"] = list(model.mm_placeholder_token_ids)
    # path under `router:` -> the value the nodes run, and where it is set
    synced: dict[tuple[str, ...], tuple[Any, str]] = {
        ("nodes", "block_size"): (block_size, "block_size"),
        ("nodes", "kv_recompute_threshold"): (cfg.kv_recompute_threshold,
                                              "kv_recompute_threshold"),
        ("retention", "decode_blocks_ttl_s"): (cfg.decoder_kv_blocks_ttl_s,
                                               "decoder_kv_blocks_ttl_s"),
    }
    registered = POLICIES.get(router.policy.name)
    if registered is not None and "decode_prompt_step_tokens" in registered.params.model_fields:
        # only a policy that reads D's prompt step takes it (the others refuse it)
        synced[("policy", "params", "decode_prompt_step_tokens")] = (
            d_prompt_cap, "decode.long_prefill_token_threshold")
    problems = []
    for path, (value, source) in synced.items():
        *sections, key = path
        holder: dict[str, Any] = dumped
        for section in sections:
            holder = holder.setdefault(section, {})
        given = holder.get(key)
        if _is_set(router, path) and given is not None and given != value:
            problems.append(
                f"router.{'.'.join(path)}: {given} disagrees with the nodes' {source} "
                f"({value}); set {source} instead, the bundle passes it on")
        holder[key] = value
    if problems:
        raise ConfigError(problems)
    revealed: dict[str, Any] = reveal_secrets(dumped)
    return revealed


def _is_set(router: RouterSettings, path: tuple[str, ...]) -> bool:
    """Whether the settings as given set the key at `path` (a section's field, or a key
    of a dict such as `policy.params`)."""
    holder: Any = router
    for name in path[:-1]:
        holder = getattr(holder, name) if isinstance(holder, BaseModel) else holder.get(name, {})
    if isinstance(holder, BaseModel):
        return path[-1] in holder.model_fields_set
    return path[-1] in holder


def _cpu_binds(cfg: BundleConfig, host: HostFacts, roles: list[tuple[Role, int]]
               ) -> dict[tuple[Role, int], str]:
    """VLLM_CPU_OMP_THREADS_BIND per node: explicit ones, the rest partition the cores."""
    if not cfg.cpu_pinning:
        return {}
    binds: dict[tuple[Role, int], str] = {}
    for role, i in roles:
        explicit = cfg.role(role).cpu_binds
        if explicit is not None:
            binds[(role, i)] = explicit[i]
    todo = [key for key in roles if key not in binds]
    if not todo:
        return binds
    available = set(host.cpu_cores)
    cores = list(cfg.cpu_cores) if cfg.cpu_cores is not None else sorted(available)
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError([
            (f"cpu_cores: core(s) {format_cpu_list(missing)} are not available here "
            f"(available: {format_cpu_list(sorted(available))})")])
    if len(todo) > len(cores):
        raise ConfigError([
            (f"{_counts(roles)}: {len(todo)} nodes to pin but only {len(cores)} "
            f"core(s) ({format_cpu_list(cores)}); lower the counts, list more cpu_cores, "
            "give explicit cpu_binds, or set cpu_pinning: false")])
    for key, part in zip(todo, partition_cores(cores, len(todo)), strict=True):
        binds[key] = format_cpu_list(part)
    return binds


def _cuda_devices(cfg: BundleConfig, host: HostFacts, roles: list[tuple[Role, int]]
                  ) -> dict[tuple[Role, int], str]:
    out: dict[tuple[Role, int], str] = {}
    todo = []
    for role, i in roles:
        explicit = cfg.role(role).cuda_devices
        if explicit is not None:
            out[(role, i)] = explicit[i]
        else:
            todo.append((role, i))
    taken = set(out.values())
    free = [str(g) for g in range(host.gpu_count) if str(g) not in taken]
    if len(todo) > len(free):
        one_each = cfg.prefill.count == cfg.decode.count == 1 and len(roles) == 2
        raise ConfigError([
            (f"{_counts(roles)}: {len(todo)} nodes need a GPU each but only "
            f"{len(free)} GPU(s) are free (of {host.gpu_count} visible)"
            + ("; topology: single runs one node on one GPU" if one_each else ""))])
    for key, gpu in zip(todo, free, strict=False):
        out[key] = gpu
    return out


def _counts(roles: list[tuple[Role, int]]) -> str:
    """The config keys that set how many nodes `roles` are (for an error)."""
    return ("decode.count" if all(role == "decode" for role, _ in roles)
            else "prefill.count + decode.count")


def partition_cores(cores: list[int], parts: int) -> list[list[int]]:
    """Split `cores` into `parts` contiguous, disjoint, near-equal groups (first ones larger)."""
    if parts < 1 or parts > len(cores):
        raise ValueError(f"cannot split {len(cores)} cores into {parts} parts")
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(list(cores[start:end]))
        start = end
    return out


def parse_cpu_list(text: str) -> tuple[int, ...] | None:
    """`"0-2,5"` -> `(0, 1, 2, 5)`; a VLLM_CPU_OMP_THREADS_BIND with one list per rank
    (`"0-1|2-3"`) gives their union. None for what names no cores (`auto`, `nobind`)."""
    cores: set[int] = set()
    for part in text.replace("|", ",").split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            return None
        cores.update(range(int(low), int(high if dash else low) + 1))
    return tuple(sorted(cores)) or None


def format_cpu_list(cores: list[int] | tuple[int, ...]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"` (the syntax VLLM_CPU_OMP_THREADS_BIND and taskset use)."""
    out: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _connect_host(bind: str, advertise: str) -> str:
    """Where a local client reaches a server bound to `bind`."""
    return advertise if bind in _WILDCARDS else bind


# ---------------------------------------------------------------------- output


def masked_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Router settings with key material replaced by `***` (for printing)."""
    out: dict[str, Any] = json.loads(json.dumps(settings))
    out["signing_keys"] = {k: "***" for k in out.get("signing_keys", {})}
    for tenant in out.get("tenants", []):
        tenant["api_keys"] = ["***" for _ in tenant.get("api_keys", [])]
    return out


def render_shell(bp: BundlePlan, *, reveal_secrets: bool = False) -> str:
    """Copy-pasteable shell: one command per process, environment inline."""
    n_p = sum(1 for n in bp.nodes if n.role == "prefill")
    nodes = ("one node" if bp.topology == "single" else
             f"{len(bp.nodes)} replica nodes" if bp.topology == "replicas" else
             f"{n_p} prefill + {len(bp.nodes) - n_p} decode node(s)")
    lines = [
        "#!/bin/sh",
        f"# kvagent bundle '{bp.name}': {nodes} on {bp.device}"
        + (" + router" if bp.router else ""),
        f"# {bp.topology_line}",
        *(f"# note: {note}" for note in bp.notes),
        "# Start each command on its machine (every one runs in the foreground).",
    ]
    for folder in ipc_socket_dirs(bp):
        lines.append(f"mkdir -p {shlex.quote(str(folder))}  # the KV event sockets")
    for spec in bp.nodes:
        where = f"cores {spec.cpu_bind}" if spec.cpu_bind else (
            f"GPU {spec.cuda_device}" if spec.cuda_device else "")
        lines += [
            "",
            f"# {spec.name}: engine {spec.engine_id}, {spec.url}, NIXL side channel "
            f"{spec.host}:{spec.side_channel_port}" + (f", {where}" if where else ""),
            _shell_command(spec),
        ]
    if bp.router:
        settings = bp.router_settings if reveal_secrets else masked_settings(bp.router_settings)
        note = "" if reveal_secrets else " (secrets masked: --reveal-secrets prints them)"
        lines += [
            "",
            f"# router: {bp.router.url}{note}",
            f"mkdir -p {shlex.quote(str(bp.router_settings_path.parent))}",
            f"cat > {shlex.quote(str(bp.router_settings_path))} <<'EOF'",
            json.dumps(settings, indent=2, sort_keys=True),
            "EOF",
            _shell_command(bp.router),
        ]
    return "\n".join(lines) + "\n"


def _shell_command(spec: ProcessSpec) -> str:
    parts = [f"{k}={shlex.quote(v)}" for k, v in spec.env.items()]
    head = ("env \\\n  " + " \\\n  ".join(parts) + " \\\n  ") if parts else ""
    argv = list(spec.argv)
    if spec.cpu_affinity:  # what the supervisor does at launch: every thread on the cores
        argv = ["taskset", "-c", format_cpu_list(spec.cpu_affinity), *argv]
    # The program first, then one "--flag [value]" per line for readability.
    first = next((i for i, t in enumerate(argv) if t.startswith("--")), len(argv))
    chunks = [" ".join(shlex.quote(t) for t in argv[:first])]
    i = first
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            chunks.append(f"{shlex.quote(argv[i])} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            chunks.append(shlex.quote(argv[i]))
            i += 1
    return head + " \\\n    ".join(chunks)


def plan_to_dict(bp: BundlePlan, *, reveal_secrets: bool = False) -> dict[str, Any]:
    def proc(spec: ProcessSpec) -> dict[str, Any]:
        d = asdict(spec)
        d["argv"] = list(spec.argv)
        return d

    settings = bp.router_settings if reveal_secrets else masked_settings(bp.router_settings)
    return {
        "name": bp.name,
        "device": bp.device,
        "topology": bp.topology,
        "topology_reason": bp.topology_reason,
        "run_dir": str(bp.run_dir),
        "nodes": [proc(n) for n in bp.nodes],
        "router": None if bp.router is None else {
            **proc(bp.router), "settings_path": str(bp.router_settings_path),
            "settings": settings},
    }


def render_json(bp: BundlePlan, *, reveal_secrets: bool = False) -> str:
    return json.dumps(plan_to_dict(bp, reveal_secrets=reveal_secrets), indent=2) + "\n"
