"""Load through the router: many concurrent sessions, thousands of turns, fake instant nodes.

Starts the echoing fake P/D backend (`backend.py`) and the router
(`python -m kvagent_server.router`) as separate processes on 127.0.0.1, then runs
`--sessions` concurrent conversations of `--turns` turns each (every turn carries the
previous turn's cache token) and reports: lost and crossed turns (must be 0), reuse,
latency percentiles, throughput, and the router process's memory (RSS at start, peak,
end; per session) sampled with psutil.

    python -m benchmarks.load.bench --sessions 200 --turns 25 --cap-s 900 \
        --out benchmarks/load/results.json

Bounded: `--cap-s` stops new turns; every child process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent

from kvagent_server.bundle.processes import stop_groups
from kvagent_server.common.ports import free_port

from benchmarks._procs import wait_ready
from benchmarks.load.sessions import run_load

API_KEY = "load-test-key-0123456789"


def start(argv: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=cwd)


class MemorySampler:
    """RSS of one process every `every_s` seconds while a run is in progress."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.peak = 0
        self.samples: list[tuple[float, int]] = []

    def rss(self) -> int:
        return self.proc.memory_info().rss

    async def run(self, t0: float) -> None:
        while True:
            rss = self.rss()
            self.peak = max(self.peak, rss)
            self.samples.append((round(time.perf_counter() - t0, 1), round(rss / 2**20, 1)))
            await asyncio.sleep(self.every_s)


async def router_metrics(base: str) -> dict[str, float]:
    """The router's reuse misses by reason, non-200 answers and store size (/metrics)."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{base}/metrics", timeout=30)).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvagent_router_reuse_misses_total{"):
            out[line.split('reason="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("kvagent_router_store_handles ", "kvagent_router_store_tokens ")):
            out[line.split(" ", 1)[0].removeprefix("kvagent_router_")] = float(
                line.rsplit(" ", 1)[1])
        elif line.startswith("kvagent_router_requests_total{") and 'status="200"' not in line:
            out["http_" + line.split('status="', 1)[1].split('"', 1)[0]] = float(
                line.rsplit(" ", 1)[1])
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    settings = {
        "tenants": [{"name": "load", "api_keys": [API_KEY],
                     "max_concurrent_streams": max(64, args.sessions)}],
        "policy": {"name": "cost_model",
                   "params": {"skip_prefill_max_tokens": args.skip_prefill_max_tokens}},
        "nodes": {"max_in_flight": max(64, args.sessions * 2), "block_size": 16,
                  "request_timeout_s": 120},
        "limits": {"first_byte_timeout_s": 120},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(settings, f)
        settings_path = f.name
    logs = Path(tempfile.mkdtemp(prefix="kva-load-"))
    backend = start([sys.executable, "-m", "benchmarks.load.backend", str(p_port), str(d_port)],
                    logs / "backend.log", cwd=HERE.parents[1])
    router = None
    try:
        await wait_ready(f"http://127.0.0.1:{p_port}/health")
        await wait_ready(f"http://127.0.0.1:{d_port}/health")
        router = start([sys.executable, "-m", "kvagent_server.router", "--port", str(r_port),
                        "--prefill", f"http://127.0.0.1:{p_port}",
                        "--decode", f"http://127.0.0.1:{d_port}", "--model", "fake-model",
                        "--settings", settings_path, "--log-level", "warning"],
                       logs / "router.log")
        base = f"http://127.0.0.1:{r_port}"
        await wait_ready(f"{base}/ready")
        headers = {"Authorization": f"Bearer {API_KEY}"}
        # Warm-up: imports, pools and first-use allocations are not per-session memory.
        await run_load(base, sessions=4, turns=2, cap_s=60, headers=headers, prefix="warm")
        mem = MemorySampler(router.pid)
        rss_start = mem.rss()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(mem.run(t0))
        cpu0 = psutil.Process(router.pid).cpu_times()
        result = await run_load(base, sessions=args.sessions, turns=args.turns,
                                cap_s=args.cap_s, headers=headers,
                                stagger_s=args.stagger_s)
        sampler.cancel()
        cpu1 = psutil.Process(router.pid).cpu_times()
        await asyncio.sleep(1.0)
        rss_end = mem.rss()
        summary = result.summary()
        router_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        summary["router"] = {
            "rss_start_mib": round(rss_start / 2**20, 1),
            "rss_peak_mib": round(mem.peak / 2**20, 1),
            "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth_per_session_kib": round((rss_end - rss_start) / args.sessions / 1024,
                                                1),
            "rss_peak_growth_per_session_kib": round(
                (mem.peak - rss_start) / args.sessions / 1024, 1),
            "cpu_s": round(router_cpu, 1),
            "cpu_ms_per_turn": round(1000 * router_cpu / max(1, summary["turns_completed"]),
                                     2),
            "rss_samples_s_mib": mem.samples[:: max(1, len(mem.samples) // 40)],
        }
        summary["router"]["from_metrics"] = await router_metrics(base)
        summary["machine"] = {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}
        summary["settings"] = settings
        router_log = (logs / "router.log").read_text(errors="replace")
        summary["router"]["log_errors"] = router_log.count("ERROR") + router_log.count(
            "Traceback")
        return summary
    finally:
        for proc in (router, backend):
            if proc is not None:
                stop_groups(proc)
        os.unlink(settings_path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=25)
    ap.add_argument("--cap-s", type=float, default=900.0)
    ap.add_argument("--stagger-s", type=float, default=20.0,
                    help="spread session starts over this many seconds")
    ap.add_argument("--skip-prefill-max-tokens", type=int, default=0,
                    help="0: every turn takes the P leg (pd_reuse), the heavier path")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    out = asyncio.run(main(args))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if out["lost"] == 0 and out["crossed"] == 0 else 1)
