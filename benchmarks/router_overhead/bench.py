"""Router overhead: latency the router adds over talking to the decode node directly.

Starts an instant fake P/D backend and the router (`python -m kvagent_server.router`) as
separate processes on 127.0.0.1, then drives streamed chat requests at 1, 16 and 64
concurrent streams:

- `direct`: client -> fake D (one plain streamed request, no P/D).
- `bare_proxy`: client -> a 20-line starlette+httpx pass-through -> fake D: the floor any
  Python proxy pays on this machine (`bare_proxy.py`).
- `router_fresh`: client -> router -> P leg -> D leg (no session: nothing to reuse).
- `router_reuse`: sessions carrying their token; each turn tokenizes, pulls from D via P.
- `router_d_direct`: the same with `skip_prefill_max_tokens`: tokenize, then D only.

Latency is measured per request to the first content chunk (TTFT) and to `[DONE]`;
the backend answers instantly, so what remains is HTTP and router work. Bounded: a fixed
number of requests per level and a wall-clock cap.

    python benchmarks/router_overhead/bench.py [--requests 400] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks._procs import stop, wait_ready

MODEL = "fake-model"
PROMPT = "Summarise the history of lighthouses in three sentences. " * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})


class Worker:
    """One client stream: a conversation that resets every few turns."""

    def __init__(self, base: str, mode: str, idx: int) -> None:
        self.base, self.mode, self.idx = base, mode, idx
        self.messages: list[dict[str, Any]] = []
        self.token: str | None = None
        self.turns = 0

    def request(self) -> tuple[str, dict[str, Any], dict[str, str]]:
        reuse = self.mode in ("router_reuse", "router_d_direct")
        if not reuse or self.turns % 6 == 0:
            self.messages = [{"role": "user", "content": PROMPT}]
            self.token = None
        headers: dict[str, str] = {}
        if reuse:
            headers["X-Session-ID"] = f"{self.mode}-{self.idx}-{self.turns // 6}"
            if self.token:
                headers["X-KVAgent-Cache-Token"] = self.token
        body = {"model": MODEL, "messages": self.messages, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": 16}
        return f"{self.base}/v1/chat/completions", body, headers

    async def one(self, client: httpx.AsyncClient) -> tuple[float, float, str | None]:
        url, body, headers = self.request()
        t0 = time.perf_counter()
        ttft = None
        last = b""
        text = []
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line != "data: [DONE]":
                    last = line.encode()
                    obj = json.loads(line[6:])
                    if obj.get("choices"):
                        text.append(obj["choices"][0].get("delta", {}).get("content") or "")
        total = time.perf_counter() - t0
        kva = json.loads(last[6:]).get("kvagent") or {}
        self.turns += 1
        self.token = kva.get("cache_token")
        self.messages += [{"role": "assistant", "content": "".join(text)},
                          {"role": "user", "content": f"next {self.turns}"}]
        return ttft or total, total, kva.get("path")


async def miss_reasons(base: str) -> dict[str, float]:
    """The router's cumulative reuse misses by reason (from its /metrics)."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{base}/metrics", timeout=30)).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvagent_router_reuse_misses_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def cpu_s(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    t = proc.cpu_times()
    return t.user + t.system


