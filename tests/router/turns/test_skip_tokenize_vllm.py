"""On real vLLM: turns that skip the router's `/tokenize` (their messages extend the held
turn's, router.skip_tokenize_extensions) go `d_direct`, reusing D's KV through D's own
prefix cache, or `pd_reuse`, P pulling only the blocks its own prompt repeats (the
plugin's pull check), and answer exactly as a recompute does.

The reference for each turn is the same request sent straight to the prefill node under a
fresh random `cache_salt` (nothing cached can match), greedy, so any wrong KV shows as a
different answer. The fake-node tests of the rule are tests/router/turns/test_skip_tokenize.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from support import greedy_chat, metric_sum, second_router

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are an on-call assistant. Answer briefly and cite the runbook section. "
          "Runbook: " + " ".join(f"section {i}: restart the worker pool, check queue depth "
                                 f"and compare p99 latency before and after." for i in range(30)))


@pytest.mark.parametrize(("path", "skip_prefill_max_tokens"),
                         [("d_direct", 100_000), ("pd_reuse", 0)])
def test_turns_that_skip_tokenize_answer_as_a_recompute(kvagent_bundle: Any, tmp_path: Path,
                                                        path: str,
                                                        skip_prefill_max_tokens: int) -> None:
    """With every reused turn sent one way (a fixed policy, so the skip does not hang on
    the cost model's lines), turns after the router learned its tokens-per-byte ratio skip
    `/tokenize`; every answer equals the recompute's. `pd_reuse`: P checks the offered
    blocks' digests itself (the plugin's pull check), which its first reuse leg shows."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b = kvagent_bundle
    session = f"skip-{path}-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "Checkout is slow."}]
    turns = []
    params = {"skip_prefill_max_tokens": skip_prefill_max_tokens}
    with second_router(b, tmp_path, policy={"params": params}) as url:
        for i in range(6):
            out = greedy_chat(url, b.model, messages, {"X-Session-ID": session})
            text = out["choices"][0]["message"]["content"] or ""
            ref = greedy_chat(b.prefill_urls[0], b.model, messages, cache_salt=uuid.uuid4().hex)
            turns.append((out["kvagent"]["path"], out["kvagent"]["reused_tokens"],
                          text == (ref["choices"][0]["message"]["content"] or "")))
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": f"Step {i} done; what next?"}]
        skipped = metric_sum(url, "kvagent_router_tokenize_skipped_total")
    print("turns (path, reused, equal to the recompute):", turns, "skipped:", skipped)
    assert all(equal for *_, equal in turns), turns
    assert all(p == path and reused > 0 for p, reused, _ in turns[1:]), turns
    # The first turns teach the router tokens per message byte; from the fourth on it skips.
    assert skipped == len(turns) - 3, turns
