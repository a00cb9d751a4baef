"""KV tiers below GPU memory (CPU, local disk or a shared filesystem) and their vLLM flags.

`KVTiers` is the validated config (the bundle's `kv_tiers:` section); `render_tiers` turns
it into the extra arguments, environment and `--kv-transfer-config` of one node, combining
the tier connector with the bundle's NIXL connector through vLLM's `MultiConnector`.
What a tier hit is worth to placement is the router's (`router.kv.tiers.tier_score`).

Facts this module relies on, read in vLLM 0.32's source (paths under `vllm/`):

- The native tiers are `OffloadingConnector` with `CPUOffloadingSpec` (CPU only) or
  `TieringOffloadingSpec` (CPU primary tier plus `secondary_tiers`, e.g. `{"type": "fs"}`).
  vLLM's worker for them needs a GPU platform (`CPU_OFFLOAD_PLATFORM_CHECK`); on CPU nodes
  the bundle names kvagent's subclass of the tiering spec instead (`spec_name` /
  `spec_module_path`, read by `OffloadingSpecFactory.get_spec_cls`, `SPEC_MODULE_PATH_READ`),
  whose worker copies blocks with torch (`vllm_plugin/host_tier.py`), and kvagent's
  subclass of the `fs` tier (namespaced directory, size check, budget:
  `vllm_plugin/disk_tier.py`).
- `--kv-offloading-size` is not used: `VllmConfig._post_init_kv_transfer_config`
  (`KV_OFFLOADING_SIZE_CLOBBERS`) replaces whatever `kv_connector` is configured (NIXL
  here) by `OffloadingConnector` and sets `kv_role` to `kv_both`. An explicit
  `MultiConnector` keeps both.
- `MultiConnector` children must not carry `engine_id`: each child is built with
  `KVTransferConfig(**child, engine_id=parent_engine_id)` (`MULTI_CONNECTOR_ENGINE_ID`),
  so a child `engine_id` is a duplicate keyword (TypeError at start-up). MultiConnector
  loads from the first child that has the tokens, so NIXL goes first: a P/D transfer the
  router asked for must win over a local tier.
- Block hashes are chained from `NONE_HASH`, derived from `PYTHONHASHSEED` when set, else
  from a fixed seed for sha256 and a random one per process for xxhash
  (`vllm/v1/core/kv_cache_utils.py`, `resolve_none_hash_seed`). Nodes that share a tier
  must agree on both the algorithm and the seed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvagent_server.common.types import Device, HashAlgo, Role

#: Where vLLM refuses its own offloading worker off GPU (checked by tests/tiers against the
#: source): CPU nodes get kvagent's worker instead.
CPU_OFFLOAD_PLATFORM_CHECK = "vllm/v1/kv_offload/cpu/spec.py:199"
#: Where vLLM imports an offloading spec it does not know from `spec_module_path`.
SPEC_MODULE_PATH_READ = "vllm/v1/kv_offload/factory.py:35"
#: kvagent's CPU offloading spec and disk tier (vllm_plugin.host_tier / .disk_tier; those
#: modules import vLLM, so the names are repeated here and checked equal by the tests).
CPU_SPEC_NAME = "KvagentTieringSpec"
CPU_SPEC_MODULE = "kvagent_server.vllm_plugin.host_tier"
CPU_DISK_TIER_TYPE = "KvagentFsTier"
CPU_DISK_TIER_MODULE = "kvagent_server.vllm_plugin.disk_tier"
#: fs tier I/O threads when unset: vLLM's 16 + 16 on GPU hosts, 2 + 2 on CPU nodes, whose
#: few cores also run the model.
DEFAULT_IO_THREADS: dict[str, int] = {"cuda": 16, "cpu": 2}
#: Where vLLM's LMCache adapter puts its buffers on `cuda:<index>`.
LMCACHE_CUDA_DEVICE = (
    "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_integration/vllm_v1_adapter.py:491")
#: Where `--kv-offloading-size` overwrites the configured connector and role.
KV_OFFLOADING_SIZE_CLOBBERS = "vllm/config/vllm.py:1115"
#: Where MultiConnector passes the parent's engine_id to every child.
MULTI_CONNECTOR_ENGINE_ID = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py:238"
#: `TieringOffloadingSpec.get_manager` rejects store_threshold >= 2.
TIERING_NO_STORE_THRESHOLD = "vllm/v1/kv_offload/tiering/spec.py:341"
#: Python refuses to start with any other PYTHONHASHSEED.
PYTHONHASHSEED_MAX = 4294967295
#: LMCache's FS connector only uses the path; the host:port part is kept for its URL parser.
LMCACHE_FS_URL = "fs://localhost:0{path}"

_GIB = 1 << 30


#: LMCache's chunk in tokens when `min_prefix_tokens` is unset.
LMCACHE_DEFAULT_CHUNK = 256


class TierConfigError(ValueError):
    """A tier setting that cannot work here; the message says which key and why."""


class CPUTier(BaseModel):
    """Host memory below the GPU KV cache (the primary offload tier)."""

    model_config = ConfigDict(extra="forbid")

    size_gib: float = Field(
        gt=0, description="Host memory per node for offloaded KV blocks, GiB "
        "(`cpu_bytes_to_use`, LMCache `max_local_cpu_size`).")
    eviction: Literal["lru", "arc"] = Field(
        default="lru", description="Eviction policy of the CPU tier (`eviction_policy`; "
        "LMCache `cache_policy`).")


class DiskTier(BaseModel):
    """A local disk or a shared filesystem (NFS, Lustre, a ReadWriteMany volume)."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(description="Directory for KV block files; absolute. Every node "
                       "must see the same directory at this path when `shared`.")
    shared: bool = Field(
        default=False,
        description="The directory is one filesystem shared by all nodes: a block one "
        "node stored is a hit on the others (needs a common hash seed, set for you).")
    size_gib: float | None = Field(
        default=None, gt=0,
        description="Disk budget, GiB: LMCache `max_local_disk_size`; on CPU nodes (native) "
        "the oldest block files are deleted past it (per node, counting the whole "
        "namespace directory). vLLM's fs tier on GPU nodes has no budget or eviction: "
        "leave it unset there and size the filesystem instead.")
    read_threads: int | None = Field(
        default=None, ge=1, le=256,
        description="Native fs tier read threads (`n_read_threads`); null: 16 on GPU "
        "nodes, 2 on CPU nodes.")
    write_threads: int | None = Field(
        default=None, ge=1, le=256,
        description="Native fs tier write threads (`n_write_threads`); null: 16 on GPU "
        "nodes, 2 on CPU nodes.")
    check_writable: bool = Field(
        default=True,
        description="Create the directory and check it is writable when the config is "
        "validated (turn off when rendering for other machines).")

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"must be an absolute path (got {str(v)!r}): every node "
                             "resolves it on its own machine, so a relative path is ambiguous")
        return v

    @model_validator(mode="after")
    def _writable(self) -> DiskTier:
        if self.check_writable:
            problem = writable_problem(self.path)
            if problem:
                raise ValueError(f"path: {problem} (or set check_writable: false when "
                                 "the directory exists only on the nodes' machines)")
        return self


