"""Router overhead: latency the router adds over talking to the decode node directly.

Starts an instant fake P/D backend and the router (`python -m kvagent_server.router`) as
separate processes on 127.0.0.1, then drives streamed chat requests at 1, 16 and 64
concurrent streams:

- `direct`: client -> fake D (one plain streamed request, no P/D).
- `direct_pd`: what a client without a router does for a P/D turn: the P leg (one token,
  not streamed) against fake P, then the streamed D leg with P's `kv_transfer_params`.
- `bare_proxy`: client -> a 20-line starlette+httpx pass-through -> fake D: the floor any
  Python proxy pays on this machine (`bare_proxy.py`).
- `router_fresh`: client -> router -> P leg -> D leg (no session: nothing to reuse).
- `router_reuse`: sessions carrying their token; each turn tokenizes, pulls from D via P.
- `router_d_direct`: the same with `skip_prefill_max_tokens`: tokenize, then D only.
- `vllm_router_pd`: client -> vllm-router (PyPI `vllm-router`, Rust) in P/D mode -> P leg
  -> D leg: the same backend work as `router_fresh`, through another router.
- `vllm_router`: client -> vllm-router in plain mode -> fake D (the `bare_proxy` shape).
  Both vllm-router modes run only when its `vllm-router` script is installed.

Latency is measured per request to the first content chunk (TTFT) and to `[DONE]`;
the backend answers instantly, so what remains is HTTP and router work. Every level runs
`--repeats` rounds with the modes interleaved (a noisy shared machine then hits all modes
alike); percentiles pool the rounds' samples. Bounded: a fixed number of requests per
level and round, and a wall-clock cap.

    python -m benchmarks.router_overhead.bench [--requests 400] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent

from kvagent_server.bundle.processes import stop_groups
from kvagent_server.common.ports import free_port

from benchmarks._procs import wait_ready

MODEL = "fake-model"
PROMPT = "Summarise the history of lighthouses in three sentences. " * 4


def start(argv: list[str], env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})}, cwd=cwd)


class Worker:
    """One client stream: a conversation that resets every few turns."""

    def __init__(self, base: str, mode: str, idx: int, prefill_base: str | None = None) -> None:
        self.base, self.mode, self.idx = base, mode, idx
        self.prefill_base = prefill_base  # direct_pd: the client runs the P leg itself
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
        if self.prefill_base is not None:
            p_body = {**body, "stream": False, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True,
                                             "do_remote_prefill": False}}
            del p_body["stream_options"]
            p = await client.post(f"{self.prefill_base}/v1/chat/completions", json=p_body)
            if p.status_code != 200:
                raise RuntimeError(f"P leg {p.status_code}: {p.text[:200]}")
            body = {**body, "kv_transfer_params": p.json()["kv_transfer_params"]}
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


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def run_level(base: str, mode: str, concurrency: int, total: int,
                    cap_s: float, pid: int, prefill_base: str | None = None) -> dict[str, Any]:
    """One round of one mode at one concurrency; keeps the raw samples for pooling."""
    per = max(1, total // concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    ttfts: list[float] = []
    totals: list[float] = []
    paths: dict[str, int] = {}
    errors: dict[str, int] = {}
    deadline = time.monotonic() + cap_s
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        workers = [Worker(base, mode, i, prefill_base) for i in range(concurrency)]
        for w in workers:  # warm-up: connections, first turn
            await w.one(client)

        async def loop(w: Worker) -> None:
            for _ in range(per):
                if time.monotonic() > deadline:
                    return
                try:
                    ttft, tot, path = await w.one(client)
                except (httpx.HTTPError, RuntimeError) as exc:  # counted, not timed
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    w.turns = 0  # start a fresh conversation
                    continue
                ttfts.append(ttft)
                totals.append(tot)
                paths[str(path)] = paths.get(str(path), 0) + 1

        t0, c0 = time.perf_counter(), cpu_s(pid)
        await asyncio.gather(*(loop(w) for w in workers))
        wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0

    return {"mode": mode, "concurrency": concurrency, "requests": len(totals),
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
            "total_p50_ms": pct(totals, 0.5), "total_p99_ms": pct(totals, 0.99),
            "mean_ms": statistics.fmean(totals) * 1000, "rps": len(totals) / wall,
            "server_cpu_ms_per_request": cpu / max(1, len(totals)) * 1000,
            "paths": paths, "errors": errors, "_ttfts": ttfts, "_totals": totals}


def summarise(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (concurrency, mode): percentiles over every round's samples pooled, CPU per
    request as the median of the rounds, and the spread of the rounds' TTFT p50."""
    out = []
    keys = sorted({(r["concurrency"], r["mode"]) for r in rounds},
                  key=lambda k: (k[0], MODES.index(k[1])))
    for c, mode in keys:
        rs = [r for r in rounds if (r["concurrency"], r["mode"]) == (c, mode)]
        ttfts = [x for r in rs for x in r["_ttfts"]]
        totals = [x for r in rs for x in r["_totals"]]
        out.append({"mode": mode, "concurrency": c, "rounds": len(rs), "requests": len(totals),
                    "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
                    "total_p50_ms": pct(totals, 0.5), "total_p99_ms": pct(totals, 0.99),
                    "rps": statistics.median(r["rps"] for r in rs),
                    "server_cpu_ms_per_request": statistics.median(
                        r["server_cpu_ms_per_request"] for r in rs),
                    "round_ttft_p50_ms": [round(r["ttft_p50_ms"], 3) for r in rs],
                    "errors": sum(sum(r["errors"].values()) for r in rs)})
    return out


