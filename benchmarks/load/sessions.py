"""Concurrent multi-turn sessions through the router, each checking it gets its own answers.

Every session's user messages carry a marker `[[s=<session> t=<turn>]]`; the fake decode
node (`backend.echo_reply`) answers `echo s=<session> t=<turn>` for the last marker of
the prompt it was given. A turn is *lost* when it fails or its stream ends without
`[DONE]` and the `kvagent` object, *crossed* when its answer names another session or
turn. Used by `bench.py` (separate processes) and by tests/reliability (in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

MODEL = "fake-model"
FILLER = "Background for this conversation, kept verbatim every turn. " * 4
ECHO_RE = re.compile(r"echo s=([\w.-]+) t=(\d+)")


def marker(session: str, turn: int) -> str:
    return f"[[s={session} t={turn}]]"


@dataclass
class TurnRecord:
    session: str
    turn: int
    status: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    path: str | None = None
    reused_tokens: int = 0
    retried: int = 0  # connection errors before any byte, retried once
    lost: bool = False
    crossed: bool = False
    error: str | None = None


@dataclass
class LoadResult:
    sessions: int
    turns_per_session: int
    wall_s: float
    records: list[TurnRecord] = field(default_factory=list)

    @property
    def completed(self) -> list[TurnRecord]:
        return [r for r in self.records if not r.lost]

    def summary(self) -> dict[str, Any]:
        done = self.completed
        ttft = sorted(r.ttft_s for r in done if r.ttft_s is not None)
        total = sorted(r.total_s for r in done if r.total_s is not None)
        later = [r for r in done if r.turn > 0]
        paths: dict[str, int] = {}
        for r in done:
            paths[r.path or "none"] = paths.get(r.path or "none", 0) + 1
        return {
            "sessions": self.sessions, "turns_per_session": self.turns_per_session,
            "turns_planned": self.sessions * self.turns_per_session,
            "turns_sent": len(self.records), "turns_completed": len(done),
            "lost": sum(r.lost for r in self.records),
            "crossed": sum(r.crossed for r in self.records),
            "retried_before_first_byte": sum(r.retried for r in self.records),
            "errors": sorted({r.error for r in self.records if r.error})[:10],
            "reused_later_turns": sum(r.reused_tokens > 0 for r in later),
            "later_turns": len(later), "paths": paths,
            "wall_s": round(self.wall_s, 2),
            "turns_per_s": round(len(done) / self.wall_s, 1) if self.wall_s else None,
            "ttft_ms": percentiles(ttft), "total_ms": percentiles(total),
        }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else (
        values * 99)
    return {"p50": round(qs[49] * 1000, 2), "p90": round(qs[89] * 1000, 2),
            "p99": round(qs[98] * 1000, 2), "max": round(values[-1] * 1000, 2)}


async def one_turn(client: httpx.AsyncClient, session: str, turn: int,
                   messages: list[dict[str, Any]], token: str | None,
                   headers: dict[str, str]) -> tuple[TurnRecord, str, str | None]:
    """One streamed turn; returns the record, the answer text and the next token."""
    rec = TurnRecord(session, turn)
    h = {**headers, "X-Session-ID": session}
    if token:
        h["X-KVAgent-Cache-Token"] = token
    body = {"model": MODEL, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    text: list[str] = []
    last: dict[str, Any] | None = None
    done = False
    try:
        async with _open(client, body, h, rec) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec.lost, rec.error = True, f"http {r.status_code}"
                return rec, "", token
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                last = obj
                for choice in obj.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        text.append(piece)
    except (httpx.HTTPError, ValueError) as exc:
        rec.lost, rec.error = True, type(exc).__name__
        return rec, "", token
    rec.total_s = time.perf_counter() - t0
    kva = (last or {}).get("kvagent")
    if not done or not isinstance(kva, dict):
        rec.lost, rec.error = True, "stream ended without [DONE] and kvagent"
        return rec, "", token
    answer = "".join(text)
    rec.path, rec.reused_tokens = kva.get("path"), int(kva.get("reused_tokens") or 0)
    echo = ECHO_RE.search(answer)
    if echo is None or echo.groups() != (session, str(turn)):
        rec.crossed = True
        rec.error = f"answer for {echo.groups() if echo else None}"
    return rec, answer, kva.get("cache_token")


@contextlib.asynccontextmanager
async def _open(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                rec: TurnRecord) -> AsyncIterator[httpx.Response]:
    """The response, retried once on a connection error before any byte (a pooled
    connection the server closed while idle), as openai-python and the SDK do."""
    for attempt in range(2):
        try:
            cm = client.stream("POST", "/v1/chat/completions", json=body, headers=headers)
            r = await cm.__aenter__()
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError,
                httpx.WriteError):
            if attempt:
                raise
            rec.retried += 1
            continue
        try:
            yield r
        finally:
            await cm.__aexit__(None, None, None)
        return


async def run_session(client: httpx.AsyncClient, session: str, turns: int,
                      deadline: float, headers: dict[str, str]) -> list[TurnRecord]:
    messages = [{"role": "user", "content": f"{FILLER} {marker(session, 0)}"}]
    token: str | None = None
    out: list[TurnRecord] = []
    for turn in range(turns):
        if time.monotonic() > deadline:
            break
        rec, answer, token = await one_turn(client, session, turn, messages, token, headers)
        out.append(rec)
        if rec.lost:  # start over, like a client whose stream broke
            messages = [{"role": "user", "content": f"{FILLER} {marker(session, turn + 1)}"}]
            token = None
            continue
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"go on {marker(session, turn + 1)}"}]
    return out


async def run_load(base_url: str, *, sessions: int, turns: int, cap_s: float,
                   headers: dict[str, str] | None = None, prefix: str = "load",
                   stagger_s: float = 0.0) -> LoadResult:
    """`sessions` concurrent conversations of `turns` turns each, bounded by `cap_s`."""
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    timeout = httpx.Timeout(max(cap_s, 30.0))
    deadline = time.monotonic() + cap_s
    t0 = time.perf_counter()

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        async def one(i: int) -> list[TurnRecord]:
            await asyncio.sleep(stagger_s * i / max(sessions, 1))
            return await run_session(client, f"{prefix}-{i}", turns, deadline, headers or {})

        per = await asyncio.gather(*(one(i) for i in range(sessions)))
    result = LoadResult(sessions, turns, time.perf_counter() - t0)
    result.records = [r for rs in per for r in rs]
    return result


def records_json(result: LoadResult) -> list[dict[str, Any]]:
    return [asdict(r) for r in result.records]
