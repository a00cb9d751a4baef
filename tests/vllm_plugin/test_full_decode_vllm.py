"""A decode node whose KV cache is full of retained turns frees them for a pure release at
once, even while a request it cannot allocate waits ahead of the release (real vLLM).

Without that, retained blocks nobody will claim hold D's memory until their TTL, and every
new request waits behind them: under a bounded KV cache a turn waited the whole TTL.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvagent_server.models.demo import ensure_demo_model

from . import flow
from .pd import Node, launch_node

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Far longer than the test may take: a request freed by the TTL fails it.
TTL_S = 900
#: Blocks of 128 tokens: a few of the turns below fill the cache.
BLOCKS = 24


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = launch_node("decode", core=1, log_dir=Path(tmp_path_factory.mktemp("full-d")),
                       ttl_s=TTL_S, threshold=64, plugin=True, model=ensure_demo_model(),
                       max_model_len=2048,
                       extra_args=["--num-gpu-blocks-override", str(BLOCKS)])
    try:
        deadline = time.monotonic() + 420
        while not node.healthy():
            assert node.proc.poll() is None, node.log_tail()
            assert time.monotonic() < deadline, "decode node did not start\n" + node.log_tail()
            time.sleep(2)
        yield node
    finally:
        node.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 7800 + 150 for i in range(n)]


def _waiting(node: Node) -> float:
    for line in httpx.get(node.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            return float(line.split()[-1])
    return 0.0


def _stays_waiting(node: Node, turn: concurrent.futures.Future[object]) -> bool:
    """The turn cannot be allocated: the node reports a waiting request on three reads in
    a row, seconds apart, while it runs nothing else (a turn that runs ends in seconds)."""
    deadline = time.monotonic() + 60
    seen = 0
    while not turn.done() and time.monotonic() < deadline:
        seen = seen + 1 if _waiting(node) >= 1 else 0
        if seen >= 3:
            return True
        time.sleep(2)
    return not turn.done()


def test_a_pure_release_unblocks_a_full_decode_node(decode: Node) -> None:
    retained: list[str] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    stuck = None
    try:
        # Retain turns (as `d_direct` leaves them) until one cannot be allocated.
        for seed in range(BLOCKS):
            turn = pool.submit(flow.plain, decode.url, _prompt(seed, 400), 4,
                               {"do_remote_prefill": False})
            if _stays_waiting(decode, turn):
                stuck = turn
                break
            done = turn.result(timeout=60)
            assert done.kv_transfer_params is not None
            retained.append(done.kv_transfer_params["remote_request_id"])
        assert stuck is not None, "the KV cache never filled"
        assert _waiting(decode) >= 1 and len(retained) >= 3
        # The router's retention guard frees them with a request of its own, queued
        # behind the stuck one.
        release = pool.submit(httpx.post, decode.url + "/v1/completions", timeout=120, json={
            "model": flow.MODEL, "prompt": ".", "max_tokens": 1,
            "kv_transfer_params": {"kvagent_release": retained}})
        t0 = time.monotonic()
        result = stuck.result(timeout=120)
        assert time.monotonic() - t0 < 60  # freed now, not at the TTL
        assert len(result.token_ids) == 4
        assert release.result(timeout=60).status_code == 200
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
