"""Streams decoding at once, interleaved A/B: the tuned aggregated node against what
`kvagent-server up` runs on this machine (its node direct, and through its router).

Why: compare's short-tool workload reads the single node's turn time above the aggregated
node's, and one-off A/Bs minutes apart moved the same node's decode by a third, more than
the gap. So both arms are up at once, as compare starts them (the same flags, the same
KV budget each, each on every core), and the targets alternate round by round, the order
reversed every other round (ABC, CBA): drift and the idle arm's cost hit every target
alike. A round sends one target `streams` greedy requests at once (`ignore_eos`, `tokens`
each; each stream its own short prompt, cached after the first round, so a round is
decoding); nothing else runs meanwhile. Reported per target: time per output token
(TPOT) and TTFT over all streams; per round, each target's TPOT minus the aggregated
node's (the streams' median each), with the share of rounds it is slower and a sign test.

    flock /tmp/kvagent-vllm.lock python -m benchmarks decode-ab [--rounds 40] \\
        [--streams 1,2] [--tokens 96] [--out DIR]

Bounded: rounds x streams x 3 requests; both arms stopped on exit (also on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gzip
import json
import math
import random
import statistics
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.multiturn.client import chat_body, stream_chat
from benchmarks.multiturn.nodes import ContentionWatch, Endpoint, wait_until_alone
from benchmarks.multiturn.run import _log, _warmup, machine
from benchmarks.multiturn.stats import percentile

from .arms import ARMS, KvBudget, serve_arm
from .run import commit
from .workloads import workload

#: The baseline every other target is paired with.
BASE = "aggregated"
TARGETS = (BASE, "kvagent-node", "kvagent-router")
BENCHMARK = "decode-ab"


def round_order(targets: Sequence[str], i: int) -> list[str]:
    """Round `i`'s order: as given on even rounds, reversed on odd ones."""
    return list(targets) if i % 2 == 0 else list(reversed(targets))


def sign_test_p(diffs: Sequence[float]) -> float | None:
    """Two-sided exact sign test of `diffs` against a median of 0 (ties dropped)."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return None
    tail = sum(math.comb(n, k) for k in range(min(pos, neg) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def summarize(samples: Sequence[dict[str, Any]], targets: Sequence[str] = TARGETS,
              base: str = BASE) -> dict[str, Any]:
    """Per stream count: each target's TPOT and TTFT over its streams, and each other
    target paired round by round with `base` (median TPOT of the round's streams): the
median and mean of the differences, the mean's standard error, the share of rounds it is
slower and a sign test. Pure:
    `samples` are the raw records (`round`, `streams`, `target`, `tpot_ms`, `ttft_ms`,
    `error`)."""
    out: dict[str, Any] = {}
    for streams in sorted({s["streams"] for s in samples}):
        ok = [s for s in samples if s["streams"] == streams and not s.get("error")
              and s.get("tpot_ms") is not None]
        per: dict[str, Any] = {}
        for t in targets:
            tp = [s["tpot_ms"] for s in ok if s["target"] == t]
            tt = [s["ttft_ms"] for s in ok if s["target"] == t and s.get("ttft_ms") is not None]
            per[t] = {"n": len(tp), "tpot_ms": {"p50": percentile(tp, 50), "p90": percentile(tp, 90)},
                      "ttft_ms": {"p50": percentile(tt, 50)},
                      "errors": sum(1 for s in samples if s["streams"] == streams
                                    and s["target"] == t and s.get("error"))}
        by_round: dict[tuple[int, str], float] = {}
        for r in sorted({s["round"] for s in ok}):
            for t in targets:
                xs = [s["tpot_ms"] for s in ok if s["round"] == r and s["target"] == t]
                if len(xs) == streams:
                    by_round[(r, t)] = statistics.median(xs)
        paired: dict[str, Any] = {}
        for t in targets:
            if t == base:
                continue
            diffs = [v - by_round[(r, base)] for (r, tt), v in by_round.items()
                     if tt == t and (r, base) in by_round]
            b50, t50 = per[base]["tpot_ms"]["p50"], per[t]["tpot_ms"]["p50"]
            paired[t] = {"rounds": len(diffs),
                         "median_diff_ms": statistics.median(diffs) if diffs else None,
                         "mean_diff_ms": statistics.fmean(diffs) if diffs else None,
                         # the mean's standard error: what the rounds resolve
                         "se_ms": (statistics.stdev(diffs) / math.sqrt(len(diffs))
                                   if len(diffs) > 1 else None),
                         "slower_share": sum(d > 0 for d in diffs) / len(diffs) if diffs else None,
                         "sign_test_p": sign_test_p(diffs),
                         "ratio_p50": t50 / b50 if t50 and b50 else None}
        out[str(streams)] = {"targets": per, "paired": paired}
    return out


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def report_md(s: dict[str, Any]) -> str:
    lines = [f"# Decode A/B: {', '.join(s['targets'])} — {s['date']}", "",
             f"`{' '.join(s['command'])}`", "",
             (f"- machine: {s['machine'].get('cpu')}, {s['machine'].get('cores')} cores; "
             f"commit `{s['commit']}`; foreign vLLM processes during the rounds: "
             f"{s['foreign_vllm_max']}; CPU time stolen by the hypervisor: "
             f"{_f(s.get('steal_s'))} s; CPU seconds of other processes: "
             f"{s.get('other_cpu_s') or 'none'}"),
             (f"- {s['rounds']} rounds per stream count, {s['tokens']} tokens a stream on a "
              f"prompt of {s.get('prompt_words', 150)} random words, the order reversed "
              f"every other round; KV budget {s['kv_gib']} GiB each arm"), ""]
    for streams, block in s["results"].items():
        lines += [f"## {streams} stream(s) at once", "",
                  "| target | TPOT p50 / p90 ms | TTFT p50 ms | streams | errors |",
                  "|---|---|---|---|---|"]
        for t, f in block["targets"].items():
            lines.append(f"| {t} | {_f(f['tpot_ms']['p50'], '.2f')} / "
                         f"{_f(f['tpot_ms']['p90'], '.2f')} | {_f(f['ttft_ms']['p50'])} | "
                         f"{f['n']} | {f['errors']} |")
        lines += ["", f"Paired with `{s['base']}` round by round:", "",
                  ("| target | TPOT p50 ratio | difference ms/token: median, mean ± se | "
                   "rounds slower | sign test p |"), "|---|---|---|---|---|"]
        for t, p in block["paired"].items():
            share = p["slower_share"]
            lines.append(f"| {t} | {_f(p['ratio_p50'], '.3f')}× | "
                         f"{_f(p['median_diff_ms'], '+.2f')}, {_f(p['mean_diff_ms'], '+.2f')} ± "
                         f"{_f(p['se_ms'], '.2f')} | "
                         f"{'-' if share is None else f'{share:.0%}'} of {p['rounds']} | "
                         f"{_f(p['sign_test_p'], '.3g')} |")
        lines.append("")
    return "\n".join(lines)


def _prompt(stream: int, words: int) -> list[dict[str, str]]:
    """Stream `stream`'s prompt: the same every round and for every target."""
    rng = random.Random(1000 + stream)
    text = " ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 7)))
                    for _ in range(words))
    return [{"role": "system", "content": "You are a terse agent."},
            {"role": "user", "content": f"Stream {stream}: {text}"}]


