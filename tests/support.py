"""Helpers for tests that run real services (redis-server, vLLM nodes, the bundle).

Plain functions and types, importable from any test module as `support` (the `tests/`
folder is on sys.path); the fixtures built on them live in `tests/conftest.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.common.ports import free_port, free_ports  # noqa: F401 - the tests' port pickers

#: Set by `.ci/run`: a test that needs real vLLM or Redis may not skip there, because a
#: skipped real-engine test is a check that silently did not happen.
REQUIRE_REAL_ENV = "KVAGENT_REQUIRE_REAL"

#: A stand-in for vLLM and the router that records its argv and environment (the bundle
#: launcher's and the deployments' tests).
FAKE_NODE = Path(__file__).parent / "fakes" / "process.py"


def require_real() -> bool:
    """Whether `KVAGENT_REQUIRE_REAL` is set (not empty, not 0): real parts must run."""
    return os.environ.get(REQUIRE_REAL_ENV, "") not in ("", "0")


def skip_unless_required(reason: str) -> None:
    """`pytest.skip(reason)`, or `pytest.fail` while `KVAGENT_REQUIRE_REAL` is set: for a
    skip no marker names (the conftest hook only turns vllm/redis-marked skips into
    failures)."""
    import pytest

    if require_real():
        pytest.fail(f"{reason} (may not skip while {REQUIRE_REAL_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


# --------------------------------------------------------------------------- redis


def p2p_received(url: str) -> float:
    """Prompt tokens a node received from another vLLM node over NIXL."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_cached_by_source_total{")
               and 'source="p2p"' in line)


@dataclass(frozen=True)
class RedisServer:
    url: str
    port: int
    proc: subprocess.Popen
    workdir: str


