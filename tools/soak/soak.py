"""Soak run against a live bundle: conversations keep starting and ending for tens of
minutes; afterwards nothing may have leaked.

    kvagent-server up --detach --ttl 120         # short block TTL: a short drain
    python tools/soak/soak.py --duration-s 1800 --drain-s 180 \
        --out tools/soak/results.json
    kvagent-server down

Processes are found with `kvagent-server status --json` (or given with `--router` and
`--node NAME=URL@PID`). Every `--sample-s` it records, per vLLM node, `/metrics`
`vllm:kv_cache_usage_perc` and running/waiting requests; per process (children
included: vLLM's engine core) open file descriptors and RSS; from the router's
`/metrics` `kvagent_router_store_handles` and `kvagent_router_in_flight`.

Checks, after the load stops and `--drain-s` has passed (set it above the decode TTL):
KV cache usage of every node back to its baseline (+ `--kv-tolerance` points), open fds of
every process back to baseline (+ `--fd-tolerance`), the router's store back to its
baseline, nothing in flight; with `--verify-every N`, every Nth turn that reused KV gave
the same greedy answer as the same request without a session (nothing reused). Exit
status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")
TOPICS = ["the history of lighthouses", "how tides work", "sourdough starters",
          "binary search trees", "the Roman road network", "bird migration"]


@dataclass
class Proc:
    name: str
    url: str
    pid: int | None
    role: str  # prefill | decode | router


@dataclass
class Totals:
    conversations: int = 0
    turns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    reused_turns: int = 0
    paths: dict[str, int] = field(default_factory=dict)
    verified: int = 0  # reused turns whose answer was compared with a no-reuse reference
    mismatches: list[dict[str, Any]] = field(default_factory=list)


def metric(text: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m and m.group(1) == name:
            total += float(m.group(3))
            seen = True
    return total if seen else None


def discover(args: argparse.Namespace) -> list[Proc]:
    if args.router:
        url, _, pid = args.router.partition("@")
        procs = [Proc("router", url, int(pid) if pid else None, "router")]
        for spec in args.node or []:
            name, _, rest = spec.partition("=")
            url, _, pid = rest.partition("@")
            role = "prefill" if name.startswith("prefill") else "decode"
            procs.append(Proc(name, url, int(pid) if pid else None, role))
        return procs
    exe = shutil.which("kvagent-server") or "kvagent-server"
    extra = [a for item in args.status_args for a in shlex.split(item)]
    out = subprocess.run([exe, "status", "--json", *extra], capture_output=True,
                         text=True, check=False)
    state = json.loads(out.stdout)
    procs = []
    for row in state["processes"]:
        name = row["name"]
        role = ("router" if name.startswith("router") else
                "prefill" if name.startswith("prefill") else "decode")
        procs.append(Proc(name, row["url"].rstrip("/"), row.get("pid"), role))
    return procs


def proc_usage(pid: int | None) -> dict[str, Any]:
    """Open fds and RSS of a process and all its children (None when it is gone)."""
    if pid is None:
        return {"fds": None, "rss_mib": None}
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
        fds = rss = 0
        for p in family:
            try:
                fds += p.num_fds()
                rss += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return {"fds": fds, "rss_mib": round(rss / 2**20, 1), "procs": len(family)}
    except psutil.NoSuchProcess:
        return {"fds": None, "rss_mib": None}


async def sample(client: httpx.AsyncClient, procs: list[Proc], t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1)}
    for p in procs:
        entry = proc_usage(p.pid)
        try:
            text = (await client.get(f"{p.url}/metrics", timeout=10)).text
        except httpx.HTTPError as exc:
            text = ""
            entry["metrics_error"] = type(exc).__name__
        if p.role == "router":
            entry["store_handles"] = metric(text, "kvagent_router_store_handles")
            entry["in_flight"] = metric(text, "kvagent_router_in_flight")
        else:
            usage = metric(text, "vllm:kv_cache_usage_perc")
            entry["kv_cache_usage_pct"] = None if usage is None else round(100 * usage, 2)
            entry["running"] = metric(text, "vllm:num_requests_running")
            entry["waiting"] = metric(text, "vllm:num_requests_waiting")
        out[p.name] = entry
    return out


async def verify(client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]],
                 max_tokens: int, answer: str, kva: dict[str, Any], totals: Totals) -> None:
    """The same request without a session (nothing reused from D): greedy answers must
    match. A mismatch is recorded, not fatal: read it with the path and reuse it had."""
    try:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": False})
    except httpx.HTTPError as exc:
        totals.errors[f"verify_{type(exc).__name__}"] = totals.errors.get(
            f"verify_{type(exc).__name__}", 0) + 1
        return
    if r.status_code != 200:
        totals.errors[f"verify_http_{r.status_code}"] = totals.errors.get(
            f"verify_http_{r.status_code}", 0) + 1
        return
    reference = r.json()["choices"][0]["message"].get("content") or ""
    totals.verified += 1
    if reference != answer:
        totals.mismatches.append({"path": kva.get("path"), "reused": kva.get("reused_tokens"),
                                  "answer": answer, "reference": reference})


async def conversation(client: httpx.AsyncClient, model: str, rng: random.Random,
                       max_turns: int, max_tokens: int, totals: Totals, idx: int,
                       verify_every: int = 0) -> None:
    session = f"soak-{idx}-{rng.randrange(1 << 30)}"
    topic = rng.choice(TOPICS)
    messages = [{"role": "system", "content": "You are concise."},
                {"role": "user", "content": f"Tell me about {topic}. " * 8}]
    token = None
    for turn in range(rng.randint(1, max_turns)):
        headers = {"X-Session-ID": session}
        if token:
            headers["X-KVAgent-Cache-Token"] = token
        try:
            r = await client.post("/v1/chat/completions", headers=headers, json={
                "model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": False})
        except httpx.HTTPError as exc:
            key = type(exc).__name__
            totals.errors[key] = totals.errors.get(key, 0) + 1
            return
        if r.status_code != 200:
            key = f"http_{r.status_code}"
            totals.errors[key] = totals.errors.get(key, 0) + 1
            return
        body = r.json()
        kva = body.get("kvagent") or {}
        token = kva.get("cache_token")
        totals.turns += 1
        totals.reused_turns += int((kva.get("reused_tokens") or 0) > 0)
        path = str(kva.get("path"))
        totals.paths[path] = totals.paths.get(path, 0) + 1
        answer = body["choices"][0]["message"].get("content") or ""
        if verify_every and (kva.get("reused_tokens") or 0) > 0 and (
                totals.turns % verify_every == 0):
            await verify(client, model, messages, max_tokens, answer, kva, totals)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Go on ({turn + 1})."}]
    totals.conversations += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    procs = discover(args)
    router = next(p for p in procs if p.role == "router")
    rng = random.Random(args.seed)
    totals = Totals()
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=router.url, timeout=args.request_timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        baseline = await sample(client, procs, t0)
        samples.append({**baseline, "phase": "baseline"})
        stop_at = time.monotonic() + args.duration_s

        async def worker(i: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                await conversation(client, model, rng, args.max_turns, args.max_tokens,
                                   totals, i * 1_000_000 + n, args.verify_every)
                n += 1

        async def sampler(phase: str, until: float) -> None:
            while time.monotonic() < until:
                await asyncio.sleep(args.sample_s)
                samples.append({**await sample(client, procs, t0), "phase": phase})
                print(json.dumps({"phase": phase, "turns": totals.turns, **samples[-1]}),
                      flush=True)

        watch = asyncio.create_task(sampler("load", stop_at))
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        watch.cancel()
        await sampler("drain", time.monotonic() + args.drain_s)
        final = await sample(client, procs, t0)
        samples.append({**final, "phase": "final"})
    warm = next((x for x in samples if x.get("phase") == "load"), baseline)
    checks = verdicts(procs, baseline, warm, final, args)
    if args.verify_every:
        checks.append({"check": "reused answers equal no-reuse answers",
                       "baseline": totals.verified, "final": len(totals.mismatches),
                       "tolerance": 0,
                       "ok": totals.verified > 0 and not totals.mismatches})
    return {"ok": all(c["ok"] for c in checks), "checks": checks,
            "totals": totals.__dict__, "duration_s": args.duration_s,
            "drain_s": args.drain_s, "concurrency": args.concurrency, "samples": samples}


def verdicts(procs: list[Proc], base: dict[str, Any], warm: dict[str, Any],
             final: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """KV, store and in-flight back to the pre-run baseline; open fds back to the first
    sample under load (`warm`): the first transfers open NIXL side-channel and keep-alive
    sockets that stay open for the node's life, which is not a leak; growth after that is."""
    out = []

    def check(what: str, before: float | None, after: float | None, tolerance: float) -> None:
        ok = before is not None and after is not None and after <= before + tolerance
        out.append({"check": what, "baseline": before, "final": after,
                    "tolerance": tolerance, "ok": ok})

    for p in procs:
        b, f = base[p.name], final[p.name]
        check(f"{p.name} open fds (vs warm)", warm[p.name].get("fds"), f.get("fds"),
              args.fd_tolerance)
        if p.role == "router":
            check("router store handles", b.get("store_handles"), f.get("store_handles"), 0)
            check("router in flight", 0.0, f.get("in_flight"), 0)
        else:
            check(f"{p.name} kv cache usage %", b.get("kv_cache_usage_pct"),
                  f.get("kv_cache_usage_pct"), args.kv_tolerance)
            check(f"{p.name} running requests", 0.0, f.get("running"), 0)
    return out