def _url_and_extra(target: str, agg: Endpoint, kva: Endpoint
                   ) -> tuple[str, dict[str, Any], bool]:
    """The chat URL of `target`, the fields its body adds, and whether it names a session."""
    if target == BASE:
        return f"{agg.base_url}/chat/completions", {}, False
    if target == "kvagent-node":
        from kvagent_server.router.reuse.transfer import RELEASE_KEY

        # the node retains what it is not told to free: release-only, as a router's release
        return (f"{kva.decode_urls[0].rstrip('/')}/v1/chat/completions",
                {"kv_transfer_params": {RELEASE_KEY: []}}, False)
    return f"{kva.base_url}/chat/completions", {}, True


async def _round(client: httpx.AsyncClient, target: str, agg: Endpoint, kva: Endpoint,
                 streams: int, tokens: int, r: int, words: int) -> list[dict[str, Any]]:
    url, extra, session = _url_and_extra(target, agg, kva)
    model = agg.model

    async def one(i: int) -> dict[str, Any]:
        body = {**chat_body(model, _prompt(i, words), [], tokens), "ignore_eos": True, **extra}
        headers = {"X-Session-ID": f"ab-{uuid.uuid4().hex[:12]}"} if session else {}
        res = await stream_chat(client, url, body, headers)
        m = res.meter
        tpot = m.tpot_s(m.completion_tokens())
        return {"round": r, "streams": streams, "target": target, "stream": i,
                "tpot_ms": tpot * 1000 if tpot is not None else None,
                "ttft_ms": m.ttft_s * 1000 if m.ttft_s is not None else None,
                "e2e_ms": res.e2e_s * 1000, "completion_tokens": m.completion_tokens(),
                "cached_tokens": m.cached_tokens(), "error": res.error}

    return list(await asyncio.gather(*(one(i) for i in range(streams))))


