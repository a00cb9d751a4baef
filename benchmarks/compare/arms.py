"""The arms `python -m benchmarks compare` runs, and the vLLM flags each node gets.

Every arm serves the same model on the same two cores with the same total KV budget
(`KvBudget`), split evenly between an arm's vLLM nodes: whole GiB of KV space per node
(`VLLM_CPU_KVCACHE_SPACE`, which vLLM-CPU reads as an integer and which the bundle sets
from `kv_cache_gib`), and, for budgets under a GiB a node, a number of KV blocks
(`--num-gpu-blocks-override`, which caps what the cache may hold whatever the space).
The aggregated nodes get the step flags kvagent's decode node gets, since they
decode too, and the plugin's reader settings; the connector-only patches stay off, as
there is no connector to patch.

Tiered arms (`aggregated-tier`, `kvagent-tiers`, `kvagent-pd-tiers`) also get one tier
budget (`TierBudget`): host memory summed over the arm's nodes and split as the KV budget
is, and one disk budget, in a directory of the run's work folder (shared by P and D in the
P/D bundle).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvagent_server.bundle.render import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_PROMPT_CAP,
    DEFAULT_DECODE_STEP_TOKENS,
    format_cpu_list,
    last_flag,
)
from kvagent_server.common.types import Topology
from kvagent_server.vllm_plugin import env as plugin_env

from benchmarks.multiturn.nodes import (
    BenchConfig,
    Device,
    Endpoint,
    aggregated_node,
    serve,
)

BLOCKS_ARG = "--num-gpu-blocks-override"
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU: Device = "cpu"


@dataclass(frozen=True)
class KvBudget:
    """What every arm may hold in KV, summed over its nodes."""

    gib: int  # KV space
    tokens: int | None = None  # a tighter cap in tokens (None: what the space holds)

    def node_gib(self, nodes: int) -> int:
        if self.gib % nodes:
            raise ValueError(f"a KV budget of {self.gib} GiB does not split into {nodes} "
                             "whole-GiB nodes")
        return self.gib // nodes

    def node_args(self, nodes: int) -> list[str]:
        """One node's cap in blocks of the CPU block size, if the budget has one."""
        if self.tokens is None:
            return []
        return [BLOCKS_ARG, str(self.tokens // nodes // DEFAULT_BLOCK_SIZE[CPU])]


#: Where a tiered arm's disk tier lives, inside the run's work folder.
TIER_DIR = "kv-tier"
#: The flag-table stand-in for a run's tier directory (rendered without a run).
TABLE_TIER_DIR = Path("/run-work-folder") / TIER_DIR


@dataclass(frozen=True)
class TierBudget:
    """What every tiered arm may hold below its engine KV: host memory summed over its
    nodes (split evenly, as the KV budget is) and one disk budget (one directory: a
    shared one counts once, as each node applies the budget to the whole directory)."""

    host_gib: float
    disk_gib: float

    def __post_init__(self) -> None:
        if self.host_gib <= 0 or self.disk_gib <= 0:
            raise ValueError(f"tier budget: host {self.host_gib} GiB and disk "
                             f"{self.disk_gib} GiB must both be > 0 (the native disk tier "
                             "stages every block through the host tier)")

    def kv_tiers(self, path: Path, *, nodes: int, shared: bool,
                 check_writable: bool = True) -> dict[str, Any]:
        """The bundle's `kv_tiers:` section for one node of an arm of `nodes`. Generated
        tokens are offloaded too (`offload_prompt_only: false`): an agent's history is
        mostly its own output, and every tiered arm gets the same tier settings."""
        return {"cpu": {"size_gib": self.host_gib / nodes},
                "disk": {"path": str(path), "shared": shared, "size_gib": self.disk_gib,
                         "check_writable": check_writable},
                "offload_prompt_only": False}


#: The default tier budget: 1 GiB of host memory and 4 GiB of disk per arm, several times
#: the pressure workloads' engine KV (272 MiB), enough to hold all their conversations.
DEFAULT_TIERS = TierBudget(host_gib=1.0, disk_gib=4.0)


def aggregated_tier_args(tiers: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """An aggregated node's tier flags and environment: the `kv_tiers` section rendered
    as the bundle renders it for a CPU node, with no NIXL to combine with (so a plain
    OffloadingConnector with kvagent's CPU spec and disk tier)."""
    from kvagent_server.engine.tiers import KVTiers, render_tiers

    r = render_tiers(KVTiers.model_validate(tiers), role="decode", device=CPU,
                     base_kv_transfer_config=None, block_size=DEFAULT_BLOCK_SIZE[CPU])
    assert r.kv_transfer_config is not None
    return [*r.args, "--kv-transfer-config", json.dumps(r.kv_transfer_config)], r.env


def aggregated_step_args() -> list[str]:
    """The step flags the bundle gives its decode node on CPU: an aggregated node decodes
    as D does, so it gets D's token budget per step and its cap per prompt per step."""
    return ["--block-size", str(DEFAULT_BLOCK_SIZE[CPU]),
            "--max-num-batched-tokens", str(DEFAULT_DECODE_STEP_TOKENS[CPU]),
            "--long-prefill-token-threshold", str(DEFAULT_DECODE_PROMPT_CAP[CPU])]


def aggregated_plugin_env() -> dict[str, str]:
    """kvagent's plugin on an aggregated node: the shared-memory readers spin
    `DEFAULT_SPIN_MS` and nap between checks (its CPU default), as on P and D. The patches
    for the NIXL connector (poll delay, load failure, retention, P's first token) are off:
    without a connector they have nothing to act on."""
    return {plugin_env.PLUGIN_ENV: "1",
            plugin_env.SPIN_ENV: str(plugin_env.DEFAULT_SPIN_MS),
            plugin_env.IDLE_POLL_ENV: str(plugin_env.DEFAULT_IDLE_POLL_MS),
            plugin_env.NIXL_DELAY_ENV: "0", plugin_env.RECOMPUTE_ENV: "0",
            plugin_env.RETENTION_ENV: "0", plugin_env.FIRST_TOKEN_ENV: "0"}


@dataclass(frozen=True)
class Arm:
    """One arm: how it serves, and how a conversation picks its endpoint."""

    name: str
    description: str
    #: "aggregated" (one node, both cores), "affine" (one node per core, each session
    #: pinned to one) or "bundle" (kvagent's P/D bundle).
    kind: str
    reuse: bool = False
    prefill_prefix_caching: bool = True
    #: KV tiers below engine memory: "local" (a host tier and a disk tier of the node's
    #: own), "shared" (every node a host tier, one disk directory for all; with one node,
    #: its own), or none.
    tier: Literal["local", "shared"] | None = None
    #: A bundle arm's topology: "pd", "single", or "auto" (what `kvagent-server up` picks
    #: on the machine running the benchmark, resolved by the bundle's own rule).
    topology: Topology | Literal["auto"] = "pd"

    @property
    def resolved_topology(self) -> Topology | None:
        """The bundle's topology on this machine (None for an arm that is no bundle)."""
        if self.kind != "bundle":
            return None
        if self.topology != "auto":
            return self.topology
        from kvagent_server.bundle.inputs import detect_host
        from kvagent_server.bundle.topology import resolve_topology
        from kvagent_server.config import validate_config

        return resolve_topology(validate_config({}), detect_host()).topology

    @property
    def nodes(self) -> int:
        if self.kind == "aggregated" or self.resolved_topology == "single":
            return 1
        return 2

    def kv_tiers(self, tiers: TierBudget, tier_dir: Path, *, check_writable: bool = True
                 ) -> dict[str, Any] | None:
        """Each node's `kv_tiers` section (None for an arm without tiers)."""
        if self.tier is None:
            return None
        return tiers.kv_tiers(tier_dir, nodes=self.nodes,
                              shared=self.tier == "shared" and self.nodes > 1,
                              check_writable=check_writable)

    def bench_config(self, kv: KvBudget, tiers: TierBudget = DEFAULT_TIERS,
                     tier_dir: Path = TABLE_TIER_DIR, *, check_writable: bool = True
                     ) -> BenchConfig:
        """The multi-turn benchmark's configuration for an aggregated or bundle arm (its
        KV space per node is `kv.node_gib(self.nodes)`, passed to `serve`); a tiered
        arm's disk tier in `tier_dir`."""
        args = kv.node_args(self.nodes)
        kv_tiers = self.kv_tiers(tiers, tier_dir, check_writable=check_writable)
        if self.kind == "aggregated":
            tier_args, tier_env = aggregated_tier_args(kv_tiers) if kv_tiers else ([], {})
            return BenchConfig(name=self.name, description=self.description, kind="aggregated",
                               node_args=(*aggregated_step_args(), *args, *tier_args),
                               node_env={**aggregated_plugin_env(), **tier_env})
        if self.kind != "bundle":
            raise ValueError(f"{self.name}: no single configuration for kind {self.kind}")
        return BenchConfig(name=self.name, description=self.description, kind="bundle",
                           reuse=self.reuse, prefill_prefix_caching=self.prefill_prefix_caching,
                           node_args=tuple(args), kv_tiers=kv_tiers,
                           topology=self.resolved_topology or "pd")

    def memory(self, kv: KvBudget, tiers: TierBudget) -> dict[str, Any]:
        """What the arm may hold, summed over its nodes: engine KV (space, and the cap in
        tokens if any), host tier and disk tier (0 without tiers)."""
        return {"nodes": self.nodes, "topology": self.resolved_topology,
                "engine_kv_gib": kv.gib, "engine_kv_tokens": kv.tokens,
                "host_tier_gib": tiers.host_gib if self.tier else 0.0,
                "disk_tier_gib": tiers.disk_gib if self.tier else 0.0,
                "disk_shared": self.tier == "shared" and self.nodes > 1}


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("aggregated", "one aggregated vLLM node on both cores, prefix caching on, D's step "
        "flags and the plugin's readers", kind="aggregated"),
    Arm("affine-2", "two aggregated vLLM nodes, one core each, prefix caching on, D's step "
        "flags and the plugin's readers; each session pinned to one node", kind="affine"),
    Arm("pd-noreuse", "kvagent's P/D bundle with the router's reuse off, P's prefix cache on",
        kind="bundle", reuse=False, prefill_prefix_caching=True),
    Arm("kvagent", "kvagent as `kvagent-server up` runs it on this machine: its defaults, "
        "topology auto (single on a CPU box or one GPU, P/D with a GPU per node; the "
        "memory table names the topology that ran)", kind="bundle", reuse=True,
        topology="auto"),
    Arm("kvagent-pd", "kvagent's P/D bundle with its defaults (cross-turn KV reuse, NIXL "
        "between P and D)", kind="bundle", reuse=True),
    Arm("kvagent-replicas", "kvagent's replicas topology: two nodes, one core each, each "
        "session on one node and moved with its KV (pulled over NIXL) when its node is "
        "busy", kind="bundle", reuse=True, topology="replicas"),
    Arm("aggregated-tier", "`aggregated` plus kvagent's CPU tiers: a host tier and a disk "
        "tier of its own, generated tokens offloaded too (the same tiers as "
        "kvagent-tiers: the fair control)", kind="aggregated", tier="local"),
    Arm("kvagent-tiers", "kvagent as `kvagent-server up` runs it on this machine (topology "
        "auto) with kv_tiers: a host tier on each node and one disk tier (shared by P and D "
        "when there are both), generated tokens offloaded too", kind="bundle", reuse=True,
        topology="auto", tier="shared"),
    Arm("kvagent-pd-tiers", "kvagent's P/D bundle with kv_tiers on P and D: a host tier "
        "each, one disk tier shared by P and D, generated tokens offloaded too (D's turns "
        "reach the shared tier)", kind="bundle", reuse=True, tier="shared"),
)}
KVAGENT = "kvagent"
KVAGENT_TIERS = "kvagent-tiers"


def subject_of(names: list[str]) -> str:
    """The arm the report measures the others against: kvagent with tiers when it runs
    (plain kvagent is then one of its baselines), else kvagent, else the first other
    kvagent arm named (`kvagent-pd-tiers` against its baselines)."""
    for name in (KVAGENT_TIERS, KVAGENT):
        if name in names:
            return name
    return next((n for n in names if n.startswith(KVAGENT)), KVAGENT)
#: The arms run when `--arms` is not given: the untiered ones (the tiered arms add two
#: start-ups and two workloads per repetition; name them with `--arms`).
DEFAULT_ARMS = ("aggregated", "affine-2", "pd-noreuse", "kvagent-pd", "kvagent")


def parse_arms(text: str) -> list[Arm]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names:
        raise ValueError(f"unknown arm(s) {unknown or 'none given'}; choose from "
                         f"{', '.join(ARMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm named twice in {names}")
    return [ARMS[n] for n in names]


def sticky_round_robin(urls: list[str]) -> Callable[[int, object], str]:
    """Client-side session affinity: the i-th session goes to node i mod n, and every turn
    of it to the same node. What a sticky load balancer that assigns a session on its
    first request does, with no proxy hop (a real one adds its own latency, so this
    favours the baseline); round robin rather than a hash so a few sessions split evenly."""
    return lambda i, _conv: urls[i % len(urls)]


@contextlib.contextmanager
def serve_arm(arm: Arm, work_dir: Path, *, kv: KvBudget, startup_timeout_s: float,
              model: str | None, tiers: TierBudget = DEFAULT_TIERS
              ) -> Iterator[tuple[list[Endpoint], Callable[[int, object], str] | None]]:
    """The arm running: its endpoints (one, or one per node for `affine`) and, for
    `affine`, each session's endpoint. Everything is stopped on exit; a tiered arm's
    disk tier is `work_dir / TIER_DIR` (a fresh one per run: every run starts cold)."""
    if arm.kind != "affine":
        try:
            # absolute: each node resolves the tier directory on its own
            with serve(arm.bench_config(kv, tiers, work_dir.resolve() / TIER_DIR), work_dir,
                       kv_cache_gib=kv.node_gib(arm.nodes),
                       startup_timeout_s=startup_timeout_s, model=model) as ep:
                yield [ep], None
        finally:
            if arm.tier and arm.kind == "aggregated":
                # vLLM's shutdown leaves the node's host region in /dev/shm (the bundle's
                # stop sweeps its own): a GiB per run would pile up otherwise
                from kvagent_server.vllm_plugin.tier_files import sweep_stale_regions

                sweep_stale_regions()
        return
    cores = sorted(os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        eps = [stack.enter_context(aggregated_node(
            work_dir / f"node{i}", kv_cache_gib=kv.node_gib(arm.nodes),
            startup_timeout_s=startup_timeout_s, cpu_bind=format_cpu_list(part), model=model,
            name=f"affine{i}", engine_args=[*aggregated_step_args(), *kv.node_args(arm.nodes)],
            extra_env=aggregated_plugin_env(), pin_process=True))
            for i, part in enumerate(halves(cores))]
        yield eps, sticky_round_robin([e.base_url for e in eps])


def halves(cores: list[int]) -> list[list[int]]:
    from kvagent_server.bundle.render import partition_cores

    if len(cores) < 2:
        raise ValueError("affine-2 needs at least two cores")
    return partition_cores(cores, 2)


# ---------------------------------------------------------------------------- flags table

#: The flags and variables the table shows (what sets a step's length and the KV budget).
TABLE_FLAGS = ("--max-num-batched-tokens", "--long-prefill-token-threshold", "--block-size",
               BLOCKS_ARG, "--prefix-caching-hash-algo")
TABLE_ENV = (plugin_env.PLUGIN_ENV, plugin_env.SPIN_ENV, plugin_env.SPIN_NAP_ENV,
             KV_SPACE_ENV, "VLLM_CPU_OMP_THREADS_BIND")


def node_row(arm: str, node: str, argv: list[str] | tuple[str, ...], env: dict[str, str]
             ) -> dict[str, str]:
    """One node's row of the flags table ("default": vLLM's own)."""
    row = {"arm": arm, "node": node}
    for flag in TABLE_FLAGS:
        row[flag] = last_flag(argv, flag) or "default"
    row["prefix caching"] = ("off" if "--no-enable-prefix-caching" in argv
                             else "on" if "--enable-prefix-caching" in argv else "default")
    for var in TABLE_ENV:
        value = env.get(var)
        row[var] = "unset" if value is None else value
    row["KV tiers"] = tier_cell(last_flag(argv, "--kv-transfer-config"))
    return row


def tier_cell(kv_transfer_config: str | None) -> str:
    """The tiers a node's `--kv-transfer-config` gives it, in short: host GiB, disk GiB,
    the disk's reach and whether generated tokens are offloaded; `none` without."""
    if not kv_transfer_config:
        return "none"
    cfg = json.loads(kv_transfer_config)
    children = cfg.get("kv_connector_extra_config", {}).get("connectors") or [cfg]
    off = next((c for c in children if c.get("kv_connector") == "OffloadingConnector"), None)
    if off is None:
        return "none"
    extra = off.get("kv_connector_extra_config", {})
    parts = [f"host {extra.get('cpu_bytes_to_use', 0) / (1 << 30):g} GiB"]
    for t in extra.get("secondary_tiers", []):
        reach = "shared" if t.get("locality") == "REMOTE" else "local"
        size = t.get("size_bytes")
        parts.append(f"disk {size / (1 << 30):g} GiB {reach}" if size else f"disk {reach}")
    if not extra.get("offload_prompt_only", True):
        parts.append("generated tokens too")
    return ", ".join(parts)


def flag_rows(arms: list[Arm], *, kv: KvBudget, model: str | None,
              tiers: TierBudget = DEFAULT_TIERS) -> list[dict[str, str]]:
    """Each node's flags as the arm would start it, rendered without starting anything
    (the bundle's through its own plan, so the table shows what the bundle passes)."""
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.render import plan
    from kvagent_server.config import validate_config

    from benchmarks.multiturn.nodes import aggregated_device, bundle_settings

    rows = []
    cores = sorted(os.sched_getaffinity(0))
    for arm in arms:
        if arm.kind == "bundle":
            cfg = validate_config(bundle_settings(
                arm.bench_config(kv, tiers, check_writable=False), Path("/nonexistent"), list(range(1, 6)),
                cores=cores, kv_cache_gib=kv.node_gib(arm.nodes), startup_timeout_s=1.0,
                model=model))
            for spec in plan(cfg, gather_inputs(cfg, build_model=False)).nodes:
                rows.append(node_row(arm.name, spec.name, spec.argv, spec.env))
            continue
        binds = ([format_cpu_list(cores)] if arm.kind == "aggregated"
                 else [format_cpu_list(p) for p in halves(cores)])
        for i, bind in enumerate(binds):
            base_env, _ = aggregated_device(CPU, kv_cache_gib=kv.node_gib(arm.nodes),
                                            serve_env={}, cpu_bind=bind)
            if arm.kind == "aggregated":
                bc = arm.bench_config(kv, tiers, check_writable=False)
                argv, env = ["--enable-prefix-caching", *bc.node_args], bc.node_env
            else:
                argv = ["--enable-prefix-caching", *aggregated_step_args(),
                        *kv.node_args(arm.nodes)]
                env = aggregated_plugin_env()
            rows.append(node_row(arm.name, "node" if arm.nodes == 1 else f"node{i}", argv,
                                 {**base_env, **env}))
    return rows