async def run_level(base: str, mode: str, concurrency: int, total: int,
                    cap_s: float, pid: int) -> dict[str, Any]:
    per = max(1, total // concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    ttfts: list[float] = []
    totals: list[float] = []
    paths: dict[str, int] = {}
    deadline = time.monotonic() + cap_s
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        workers = [Worker(base, mode, i) for i in range(concurrency)]
        for w in workers:  # warm-up: connections, first turn
            await w.one(client)

        async def loop(w: Worker) -> None:
            for _ in range(per):
                if time.monotonic() > deadline:
                    return
                ttft, tot, path = await w.one(client)
                ttfts.append(ttft)
                totals.append(tot)
                paths[str(path)] = paths.get(str(path), 0) + 1

        t0, c0 = time.perf_counter(), cpu_s(pid)
        await asyncio.gather(*(loop(w) for w in workers))
        wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    return {"mode": mode, "concurrency": concurrency, "requests": len(totals),
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
            "total_p50_ms": pct(totals, 0.5), "total_p99_ms": pct(totals, 0.99),
            "mean_ms": statistics.fmean(totals) * 1000, "rps": len(totals) / wall,
            "server_cpu_ms_per_request": cpu / max(1, len(totals)) * 1000,
            "paths": paths}


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    p_port, d_port = free_port(), free_port()
    procs = [start([sys.executable, str(HERE / "fake_backend.py"), str(p_port), str(d_port)])]
    results: list[dict[str, Any]] = []
    try:
        await wait_ready(f"http://127.0.0.1:{d_port}/health")
        await wait_ready(f"http://127.0.0.1:{p_port}/health")
        routers: dict[str, str] = {}
        pids: dict[str, int] = {"direct": procs[0].pid}
        tmp = Path(tempfile.mkdtemp(prefix="kva-bench-"))
        for name, skip in (("router", 0), ("router_dd", 1000)):
            port = free_port()
            cfg = tmp / f"{name}.json"
            cfg.write_text(json.dumps({"skip_prefill_max_tokens": skip, "block_size": 16,
                                       "kv_recompute_threshold": 16,
                                       "node_max_in_flight": 1024}))
            procs.append(start([sys.executable, "-m", "kvagent_server.router", "--port",
                                str(port), "--prefill", f"http://127.0.0.1:{p_port}",
                                "--decode", f"http://127.0.0.1:{d_port}", "--model", MODEL,
                                "--settings", str(cfg), "--log-level", "warning"]))
            routers[name] = f"http://127.0.0.1:{port}"
            pids[name] = procs[-1].pid
            await wait_ready(f"{routers[name]}/ready")
        port = free_port()
        procs.append(start([sys.executable, str(HERE / "bare_proxy.py"), str(port),
                            f"http://127.0.0.1:{d_port}"]))
        routers["bare"] = f"http://127.0.0.1:{port}"
        pids["bare"] = procs[-1].pid
        which = {"direct": "direct", "bare_proxy": "bare", "router_fresh": "router",
                 "router_reuse": "router", "router_d_direct": "router_dd"}
        await asyncio.sleep(1.0)
        bases = {"direct": f"http://127.0.0.1:{d_port}", "bare_proxy": routers["bare"],
                 "router_fresh": routers["router"], "router_reuse": routers["router"],
                 "router_d_direct": routers["router_dd"]}
        for concurrency in args.concurrency:
            for mode in args.modes:
                res = await run_level(bases[mode], mode, concurrency, args.requests,
                                      args.cap_s, pids[which[mode]])
                if mode.startswith("router"):
                    res["misses_so_far"] = await miss_reasons(bases[mode])
                results.append(res)
                print(f"c={concurrency:>3} {mode:<16} n={res['requests']:>4} "
                      f"ttft p50={res['ttft_p50_ms']:7.2f} p99={res['ttft_p99_ms']:7.2f} ms  "
                      f"total p50={res['total_p50_ms']:7.2f} p99={res['total_p99_ms']:7.2f} "
                      f"ms  {res['rps']:6.1f} req/s  cpu {res['server_cpu_ms_per_request']:.2f} "
                      f"ms/req  {res['paths']} {res.get('misses_so_far', '')}", flush=True)
    finally:
        for proc in reversed(procs):
            stop(proc)
    return results


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so `main`'s finally stops the child processes


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per level and mode")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=["direct", "bare_proxy", "router_fresh",
                                                   "router_reuse", "router_d_direct"])
    ap.add_argument("--cap-s", type=float, default=60.0, help="wall-clock cap per level")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = asyncio.run(main(args))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