class KVTiers(BaseModel):
    """KV cache tiers below GPU memory, the same on every node of the chosen roles."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["native", "lmcache"] = Field(
        default="native",
        description="`native`: vLLM's OffloadingConnector (CPU tier, fs tier through its "
        "tiering spec). `lmcache`: LMCacheConnectorV1 configured by `LMCACHE_*` env.")
    cpu: CPUTier | None = Field(default=None, description="The CPU tier; null: none.")
    disk: DiskTier | None = Field(default=None, description="The disk/shared-fs tier.")
    roles: list[Role] = Field(
        default_factory=lambda: list[Role](("prefill", "decode")),
        description="Node roles that get the tiers.")
    min_prefix_tokens: int | None = Field(
        default=None, ge=1,
        description="Smallest prefix worth storing, in tokens: the offload chunk (native "
        "`block_size`, a multiple of the KV block size; LMCache `chunk_size`). Shorter "
        "prefixes are never stored. Null: one KV block (native), 256 (LMCache).")
    store_after_hits: int = Field(
        default=0, ge=0,
        description="Store a chunk only after it was offered this many times (native "
        "CPU-only tier: `store_threshold`; values below 2 store everything).")
    offload_prompt_only: bool = Field(
        default=True,
        description="Only prompt blocks are offloaded, not generated ones (native "
        "`offload_prompt_only`).")
    hash_algo: HashAlgo = Field(
        default="sha256",
        description="`--prefix-caching-hash-algo`, set on every node when tiers are on, so "
        "all nodes name blocks alike.")
    hash_seed: int | None = Field(
        default=None, ge=0, le=PYTHONHASHSEED_MAX,
        description="PYTHONHASHSEED for every node (seeds vLLM's block hash chain). "
        "Required with xxhash and a shared disk; null otherwise keeps vLLM's fixed "
        "sha256 seed, which already agrees across processes.")

    @property
    def enabled(self) -> bool:
        return self.cpu is not None or self.disk is not None

    @model_validator(mode="after")
    def _check(self) -> KVTiers:
        problems: list[str] = []
        if len(set(self.roles)) != len(self.roles):
            problems.append("roles: listed twice")
        if self.enabled and not self.roles:
            problems.append("roles: empty while a tier is configured (list prefill "
                            "and/or decode, or remove the tiers)")
        if self.backend == "native" and self.disk is not None:
            if self.cpu is None:
                problems.append(
                    "disk: the native backend stages every block through a CPU tier "
                    "(TieringOffloadingSpec's primary tier): add cpu: {size_gib: ...}")
            if self.store_after_hits >= 2:
                problems.append(
                    "store_after_hits: not supported with a disk tier on the native "
                    f"backend ({TIERING_NO_STORE_THRESHOLD})")
        if (self.backend == "lmcache" and self.disk is not None and not self.disk.shared
                and self.disk.size_gib is None):
            problems.append("disk.size_gib: required for LMCache's local disk "
                            "(max_local_disk_size; 0 would store nothing)")
        if self.backend == "lmcache" and self.store_after_hits >= 2:
            problems.append("store_after_hits: native backend only (LMCache has no "
                            "store threshold)")
        if (self.disk is not None and self.disk.shared and self.hash_algo.startswith("xxhash")
                and self.hash_seed is None):
            problems.append(
                f"hash_seed: required with hash_algo {self.hash_algo} and a shared disk: "
                "vLLM seeds xxhash block hashes randomly per process unless PYTHONHASHSEED "
                "is set, so no node would find another's blocks")
        if problems:
            raise ValueError("\n".join(f"kv_tiers.{p}" for p in problems))
        return self


def writable_problem(path: Path) -> str | None:
    """Why `path` cannot hold KV files here (created if missing), or None if it can."""
    if path.exists() and not path.is_dir():
        return f"{path} is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path} ({exc.strerror})"
    if not path.is_dir():
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this user"
    return None


# ---------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class TierRendering:
    """What the tiers add to one node: argv, environment, and the final kv-transfer-config."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kv_transfer_config: dict[str, Any] | None = None


