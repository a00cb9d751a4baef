"""Hostile clients against the router (fake P/D nodes), with a well-behaved client beside.

    python -m tools.attack.run --out tools/attack/results.json
    python -m tools.attack.run --quick          # the suite's slice (~40 s)

Starts the fake nodes (`backend.py`) and the router (`python -m kvagent_server.router`)
on loopback, runs a quiet phase, then one phase per attack, each bounded in time and
count, and stops everything (also on failure). Attackers connect from other loopback
source addresses (127.0.0.2 and up) than the well-behaved client (127.0.0.1), as
separate clients would. Recorded per phase: the router's RSS and open fds (peak, from
/proc), event-loop lag (the latency of a `/livez` probe every 50 ms on its own
connection: the loop's lag plus one small request), the well-behaved client's TTFT, and
what the attack got back. The probe and the well-behaved client run in an observer
process of their own (`--observe`), so the attackers' own work cannot delay what they
time; their samples are split into phases by time afterwards. Targets (`check`): RSS under `--rss-cap-mib`, fds under
`max_connections` + 64, the well-behaved TTFT p99 within 2x its quiet value (the suite's
slice allows 4x: the machine is shared), isolation held, the router alive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvagent_server.bundle.processes import stop_groups

ROOT = Path(__file__).resolve().parents[2]

from benchmarks._procs import free_ports, wait_ready

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
MODEL = "fake-model"
GOOD, FLOOD = "key-alice", "key-flood"
#: Other callers of the good client's tenant: each replays its session id once.
BOBS = [f"key-bob-{i}" for i in range(5)]
MIB = 1024 * 1024

SETTINGS: dict[str, Any] = {
    "tenants": [{"name": "acme", "api_keys": [GOOD, *BOBS]},
                {"name": "flood", "api_keys": [FLOOD]}],
    "limits": {"header_timeout_s": 3.0, "body_timeout_s": 4.0, "stream_write_timeout_s": 3.0,
               "max_connections": 1024, "max_connections_per_client": 128,
               "max_streams_per_client": 32, "max_upstream_body_bytes": MIB,
               "max_handles_per_tenant": 50},
    "retention": {"check_interval_s": 0.5},
    "nodes": {"health_interval_s": 5.0},
    "policy": {"params": {"skip_prefill_max_tokens": 0}},
}
LIMITS: dict[str, Any] = SETTINGS["limits"]


# ------------------------------------------------------------------ measuring


@dataclass
class Phase:
    name: str
    rss_mib: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    good_errors: int = 0
    good_reused: int = 0
    attack: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def p(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)

        return {"rss_mib_max": max(self.rss_mib, default=None),
                "fds_max": max(self.fds, default=None),
                "loop_lag_ms_p50": p(self.lag_ms, 0.5), "loop_lag_ms_p99": p(self.lag_ms, 0.99),
                "loop_lag_ms_max": p(self.lag_ms, 1.0),
                "ttft_ms_p50": p(self.ttft_ms, 0.5), "ttft_ms_p99": p(self.ttft_ms, 0.99),
                "good_turns": len(self.ttft_ms), "good_errors": self.good_errors,
                "good_reused_turns": self.good_reused, "attack": self.attack}


@dataclass
class Samples:
    """What the observer process saw, each sample stamped with `time.monotonic()` (one
    clock for every process on Linux), to be split into phases afterwards."""
    rss_mib: list[tuple[float, float]] = field(default_factory=list)
    fds: list[tuple[float, int]] = field(default_factory=list)
    lag_ms: list[tuple[float, float]] = field(default_factory=list)
    #: (turn sent, TTFT ms or None for a failed turn, reused)
    turns: list[tuple[float, float | None, bool]] = field(default_factory=list)

    def phase(self, name: str, start: float, end: float) -> Phase:
        def within(rows: list[Any]) -> list[Any]:
            return [r for r in rows if start <= r[0] < end]

        ph = Phase(name)
        ph.rss_mib = [v for _, v in within(self.rss_mib)]
        ph.fds = [v for _, v in within(self.fds)]
        ph.lag_ms = [v for _, v in within(self.lag_ms)]
        for _, ttft, reused in within(self.turns):
            if ttft is None:
                ph.good_errors += 1
            else:
                ph.ttft_ms.append(ttft)
                ph.good_reused += reused
        return ph


class Monitor:
    """Samples the router process and probes its loop."""

    def __init__(self, pid: int, base: str, samples: Samples) -> None:
        self.pid, self.base, self.samples = pid, base, samples

    def sample(self) -> None:
        now = time.monotonic()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.samples.rss_mib.append((now, round(int(line.split()[1]) / 1024, 1)))
            self.samples.fds.append((now, len(os.listdir(f"/proc/{self.pid}/fd"))))

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=30) as c:
            while True:
                self.sample()
                t0 = time.perf_counter()
                sent = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    await c.get("/livez")
                    self.samples.lag_ms.append((sent, (time.perf_counter() - t0) * 1000))
                await asyncio.sleep(0.05)


class GoodClient:
    """Streamed turns on one session (reset every 4 turns), measuring TTFT."""

    def __init__(self, base: str, samples: Samples, session: str) -> None:
        self.base, self.samples, self.session = base, samples, session
        self.turns = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=30,
                                     headers={"Authorization": f"Bearer {GOOD}"}) as c:
            messages: list[dict[str, str]] = []
            while True:
                if self.turns % 4 == 0:
                    messages = [{"role": "user", "content": "Summarise this. " * 20}]
                sent = time.monotonic()
                t0 = time.perf_counter()
                ttft, text, kva = None, [], {}
                try:
                    async with c.stream("POST", "/v1/chat/completions", json={
                            "model": MODEL, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}, "max_tokens": 32},
                            headers={"X-Session-ID": self.session}) as r:
                        if r.status_code != 200:
                            raise RuntimeError(r.status_code)
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            obj = json.loads(line[6:])
                            if ttft is None and obj.get("choices"):
                                ttft = time.perf_counter() - t0
                            if obj.get("choices"):
                                text.append(obj["choices"][0]["delta"].get("content") or "")
                            kva = obj.get("kvagent") or kva
                    self.samples.turns.append((sent, (ttft or 0) * 1000,
                                               bool(kva.get("reused_tokens"))))
                except (httpx.HTTPError, RuntimeError, ValueError):
                    self.samples.turns.append((sent, None, False))
                    await asyncio.sleep(0.1)
                self.turns += 1
                messages = [*messages, {"role": "assistant", "content": "".join(text)},
                            {"role": "user", "content": f"and then {self.turns}?"}]
                await asyncio.sleep(0.05)


async def observe(base: str, pid: int, session: str, out: Path) -> None:
    """The observer process: the loop probe and the well-behaved client, until SIGTERM;
    then the samples go to `out`. Apart from the attackers' process, so that what they
    do in their own event loop (encoding a 9 MiB body, say) cannot delay what it times."""
    import signal

    samples = Samples()
    stop_ev = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop_ev.set)
    tasks = [asyncio.create_task(Monitor(pid, base, samples).run()),
             asyncio.create_task(GoodClient(base, samples, session).run())]
    await stop_ev.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    out.write_text(json.dumps({k: getattr(samples, k) for k in
                               ("rss_mib", "fds", "lag_ms", "turns")}))


# ------------------------------------------------------------------ attacks


class Attacks:
    def __init__(self, port: int, base: str, rng: random.Random, scale: float,
                 good_session: str) -> None:
        self.port, self.base, self.rng, self.scale = port, base, rng, scale
        self.good_session = good_session
        self._src = 1

    def src(self) -> str:
        """A fresh attacker source address (127.0.0.2 ... 127.0.0.254)."""
        self._src = self._src % 253 + 1
        return f"127.0.0.{self._src + 1}"

    async def conn(self, src: str | None = None) -> tuple[asyncio.StreamReader,
                                                          asyncio.StreamWriter]:
        return await asyncio.open_connection(HOST, self.port, local_addr=(src or self.src(), 0))

    async def small_buffer_conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection whose receive buffer is tiny: a non-reader stalls the router's
        writes after kilobytes, not megabytes."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind((self.src(), 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (HOST, self.port))
        return await asyncio.open_connection(sock=sock)

    @staticmethod
    async def status(reader: asyncio.StreamReader, timeout: float) -> str:
        """The answer's status, or how the connection ended (a server that closes with
        unread bytes resets it: the answer is then lost in transit)."""
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        except TimeoutError:
            return "no answer"
        except OSError:
            return "reset"
        return line.decode(errors="replace").split(" ")[1] if line else "closed"

    async def header_flood(self, size_mib: int, conns: int) -> dict[str, Any]:
        """Header blocks of `size_mib` that never end, `conns` at once."""
        async def one() -> tuple[str, float]:
            reader, writer = await self.conn()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
            sent = 0
            chunk = b"a" * MIB
            end = time.monotonic() + 60  # a router that buffers it all takes a while
            try:
                while sent < size_mib * MIB and time.monotonic() < end:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), 10)
                    sent += MIB
            except (OSError, TimeoutError):
                pass
            status = await self.status(reader, 5)
            writer.close()
            return status, sent / MIB

        results = await asyncio.gather(*(one() for _ in range(conns)))
        return {"statuses": sorted({s for s, _ in results}),
                "mib_sent_before_close_max": max(m for _, m in results)}

    async def slow_headers(self, n: int, seconds: float) -> dict[str, Any]:
        """`n` connections sending one header byte a second (from 15 addresses)."""
        srcs = [self.src() for _ in range(15)]
        opened = refused = 0
        lifetimes: list[float] = []
        answers: dict[str, int] = {}
        end = time.monotonic() + seconds

        async def one(i: int) -> None:
            nonlocal opened, refused
            try:
                reader, writer = await self.conn(srcs[i % len(srcs)])
            except OSError:
                refused += 1
                return
            opened += 1
            t0 = time.monotonic()
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
            try:
                while time.monotonic() < end and not reader.at_eof():
                    writer.write(b"x")
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        data = await asyncio.wait_for(reader.read(200), 1.0)
                        if data or reader.at_eof():
                            key = data.split(b" ")[1].decode() if data else "closed"
                            answers[key] = answers.get(key, 0) + 1
                            break
            except OSError:
                answers["reset"] = answers.get("reset", 0) + 1
            lifetimes.append(time.monotonic() - t0)
            writer.close()

        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(i)))
            if i % 100 == 99:
                await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return {"connections": n, "opened": opened, "refused": refused, "answers": answers,
                "lifetime_s_max": round(max(lifetimes, default=0), 1)}

    async def slow_bodies(self, n: int, seconds: float) -> dict[str, Any]:
        """`n` requests whose declared 10 kB body arrives a byte a second."""
        end = time.monotonic() + seconds

        async def one() -> str:
            reader, writer = await self.conn()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"authorization: Bearer " + FLOOD.encode() + b"\r\n"
                         b"content-type: application/json\r\ncontent-length: 10000\r\n\r\n{")
            try:
                while time.monotonic() < end:
                    writer.write(b" ")
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        data = await asyncio.wait_for(reader.read(200), 1.0)
                        return data.split(b" ")[1].decode() if data else "closed"
            except OSError:
                return "reset"
            finally:
                writer.close()
            return "still open"

        results = await asyncio.gather(*(one() for _ in range(n)))
        return {"requests": n, "statuses": {s: results.count(s) for s in set(results)}}

    async def slow_readers(self, n: int, seconds: float) -> dict[str, Any]:
        """`n` streamed requests for a long answer whose clients never read."""
        body = json.dumps({"model": MODEL, "stream": True, "messages": [
            {"role": "user", "content": "LONG please"}]}).encode()
        writers = []
        for _ in range(n):
            _, writer = await self.small_buffer_conn()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"authorization: Bearer " + FLOOD.encode() + b"\r\n"
                         b"content-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            writers.append(writer)
        await asyncio.sleep(seconds)
        for w in writers:
            w.close()
        return {"streams": n, "router_slow_clients_cut": await self.metric(
            "kvagent_router_slow_clients_total")}

    async def churn(self, seconds: float) -> dict[str, Any]:
        """Connections opened and closed as fast as the machine allows (half send a
        request and close without reading the answer)."""
        end = time.monotonic() + seconds
        count = errors = 0

        async def worker() -> None:
            nonlocal count, errors
            while time.monotonic() < end:
                try:
                    _, writer = await self.conn()
                    if count % 2:
                        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
                    writer.close()
                    count += 1
                except OSError:
                    errors += 1
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(worker() for _ in range(8)))
        return {"connections": count, "connect_errors": errors}

    async def hijack_and_quota(self, sessions: int) -> dict[str, Any]:
        """Bob (same tenant, other key) replays the good client's session id; a second
        tenant floods one-turn sessions past its quota; request-level abuse."""
        out: dict[str, Any] = {}
        async with httpx.AsyncClient(base_url=self.base, timeout=30,
                                     transport=httpx.AsyncHTTPTransport(
                                         local_address=self.src())) as c:
            first = [{"role": "user", "content": "Summarise this. " * 20}]
            stolen = 0
            errors = 0
            for i, key in enumerate(BOBS):
                bob = {"Authorization": f"Bearer {key}", "X-Session-ID": self.good_session}
                try:
                    r = await c.post("/v1/chat/completions", headers=bob, json={
                        "model": MODEL, "messages": [
                            *first, {"role": "assistant", "content": "ok " * 24},
                            {"role": "user", "content": f"q{i}"}]})
                    stolen += bool(r.json().get("kvagent", {}).get("reused_tokens"))
                except (httpx.HTTPError, ValueError):
                    errors += 1
            out["hijack_turns_that_reused_another_callers_kv"] = stolen
            flood = {"Authorization": f"Bearer {FLOOD}"}
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> int | str:
                async with sem:
                    try:
                        r = await c.post("/v1/chat/completions", headers={
                            **flood, "X-Session-ID": f"flood-{i}"}, json={
                            "model": MODEL, "messages": [{"role": "user",
                                                          "content": f"f{i}"}]})
                    except httpx.HTTPError as exc:
                        return type(exc).__name__
                    return r.status_code

            before = await self.d_blocks()
            codes = await asyncio.gather(*(one(i) for i in range(sessions)))
            out["flood_sessions"] = sessions
            out["flood_statuses"] = {str(s): codes.count(s) for s in set(codes)}
            await asyncio.sleep(1.5)  # two retention rounds: releases flushed
            after = await self.d_blocks()
            out["d_blocks_pinned_by_flood"] = (after - before if None not in (before, after)
                                               else None)
            abuse = {
                "body_9mib": {"model": MODEL, "messages": [
                    {"role": "user", "content": "x" * (9 * MIB)}]},
                "huge_answer": {"model": MODEL, "messages": [
                    {"role": "user", "content": "HUGE"}]},
                "newline_session": {"model": MODEL, "kvagent": {"session_id": "s\n"},
                                    "messages": [{"role": "user", "content": "hi"}]},
                "messages_5000": {"model": MODEL, "messages": [
                    {"role": "user", "content": "."}] * 5000},
            }
            for name, body in abuse.items():
                try:
                    r = await c.post("/v1/chat/completions", json=body, headers=flood)
                    out[name] = r.status_code
                except httpx.HTTPError as exc:
                    out[name] = type(exc).__name__
            out["hijack_errors"] = errors
        return out

    async def metric(self, name: str) -> float | None:
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"{self.base}/metrics", timeout=30)).text
        for line in text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
        return None

    async def d_blocks(self) -> float | None:
        return None  # set by main: the fake D's URL is not the router's


# ------------------------------------------------------------------ the run


def _spawn(argv: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
    """A process in its own group (`stop_groups` ends the group); output to `log` or nowhere."""
    if log is None:
        return subprocess.Popen(argv, start_new_session=True, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with log.open("w") as out:
        return subprocess.Popen(argv, start_new_session=True, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    p_port, d_port, r_port = free_ports(3)
    procs: list[subprocess.Popen] = []
    # The caller's PYTHONPATH first: it may name another checkout's router to compare.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.environ.get("PYTHONPATH", ""), str(ROOT / "sdk"), str(ROOT / "server"),
         str(ROOT)])}
    from kvagent_server.router.settings import RouterSettings

    # Settings this router knows (an older one, for a before/after comparison, lacks some).
    known = {k: v for k, v in SETTINGS.items() if k in RouterSettings.model_fields}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"router": known}, f)
        settings_path = f.name
    base = f"http://{HOST}:{r_port}"
    d_url = f"http://{HOST}:{d_port}"
    try:
        procs.append(_spawn([sys.executable, "-m", "tools.attack.backend", str(p_port),
                             str(d_port)], env, args.backend_log))
        await wait_ready(f"http://{HOST}:{p_port}/health")
        await wait_ready(f"{d_url}/health")
        router = _spawn(
            [sys.executable, "-m", "kvagent_server.router", "--port", str(r_port),
             "--prefill", f"http://{HOST}:{p_port}", "--decode", d_url, "--model", MODEL,
             "--settings", settings_path, "--log-level", "warning"], env, args.router_log)
        procs.append(router)
        await wait_ready(f"{base}/ready")
        session = f"good-{rng.randrange(1 << 30):x}"
        attacks = Attacks(r_port, base, rng, args.scale, session)

        async def d_blocks() -> float | None:
            from tools.attack.backend import KV_BLOCKS

            async with httpx.AsyncClient() as c:
                text = (await c.get(f"{d_url}/metrics", timeout=30)).text
            for line in text.splitlines():
                if line.startswith("vllm:kv_cache_usage_perc"):
                    return round(float(line.rsplit(" ", 1)[1]) * KV_BLOCKS)
            return None

        attacks.d_blocks = d_blocks  # type: ignore[method-assign]
        samples_path = Path(tempfile.mkdtemp(prefix="kvagent-attack-")) / "samples.json"
        observer = _spawn([sys.executable, str(HERE / "run.py"), "--observe", base,
                           str(router.pid), session, str(samples_path)], env, None)
        procs.append(observer)
        await asyncio.sleep(0.5)  # the observer's first turns before the quiet phase
        s, q = args.scale, args.phase_s
        plan: list[tuple[str, Any]] = [
            ("quiet", lambda: asyncio.sleep(q)),
            ("header_flood_200mib", lambda: attacks.header_flood(int(200 * s) or 1, 1)),
            ("header_flood_4x256mib", lambda: attacks.header_flood(int(256 * s) or 1, 4)),
            ("slow_headers", lambda: attacks.slow_headers(int(1500 * s), q)),
            ("slow_bodies", lambda: attacks.slow_bodies(
                int(200 * s), max(q, LIMITS["body_timeout_s"] + 2))),
            ("slow_readers", lambda: attacks.slow_readers(
                2, max(q, LIMITS["stream_write_timeout_s"] + 12))),
            ("churn", lambda: attacks.churn(q)),
            ("hijack_quota_abuse", lambda: attacks.hijack_and_quota(int(300 * s) or 60)),
            ("quiet_after", lambda: asyncio.sleep(q)),
        ]
        windows: list[tuple[str, float, float, dict[str, Any]]] = []
        phases: dict[str, Any] = {}
        deadline = time.monotonic() + args.max_s
        for name, attack in plan:
            if args.only and name not in args.only and not name.startswith("quiet"):
                continue
            if time.monotonic() > deadline:
                phases[name] = {"skipped": "run over --max-s"}
                continue
            started = time.monotonic()
            result = await asyncio.wait_for(attack(), timeout=max(5.0, q * 4 + 60))
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))  # samples
            result = result or {}
            result["seconds"] = round(time.monotonic() - started, 1)
            windows.append((name, started, time.monotonic(), result))
            phases[name] = {"router_alive": router.poll() is None}
            print(name, json.dumps(result), flush=True)
        observer.terminate()
        observer.wait(30)
        raw = json.loads(samples_path.read_text())
        samples = Samples(**{k: [tuple(r) for r in v] for k, v in raw.items()})
        for name, start, end, result in windows:
            ph = samples.phase(name, start, end)
            ph.attack = result
            phases[name] = {**ph.summary(), **phases[name]}
            print(name, json.dumps(phases[name]), flush=True)
        return {"settings": known, "seed": args.seed, "scale": args.scale,
                "phase_s": q, "phases": phases, "checks": check(phases, args)}
    finally:
        for p in reversed(procs):
            stop_groups(p)
        os.unlink(settings_path)


def check(phases: dict[str, Any], args: argparse.Namespace) -> dict[str, bool]:
    quiet = phases["quiet"]["ttft_ms_p99"] or 1.0
    ran = [p for p in phases.values() if "skipped" not in p]
    out = {
        "router_alive": all(p["router_alive"] for p in ran),
        "rss_under_cap": all((p["rss_mib_max"] or 0) < args.rss_cap_mib for p in ran),
        "fds_under_cap": all((p["fds_max"] or 0) < LIMITS["max_connections"] + 64
                             for p in ran),
        # A phase without a single finished turn means the client was stuck: a failure.
        "good_ttft_p99_within": all(p["ttft_ms_p99"] is not None
                                    and p["ttft_ms_p99"] <= args.ttft_factor * quiet
                                    for p in ran),
        "good_client_never_failed": all(p["good_errors"] == 0 for p in ran),
    }
    hq = phases.get("hijack_quota_abuse", {}).get("attack", {})
    if "hijack_turns_that_reused_another_callers_kv" not in hq:
        hq = {}
    if hq:
        out["no_hijack"] = hq["hijack_turns_that_reused_another_callers_kv"] == 0
        out["request_abuse_rejected"] = (hq["body_9mib"] == 413 and hq["huge_answer"] == 502
                                         and hq["newline_session"] == 400
                                         and hq["messages_5000"] == 400)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="attack sizes (1: the issue's 200 MiB, 1,500 connections ...)")
    p.add_argument("--phase-s", type=float, default=10.0, help="seconds per timed phase")
    p.add_argument("--max-s", type=float, default=300.0, help="stop starting phases after")
    p.add_argument("--rss-cap-mib", type=float, default=400.0)
    p.add_argument("--ttft-factor", type=float, default=2.0)
    p.add_argument("--quick", action="store_true",
                   help="the suite's slice: scale 0.1, 3 s phases, 4x TTFT allowance")
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="comma-separated phases to run (the quiet ones always run)")
    p.add_argument("--out", type=Path)
    p.add_argument("--router-log", type=Path)
    p.add_argument("--backend-log", type=Path)
    p.add_argument("--observe", nargs=4, metavar=("BASE", "ROUTER_PID", "SESSION", "OUT"),
                   help=argparse.SUPPRESS)  # the observer process (see `observe`)
    args = p.parse_args()
    if args.observe:
        base, pid, session, out = args.observe
        asyncio.run(observe(base, int(pid), session, Path(out)))
        return 0
    if args.quick:
        args.scale, args.phase_s, args.max_s, args.ttft_factor = 0.1, 3.0, 50.0, 4.0
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(result["checks"]))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