def rejudge(args: argparse.Namespace) -> dict[str, Any]:
    """The verdicts of a saved run under this script's current rules."""
    result = json.loads(args.rejudge.read_text())
    samples = result["samples"]
    base = next(x for x in samples if x["phase"] == "baseline")
    final = next(x for x in samples if x["phase"] == "final")
    warm = next((x for x in samples if x["phase"] == "load"), base)
    roles = {"router": "router"}
    procs = [Proc(name, "", None, roles.get(name, "prefill" if name.startswith("prefill")
                                              else "decode"))
             for name, v in base.items() if isinstance(v, dict)]
    checks = verdicts(procs, base, warm, final, args)
    totals = result["totals"]
    if totals.get("verified") is not None:
        checks.append({"check": "reused answers equal no-reuse answers",
                       "baseline": totals["verified"], "final": len(totals["mismatches"]),
                       "tolerance": 0,
                       "ok": totals["verified"] > 0 and not totals["mismatches"]})
    return {**result, "ok": all(c["ok"] for c in checks), "checks": checks,
            "rejudged_from": str(args.rejudge)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=1800)
    ap.add_argument("--drain-s", type=float, default=180,
                    help="wait after the load (must exceed the decode block TTL)")
    ap.add_argument("--sample-s", type=float, default=15)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--request-timeout-s", type=float, default=300)
    ap.add_argument("--kv-tolerance", type=float, default=0.5)
    ap.add_argument("--fd-tolerance", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verify-every", type=int, default=0,
                    help="every Nth turn, if it reused KV, compare its answer with the same "
                         "request sent without a session (no reuse); 0: off")
    ap.add_argument("--router", help="URL[@PID] instead of `kvagent-server status`")
    ap.add_argument("--node", action="append", help="NAME=URL[@PID] (with --router)")
    ap.add_argument("--status-args", action="append", default=[],
                    help="extra arguments for `kvagent-server status` (e.g. --name x)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rejudge", type=Path,
                    help="recompute the verdicts of a saved --out file (no load is run)")
    args = ap.parse_args()
    result = rejudge(args) if args.rejudge else asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
