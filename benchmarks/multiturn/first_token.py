"""D's first token, interleaved A/B: P's token (`forward_first_token` on) against D's own.

The effect is one model step on D (~10 ms on the development machine) within a turn of
~200 ms, and this host's drift between configurations run minutes apart is larger than
that. So both arms run on one bundle's nodes at once and alternate turn by turn, each
through a router of its own, the two alike but for `forward_first_token` (the bundle's
own router is not used: its logging and start-up differ from a router started here);
every reused turn goes through P (`pd_reuse`). Each conversation of the workload runs
twice, once per arm, its two copies' turns alternating (which arm goes first alternates
too); each router serves its arm as a tenant of its own, so under its own cache salt, and
the copies share no cached prefix. The turns
are the multi-turn benchmark's (greedy, streamed, with tools). Reported per arm: TTFT and
end-to-end time at the client, and per turn the on/off ratio of each; the two copies'
answers must be equal (the same prompts, greedy).

    flock /tmp/kvagent-vllm.lock python -m benchmarks.multiturn.first_token \\
        [--conversations 4] [--turns 8] [--out DIR]

Bounded: conversations x turns x 2 requests, one bundle and one extra router, stopped on
exit (also on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from .._procs import router_over
from .client import chat_body, session_headers, stream_chat
from .nodes import LOAD_ONLY_CONFIGS, ContentionWatch, bundle, wait_until_alone
from .run import machine, versions
from .workload import Conversation, WorkloadSpec, assistant_message, generate

HERE = Path(__file__).resolve().parent
#: The arms: P's token forwarded to D (`forward_first_token` on), and not.
ARMS = ("p_token", "own_token")
#: Each arm's router serves one tenant of its own: its own cache salt, no shared prefix.
TENANTS = {arm: {"name": f"{arm}-arm", "api_keys": [f"{arm}-arm-key"]} for arm in ARMS}


def arm_settings(arm: str) -> dict[str, Any]:
    """An arm's router settings: every reused turn through P, P's token to D or not."""
    return {"policy": {"name": "cost_model", "params": {"skip_prefill_max_tokens": 0}},
            "engine": {"forward_first_token": arm == ARMS[0]}, "tenants": [TENANTS[arm]]}


def arm_headers(arm: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[arm]['api_keys'][0]}"}


@contextmanager
def arm_router(prefill: tuple[str, ...], decode: tuple[str, ...], work: Path,
               arm: str) -> Iterator[str]:
    """The arm's router over the bundle's nodes; yields its /v1 URL."""
    with router_over(prefill, decode, arm_settings(arm), work / f"{arm}-router.json") as url:
        yield f"{url}/v1"


class Copy:
    """One arm's copy of a conversation: its history, cache token and records."""

    def __init__(self, arm: str, url: str, conv: Conversation, model: str,
                 max_tokens: int, headers: dict[str, str] | None = None) -> None:
        self.arm, self.url, self.conv, self.headers = arm, url, conv, headers or {}
        self.model, self.max_tokens = model, max_tokens
        self.history: list[dict[str, Any]] = []
        self.answer = ""
        self.token: str | None = None
        self.records: list[dict[str, Any]] = []

    async def turn(self, client: httpx.AsyncClient, i: int) -> None:
        turn = self.conv.turns[i]
        if turn.assistant is not None:
            self.history.append(assistant_message(turn.assistant, self.answer,
                                                  keep_recorded=False))
        self.history.extend(turn.messages)
        body = chat_body(self.model, self.history, self.conv.tools, self.max_tokens)
        res = await stream_chat(client, f"{self.url}/chat/completions", body,
                                {**session_headers(f"{self.arm}-{self.conv.id}", self.token),
                                 **self.headers})
        if res.error is not None:
            raise RuntimeError(f"{self.arm} {self.conv.id} turn {i}: {res.error}")
        kva = res.meter.kvagent or {}
        self.answer = res.meter.answer
        self.token = kva.get("cache_token") or None
        self.records.append({"turn": i, "path": kva.get("path"), "ttft_s": res.meter.ttft_s,
                             "e2e_s": res.e2e_s, "answer": self.answer})


