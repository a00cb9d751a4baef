"""Bring each benchmark configuration up and down: the kvagent bundle (router + P/D nodes)
through `kvagent_server.bundle.supervisor.Bundle`, and a plain aggregated vLLM node.

Only one configuration runs at a time: on a small CPU box two would fight for the cores and
the numbers would measure the fight.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import httpx
import psutil
from kvagent_server.common.types import Device, Topology
from kvagent_server.vllm_plugin.env import (
    CPU_SPIN_NAP_US,
    DEFAULT_SPIN_MS,
    SPIN_ENV,
    SPIN_NAP_ENV,
)
from pydantic import BaseModel, ConfigDict, Field

from benchmarks._procs import free_ports

VLLM_MODULE = "vllm.entrypoints.openai.api_server"

#: The one GPU every node of a configuration uses on `cuda` (CUDA_VISIBLE_DEVICES): one GPU
#: holds P and D, each with its own share of GPU memory (on `cpu` the cores are partitioned).
GPU = "0"
#: Most of the GPU's memory the nodes of one configuration may claim together. vLLM
#: checks at start-up that free memory >= total x `--gpu-memory-utilization`: with the
#: default 0.9 a second node beside the first can fail that check.
GPU_MEMORY_TOTAL = 0.9
#: A node's share when it is alone or one of two (P+D): 0.4 of the GPU.
GPU_MEMORY_PER_NODE = 0.4


class BenchConfig(BaseModel):
    """One configuration under test."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    kind: Literal["bundle", "aggregated"]
    reuse: bool = False  # router setting `reuse` (bundle only)
    prefill_prefix_caching: bool = True  # P's vLLM prefix cache (bundle only)
    # The path policy's parameters (bundle only; every arm runs `cost_model`, and these
    # are its `router.policy.params`: `router_policy`).
    #: `skip_prefill_max_tokens`: None lets the cost model choose between `d_direct` and
    #: `pd_reuse`; 0 never skips P; a huge value always does.
    skip_prefill_max_tokens: int | None = None
    #: `queue_aware_paths`: the cost model also prices the work in flight on each node;
    #: None: the policy's default.
    queue_aware_paths: bool | None = None
    #: `d_direct_stall_max_ms`: None, the policy's default.
    d_direct_stall_max_ms: float | None = None
    #: True: no such cap (the parameter null), the cost model's sums alone decide.
    stall_cap_off: bool = False
    #: `fresh_on_decode`. None: the policy's default, or `never` with a fixed
    #: `skip_prefill_max_tokens` (a fixed threshold is P/D as designed: P computes every
    #: prompt it does not skip).
    fresh_on_decode: Literal["auto", "never", "always"] | None = None
    #: `skip_tokenize_extensions`: False tokenizes every reused turn, as the router did
    #: before turns could skip it.
    skip_tokenize_extensions: bool = True
    #: Router setting `engine.forward_prompt_ids` (bundle only): False lets D render the chat
    #: again instead of taking P's prompt token ids.
    forward_prompt_ids: bool = True
    #: Router setting `engine.forward_first_token` (bundle only): False lets D sample its own
    #: first token (one more step) instead of emitting and computing from P's.
    forward_first_token: bool = True
    prefill_count: int = Field(default=1, ge=1, le=4)  # P nodes (bundle only)
    #: The bundle's `topology` (bundle only): `pd` (P and D nodes, what most configurations
    #: measure), `single` (one node serves every turn, what `up` picks on a CPU box) or
    #: `replicas` (`REPLICAS` symmetric nodes, sessions moving with their KV).
    topology: Topology = "pd"
    #: KV block size in tokens (bundle only); None: the bundle's default (128 on CPU).
    block_size: int | None = None
    #: Environment for every vLLM node: every P and D node over the plugin's defaults, or
    #: the aggregated node over its own.
    node_env: dict[str, str] = Field(default_factory=dict)
    #: Environment for the P nodes only (bundle only), over `node_env`.
    prefill_env: dict[str, str] = Field(default_factory=dict)
    #: More vLLM arguments for every vLLM node of the configuration (the aggregated node,
    #: or every P and D node), after the run's own `engine_args`.
    node_args: tuple[str, ...] = ()
    #: Bundle setting `pin_processes` (bundle only): False pins only the threads that
    #: compute, as the bundle did before; the HTTP server and the rest float.
    pin_processes: bool = True
    #: D's vLLM token budget per step (bundle setting `decode.max_num_batched_tokens`);
    #: None: the bundle's default (512 on CPU).
    decode_step_tokens: int | None = None
    #: D's cap per prompt per step while other requests share it (bundle setting
    #: `decode.long_prefill_token_threshold`, 0 off); None: the bundle's default (128 on CPU).
    decode_prompt_cap: int | None = None
    #: P's cap per prompt per step while other requests share it (bundle setting
    #: `prefill.long_prefill_token_threshold`, 0 off); None: the bundle's default (off).
    prefill_prompt_cap: int | None = None
    #: The bundle's `kv_tiers:` section (bundle only; None: no tiers). An aggregated
    #: node's tiers travel in `node_args`/`node_env` (its own connector flags).
    kv_tiers: dict[str, Any] | None = None

    def router_policy(self) -> dict[str, Any]:
        """The router's `policy` section this configuration runs: `cost_model` with the
        parameters it sets (the rest: the policy's defaults)."""
        params: dict[str, Any] = {}
        if self.skip_prefill_max_tokens is not None:
            params["skip_prefill_max_tokens"] = self.skip_prefill_max_tokens
        if self.queue_aware_paths is not None:
            params["queue_aware_paths"] = self.queue_aware_paths
        if self.stall_cap_off:
            params["d_direct_stall_max_ms"] = None
        elif self.d_direct_stall_max_ms is not None:
            params["d_direct_stall_max_ms"] = self.d_direct_stall_max_ms
        if self.fresh_on_decode is not None:
            params["fresh_on_decode"] = self.fresh_on_decode
        elif self.skip_prefill_max_tokens is not None:
            params["fresh_on_decode"] = "never"
        if not self.skip_tokenize_extensions:
            params["skip_tokenize_extensions"] = False
        return {"name": "cost_model", "params": params}


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig(name="kvagent", kind="bundle", reuse=True,
                description="kvagent router with cross-turn KV reuse, P/D with NIXL"),
    BenchConfig(name="pd_noreuse_pcache_off", kind="bundle", reuse=False,
                prefill_prefix_caching=False,
                description="same P/D nodes, router reuse off, P prefix cache off (AWS's setup)"),
    BenchConfig(name="pd_noreuse_pcache_on", kind="bundle", reuse=False,
                prefill_prefix_caching=True,
                description="same P/D nodes, router reuse off, P prefix cache on"),
    BenchConfig(name="aggregated", kind="aggregated",
                description="one aggregated vLLM node with prefix caching (no P/D)"),
)}

