"""Per-chunk cost of the SDK's streaming path against raw httpx streaming of the same bytes.

The same recorded-shape vLLM stream (N content chunks + finish + usage + ``[DONE]``) is
served by ``httpx.MockTransport``, one transport read per SSE event as on a live
connection, and consumed four ways (sync and async each):

* ``httpx bytes``    - ``iter_bytes()`` only: the floor, no parsing at all;
* ``httpx + json``   - ``iter_lines()`` + ``json.loads`` of each ``data:`` line: what a
  hand-rolled client minimally does;
* ``kvagent``        - ``Session.stream()``: SSE decoding, delta accumulation, typed
  events, token extraction, history commit, (no-op) telemetry span, request building.

Reported: min and median over rounds of µs per chunk (variants interleaved in each round),
and kvagent's ratio to both baselines, from the minima (the least disturbed runs).

    python -m benchmarks.sdk_overhead.run                 # N=2000 chunks, 15 rounds
    python -m benchmarks.sdk_overhead.run --chunks 500 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from kvagent import AsyncSession, Session

URL = "http://bench.local/v1/chat/completions"
MODEL = "kvagent-demo"


def build_stream(chunks: int) -> list[bytes]:
    """vLLM 0.32-shaped SSE events (as recorded in tests/sdk/data), one bytes object each."""
    head = {"id": "chatcmpl-9f96f7f2dcbc3f52", "object": "chat.completion.chunk",
            "created": 1796000463, "model": MODEL}

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({**head, **obj}, separators=(",", ":")).encode() + b"\n\n"

    events = [event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}],
                     "prompt_token_ids": None, "prompt_text": None})]
    for i in range(chunks):
        events.append(event({"choices": [{"index": 0, "delta": {"content": f" tok{i % 97}"},
                                          "logprobs": None, "finish_reason": None,
                                          "token_ids": None}]}))
    events.append(event({"choices": [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None,
                                      "token_ids": None}]}))
    events.append(event({"choices": [], "usage": {"prompt_tokens": 29,
                                                  "total_tokens": 29 + chunks,
                                                  "completion_tokens": chunks},
                         "kvagent": {"cache_token": "kva1.eyJoIjoiMSJ9.c2ln",
                                     "reused_tokens": 0, "expires_in": 420,
                                     "path": "pd_fresh"}}))
    events.append(b"data: [DONE]\n\n")
    return events


class Pieces(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece


def transport(pieces: list[bytes]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Pieces(pieces))
    return httpx.MockTransport(handler)


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def raw_bytes(client: httpx.Client) -> int:
    n = 0
    with client.stream("POST", URL, json=BODY) as response:
        for _ in response.iter_bytes():
            n += 1
    return n


def raw_json(client: httpx.Client) -> int:
    text = []
    with client.stream("POST", URL, json=BODY) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return len(text)


def sdk(client: httpx.Client) -> int:
    session = Session("http://bench.local/v1", MODEL, http_client=client)
    return sum(1 for _ in session.stream("hi"))


async def araw_bytes(client: httpx.AsyncClient) -> int:
    n = 0
    async with client.stream("POST", URL, json=BODY) as response:
        async for _ in response.aiter_bytes():
            n += 1
    return n


async def araw_json(client: httpx.AsyncClient) -> int:
    text = []
    async with client.stream("POST", URL, json=BODY) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return len(text)


async def asdk(client: httpx.AsyncClient) -> int:
    session = AsyncSession("http://bench.local/v1", MODEL, http_client=client)
    return sum([1 async for _ in session.stream("hi")])


def _stats(samples: list[float], chunks: int) -> dict[str, float]:
    per_chunk = [t / chunks * 1e6 for t in samples]
    return {"min": min(per_chunk), "median": statistics.median(per_chunk)}


def measure(fns: dict[str, Callable[[], Any]], chunks: int, rounds: int
            ) -> dict[str, dict[str, float]]:
    """µs per chunk of each variant; variants are interleaved within every round so load
    changes on a shared machine hit all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: _stats(values, chunks) for name, values in samples.items()}


async def ameasure(fns: dict[str, Callable[[], Any]], chunks: int, rounds: int
                   ) -> dict[str, dict[str, float]]:
    """``measure`` for coroutine functions, inside one running event loop."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        await fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            await fn()
            samples[name].append(time.perf_counter() - start)
    return {name: _stats(values, chunks) for name, values in samples.items()}


def run(chunks: int, rounds: int) -> dict[str, Any]:
    pieces = build_stream(chunks)
    results: dict[str, dict[str, float]] = {}
    with httpx.Client(transport=transport(pieces)) as client:
        results.update(measure({
            "sync httpx bytes": lambda: raw_bytes(client),
            "sync httpx + json": lambda: raw_json(client),
            "sync kvagent": lambda: sdk(client)}, chunks, rounds))

    async def async_all() -> None:
        async with httpx.AsyncClient(transport=transport(pieces)) as client:
            results.update(await ameasure({
                "async httpx bytes": lambda: araw_bytes(client),
                "async httpx + json": lambda: araw_json(client),
                "async kvagent": lambda: asdk(client)}, chunks, rounds))

    asyncio.run(async_all())
    ratios = {
        mode: {"vs_bytes": results[f"{mode} kvagent"]["min"]
               / results[f"{mode} httpx bytes"]["min"],
               "vs_json": results[f"{mode} kvagent"]["min"]
               / results[f"{mode} httpx + json"]["min"]}
        for mode in ("sync", "async")
    }
    return {"chunks": chunks, "rounds": rounds, "us_per_chunk": results, "ratios": ratios,
            "python": sys.version.split()[0], "httpx": httpx.__version__,
            "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0],
            "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    out = run(args.chunks, args.rounds)
    print(f"{out['chunks']} chunks, {out['rounds']} rounds, µs per chunk (min / median); "
          f"load {out['load_avg_1m']:.2f} on {out['cpus']} CPUs")
    for name, value in out["us_per_chunk"].items():
        print(f"  {name:<20} {value['min']:8.2f} {value['median']:8.2f}")
    print("  ratios of the minima:")
    for mode, ratio in out["ratios"].items():
        print(f"  {mode} kvagent / httpx bytes = {ratio['vs_bytes']:.2f}x, "
              f"/ httpx + json = {ratio['vs_json']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
