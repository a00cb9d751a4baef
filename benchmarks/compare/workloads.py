"""The named workloads of `python -m benchmarks compare`: the multi-turn agent workload and
the regimes where P/D with cross-turn reuse should win or has lost. Each is bounded in
requests and, with think times, in time; `quick` is the smoke size of each."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.compare.arms import KvBudget
from benchmarks.multiturn.workload import WorkloadSpec


@dataclass(frozen=True)
class NamedWorkload:
    name: str
    why: str
    spec: WorkloadSpec
    #: KV budget of every arm, summed over its vLLM nodes (each arm splits it evenly).
    kv: KvBudget
    #: Seconds each session waits (its tool "runs") before every later turn; 0: none.
    think_s: float = 0.0
    #: Seconds between session starts when sessions wait (so they overlap, not align).
    stagger_s: float = 0.0

    @property
    def turns(self) -> int:
        return self.spec.turns


#: The bundle's KV per node (2 GiB): every arm gets two nodes' worth in all.
DEFAULT_KV = KvBudget(gib=4)
#: Small enough that the sessions' prefixes do not all fit, on one node or two: 17,408
#: tokens per node of a two-node arm (136 blocks of 128; 136 MiB of the demo model's
#: 8 KiB per token), a little over the longest prompt it accepts (16,384), which vLLM
#: requires of any cap; 34,816 on the aggregated node.
PRESSURE_KV = KvBudget(gib=2, tokens=34_816)


def workload(name: str, *, quick: bool, seed: int = 0) -> NamedWorkload:
    """`name`'s workload; ValueError for an unknown name."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](quick, seed)


def _agent(quick: bool, seed: int) -> NamedWorkload:
    spec = WorkloadSpec.quick(seed) if quick else WorkloadSpec.full(seed)
    return NamedWorkload("agent", "the multi-turn agent workload: shared system prompt with "
                         "tool schemas, a document per conversation, tool results of "
                         "120-500 tokens", spec, DEFAULT_KV)


def _short_tool(quick: bool, seed: int) -> NamedWorkload:
    base = WorkloadSpec.quick(seed) if quick else WorkloadSpec.full(seed)
    spec = base.model_copy(update={"tool_result_tokens": (8, 40), "user_turn_tokens": (8, 24)})
    return NamedWorkload("short-tool", "tool results of 8-40 tokens: each later turn adds "
                         "little to compute, so what a turn costs is mostly fixed overhead "
                         "(where kvagent lost before)", spec, DEFAULT_KV)


def _pressure_quick(seed: int) -> WorkloadSpec:
    """The smoke size of both workloads under the pressure KV budget."""
    return WorkloadSpec(seed=seed, conversations=6, turns=3, concurrency=6,
                        system_prompt_tokens=200, context_tokens=6000,
                        tool_result_tokens=(100, 300), max_tokens=8)


def _pressure(quick: bool, seed: int) -> NamedWorkload:
    if quick:
        spec = _pressure_quick(seed)
    else:
        spec = WorkloadSpec(seed=seed, conversations=8, turns=6, concurrency=8,
                            context_tokens=7000, tool_result_tokens=(200, 800))
    return NamedWorkload("pressure", "long agent contexts, every conversation in flight, "
                         "a KV budget that cannot hold all their prefixes: prefix caches "
                         "evict what the next turn needs", spec, PRESSURE_KV)


def _long_wait(quick: bool, seed: int) -> NamedWorkload:
    if quick:
        spec = _pressure_quick(seed)
        think, stagger = 15.0, 3.0
    else:
        spec = WorkloadSpec(seed=seed, conversations=8, turns=5, concurrency=8,
                            context_tokens=6000, tool_result_tokens=(200, 800))
        think, stagger = 45.0, 10.0
    return NamedWorkload("long-wait", f"each session waits {think:.0f} s for its tool before "
                         "every later turn while the others run, under the pressure KV "
                         "budget: a prefix must survive the others' turns to be reused",
                         spec, PRESSURE_KV, think_s=think, stagger_s=stagger)


WORKLOADS = {"agent": _agent, "short-tool": _short_tool, "pressure": _pressure,
             "long-wait": _long_wait}
