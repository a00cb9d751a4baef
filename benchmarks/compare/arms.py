"""The arms `python -m benchmarks compare` runs, and the vLLM flags each node gets.

Every arm serves the same model on the same two cores with the same total KV budget
(`KvBudget`), split evenly between an arm's vLLM nodes: whole GiB of KV space per node
(`VLLM_CPU_KVCACHE_SPACE`, which vLLM-CPU reads as an integer and which the bundle sets
from `kv_cache_gib`), and, for budgets under a GiB a node, a number of KV blocks
(`--num-gpu-blocks-override`, which caps what the cache may hold whatever the space).
The aggregated nodes get the step flags kvagent's decode node gets, since they
decode too, and the plugin's reader settings; the connector-only patches stay off, as
there is no connector to patch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvagent_server.bundle.render import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_PROMPT_CAP,
    DEFAULT_DECODE_STEP_TOKENS,
    format_cpu_list,
    last_flag,
)
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

    @property
    def nodes(self) -> int:
        return 1 if self.kind == "aggregated" else 2

    def bench_config(self, kv: KvBudget) -> BenchConfig:
        """The multi-turn benchmark's configuration for an aggregated or bundle arm (its
        KV space per node is `kv.node_gib(self.nodes)`, passed to `serve`)."""
        args = kv.node_args(self.nodes)
        if self.kind == "aggregated":
            return BenchConfig(name=self.name, description=self.description, kind="aggregated",
                               node_args=(*aggregated_step_args(), *args),
                               node_env=aggregated_plugin_env())
        if self.kind != "bundle":
            raise ValueError(f"{self.name}: no single configuration for kind {self.kind}")
        return BenchConfig(name=self.name, description=self.description, kind="bundle",
                           reuse=self.reuse, prefill_prefix_caching=self.prefill_prefix_caching,
                           node_args=tuple(args))


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("aggregated", "one aggregated vLLM node on both cores, prefix caching on, D's step "
        "flags and the plugin's readers", kind="aggregated"),
    Arm("affine-2", "two aggregated vLLM nodes, one core each, prefix caching on, D's step "
        "flags and the plugin's readers; each session pinned to one node", kind="affine"),
    Arm("pd-noreuse", "kvagent's P/D bundle with the router's reuse off, P's prefix cache on",
        kind="bundle", reuse=False, prefill_prefix_caching=True),
    Arm("kvagent", "kvagent's P/D bundle with its defaults (cross-turn KV reuse)",
        kind="bundle", reuse=True),
)}
KVAGENT = "kvagent"


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
              model: str | None
              ) -> Iterator[tuple[list[Endpoint], Callable[[int, object], str] | None]]:
    """The arm running: its endpoints (one, or one per node for `affine`) and, for
    `affine`, each session's endpoint. Everything is stopped on exit."""
    if arm.kind != "affine":
        with serve(arm.bench_config(kv), work_dir, kv_cache_gib=kv.node_gib(arm.nodes),
                   startup_timeout_s=startup_timeout_s, model=model) as ep:
            yield [ep], None
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
               BLOCKS_ARG)
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
    return row


def flag_rows(arms: list[Arm], *, kv: KvBudget, model: str | None) -> list[dict[str, str]]:
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
                arm.bench_config(kv), Path("/nonexistent"), list(range(1, 6)),
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
            argv = ["--enable-prefix-caching", *aggregated_step_args(),
                    *kv.node_args(arm.nodes)]
            rows.append(node_row(arm.name, "node" if arm.nodes == 1 else f"node{i}", argv,
                                 {**base_env, **aggregated_plugin_env()}))
    return rows
