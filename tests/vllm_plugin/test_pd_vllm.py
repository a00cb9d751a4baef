"""Real 1P+1D vLLM nodes with NixlConnector and the kvagent plugin (CPU, demo model).

One pair serves the whole module (start-up takes minutes on 2 cores). P is pinned to core
0, D to core 1. D retains finished sequences for TTL_S seconds.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("vLLM with NIXL is not installed (pip install 'kvagent[cpu]')",
                allow_module_level=True)

psutil = pytest.importorskip("psutil")

from kvagent_server.router.reuse.transfer import FIRST_TOKEN_KEY
from kvagent_server.vllm_plugin import env

from . import flow
from .pd import PDPair

TTL_S = 25
BLOCK = 128


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 7800 + 150 for i in range(n)]


def _salt() -> dict[str, str]:
    """A fresh cache salt: the request cannot hit any prefix cache (a true recompute)."""
    return {"cache_salt": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    log_dir = Path(tmp_path_factory.mktemp("pd"))
    pd = PDPair.start(log_dir=log_dir, ttl_s=TTL_S, plugin=True)
    pids = pd.pids()
    try:
        yield pd
    finally:
        pd.stop()
    time.sleep(1)
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"


def _metric(node, name: str, **labels: str) -> float:
    text = node.metrics()
    if not labels:
        return flow.metric_sum(text, name)
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _turn1_on_d(pair: PDPair, prompt: list[int], n: int) -> flow.DResult:
    """Turn 1 computed by D alone (D retains it); P's prefix cache never sees it."""
    res = flow.plain(pair.d.url, prompt, n, kv_params={"do_remote_prefill": False})
    assert res.kv_transfer_params is not None
    return res