def render_tiers(tiers: KVTiers, *, role: Role, device: Device,
                 base_kv_transfer_config: Mapping[str, Any] | None,
                 block_size: int, kv_events: bool = False) -> TierRendering:
    """The tier part of one node's command. Pure; raises `TierConfigError` when the
    device cannot run the tiers as configured (vLLM would otherwise start and fail at
    first use).

    With `kv_events` (the node publishes KV events) the native tiers announce every
    block of an offloaded chunk, not only its last (`self_describing_kv_events`), so the
    router can match prompt prefixes block by block."""
    base = copy.deepcopy(dict(base_kv_transfer_config)) if base_kv_transfer_config else None
    if not tiers.enabled or role not in tiers.roles:
        return TierRendering(kv_transfer_config=base)
    _check_device(tiers, device)
    if tiers.min_prefix_tokens is not None and tiers.backend == "native" \
            and tiers.min_prefix_tokens % block_size:
        up = -(-tiers.min_prefix_tokens // block_size) * block_size
        raise TierConfigError(
            f"kv_tiers.min_prefix_tokens: {tiers.min_prefix_tokens} is not a multiple of the "
            f"KV block size ({block_size}); use {up}")

    buffer_device = (base or {}).get("kv_buffer_device", device)
    child = (_native_connector(tiers, device=device, kv_events=kv_events)
             if tiers.backend == "native" else _lmcache_connector())
    child["kv_buffer_device"] = buffer_device
    env = _lmcache_env(tiers) if tiers.backend == "lmcache" else {}
    if tiers.hash_seed is not None:
        env["PYTHONHASHSEED"] = str(tiers.hash_seed)
    args = ["--prefix-caching-hash-algo", tiers.hash_algo]

    if base is None:
        return TierRendering(args=args, env=env, kv_transfer_config=child)
    if base.get("kv_connector") == "MultiConnector":
        raise TierConfigError("kv_tiers: the node already uses a MultiConnector; add the "
                              "tier connector to its connectors list yourself")
    nixl = {k: v for k, v in base.items() if k != "engine_id"}
    parent: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": base.get("kv_role"),
        "kv_buffer_device": buffer_device,
        "kv_connector_extra_config": {"connectors": [nixl, child]},
    }
    if "engine_id" in base:
        parent["engine_id"] = base["engine_id"]
    for key in ("kv_load_failure_policy", "kv_port"):
        if key in base:
            parent[key] = base[key]
    return TierRendering(args=args, env=env, kv_transfer_config=parent)


