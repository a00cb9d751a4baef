"""On real vLLM: `topology: replicas`, two kv_both nodes (one core each) and the router
with no prefill node. A session's turns stay on its node (`d_direct`) until that node is
busy; the turn then moves to the other node, which pulls the session's KV from the first
over NIXL (`d_pull`: a P leg's pull params on a node that also decodes and keeps the
sequence, `kvagent_retain`), and the next turn extends it there. Every greedy answer
equals the same request recomputed (sent straight to a node under a fresh random
`cache_salt`, so nothing cached matches), so wrong KV shows as a different answer.

One bundle start, four turns of one session and one long turn of another that keeps the
first node busy (`router.nodes.max_in_flight: 1`); a third session moves at the same time
with the holder's blocks shifted on purpose (the test-only header): its answer differs
from the recompute, so the differential does catch wrong KV on this path. The rules and
the fake-node tests:
tests/router/turns/test_replicas.py, tests/router/http/test_replicas_topology.py.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from support import (
    free_port,
    greedy_chat,
    replicas_config,
    start_bundle,
    turn_against_recompute,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

SYSTEM = ("You are a release assistant. Answer briefly. Checklist: "
          + " ".join(f"item {i}: confirm the build, tag it, and post the notes." for i in range(40)))


class Busy:
    """A long streamed turn of another session through the router: while it streams, the
    node it runs on has a leg in flight (saturated at `max_in_flight: 1`)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.started = threading.Event()
        self.stop = threading.Event()
        self.path: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "stream": True, "temperature": 0.0, "max_tokens": 400,
                "ignore_eos": True, "messages": [{"role": "user", "content": "Count on."}]}
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              headers={"X-Session-ID": f"busy-{uuid.uuid4().hex[:6]}"},
                              timeout=300) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                    if self.stop.is_set():
                        return  # closing the stream aborts the request on the node
        except (httpx.HTTPError, AssertionError) as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def __enter__(self) -> Self:
        self.thread.start()
        assert self.started.wait(300), "the busy turn never streamed"
        assert self.error is None, self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(300)


def test_a_session_moves_with_its_kv_and_every_answer_equals_a_recompute(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    cfg = replicas_config(
        tmp_path / "run",
        router={"port": free_port(), "nodes": {"max_in_flight": 1},
                "test_shift_blocks_header": True})
    b, bundle = start_bundle(cfg)
    try:
        assert bundle.plan.topology == "replicas" and len(b.decode_urls) == 2
        assert not b.prefill_urls
        url, ref_node = b.router_url, b.decode_urls[1]
        session = f"replicas-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Release {uuid.uuid4().hex[:6]} is ready. First?"}]
        turns = []

        def one_turn(i: int) -> None:
            nonlocal messages
            turn, text = turn_against_recompute(url, ref_node, b.model, session, messages)
            turns.append(turn)
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": f"Step {i} done; what next?"}]

        one_turn(0)  # both nodes idle: the first, d0
        one_turn(1)  # extended on d0
        # The negative control's session, on d0 too (nodes idle: the first).
        control = f"control-{uuid.uuid4().hex[:8]}"
        c_msgs: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Release {uuid.uuid4().hex[:6]} is late. Why?"}]
        c_text = greedy_chat(url, b.model, c_msgs, {"X-Session-ID": control})[
            "choices"][0]["message"]["content"] or ""
        c_msgs += [{"role": "assistant", "content": c_text},
                   {"role": "user", "content": "And what do we do now?"}]
        with Busy(url, b.model) as busy:  # another session's long turn, on d0 too
            one_turn(2)  # d0 saturated: the session moves to d1, its KV pulled along
            shifted = greedy_chat(url, b.model, c_msgs, {
                "X-Session-ID": control, "X-Kvagent-Test-Shift-Blocks": "1"})
        assert busy.error is None, busy.error
        c_ref = greedy_chat(ref_node, b.model, c_msgs, cache_salt=uuid.uuid4().hex)
        assert shifted["kvagent"]["path"] == "d_pull", shifted["kvagent"]
        assert shifted["kvagent"]["reused_tokens"] > 0, shifted["kvagent"]
        assert (shifted["choices"][0]["message"]["content"]
                != c_ref["choices"][0]["message"]["content"]), "wrong KV went unnoticed"
        one_turn(3)  # extended on d1
        print("turns (path, reused, cached, equal to the recompute):", turns)
        assert all(equal for *_, equal in turns), turns
        assert [t[0] for t in turns] == ["d_fresh", "d_direct", "d_pull", "d_direct"], turns
        for path, reused, cached, _ in turns[1:]:
            assert reused > 0 and (cached or 0) >= reused, turns
        # A claimed handle on d1: the router records one only from a decode node's
        # retention, so d1 finished the pulling request as one (`kvagent_retain`); a P
        # lease would have left turn 3 nothing to claim (`no_handle`, `d_fresh`). Each
        # turn adds less than a block (128 tokens), so the block-aligned reuse may not grow.
        assert turns[3][1] >= turns[2][1], turns
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'reason="affinity_overloaded"' in metrics
    finally:
        bundle.stop()
