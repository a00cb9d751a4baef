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
from pathlib import Path
from typing import Any

import httpx

from .client import chat_body, stream_chat
from .results import BenchmarkReport, RequestRecord
from .stats import percentile
from .workload import Workload, WorkloadSpec, assistant_message, generate

REUSE_PATHS = ("pd_reuse", "d_direct")


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


def pick(records: list[RequestRecord], per_path: int) -> list[RequestRecord]:
    """Up to `per_path` reused later turns per path, spread evenly over the run."""
    out = []
    for path in REUSE_PATHS:
        rows = [r for r in records if r.path == path and r.turn > 0 and r.error is None
                and (r.reused_tokens or 0) > 0 and r.ttft_s is not None]
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


def summarise(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for path in REUSE_PATHS:
        rows = [s for s in samples if s["path"] == path]
        if not rows:
            continue
        ratios = [s["measured_ttft_s"] / s["floor_s"] for s in rows]
        out[path] = {"n": len(rows), "ratio_p50": percentile(ratios, 50),
                     "ratio_mean": statistics.fmean(ratios),
                     "measured_ttft_p50_s": percentile([s["measured_ttft_s"] for s in rows], 50),
                     "floor_p50_s": percentile([s["floor_s"] for s in rows], 50),
                     "engine_ttft_p50_s": percentile([s["engine_ttft_s"] for s in rows], 50),
                     "transfer_p50_s": percentile([s["transfer_s"] for s in rows], 50)}
    return out


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

    from kvagent_server import demo_model

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
    samples: list[dict[str, Any]] = []

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
                transfer = ((rec.reused_tokens or 0) * per_token / bandwidth
                            if rec.path == "pd_reuse" else 0.0)
                floor = got["engine_ttft_s"] + transfer
                samples.append({"conversation": rec.conversation, "turn": rec.turn,
                                "path": rec.path, "reused_tokens": rec.reused_tokens,
                                "recorded_prompt_tokens": rec.prompt_tokens, **got,
                                "transfer_s": transfer, "floor_s": floor,
                                "measured_ttft_s": rec.ttft_s,
                                "ratio": rec.ttft_s / floor if rec.ttft_s else None})
                s = samples[-1]
                print(f"{rec.conversation} t{rec.turn} {rec.path:<9} reused {rec.reused_tokens}"
                      f"/{got['prompt_tokens']} (engine cached {got['engine_cached_tokens']})"
                      f"  engine {got['engine_ttft_s'] * 1000:6.1f} ms + transfer "
                      f"{transfer * 1000:5.1f} ms = floor {floor * 1000:6.1f} ms;"
                      f" measured {rec.ttft_s * 1000:6.1f} ms  ratio {s['ratio']:.2f}",
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
           "summary": summarise(samples), "samples": samples}
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