def test_turn1_p_then_d_streams_kv_params_in_final_chunk(pair: PDPair) -> None:
    prompt = _prompt(1, 1000)
    p = flow.p_leg(pair.p.url, prompt)
    pp = p["kv_transfer_params"]
    assert pp["do_remote_prefill"] is True and pp["remote_block_ids"][0]
    pulled = _metric(pair.d, "vllm:nixl_xfer_time_seconds_count")
    p2p = _metric(pair.d, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    d = flow.d_leg(pair.d.url, prompt, pp, 8)
    assert _metric(pair.d, "vllm:nixl_xfer_time_seconds_count") == pulled + 1
    assert _metric(pair.d, "vllm:prompt_tokens_cached_by_source_total",
                   source="p2p") == p2p + len(prompt)
    kv = d.final_chunk["kv_transfer_params"]
    assert d.final_chunk.get("usage") is not None, "params ride on the last (usage) chunk"
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    # D retains the prompt and every generated token but the last (it has no KV yet).
    assert kv["remote_num_tokens"] == len(prompt) + len(d.token_ids) - 1
    assert len(kv["remote_block_ids"][0]) == -(-kv["remote_num_tokens"] // BLOCK)
    assert kv["remote_engine_id"] == pair.d.engine_id


def test_streamed_params_match_the_non_streamed_shape(pair: PDPair) -> None:
    import httpx

    prompt = _prompt(2, 300)
    body = {"model": flow.MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": False}}
    whole = httpx.post(pair.d.url + "/v1/completions", json=body, timeout=300).json()
    streamed = flow.plain(pair.d.url, prompt, 4, kv_params={"do_remote_prefill": False})
    a, b = whole["kv_transfer_params"], streamed.kv_transfer_params
    assert b is not None and set(a) == set(b)
    assert a["remote_num_tokens"] == b["remote_num_tokens"]


def test_streamed_chat_final_chunk_carries_kv_params(pair: PDPair) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the weather " * 40}]
    p = flow.p_leg_chat(pair.p.url, messages)
    d = flow.chat_stream(pair.d.url, messages, 6, kv_params=p["kv_transfer_params"])
    kv = d.final_chunk.get("kv_transfer_params")
    assert kv is not None and kv["do_remote_decode"] is True
    assert kv["remote_num_tokens"] == d.usage["prompt_tokens"] + d.usage["completion_tokens"] - 1


def test_turn2_p_pulls_d_blocks_and_computes_only_new_tokens(pair: PDPair) -> None:
    prompt = _prompt(3, 2000)
    t1 = _turn1_on_d(pair, prompt, 16)
    kv = t1.kv_transfer_params
    n = kv["remote_num_tokens"]
    new = _prompt(33, 100)
    prompt2 = prompt + t1.token_ids + new
    reads = _metric(pair.p, "vllm:nixl_xfer_time_seconds_count")
    p2p = _metric(pair.p, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
    computed = _metric(pair.p, "vllm:prompt_tokens_by_source_total", source="local_compute")
    p = flow.p_leg(pair.p.url, prompt2, flow.reuse_params(kv))
    assert _metric(pair.p, "vllm:nixl_xfer_time_seconds_count") == reads + 1
    assert _metric(pair.p, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == p2p + n
    assert p["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    # P computed only the tokens it did not pull.
    assert _metric(pair.p, "vllm:prompt_tokens_by_source_total",
                   source="local_compute") == computed + len(prompt2) - n


def test_turn2_greedy_output_is_the_same_with_pulled_kv(pair: PDPair) -> None:
    prompt = _prompt(4, 1500)
    t1 = _turn1_on_d(pair, prompt, 12)
    prompt2 = prompt + t1.token_ids + _prompt(44, 80)
    p = flow.p_leg(pair.p.url, prompt2, flow.reuse_params(t1.kv_transfer_params))
    assert p["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000
    reused = flow.d_leg(pair.d.url, prompt2, p["kv_transfer_params"], 24)

    salt = _salt()
    p_re = flow.p_leg(pair.p.url, prompt2, extra=salt)
    assert p_re["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    recomputed = flow.d_leg(pair.d.url, prompt2, p_re["kv_transfer_params"], 24, extra=salt)
    assert reused.token_ids == recomputed.token_ids
    assert len(reused.token_ids) == 24


def _p_token(pair: PDPair, prompt: list[int], salt: dict[str, str]) -> tuple[dict, int]:
    """A fresh P leg: its params for D and the token P sampled."""
    p = flow.p_leg(pair.p.url, prompt, extra={**salt, "return_token_ids": True})
    assert p["choices"][0]["finish_reason"] == "length"
    return p["kv_transfer_params"], p["choices"][0]["token_ids"][0]


def test_d_emits_the_token_it_is_given_and_computes_from_it(pair: PDPair) -> None:
    """`kvagent_first_token` (plugin: first_token): D's first token is the one given, not
    one it samples, and what follows is what one node computes from the prompt plus it.
    A token greedy would not pick shows both (P's own is the next test)."""
    prompt, salt = _prompt(11, 700), _salt()
    params, sampled = _p_token(pair, prompt, salt)
    given = next(t for t in reversed(prompt) if t != sampled)
    d = flow.d_leg(pair.d.url, prompt, {**params, FIRST_TOKEN_KEY: given}, 8, extra=salt)
    ref = flow.plain(pair.d.url, [*prompt, given], 7, extra=_salt())
    assert d.token_ids[0] == given
    assert d.token_ids[1:] == ref.token_ids
    assert d.usage is not None and d.usage["completion_tokens"] == 8
    assert d.usage["prompt_tokens"] == len(prompt)


def test_d_given_p_token_answers_as_one_node_and_declines_what_it_cannot_take(
        pair: PDPair) -> None:
    """Given P's own token, greedy, D answers exactly as one node computing the prompt
    does. A request asking for logprobs (D would have no logprobs for a token it did not
    sample) ignores the given token: D samples its own, and still answers the same."""
    prompt, salt = _prompt(12, 900), _salt()
    ref = flow.plain(pair.d.url, prompt, 8, extra=_salt())
    params, sampled = _p_token(pair, prompt, salt)
    taken = flow.d_leg(pair.d.url, prompt, {**params, FIRST_TOKEN_KEY: sampled}, 8,
                       extra=salt)
    assert taken.token_ids == ref.token_ids
    params, sampled = _p_token(pair, prompt, salt)
    other = next(t for t in reversed(prompt) if t != sampled)
    declined = flow.d_leg(pair.d.url, prompt, {**params, FIRST_TOKEN_KEY: other}, 8,
                          extra={**salt, "logprobs": 1})
    assert declined.token_ids == ref.token_ids


def test_block_aligned_prefix_reuse(pair: PDPair) -> None:
    """Reuse only the first K tokens (as after a history edit): truncate the handle."""
    prompt = _prompt(5, 1200)
    t1 = _turn1_on_d(pair, prompt, 8)
    keep = 5 * BLOCK
    # Shares keep+37 tokens with what D holds, then diverges: only `keep` (5 full blocks)
    # can be reused.
    prompt2 = prompt[:keep + 37] + _prompt(55, 400)
    p = flow.p_leg(pair.p.url, prompt2,
                   flow.reuse_params(t1.kv_transfer_params, keep + 37, BLOCK))
    assert p["usage"]["prompt_tokens_details"]["cached_tokens"] == keep
    reused = flow.d_leg(pair.d.url, prompt2, p["kv_transfer_params"], 16)
    salt = _salt()
    p_re = flow.p_leg(pair.p.url, prompt2, extra=salt)
    recomputed = flow.d_leg(pair.d.url, prompt2, p_re["kv_transfer_params"], 16, extra=salt)
    assert reused.token_ids == recomputed.token_ids


def test_d_direct_hits_retained_prefix_and_retains_again(pair: PDPair) -> None:
    prompt = _prompt(6, 1100)
    t1 = _turn1_on_d(pair, prompt, 8)
    prompt2 = prompt + t1.token_ids + _prompt(66, 30)
    t2 = flow.plain(pair.d.url, prompt2, 8, kv_params={"do_remote_prefill": False})
    full_blocks = (t1.kv_transfer_params["remote_num_tokens"] // BLOCK) * BLOCK
    assert t2.usage["prompt_tokens_details"]["cached_tokens"] == full_blocks
    assert t2.kv_transfer_params["remote_num_tokens"] == len(prompt2) + 8 - 1
    no_params = flow.plain(pair.d.url, prompt2 + t2.token_ids + [160], 4)
    assert no_params.kv_transfer_params is None


def _released(pair: PDPair, request_id: str) -> bool:
    return f"Releasing expired KV blocks for request {request_id} " in pair.d.log_path.read_text(
        errors="replace")


def test_d_blocks_expire_at_the_ttl_can_be_released_early_and_p_declines_expired_ones(
        pair: PDPair) -> None:
    """The soak's leak: stock vLLM 0.32 never expires a sequence D computed itself (sent
    with `{"do_remote_prefill": false}`, the router's d_direct path), so D's KV filled up.
    With the plugin it expires at the TTL, and a later request can release it at once.
    Past the TTL, P declines to read a turn's expired blocks and recomputes. (One wait for
    D's TTL serves both.)"""
    prompt = _prompt(7, 1000)
    t1 = _turn1_on_d(pair, prompt, 8)  # read after its TTL, below
    a = _turn1_on_d(pair, _prompt(8, 900), 4)
    a_id = a.kv_transfer_params["remote_request_id"]
    b = flow.plain(pair.d.url, _prompt(9, 600), 4,
                   kv_params={"do_remote_prefill": False, "kvagent_release": [a_id]})
    b_id = b.kv_transfer_params["remote_request_id"]
    deadline = time.monotonic() + 10
    while not _released(pair, a_id):
        assert time.monotonic() < deadline, "A was not released when B finished"
        time.sleep(0.5)
    assert not _released(pair, b_id)  # B is retained for the next turn...
    deadline = time.monotonic() + TTL_S + 20
    while not _released(pair, b_id):  # ...and freed at its TTL, not never
        assert time.monotonic() < deadline, "B's blocks never expired (the leak)"
        time.sleep(1)
    # t1 is older than B: its TTL has passed too.
    assert _released(pair, t1.kv_transfer_params["remote_request_id"])
    expired = _metric(pair.p, "vllm:nixl_num_kv_expired_reqs_total")
    reads = _metric(pair.p, "vllm:nixl_xfer_time_seconds_count")
    prompt2 = prompt + t1.token_ids + _prompt(77, 50)
    salt = _salt()
    p = flow.p_leg(pair.p.url, prompt2, flow.reuse_params(t1.kv_transfer_params), extra=salt)
    # P declined the expired handle: no NIXL read, nothing reused, the turn recomputed.
    assert _metric(pair.p, "vllm:nixl_xfer_time_seconds_count") == reads
    assert _metric(pair.p, "vllm:nixl_num_kv_expired_reqs_total") >= expired + 1
    assert p["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    d = flow.d_leg(pair.d.url, prompt2, p["kv_transfer_params"], 8, extra=salt)
    assert len(d.token_ids) == 8


async def test_watermark_guard_evicts_and_releases_on_a_real_decode_node(pair: PDPair) -> None:
    """The router's retention guard against real vLLM: D's real `/metrics` trip the
    watermark, the oldest handle leaves the store and D frees its blocks at once."""
    from kvagent_server.router.nodes.client import NodeClient
    from kvagent_server.router.nodes.retention import RetentionGuard
    from kvagent_server.router.store.handle import Handle
    from kvagent_server.router.store.memory import MemoryStore

    kept = _turn1_on_d(pair, _prompt(10, 700), 4)
    old = _turn1_on_d(pair, _prompt(11, 700), 4)
    store = MemoryStore()
    now = time.time()
    for i, res in enumerate((old, kept)):  # `old` stored first: the oldest
        await store.put(Handle(handle_id=f"h{i}", tenant="t", session=f"s{i}",
                               decode_node="d0", decode_epoch="e",
                               kv_transfer_params=res.kv_transfer_params,
                               token_ids=list(range(700)), block_size=BLOCK,
                               created_at=now, expires_at=now + 60))
    client = NodeClient(timeout_s=30)
    try:
        guard = RetentionGuard(lambda name: client, nodes=lambda: [("d0", pair.d.url, "e")],
                               evict=store.evict_oldest, model=lambda: flow.MODEL,
                               high=1e-6, low=5e-7, interval_s=60)
        assert await guard.run_once() >= 1
    finally:
        await client.aclose()
    old_id = old.kv_transfer_params["remote_request_id"]
    deadline = time.monotonic() + 10
    while not _released(pair, old_id):
        assert time.monotonic() < deadline, "the evicted handle's blocks were not released"
        await asyncio.sleep(0.5)
    assert await store.claim("t", "h0") is None  # evicted: no turn can present it


def test_cpu_nodes_readers_nap(pair: PDPair) -> None:
    """The plugin's CPU default: both nodes' shared-memory readers nap between checks."""
    for node in (pair.p, pair.d):
        assert (f"shared-memory readers nap {env.CPU_SPIN_NAP_US} us between checks"
                in node.log_path.read_text(errors="replace")), node.log_tail()


def test_idle_bundle_uses_under_a_fifth_of_a_core(pair: PDPair) -> None:
    procs = [psutil.Process(pid) for pid in pair.pids()]
    time.sleep(2)
    before = sum(sum(p.cpu_times()[:2]) for p in procs)
    time.sleep(10)
    used = sum(sum(p.cpu_times()[:2]) for p in procs) - before
    assert used / 10 < 0.20, f"idle P+D used {100 * used / 10:.1f}% of one core"