def start_redis(port: int | None = None, timeout: float = 20.0) -> RedisServer:
    """Start a real `redis-server` on 127.0.0.1 (a free port unless given), no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server binary not installed (./dev test installs it)")
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="kvagent-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, proc=proc,
                                   workdir=workdir)
        except OSError:
            time.sleep(0.05)
    stop_groups(proc)
    raise RuntimeError("redis-server did not start")


def stop_redis(server: RedisServer) -> None:
    stop_groups(server.proc)
    shutil.rmtree(server.workdir, ignore_errors=True)


@dataclass(frozen=True)
class VLLMNode:
    """A running aggregated vLLM-CPU node (no KV connector) serving the demo model."""

    base_url: str  # ends in /v1
    root_url: str
    model: str
    model_path: Path
    log_path: Path


#: The context of the suite's shared nodes (`kvagent_bundle`, and `vllm_node` beside it):
#: room for Claude Code's first request (its system prompt and tools, ~29k tokens).
SUITE_MAX_MODEL_LEN = 32768


def start_vllm_node(log_dir: Path, *, extra_args: list[str] | None = None,
                    timeout: float = 300.0, env: dict[str, str] | None = None,
                    max_model_len: int | None = None,
                    ) -> tuple[VLLMNode, subprocess.Popen]:
    """Start one aggregated vLLM-CPU node serving the demo model (the demo's context
    unless `max_model_len`); `env` adds to (and wins over) the inherited environment."""
    from kvagent_server.models.demo import (
        DEMO_MODEL_NAME,
        demo_serve_args,
        demo_serve_env,
        ensure_demo_model,
    )

    model_path = ensure_demo_model()
    port = free_port()
    log_path = log_dir / f"vllm-{port}.log"
    env = {**os.environ, **demo_serve_env(), **(env or {})}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_path), "--host", "127.0.0.1", "--port", str(port),
            *(demo_serve_args(max_model_len) if max_model_len else demo_serve_args()),
            *TEST_ENGINE_ARGS, *(extra_args or [])]
    if "--served-model-name" not in argv:
        argv += ["--served-model-name", DEMO_MODEL_NAME]
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log_path}:\n"
                               + log_path.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(f"{root}/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        stop_groups(proc)
        raise RuntimeError(f"vLLM did not become healthy in {timeout}s; see {log_path}")
    node = VLLMNode(base_url=f"{root}/v1", root_url=root, model=DEMO_MODEL_NAME,
                    model_path=model_path, log_path=log_path)
    return node, proc


@dataclass(frozen=True)
class KVAgentBundle:
    """A running bundle (1 P + 1 D + router) or the reason it is unavailable."""

    available: bool
    reason: str | None = None
    base_url: str = ""  # the router, ending in /v1
    router_url: str = ""
    model: str = ""
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    run_dir: Path | None = None


#: vLLM arguments of every engine the suite starts: eager mode (no torch.compile). Compiling
#: one engine config costs ~60 s of CPU on a fresh machine and ~25 s even from the cache,
#: and the suite starts a few dozen engines; eager is what vLLM's own tests run. Answers are
#: compared between engines of the same mode. The demo (tests/demo/test_demo_vllm.py) and the
#: benchmarks' quick mode (tests/benchmarks/test_quick_vllm.py) run the default, compiled mode.
TEST_ENGINE_ARGS = ("-O0",)


def pd_config(data: dict[str, Any]):
    """`validate_config(data)` with `topology: pd` unless `data` names one: for the tests of
    the P/D plan (`auto` would run one node on a CPU machine)."""
    from kvagent_server.config import validate_config

    return validate_config({"topology": "pd", **data})


def bundle_config(run_dir: Path, **overrides: object):
    """A bundle config on free loopback ports, for tests (demo model, CPU, pinned, eager).

    P/D unless `topology` says otherwise: most tests are about the P/D mechanism, and
    `auto` would run one node on this CPU machine."""
    from kvagent_server.config import validate_config

    data: dict[str, object] = {
        "name": "test",
        "topology": "pd",
        "device": "cpu",
        "run_dir": str(run_dir),
        "kv_cache_gib": 1,
        "max_model_len": 16384,
        "prefill": {"ports": [free_port()], "side_channel_ports": [free_port()]},
        "decode": {"ports": [free_port()], "side_channel_ports": [free_port()]},
        "router": {"port": free_port()},
        "startup_timeout_s": 600,
        "stop_grace_s": 10,
    }
    data.update(overrides)
    for role in ("prefill", "decode"):
        spec = dict(data.get(role) or {})  # type: ignore[call-overload]
        spec["extra_args"] = [*TEST_ENGINE_ARGS, *spec.get("extra_args", [])]
        data[role] = spec
    return validate_config(data)


def replicas_config(run_dir: Path, **overrides: object):
    """`bundle_config` of the `replicas` topology: two symmetric nodes on free ports."""
    return bundle_config(run_dir, topology="replicas", decode={
        "count": 2, "ports": [free_port(), free_port()],
        "side_channel_ports": [free_port(), free_port()]}, **overrides)


def start_bundle(config):
    """Start a bundle with the package's own launcher; returns (handle, Bundle)."""
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.supervisor import Bundle

    inputs = gather_inputs(config)
    bundle = Bundle(config, inputs=inputs)
    bundle.start(wait=True)
    handle = KVAgentBundle(
        available=True,
        base_url=f"{bundle.router_url}/v1",
        router_url=bundle.router_url or "",
        model=config.served_model_name or inputs.model.served_name,
        prefill_urls=tuple(bundle.node_urls("prefill")),
        decode_urls=tuple(bundle.node_urls("decode")),
        run_dir=config.resolved_run_dir(),
    )
    return handle, bundle


def metric_sum(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) on a node or the router."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total

def cached_by_source(url: str) -> dict[str, float]:
    """Prompt tokens a vLLM node took from each source (device, host, disk, p2p) so far
    (`vllm:prompt_tokens_cached_by_source`, summed over the other labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def kv_usage(url: str) -> float:
    """A vLLM node's engine KV in use, 0..1 (`vllm:kv_cache_usage_perc`)."""
    return metric_sum(url, "vllm:kv_cache_usage_perc")


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `cond` until it holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def random_document(seed: int, n_words: int) -> list[dict[str, Any]]:
    """A system prompt and a document of `n_words` random words (~3 tokens each): a
    prompt no other test's prefix shares."""
    rng = random.Random(seed)
    text = " ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 7)))
                    for _ in range(n_words))
    return [{"role": "system", "content": "You are a terse agent. Read the document."},
            {"role": "user", "content": f"Document {seed}: {text}"}]


