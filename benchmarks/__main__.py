"""`python -m benchmarks SUBCOMMAND ...`: every benchmark by one name.

    python -m benchmarks --help                 # the list below
    python -m benchmarks compare --quick        # the headline comparison
    python -m benchmarks multiturn --help       # any benchmark's own options

Each subcommand runs the benchmark's own module as `python -m MODULE ARGS` would, so its
options and output are the module's; nothing heavy is imported to print this list.
Processes a benchmark starts for itself (fake backends, the bare proxy) are not listed:
they are parts, not benchmarks.
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    module: str
    what: str
    #: Needs real vLLM nodes: run it under `flock /tmp/kvagent-vllm.lock` on a quiet machine.
    vllm: bool = False


BENCHMARKS: dict[str, Benchmark] = {
    "compare": Benchmark(
        "benchmarks.compare.run", "every arm (aggregated, affine-2, pd-noreuse, kvagent) on one "
        "workload, into one report", vllm=True),
    "decode-ab": Benchmark(
        "benchmarks.compare.decode_ab", "streams decoding at once on the aggregated node and "
        "on what `up` runs here (node direct, through its router), interleaved A/B", vllm=True),
    "outside": Benchmark(
        "benchmarks.outside.run", "the same arms measured by an outside harness (aiperf, "
        "multi-turn, session id only)", vllm=True),
    "multiturn": Benchmark(
        "benchmarks.multiturn.run", "the multi-turn agent workload against each configuration",
        vllm=True),
    "multiturn-load": Benchmark(
        "benchmarks.multiturn.load", "goodput under load: sessions arriving over time", vllm=True),
    "first-token": Benchmark(
        "benchmarks.multiturn.first_token", "D's first token against P's, interleaved A/B",
        vllm=True),
    "floor": Benchmark(
        "benchmarks.multiturn.floor", "a reused turn's measured floor, and measured / floor per "
        "path", vllm=True),
    "pool": Benchmark(
        "benchmarks.multiturn.pool", "several recorded load draws pooled: goodput ratio, sign test"),
    "compare-runs": Benchmark(
        "benchmarks.multiturn.compare_runs", "two recorded sets of draws, draw by draw"),
    "prefix": Benchmark(
        "benchmarks.multiturn.prefix", "what a chat format lets a router reuse, without a server"),
    "cuda-plan": Benchmark(
        "benchmarks.multiturn.cuda_plan", "the multi-turn benchmark's GPU layout, rendered "
        "without a GPU"),
    "node-trace": Benchmark(
        "benchmarks.multiturn.node_trace", "the table of a recorded node trace"),
    "fleet-sim": Benchmark(
        "benchmarks.fleet_sim.run", "the fleet simulator: validate against recorded runs, sweep"),
    "router-overhead": Benchmark(
        "benchmarks.router_overhead.bench", "latency the router adds over the decode node "
        "(fake instant nodes)"),
    "router-logic": Benchmark(
        "benchmarks.router_overhead.logic_cost", "the router's own per-turn work, in-process"),
    "load": Benchmark(
        "benchmarks.load.bench", "thousands of turns through the router on fake nodes: lost "
        "and crossed turns"),
    "nixl-bandwidth": Benchmark(
        "benchmarks.nixl_bandwidth.run", "NIXL/UCX READ bandwidth between two processes, "
        "against memcpy"),
    "sdk-overhead": Benchmark(
        "benchmarks.sdk_overhead.run", "the SDK's streaming path against raw httpx"),
    "sdk-connection": Benchmark(
        "benchmarks.sdk_overhead.connection", "turn-to-first-byte with and without connection "
        "reuse"),
    "index": Benchmark(
        "benchmarks.index", "the run log (benchmarks/index.jsonl): add a run, render the "
        "markdown"),
}


def usage() -> str:
    lines = ["usage: python -m benchmarks SUBCOMMAND [ARGS]   (SUBCOMMAND --help: its options)",
             "", "subcommands (* starts real vLLM: run under flock /tmp/kvagent-vllm.lock):"]
    width = max(map(len, BENCHMARKS))
    for name, b in BENCHMARKS.items():
        lines.append(f"  {name:{width}s} {'*' if b.vllm else ' '} {b.what}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    bench = BENCHMARKS[argv[0]]
    saved = sys.argv
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    try:
        runpy.run_module(bench.module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