def added(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The router's added latency (TTFT) over each baseline, per concurrency."""
    by = {(s["concurrency"], s["mode"]): s for s in summary}
    out = []
    for (c, mode), s in by.items():
        if not mode.startswith(ROUTERS):
            continue
        for base in ("direct_pd", "direct"):
            b = by.get((c, base))
            if b is None:
                continue
            out.append({"concurrency": c, "mode": mode, "baseline": base,
                        "added_ttft_p50_ms": s["ttft_p50_ms"] - b["ttft_p50_ms"],
                        "added_ttft_p99_ms": s["ttft_p99_ms"] - b["ttft_p99_ms"],
                        "added_total_p50_ms": s["total_p50_ms"] - b["total_p50_ms"],
                        "added_total_p99_ms": s["total_p99_ms"] - b["total_p99_ms"]})
    return out


def line(res: dict[str, Any]) -> str:
    return (f"c={res['concurrency']:>3} {res['mode']:<16} n={res['requests']:>5} "
            f"ttft p50={res['ttft_p50_ms']:7.2f} p99={res['ttft_p99_ms']:7.2f} ms  "
            f"total p50={res['total_p50_ms']:7.2f} p99={res['total_p99_ms']:7.2f} "
            f"ms  {res['rps']:6.1f} req/s  cpu {res['server_cpu_ms_per_request']:.2f} ms/req"
            + (f"  errors {res['errors']}" if res.get("errors") else ""))


MODES = ["direct", "direct_pd", "bare_proxy", "router_fresh", "router_reuse", "router_d_direct",
         "vllm_router_pd", "vllm_router"]
ROUTERS = ("router", "vllm_router")
#: kvagent mode -> the vllm-router mode doing the same backend work.
PAIRS = {"router_fresh": "vllm_router_pd", "bare_proxy": "vllm_router"}


def vllm_router_bin() -> str | None:
    """The `vllm-router` script of this interpreter's environment, else one on PATH."""
    here = Path(sys.executable).with_name("vllm-router")
    return str(here) if here.exists() else shutil.which("vllm-router")


def vllm_router_argv(binary: str, port: int, p_url: str, d_url: str, *, pd: bool) -> list[str]:
    """vllm-router with its defaults (cache-aware policy), but limits that never queue or
    refuse the benchmark's concurrency and quiet logs."""
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--max-concurrent-requests", "4096", "--queue-size", "4096",
            "--health-check-interval-secs", "60",
            # its metrics listener has a fixed default port: two instances would collide
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if pd:
        return argv + ["--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url]
    return argv + ["--worker-urls", d_url]


def versus(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvagent's router against vllm-router doing the same backend work, per concurrency:
    each one's added TTFT p50 over the same baseline, and their ratio (from one run)."""
    by = {(s["concurrency"], s["mode"]): s for s in summary}
    out = []
    for (c, mode), s in sorted(by.items()):
        other = by.get((c, PAIRS.get(mode, "")))
        base = by.get((c, "direct_pd" if mode == "router_fresh" else "direct"))
        if other is None or base is None:
            continue
        ours = s["ttft_p50_ms"] - base["ttft_p50_ms"]
        theirs = other["ttft_p50_ms"] - base["ttft_p50_ms"]
        out.append({"concurrency": c, "kvagent_mode": mode, "vllm_router_mode": other["mode"],
                    "baseline": base["mode"], "kvagent_added_ttft_p50_ms": ours,
                    "vllm_router_added_ttft_p50_ms": theirs,
                    "ratio_added": ours / theirs if theirs > 0 else None,
                    "ratio_ttft_p50": s["ttft_p50_ms"] / other["ttft_p50_ms"],
                    "ratio_ttft_p99": s["ttft_p99_ms"] / other["ttft_p99_ms"],
                    "kvagent_cpu_ms_per_request": s["server_cpu_ms_per_request"],
                    "vllm_router_cpu_ms_per_request": other["server_cpu_ms_per_request"]})
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    p_port, d_port = free_port(), free_port()
    procs = [start([sys.executable, "-m", "benchmarks.router_overhead.fake_backend", str(p_port),
                    str(d_port)], cwd=HERE.parents[1])]
    rounds: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        await wait_ready(f"http://127.0.0.1:{d_port}/health")
        await wait_ready(f"http://127.0.0.1:{p_port}/health")
        routers: dict[str, str] = {}
        pids: dict[str, int] = {"direct": procs[0].pid}
        tmp = Path(tempfile.mkdtemp(prefix="kva-bench-"))
        for name, skip in (("router", 0), ("router_dd", 1000)):
            port = free_port()
            cfg = tmp / f"{name}.json"
            cfg.write_text(json.dumps({
                "policy": {"name": "cost_model", "params": {"skip_prefill_max_tokens": skip}},
                "nodes": {"block_size": 16, "kv_recompute_threshold": 16,
                          "max_in_flight": 1024}}))
            procs.append(start([sys.executable, "-m", "kvagent_server.router", "--port",
                                str(port), "--prefill", f"http://127.0.0.1:{p_port}",
                                "--decode", f"http://127.0.0.1:{d_port}", "--model", MODEL,
                                "--settings", str(cfg), "--log-level", "warning"]))
            routers[name] = f"http://127.0.0.1:{port}"
            pids[name] = procs[-1].pid
            await wait_ready(f"{routers[name]}/ready")
        vr = vllm_router_bin()
        wanted = [m for m in args.modes if m.startswith("vllm_router")]
        if wanted and vr is None:
            print("vllm-router is not installed: skipping " + ", ".join(wanted), flush=True)
            args.modes = [m for m in args.modes if m not in wanted]
        for name, pd in (("vllm_router_pd", True), ("vllm_router", False)):
            if name not in args.modes:
                continue
            assert vr is not None
            port = free_port()
            procs.append(start(vllm_router_argv(vr, port, f"http://127.0.0.1:{p_port}",
                                                f"http://127.0.0.1:{d_port}", pd=pd)))
            routers[name] = f"http://127.0.0.1:{port}"
            pids[name] = procs[-1].pid
            await wait_ready(f"{routers[name]}/health")
        port = free_port()
        procs.append(start([sys.executable, str(HERE / "bare_proxy.py"), str(port),
                            f"http://127.0.0.1:{d_port}"]))
        routers["bare"] = f"http://127.0.0.1:{port}"
        pids["bare"] = procs[-1].pid
        which = {"direct": "direct", "direct_pd": "direct", "bare_proxy": "bare",
                 "router_fresh": "router", "router_reuse": "router",
                 "router_d_direct": "router_dd", "vllm_router_pd": "vllm_router_pd",
                 "vllm_router": "vllm_router"}
        await asyncio.sleep(1.0)
        bases = {"direct": f"http://127.0.0.1:{d_port}", "direct_pd": f"http://127.0.0.1:{d_port}",
                 "bare_proxy": routers["bare"], "router_fresh": routers["router"],
                 "router_reuse": routers["router"], "router_d_direct": routers["router_dd"],
                 **{m: routers[m] for m in ("vllm_router_pd", "vllm_router") if m in routers}}
        for concurrency in args.concurrency:
            for rnd in range(args.repeats):
                for mode in args.modes:
                    res = await run_level(bases[mode], mode, concurrency, args.requests,
                                          args.cap_s, pids[which[mode]],
                                          f"http://127.0.0.1:{p_port}"
                                          if mode == "direct_pd" else None)
                    if mode.startswith("router_"):
                        res["misses_so_far"] = await miss_reasons(bases[mode])
                    res["round"] = rnd
                    res["loadavg_1m"] = round(os.getloadavg()[0], 2)
                    rounds.append(res)
                    print(f"r{rnd} {line(res)}  {res['paths']} {res.get('misses_so_far', '')}",
                          flush=True)
    finally:
        for proc in reversed(procs):
            stop_groups(proc)
    summary = summarise(rounds)
    loads = [round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]
    return {"command": " ".join(["python", *sys.argv]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "loadavg_before": loads[0], "loadavg_after": loads[1],
            "cpus": os.cpu_count(), "repeats": args.repeats,
            "vllm_router": vllm_router_version(),
            "summary": summary, "added": added(summary), "versus_vllm_router": versus(summary),
            "rounds": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rounds]}


def vllm_router_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-router")
    except PackageNotFoundError:
        return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so `main`'s finally stops the child processes


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400,
                    help="requests per level, mode and round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per level")
    ap.add_argument("--cap-s", type=float, default=60.0,
                    help="wall-clock cap per level, mode and round")
    ap.add_argument("--out", type=Path, help="results.json (a results.txt goes beside it)")
    args = ap.parse_args()
    out = asyncio.run(main(args))
    head = (f"{out['date_utc']} UTC  load average before {out['loadavg_before']}, "
            f"after {out['loadavg_after']}  ({out['cpus']} CPUs)")
    text = [head, out["command"], "", "pooled over rounds:"]
    text += [line(s) for s in out["summary"]] + ["", "added TTFT/total:"]
    text += [f"c={a['concurrency']:>3} {a['mode']:<16} vs {a['baseline']:<9} "
             f"ttft p50 {a['added_ttft_p50_ms']:+7.2f} p99 {a['added_ttft_p99_ms']:+8.2f} ms   "
             f"total p50 {a['added_total_p50_ms']:+7.2f} p99 {a['added_total_p99_ms']:+8.2f} ms"
             for a in out["added"]]
    if out["versus_vllm_router"]:
        text += ["", (f"kvagent router vs vllm-router {out['vllm_router']} (same backend, "
                      "one run; ratio = kvagent / vllm-router):")]
        text += [f"c={v['concurrency']:>3} {v['kvagent_mode']:<13} vs {v['vllm_router_mode']:<15} "
                 f"added ttft p50 {v['kvagent_added_ttft_p50_ms']:+6.2f} vs "
                 f"{v['vllm_router_added_ttft_p50_ms']:+6.2f} ms  ratio added "
                 + (f"{v['ratio_added']:.2f}" if v["ratio_added"] is not None else "n/a")
                 + f"  ttft p50 ratio {v['ratio_ttft_p50']:.2f}  p99 ratio "
                 f"{v['ratio_ttft_p99']:.2f}  cpu/req {v['kvagent_cpu_ms_per_request']:.2f} vs "
                 f"{v['vllm_router_cpu_ms_per_request']:.2f} ms" for v in out["versus_vllm_router"]]
    print("\n".join(text))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
        args.out.with_suffix(".txt").write_text("\n".join(text) + "\n")
