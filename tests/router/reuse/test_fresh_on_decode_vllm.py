"""On real vLLM: a first turn computed on the decode node (`d_fresh`,
router.fresh_on_decode) answers as a recompute does, and the next turns reuse the KV D
computed, P pulling it over NIXL.

The reference for each turn is the same request sent straight to the prefill node under a
fresh random `cache_salt` (nothing cached can match), greedy, so any wrong KV shows as a
different answer. The rule and the fake-node tests: tests/router/reuse/test_fresh_on_decode.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from support import greedy_chat, second_router

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are a release assistant. Answer briefly. Checklist: "
          + " ".join(f"item {i}: confirm the build, tag it, and post the notes." for i in range(40)))


def test_a_first_turn_on_d_answers_as_a_recompute_and_p_pulls_it_next(kvagent_bundle: Any,
                                                                      tmp_path: Path) -> None:
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    b = kvagent_bundle
    session = f"fresh-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Release {uuid.uuid4().hex[:6]} is ready. First step?"}]
    turns = []
    with second_router(b, tmp_path,
                       policy={"params": {"fresh_on_decode": "always",
                                          "skip_prefill_max_tokens": 0,
                                          "skip_tokenize_extensions": False}}) as url:
        for i in range(3):
            out = greedy_chat(url, b.model, messages, {"X-Session-ID": session})
            text = out["choices"][0]["message"]["content"] or ""
            ref = greedy_chat(b.prefill_urls[0], b.model, messages, cache_salt=uuid.uuid4().hex)
            cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            turns.append((out["kvagent"]["path"], out["kvagent"]["reused_tokens"], cached,
                          text == (ref["choices"][0]["message"]["content"] or "")))
            messages = [*messages, {"role": "assistant", "content": text},
                        {"role": "user", "content": f"Step {i} done; what next?"}]
    print("turns (path, reused, cached, equal to the recompute):", turns)
    assert all(equal for *_, equal in turns), turns
    assert turns[0][0] == "d_fresh" and turns[0][1] == 0, turns
    # P pulled the blocks D computed on the d_fresh turn, then on the pd_reuse one.
    assert all(p == "pd_reuse" and reused > 0 and cached >= reused
               for p, reused, cached, _ in turns[1:]), turns