async def _drive(agg: Endpoint, kva: Endpoint, *, rounds: int, streams: Sequence[int],
                 tokens: int, words: int, timeout_s: float) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for n in streams:  # one unrecorded round: every stream's prompt is cached after it
            for t in TARGETS:
                await _round(client, t, agg, kva, n, tokens, -1, words)
        for r in range(rounds):
            for n in streams:
                for t in round_order(TARGETS, r):
                    samples += await _round(client, t, agg, kva, n, tokens, r, words)
            if (r + 1) % 10 == 0:
                _log(f"decode-ab: {r + 1}/{rounds} rounds")
    return samples


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks decode-ab",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--streams", default="1,2",
                    help="comma-separated stream counts, each run every round (default 1,2)")
    ap.add_argument("--tokens", type=int, default=96, help="output tokens a stream")
    ap.add_argument("--prompt-words", type=int, default=150,
                    help="random words in each stream's prompt (~3 tokens each): the context "
                    "every token attends to")
    ap.add_argument("--workload", default="short-tool",
                    help="the compare workload whose KV budget both arms get")
    ap.add_argument("--model", default=None, help="built-in model id (default kvagent-demo)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--resummarize", type=Path, default=None, metavar="DIR",
                    help="rewrite DIR's summary and report from its raw samples (DIR/raw, "
                    "or the path its summary names) with this code, running nothing")
    ap.add_argument("--wait-alone", type=float, default=120.0, metavar="SECONDS",
                    help="before starting, wait this long for vLLM processes not started "
                    "here to exit (fail if they remain); 0: do not check")
    return ap


def resummarize(folder: Path) -> dict[str, Any]:
    """A recorded run's summary again from its raw samples; rewrites its two files."""
    s = json.loads((folder / "summary.json").read_text())
    raw = folder / "raw" / "samples.jsonl.gz"
    raw = raw if raw.is_file() else Path(s["raw_samples"])
    with gzip.open(raw, "rt") as f:
        samples = [json.loads(line) for line in f if line.strip()]
    s["results"] = summarize(samples, s["targets"], s["base"])
    (folder / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (folder / "report.md").write_text(report_md(s))
    return s


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.resummarize is not None:
        print(report_md(resummarize(args.resummarize)))
        return 0
    try:
        streams = [int(x) for x in args.streams.split(",") if x.strip()]
        nw = workload(args.workload, quick=False)
    except ValueError as exc:
        raise SystemExit(f"decode-ab: {exc}") from None
    if (args.rounds < 1 or args.tokens < 2 or args.prompt_words < 1 or not streams
            or min(streams) < 1):
        raise SystemExit("decode-ab: --rounds, --prompt-words and stream counts >= 1, "
                         "--tokens >= 2")
    kv = KvBudget(gib=nw.kv.gib, tokens=nw.kv.tokens)
    now = dt.datetime.now(dt.UTC)
    out = args.out or Path(tempfile.gettempdir()) / "kvagent-decode-ab" / f"{now:%Y%m%dT%H%M%SZ}-decode-ab"
    out.mkdir(parents=True, exist_ok=True)
    command = ["python", "-m", "benchmarks", BENCHMARK,
               *(argv if argv is not None else sys.argv[1:])]
    if args.wait_alone > 0:
        wait_until_alone(args.wait_alone, log=_log)
    with contextlib.ExitStack() as stack:
        _log("decode-ab: starting the aggregated node and what `up` runs here, both at once")
        (agg,), _ = stack.enter_context(serve_arm(
            ARMS[BASE], out / "work" / BASE, kv=kv, startup_timeout_s=args.startup_timeout,
            model=args.model))
        (kva,), _ = stack.enter_context(serve_arm(
            ARMS["kvagent"], out / "work" / "kvagent", kv=kv,
            startup_timeout_s=args.startup_timeout, model=args.model))
        for ep in (agg, kva):
            _warmup(ep.base_url, ep.model)
        _log(f"decode-ab: up; {args.rounds} rounds of {streams} stream(s) x {args.tokens} tokens")
        with ContentionWatch() as watch:
            samples = asyncio.run(_drive(agg, kva, rounds=args.rounds, streams=streams,
                                         tokens=args.tokens, words=args.prompt_words,
                                         timeout_s=args.request_timeout))
    raw = out / "raw" / "samples.jsonl.gz"
    raw.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(raw, "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    s = {"benchmark": BENCHMARK, "command": command, "commit": commit(), "machine": machine(),
         "date": now.isoformat(timespec="seconds"), "targets": list(TARGETS), "base": BASE,
         "rounds": args.rounds, "streams": streams, "tokens": args.tokens, "kv_gib": kv.gib,
         "prompt_words": args.prompt_words,
         "topology": ARMS["kvagent"].resolved_topology, "foreign_vllm_max": watch.max,
         "steal_s": watch.steal_s, "other_cpu_s": dict(sorted(
             watch.other_cpu.items(), key=lambda kv_: -kv_[1])[:5]),
         "results": summarize(samples), "raw_samples": str(raw)}
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "report.md").write_text(report_md(s))
    print(report_md(s))
    errors = sum(1 for x in samples if x["error"])
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