def ignore_eos_body(model: str, messages: list[dict[str, Any]], max_tokens: int
                    ) -> dict[str, Any]:
    """A greedy chat request that generates exactly `max_tokens` (`ignore_eos`): a turn
    whose KV size the test knows."""
    return {"model": model, "messages": messages, "temperature": 0.0,
            "max_tokens": max_tokens, "ignore_eos": True}


def release_nudge(url: str, model: str, timeout: float = 120.0) -> None:
    """One one-token request to a node: its offloading scheduler builds a finished
    request's last tier stores at the next engine step. Release-only params, as the
    router's own releases: the node does not retain its blocks (no router knows them)."""
    from kvagent_server.router.reuse.transfer import RELEASE_KEY

    r = httpx.post(f"{url}/v1/completions", timeout=timeout,
                   json={"model": model, "prompt": [11], "max_tokens": 1,
                         "kv_transfer_params": {RELEASE_KEY: []}})
    assert r.status_code == 200, r.text


def greedy_chat(url: str, model: str, messages: list[dict[str, Any]],
                headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """One non-streamed chat completion, greedy and 16 tokens long; asserts a 200."""
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers or {}, timeout=300,
                   json={"model": model, "messages": messages, "temperature": 0.0,
                         "max_tokens": 16, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def session_chat(base_url: str, session: str, body: dict[str, Any], token: str | None = None,
                 *, timeout: float = 600.0) -> dict[str, Any]:
    """One non-streamed turn of `session` through a router (`base_url` ends in `/v1`),
    with the cache token of its last turn if given; asserts a 200."""
    headers = {"X-Session-ID": session, **({"X-KVAgent-Cache-Token": token} if token else {})}
    r = httpx.post(f"{base_url}/chat/completions", json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def recomputed_answer(node_url: str, body: dict[str, Any], *, timeout: float = 600.0) -> str:
    """`body` sent to one vLLM node (its root URL) under a fresh `cache_salt`, so nothing
    is reused (asserted): the answer a turn with reuse must equal."""
    r = httpx.post(f"{node_url}/v1/chat/completions", timeout=timeout,
                   json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, out["usage"]
    return str(out["choices"][0]["message"]["content"])


def turn_against_recompute(router_url: str, node_url: str, model: str, session: str,
                           messages: list[dict[str, Any]]
                           ) -> tuple[tuple[str, int, int | None, bool], str]:
    """One greedy turn of `session` through the router, and the same messages recomputed
    on `node_url` under a fresh salt (nothing cached, asserted): the turn's (path, reused
    tokens, cached tokens, answer equal to the recompute) and its answer's text."""
    out = greedy_chat(router_url, model, messages, {"X-Session-ID": session})
    text = out["choices"][0]["message"]["content"] or ""
    ref = greedy_chat(node_url, model, messages, cache_salt=uuid.uuid4().hex)
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return ((out["kvagent"]["path"], out["kvagent"]["reused_tokens"], cached,
             text == (ref["choices"][0]["message"]["content"] or "")), text)


@contextlib.contextmanager
def second_router(b: KVAgentBundle, tmp_path: Path, *, prefill: bool = True,
                  **settings: Any) -> Iterator[str]:
    """A second router (`python -m kvagent_server.router`) in front of the bundle's nodes,
    with its own settings and store; yields its URL. `prefill=False`: in front of the
    decode node alone (no `--prefill`: the single topology)."""
    from kvagent_server.bundle.supervisor import probe

    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": settings}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvagent_server.router", "--port", str(port),
         *(["--prefill", *b.prefill_urls] if prefill else []),
         "--decode", *b.decode_urls, "--settings", str(cfg),
         "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not probe(f"{url}/ready"):
            assert time.monotonic() < deadline and proc.poll() is None, "router did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