def _check_device(tiers: KVTiers, device: Device) -> None:
    if device == "cuda":
        if tiers.backend == "native" and tiers.disk is not None and tiers.disk.size_gib:
            raise TierConfigError(
                "kv_tiers.disk.size_gib: vLLM's fs tier on GPU nodes has no size limit or "
                "eviction; remove it and size the filesystem, or use backend: lmcache")
        return
    what = "cpu tier" if tiers.cpu is not None else "disk tier"
    if tiers.backend == "lmcache":
        raise TierConfigError(
            f"kv_tiers: the {what} with backend lmcache needs device=cuda: vLLM's LMCache "
            f"adapter allocates on cuda ({LMCACHE_CUDA_DEVICE}); use backend: native")
    if tiers.store_after_hits >= 2:
        raise TierConfigError(
            "kv_tiers.store_after_hits: not supported on CPU nodes (their tiers always run "
            f"vLLM's tiering spec, {TIERING_NO_STORE_THRESHOLD})")


def _native_connector(tiers: KVTiers, *, device: Device,
                      kv_events: bool = False) -> dict[str, Any]:
    """vLLM's OffloadingConnector. GPU nodes: vLLM's own specs and fs tier. CPU nodes:
    kvagent's tiering spec (vLLM's, with a CPU worker) and disk tier (vLLM's fs tier,
    namespaced, size-checked, with a budget), always, since only the tiering spec maps
    the host region the CPU worker copies into."""
    assert tiers.cpu is not None  # validated: native always has a CPU tier
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": int(tiers.cpu.size_gib * _GIB),
        "eviction_policy": tiers.cpu.eviction,
        "offload_prompt_only": tiers.offload_prompt_only,
    }
    if tiers.min_prefix_tokens is not None:
        extra["block_size"] = tiers.min_prefix_tokens
    if tiers.store_after_hits >= 2:
        extra["store_threshold"] = tiers.store_after_hits
    if kv_events:
        extra["self_describing_kv_events"] = True
    if device == "cpu":
        extra["spec_name"] = CPU_SPEC_NAME
        extra["spec_module_path"] = CPU_SPEC_MODULE
    elif tiers.disk is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
    if tiers.disk is not None:
        threads = DEFAULT_IO_THREADS[device]
        tier: dict[str, Any] = {
            "type": "fs",
            "root_dir": str(tiers.disk.path),
            "n_read_threads": tiers.disk.read_threads or threads,
            "n_write_threads": tiers.disk.write_threads or threads,
            "locality": "REMOTE" if tiers.disk.shared else "LOCAL",
        }
        if device == "cpu":
            tier.update(type=CPU_DISK_TIER_TYPE, module_path=CPU_DISK_TIER_MODULE,
                        hash_algo=tiers.hash_algo)
            if tiers.disk.size_gib:
                tier["size_bytes"] = int(tiers.disk.size_gib * _GIB)
        if kv_events:  # the fs tier publishes (medium STORAGE) only when asked to
            tier["enable_kv_events"] = True
        extra["secondary_tiers"] = [tier]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def _lmcache_connector() -> dict[str, Any]:
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def _lmcache_env(tiers: KVTiers) -> dict[str, str]:
    """LMCache reads `LMCACHE_<KEY>` for every key of its config when no file is given."""
    env = {"LMCACHE_CHUNK_SIZE": str(tiers.min_prefix_tokens or LMCACHE_DEFAULT_CHUNK),
           "LMCACHE_SAVE_UNFULL_CHUNK": "False"}
    if tiers.cpu is not None:
        env.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=_num(tiers.cpu.size_gib),
                   LMCACHE_CACHE_POLICY=tiers.cpu.eviction.upper())
    else:
        env["LMCACHE_LOCAL_CPU"] = "False"
    disk = tiers.disk
    if disk is not None:
        if disk.shared:
            env["LMCACHE_REMOTE_URL"] = LMCACHE_FS_URL.format(path=disk.path)
            env["LMCACHE_REMOTE_SERDE"] = "naive"
        else:
            assert disk.size_gib is not None  # validated
            env["LMCACHE_LOCAL_DISK"] = f"file://{disk.path}/"
            env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = _num(disk.size_gib)
    return env


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