#: More configurations for the load mode (`load.py`): the cost model against each fixed
#: policy, and two P nodes. Not in `CONFIGS`, whose four are the multi-turn run's.
ALWAYS_SKIP_P = 1_000_000
#: vLLM's token budget per engine step: chunked prefill splits a prompt into such steps.
STEP_BUDGET_ARG = "--max-num-batched-tokens"
#: vLLM's budget on CPU for its API server (the bundle gives D 128).
CPU_VLLM_STEP_TOKENS = 2048
LOAD_ONLY_CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig(name="kvagent_queue_aware", kind="bundle", reuse=True, queue_aware_paths=True,
                description="kvagent whose cost model also prices the work in flight on "
                "P and D (router.policy.params.queue_aware_paths)"),
    BenchConfig(name="kvagent_ttft_lines", kind="bundle", reuse=True, queue_aware_paths=False,
                description="kvagent whose cost model compares each path's learned TTFT "
                "line alone, blind to the work in flight "
                "(router.policy.params.queue_aware_paths off)"),
    BenchConfig(name="kvagent_stall_cap", kind="bundle", reuse=True,
                d_direct_stall_max_ms=40,
                description="kvagent whose cost model sends a delta to P while streams decode "
                "on D if D would compute it for over 40 ms "
                "(router.policy.params.d_direct_stall_max_ms; set explicitly: the router's "
                "default from 2026-12-04 evening until it was set from D's step time)"),
    BenchConfig(name="kvagent_stall_cap_off", kind="bundle", reuse=True, stall_cap_off=True,
                description="kvagent whose cost model's summed costs alone choose between "
                "d_direct and pd_reuse, however long a delta stalls D's streams "
                "(router.policy.params.d_direct_stall_max_ms null), as before 2026-12-04 "
                "evening"),
    BenchConfig(name="kvagent_fresh_on_p", kind="bundle", reuse=True, fresh_on_decode="never",
                description="kvagent whose P computes every first turn, however much work "
                "is queued on it (router.policy.params.fresh_on_decode never)"),
    BenchConfig(name="kvagent_always_pd_reuse_fresh_auto", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, fresh_on_decode="auto",
                description="kvagent_always_pd_reuse whose first turns D computes itself "
                "while P is busier (router.policy.params.fresh_on_decode auto)"),
    BenchConfig(name="kvagent_tokenize_always", kind="bundle", reuse=True,
                skip_tokenize_extensions=False,
                description="kvagent that tokenizes every reused turn, even one whose "
                "messages extend the held turn's "
                "(router.policy.params.skip_tokenize_extensions off)"),
    BenchConfig(name="kvagent_render", kind="bundle", reuse=True, forward_prompt_ids=False,
                description="kvagent whose D renders the chat again after a P leg instead "
                "of taking P's prompt token ids (router.engine.forward_prompt_ids off)"),
    BenchConfig(name="kvagent_always_d_direct", kind="bundle", reuse=True,
                skip_prefill_max_tokens=ALWAYS_SKIP_P,
                description="kvagent with a fixed policy: every reused turn skips P "
                "(d_direct)"),
    BenchConfig(name="kvagent_always_pd_reuse", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0,
                description="kvagent with a fixed policy: every reused turn takes P, which "
                "pulls the prefix from D (pd_reuse)"),
    BenchConfig(name="kvagent_always_pd_reuse_tokenize_always", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, skip_tokenize_extensions=False,
                description="kvagent_always_pd_reuse that tokenizes every reused turn "
                "(router.policy.params.skip_tokenize_extensions off: the router verifies "
                "every offer itself, as it did before P checked its pulls)"),
    BenchConfig(name="kvagent_always_pd_reuse_render", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, forward_prompt_ids=False,
                description="kvagent_always_pd_reuse whose D renders the chat again "
                "(router.engine.forward_prompt_ids off), as before D took P's prompt token ids"),
    BenchConfig(name="kvagent_always_pd_reuse_own_token", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, forward_first_token=False,
                description="kvagent_always_pd_reuse whose D recomputes the prompt's last "
                "token to sample a first token of its own (router.engine.forward_first_token off), "
                "as before D took P's"),
    BenchConfig(name="kvagent_always_pd_reuse_again", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0,
                description="kvagent_always_pd_reuse once more: an A/A control for what "
                "the order of configurations in one run moves"),
    BenchConfig(name="kvagent_always_pd_reuse_spin1", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, node_env={SPIN_ENV: "1"},
                description="kvagent_always_pd_reuse whose nodes' shared-memory readers "
                f"busy-wait 1 ms after a message before sleeping (plugin spin_ms 1, "
                f"default {DEFAULT_SPIN_MS})"),
    BenchConfig(name="kvagent_spin1", kind="bundle", reuse=True, node_env={SPIN_ENV: "1"},
                description="kvagent whose nodes' shared-memory readers busy-wait 1 ms "
                f"after a message before sleeping (plugin spin_ms 1, default "
                f"{DEFAULT_SPIN_MS})"),
    BenchConfig(name="kvagent_always_pd_reuse_pspin1", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, prefill_env={SPIN_ENV: "1"},
                description="kvagent_always_pd_reuse whose P node's shared-memory readers "
                "busy-wait 1 ms after a message before sleeping, D's the default "
                f"{DEFAULT_SPIN_MS} ms"),
    BenchConfig(name="kvagent_pspin1", kind="bundle", reuse=True,
                prefill_env={SPIN_ENV: "1"},
                description="kvagent whose P node's shared-memory readers busy-wait 1 ms "
                f"after a message before sleeping, D's the default {DEFAULT_SPIN_MS} ms"),
    BenchConfig(name="kvagent_always_pd_reuse_yield", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, node_env={SPIN_NAP_ENV: "0"},
                description="kvagent_always_pd_reuse whose nodes' shared-memory readers "
                "yield between checks inside their busy-wait window, as vLLM's do, instead "
                f"of napping (plugin nap_us 0, CPU default {CPU_SPIN_NAP_US})"),
    BenchConfig(name="kvagent_yield", kind="bundle", reuse=True, node_env={SPIN_NAP_ENV: "0"},
                description="kvagent whose nodes' shared-memory readers yield between "
                "checks inside their busy-wait window, as vLLM's do, instead of napping "
                f"(plugin nap_us 0, CPU default {CPU_SPIN_NAP_US})"),
    BenchConfig(name="kvagent_own_token", kind="bundle", reuse=True,
                forward_first_token=False,
                description="kvagent whose D samples its own first token after a P leg "
                "(router.engine.forward_first_token off)"),
    BenchConfig(name="kvagent_always_pd_reuse_block512", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, block_size=512,
                description="kvagent_always_pd_reuse with 512-token KV blocks: a pull moves "
                "4x fewer, 4x larger NIXL descriptors (reuse aligns to 512 tokens)"),
    BenchConfig(name="kvagent_pin_off", kind="bundle", reuse=True, pin_processes=False,
                description="kvagent whose nodes pin only the threads that compute "
                "(bundle pin_processes off): their HTTP servers and other threads float "
                "over both cores"),
    BenchConfig(name="kvagent_always_pd_reuse_pin_off", kind="bundle", reuse=True,
                skip_prefill_max_tokens=0, pin_processes=False,
                description="kvagent_always_pd_reuse whose nodes pin only the threads that "
                "compute (bundle pin_processes off)"),
    BenchConfig(name="kvagent_d_steps_2048", kind="bundle", reuse=True,
                decode_step_tokens=CPU_VLLM_STEP_TOKENS, decode_prompt_cap=0,
                description="kvagent whose D computes up to vLLM's CPU default of "
                f"{CPU_VLLM_STEP_TOKENS} tokens per step, with no cap per prompt"),
    BenchConfig(name="kvagent_pin_off_d_steps_2048", kind="bundle", reuse=True,
                pin_processes=False, decode_step_tokens=CPU_VLLM_STEP_TOKENS,
                decode_prompt_cap=0,
                description="kvagent as the bundle was before 2026-12-04: only the "
                "compute threads pinned, D's steps up to vLLM's CPU default of "
                f"{CPU_VLLM_STEP_TOKENS} tokens"),
    BenchConfig(name="kvagent_d_steps_128", kind="bundle", reuse=True,
                decode_step_tokens=128, decode_prompt_cap=0,
                description="kvagent as the bundle was before 2026-12-04 evening: D "
                "computes at most 128 tokens per step, also when nothing else runs on it"),
    BenchConfig(name="kvagent_d_steps_2048_cap128", kind="bundle", reuse=True,
                decode_step_tokens=CPU_VLLM_STEP_TOKENS, decode_prompt_cap=128,
                description="kvagent whose D computes a prompt in 128-token steps while "
                f"other requests share it, and in steps of up to {CPU_VLLM_STEP_TOKENS} "
                "alone"),
    BenchConfig(name="kvagent_p_cap512", kind="bundle", reuse=True, prefill_prompt_cap=512,
                description="kvagent whose P computes at most 512 tokens of one prompt per "
                "step while other requests share it, so a first turn arriving behind a "
                "long delta shares P's steps instead of waiting for most of it"),
    BenchConfig(name="aggregated_chunk256", kind="aggregated",
                node_args=(STEP_BUDGET_ARG, "256"),
                description="the aggregated node computing at most 256 tokens per step: "
                "shorter gaps between tokens, slower prompts"),
    BenchConfig(name="kvagent_2p", kind="bundle", reuse=True, prefill_count=2,
                description="kvagent with two P nodes sharing P's cores, one D"),
    BenchConfig(name="pd_noreuse_pcache_on_2p", kind="bundle", reuse=False,
                prefill_prefix_caching=True, prefill_count=2,
                description="two P nodes sharing P's cores, one D, router reuse off, "
                "P prefix cache on"),
)}
ALL_CONFIGS: dict[str, BenchConfig] = {**CONFIGS, **LOAD_ONLY_CONFIGS}