def summarize(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per arm p50/mean of TTFT and E2E over the reused turns, and the p50 of the per-turn
    on/off ratios (each ratio from two turns seconds apart)."""
    reused = [(a, b) for a, b in pairs if a["turn"] > 0]
    out: dict[str, Any] = {"reused_turns": len(reused),
                           "answers_equal": sum(a["answer"] == b["answer"] for a, b in pairs),
                           "turns": len(pairs)}
    for key in ("ttft_s", "e2e_s"):
        for arm, idx in zip(ARMS, (0, 1), strict=True):
            vals = [p[idx][key] * 1000 for p in reused]
            out[f"{arm}_{key[:-2]}_ms_p50"] = round(statistics.median(vals), 1)
            out[f"{arm}_{key[:-2]}_ms_mean"] = round(statistics.fmean(vals), 1)
        diffs = [(a[key] - b[key]) * 1000 for a, b in reused]
        ratios = [a[key] / b[key] for a, b in reused]
        out[f"{key[:-2]}_diff_ms_p50"] = round(statistics.median(diffs), 1)
        out[f"{key[:-2]}_ratio_p50"] = round(statistics.median(ratios), 3)
        out[f"{key[:-2]}_on_faster_turns"] = sum(d < 0 for d in diffs)
    return out


async def run_ab(urls: dict[str, str], model: str, conversations: list[Conversation],
                 max_tokens: int, *, transport: httpx.AsyncBaseTransport | None = None
                 ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each conversation once per arm, the arms' turns alternating; (on, off) per turn."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    async with httpx.AsyncClient(timeout=600, transport=transport) as client:
        for conv in conversations:
            on, off = (Copy(arm, urls[arm], conv, model, max_tokens, arm_headers(arm))
                       for arm in ARMS)
            for i in range(len(conv.turns)):
                for copy in ((on, off) if i % 2 == 0 else (off, on)):
                    await copy.turn(client, i)
                print(f"  {conv.id} turn {i}: ttft {on.records[-1]['ttft_s'] * 1000:.0f} / "
                      f"{off.records[-1]['ttft_s'] * 1000:.0f} ms", flush=True)
            pairs += list(zip(on.records, off.records, strict=True))
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--wait-alone", type=float, default=0.0,
                    help="wait up to this many seconds for other vLLM processes to end")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    now = dt.datetime.now(dt.UTC)
    out = args.out or HERE / "results" / f"{now:%Y%m%dT%H%M%SZ}-first-token-ab"
    out.mkdir(parents=True, exist_ok=True)
    if args.wait_alone:
        wait_until_alone(args.wait_alone)
    spec = WorkloadSpec(conversations=args.conversations, turns=args.turns, concurrency=1)
    workload = generate(spec)
    config = LOAD_ONLY_CONFIGS["kvagent_always_pd_reuse"]
    with ContentionWatch() as watch, bundle(config, out / "work", kv_cache_gib=args.kv_cache_gib,
                                            startup_timeout_s=900) as ep, \
            arm_router(ep.prefill_urls, ep.decode_urls, out, ARMS[0]) as on_url, \
            arm_router(ep.prefill_urls, ep.decode_urls, out, ARMS[1]) as off_url:
        urls = {ARMS[0]: on_url, ARMS[1]: off_url}
        pairs = asyncio.run(run_ab(urls, ep.model, workload.conversations, workload.max_tokens))
    summary = summarize(pairs)
    report = {"created_at": now.isoformat(timespec="seconds"),
              "command": "python -m benchmarks.multiturn.first_token "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "versions": versions(),
              "foreign_vllm_max": watch.max, "load_max": round(watch.load_max, 2),
              "workload": spec.model_dump(mode="json"), "summary": summary,
              "pairs": [{"on": a, "off": b} for a, b in pairs]}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("foreign_vllm_max", "load_max", "summary")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