#: The reference for answer agreement: recomputes every prompt on P, the plainest path.
REFERENCE_CONFIG = "pd_noreuse_pcache_off"


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # ends in /v1
    model: str
    log_dir: Path
    #: The bundle's vLLM nodes (empty for an aggregated node).
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()


def own_pids() -> set[int]:
    """This process and every process it started (its nodes, their workers)."""
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.children(recursive=True))}


def foreign_vllm() -> list[str]:
    """Command lines of vLLM API servers not started by this process (another user's P/D
    pair, a leftover): benchmarking beside them measures contention, not the system."""
    seen = {proc.pid: " ".join(proc.info.get("cmdline") or [])
            for proc in psutil.process_iter(["cmdline"])}
    own = own_pids()  # after the scan: a node started meanwhile is still ours
    return [f"{pid} {cmd[:160]}" for pid, cmd in seen.items()
            if VLLM_MODULE in cmd and pid not in own]


def wait_until_alone(timeout_s: float, *, poll_s: float = 10.0, log=print) -> None:
    """Wait (up to `timeout_s`) until no foreign vLLM runs; RuntimeError if one still does."""
    deadline = time.monotonic() + timeout_s
    said = None
    while True:
        others = foreign_vllm()
        if not others:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError("other vLLM processes are running:\n  " + "\n  ".join(others))
        if said != len(others):
            log(f"waiting for {len(others)} vLLM process(es) not started here to exit")
            said = len(others)
        time.sleep(poll_s)


def steal_ticks() -> int | None:
    """Clock ticks the hypervisor gave this machine's cores to others since boot (the
    `steal` column of /proc/stat); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else None


#: pid -> (start time, name, user + system CPU seconds), as `process_cpu` reads them.
ProcessCpu = dict[int, tuple[float, str, float]]


def process_cpu() -> ProcessCpu:
    """Every process that can be read, with its start time (a pid may be reused)."""
    out = {}
    for proc in psutil.process_iter(["create_time", "name", "cpu_times"]):
        times = proc.info.get("cpu_times")
        if times is not None:
            out[proc.pid] = (proc.info.get("create_time") or 0.0, proc.info.get("name") or "?",
                             times.user + times.system)
    return out


def cpu_outside(before: ProcessCpu, after: ProcessCpu, own: set[int]) -> dict[str, float]:
    """CPU seconds by process name that processes not in `own` used between two
    `process_cpu` snapshots, most first; one started meanwhile counts from zero."""
    used: dict[str, float] = {}
    for pid, (started, name, cpu) in after.items():
        if pid in own:
            continue
        was = before.get(pid)
        spent = cpu - was[2] if was is not None and was[0] == started else cpu
        if spent > 0:
            used[name] = used.get(name, 0.0) + spent
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


class ContentionWatch:
    """Samples `foreign_vllm()` in a thread while a workload runs; `.max` is the most seen.
    `.load_max`: the highest 1-minute load average seen (it counts the benchmark's own
    threads too: the engines' exceed the cores). What competed for the cores, over the
    whole watch: `.steal_s`, CPU time the hypervisor gave to other machines (None where
    unknown), and `.other_cpu`, CPU seconds by name of processes outside this one and its
    children."""

    def __init__(self, every_s: float = 2.0) -> None:
        import threading

        self.max = 0
        self.load_max = 0.0
        self.steal_s: float | None = None
        self.other_cpu: dict[str, float] = {}
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contention-watch", daemon=True)
        self._steal0: int | None = None
        self._cpu0: ProcessCpu = {}

    def _run(self) -> None:
        while True:
            self.max = max(self.max, len(foreign_vllm()))
            self.load_max = max(self.load_max, os.getloadavg()[0])
            if self._stop.wait(self._every):
                return

    def __enter__(self) -> Self:
        self._steal0, self._cpu0 = steal_ticks(), process_cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.other_cpu = cpu_outside(self._cpu0, process_cpu(), own_pids())
        steal = steal_ticks()
        if steal is not None and self._steal0 is not None:
            self.steal_s = (steal - self._steal0) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serve(config: BenchConfig, work_dir: Path, *, kv_cache_gib: int = 2,
          startup_timeout_s: float = 900.0, model: str | None = None,
          device: Device = "cpu", engine_args: list[str] | None = None
          ) -> Iterator[Endpoint]:
    """The configuration serving `model` (a built-in id or a path; None: the demo model),
    running; stopped (with every child process) on exit. `engine_args`: more vLLM
    arguments for every node (e.g. `-O0`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    if config.kind == "aggregated":
        with aggregated_node(work_dir, kv_cache_gib=kv_cache_gib,
                             startup_timeout_s=startup_timeout_s, model=model,
                             device=device, extra_env=config.node_env,
                             engine_args=[*(engine_args or []), *config.node_args]) as ep:
            yield ep
    else:
        with bundle(config, work_dir, kv_cache_gib=kv_cache_gib,
                    startup_timeout_s=startup_timeout_s, model=model, device=device,
                    engine_args=engine_args) as ep:
            yield ep


def gpu_memory_fraction(nodes: int) -> float:
    """`--gpu-memory-utilization` of each of `nodes` vLLM nodes sharing one GPU: at most
    `GPU_MEMORY_PER_NODE`, and together at most `GPU_MEMORY_TOTAL`. The KV cache itself is
    sized by `--kv-cache-memory-bytes` (kv_cache_gib), which vLLM honours over the
    fraction; the fraction is the start-up check's bar and the node's budget."""
    if nodes < 1:
        raise ValueError(f"nodes: {nodes} < 1")
    return min(GPU_MEMORY_PER_NODE, int(GPU_MEMORY_TOTAL / nodes * 100) / 100)


def bundle_settings(config: BenchConfig, run_dir: Path, ports: list[int], *, cores: list[int],
                    kv_cache_gib: int, startup_timeout_s: float, model: str | None = None,
                    device: Device = "cpu", engine_args: list[str] | None = None) -> dict:
    """The bundle configuration of `config`: `ports` are P's HTTP and side-channel ports
    (prefill_count each), then D's two and the router's.

    `device="cuda"`: every node on GPU 0 (`cuda_devices`), each with a share of its memory
    (`gpu_memory_fraction`), no CPU pinning; `cores` is then unused."""
    n_p = config.prefill_count
    engine_args = [*(engine_args or []), *config.node_args]
    if config.topology == "replicas":
        return replicas_settings(config, run_dir, ports, kv_cache_gib=kv_cache_gib,
                                 startup_timeout_s=startup_timeout_s, model=model,
                                 device=device, engine_args=engine_args)
    if len(ports) != 2 * n_p + 3:
        raise ValueError(f"{config.name}: need {2 * n_p + 3} ports, got {len(ports)}")
    prefill: dict = {"count": n_p, "ports": ports[:n_p], "side_channel_ports": ports[n_p:2 * n_p],
                     "prefix_caching": config.prefill_prefix_caching}
    decode: dict = {"ports": [ports[2 * n_p]], "side_channel_ports": [ports[2 * n_p + 1]]}
    if device == "cuda":
        share = ["--gpu-memory-utilization", f"{gpu_memory_fraction(n_p + 1):g}"]
        prefill["cuda_devices"], decode["cuda_devices"] = [GPU] * n_p, [GPU]
        prefill["extra_args"] = [*share, *engine_args]
        decode["extra_args"] = [*share, *engine_args]
    else:
        if n_p > 1:
            p_binds, d_bind = shared_prefill_binds(cores, n_p)
            prefill["cpu_binds"], decode["cpu_binds"] = p_binds, [d_bind]
        if engine_args:
            prefill["extra_args"], decode["extra_args"] = list(engine_args), list(engine_args)
    if config.decode_step_tokens is not None:
        decode["max_num_batched_tokens"] = config.decode_step_tokens
    if config.decode_prompt_cap is not None:
        decode["long_prefill_token_threshold"] = config.decode_prompt_cap
    if config.prefill_prompt_cap is not None:
        prefill["long_prefill_token_threshold"] = config.prefill_prompt_cap
    if config.node_env or config.prefill_env:
        prefill["extra_env"] = {**config.node_env, **config.prefill_env}
        decode["extra_env"] = dict(config.node_env)
    # server_timing: the per-stage budget of each turn reaches the records
    router: dict = {"port": ports[-1], "reuse": config.reuse, "server_timing": True,
                    "policy": config.router_policy()}
    engine: dict[str, bool] = {}
    if not config.forward_prompt_ids:
        engine["forward_prompt_ids"] = False
    if not config.forward_first_token:
        engine["forward_first_token"] = False
    if engine:
        router["engine"] = engine
    return {
        **({"block_size": config.block_size} if config.block_size else {}),
        **({"device": "cuda", "cpu_pinning": False} if device == "cuda" else {}),
        **({} if config.pin_processes else {"pin_processes": False}),
        "name": f"mtbench-{config.name}".replace("_", "-"),
        # Named, never `auto`: a configuration measures the same thing on every machine.
        "topology": config.topology,
        "model": model,
        "run_dir": str(run_dir),
        "kv_cache_gib": kv_cache_gib,
        "startup_timeout_s": startup_timeout_s,
        **({"prefill": prefill} if config.topology == "pd" else {}),
        "decode": decode,
        "router": router,
        **({"kv_tiers": config.kv_tiers} if config.kv_tiers else {}),
    }


#: The replicas topology's nodes in a benchmark: one a core on this 2-core machine.
REPLICAS = 2


def replicas_settings(config: BenchConfig, run_dir: Path, ports: list[int], *,
                      kv_cache_gib: int, startup_timeout_s: float, model: str | None,
                      device: Device, engine_args: list[str]) -> dict:
    """The bundle configuration of a `replicas` configuration: `ports` are each node's
    HTTP and side-channel ports, then the router's. The bundle pins each node to its own
    cores; every node gets D's step settings (each decodes)."""
    if device != "cpu":
        raise ValueError(f"{config.name}: the replicas benchmark runs on CPU only")
    if len(ports) != 2 * REPLICAS + 1:
        raise ValueError(f"{config.name}: need {2 * REPLICAS + 1} ports, got {len(ports)}")
    decode: dict = {"count": REPLICAS, "ports": ports[0:2 * REPLICAS:2],
                    "side_channel_ports": ports[1:2 * REPLICAS:2]}
    if engine_args:
        decode["extra_args"] = list(engine_args)
    if config.decode_step_tokens is not None:
        decode["max_num_batched_tokens"] = config.decode_step_tokens
    if config.decode_prompt_cap is not None:
        decode["long_prefill_token_threshold"] = config.decode_prompt_cap
    if config.node_env:
        decode["extra_env"] = dict(config.node_env)
    return {
        **({"block_size": config.block_size} if config.block_size else {}),
        **({} if config.pin_processes else {"pin_processes": False}),
        "name": f"mtbench-{config.name}".replace("_", "-"), "topology": "replicas",
        "model": model, "run_dir": str(run_dir), "kv_cache_gib": kv_cache_gib,
        "startup_timeout_s": startup_timeout_s, "decode": decode,
        "router": {"port": ports[-1], "reuse": config.reuse, "server_timing": True,
                   "policy": config.router_policy()},
        **({"kv_tiers": config.kv_tiers} if config.kv_tiers else {}),
    }


def port_count(config: BenchConfig) -> int:
    """The free ports `bundle_settings` takes for `config`."""
    if config.topology == "replicas":
        return 2 * REPLICAS + 1
    return 2 * config.prefill_count + 3


@contextmanager
def bundle(config: BenchConfig, work_dir: Path, *, kv_cache_gib: int,
           startup_timeout_s: float, model: str | None = None, device: Device = "cpu",
           engine_args: list[str] | None = None) -> Iterator[Endpoint]:
    """The kvagent bundle on free loopback ports, run directory inside `work_dir`."""
    from kvagent_server.bundle.supervisor import Bundle
    from kvagent_server.config import validate_config

    ports = free_ports(port_count(config))
    cfg = validate_config(bundle_settings(
        config, work_dir / "run", ports, cores=sorted(os.sched_getaffinity(0)),
        kv_cache_gib=kv_cache_gib, startup_timeout_s=startup_timeout_s, model=model,
        device=device, engine_args=engine_args))
    b = Bundle(cfg)
    try:
        b.start(wait=True)
        assert b.router_url is not None
        yield Endpoint(base_url=b.router_url.rstrip("/") + "/v1", model=b.state.model,
                       log_dir=b.run_dir / "logs",
                       prefill_urls=tuple(b.node_urls("prefill")),
                       decode_urls=tuple(b.node_urls("decode")))
    finally:
        survivors = b.stop()
        if survivors:
            print(f"warning: bundle processes survived stop: {survivors}", file=sys.stderr)


def shared_prefill_binds(cores: list[int], prefill_count: int) -> tuple[list[str], str]:
    """CPU binds for several P nodes and one D: the P nodes share the cores one P gets in
    the default 1P+1D bundle, D keeps its own. The comparison with one P then isolates
    placement across P nodes; the cores given to prefill and to decode stay the same."""
    from kvagent_server.bundle.render import format_cpu_list, partition_cores

    if len(cores) < 2:
        raise ValueError("P and D need at least two cores between them")
    p_cores, d_cores = partition_cores(cores, 2)
    return [format_cpu_list(p_cores)] * prefill_count, format_cpu_list(d_cores)


def aggregated_args(model_path: str, port: int, serve_args: list[str] | None = None
                    ) -> list[str]:
    """What many users run today: one node, prefix caching on, cached-token counts on.
    `serve_args`: the model's own vLLM arguments (default: the demo model's)."""
    if serve_args is None:
        from kvagent_server.models import demo as demo_model

        serve_args = demo_model.demo_serve_args()
    return ["--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            *serve_args, "--enable-prefix-caching", "--enable-prompt-tokens-details"]


def aggregated_device(device: Device, *, kv_cache_gib: int, serve_env: dict[str, str],
                      cpu_bind: str | None = None, ncpu: int = 1
                      ) -> tuple[dict[str, str], list[str]]:
    """The aggregated node's environment and device arguments. CPU: its KV space and all
    cores (`0-<ncpu-1>`) or `cpu_bind`. CUDA: GPU 0, the same KV size as a bundle node
    (`--kv-cache-memory-bytes`, which is what the bundle renders), a node's share of GPU
    memory, and the bundle's block size; no VLLM_CPU_* variables."""
    if device == "cuda":
        from kvagent_server.bundle.render import DEFAULT_BLOCK_SIZE

        return ({**serve_env, "CUDA_VISIBLE_DEVICES": GPU},
                ["--kv-cache-memory-bytes", str(kv_cache_gib * 1024**3),
                 "--gpu-memory-utilization", f"{gpu_memory_fraction(1):g}",
                 "--block-size", str(DEFAULT_BLOCK_SIZE["cuda"])])
    return ({**serve_env, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
             "VLLM_CPU_OMP_THREADS_BIND": cpu_bind or f"0-{ncpu - 1}"}, [])


@contextmanager
def aggregated_node(work_dir: Path, *, kv_cache_gib: int, startup_timeout_s: float,
                    cpu_bind: str | None = None, model: str | None = None,
                    device: Device = "cpu", engine_args: list[str] | None = None,
                    extra_env: dict[str, str] | None = None, name: str = "aggregated",
                    pin_process: bool = False) -> Iterator[Endpoint]:
    """A plain `python -m vllm.entrypoints.openai.api_server` serving a built-in model.
    `extra_env`: over its own environment. `pin_process` with `cpu_bind` on CPU: every
    thread of the node runs on those cores, as the bundle pins its nodes
    (`pin_processes`), so two nodes beside each other do not share a core; without it
    only the compute threads are bound. `name`: its log's and process mark's."""
    from kvagent_server.bundle import processes
    from kvagent_server.bundle.render import parse_cpu_list
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(model)
    if builtin is None:
        raise ValueError(f"aggregated: {model!r} is not a built-in model id")
    model_path = str(builtin.ensure(None))
    (port,) = free_ports(1)
    run_dir = work_dir / "run"
    log_path = run_dir / "logs" / f"{name}.log"
    env, device_args = aggregated_device(device, kv_cache_gib=kv_cache_gib,
                                         serve_env=builtin.serve_env(), cpu_bind=cpu_bind,
                                         ncpu=len(os.sched_getaffinity(0)))
    affinity = (parse_cpu_list(cpu_bind) if pin_process and cpu_bind and device == "cpu"
                else None)
    popen = processes.launch([sys.executable, "-m", VLLM_MODULE,
                              *aggregated_args(model_path, port,
                                               builtin.serve_args(builtin.max_model_len)),
                              *device_args, *(engine_args or [])],
                             env={**env, **(extra_env or {})}, log_path=log_path,
                             run_dir=run_dir, name=name, cpu_affinity=affinity)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if popen.poll() is not None:
                raise RuntimeError(f"{name} vLLM exited with {popen.returncode}; "
                                   f"see {log_path}")
            try:
                if httpx.get(f"{root}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{name} vLLM not healthy after {startup_timeout_s:.0f}"
                                   f" s; see {log_path}")
            time.sleep(0.5)
        yield Endpoint(base_url=f"{root}/v1", model=builtin.name,
                       log_dir=log_path.parent)
    finally:
        survivors = processes.terminate([popen.pid], run_dir, name=name, grace=15.0,
                                        reap=[popen])
        if survivors:
            print(f"warning: vLLM processes survived stop: {survivors}", file=sys.stderr)


def log_tails(log_dir: Path, lines: int = 40) -> str:
    """The last lines of every log in `log_dir`, for a failed configuration's report."""
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"==> {path.name} <==\n" + "\n".join(text))
    return "\n".join(parts)
