"""Redis unreachable: every turn still answers (recomputed, no token), nothing fails."""

from __future__ import annotations

import json

from fakes import router_stack
from support import free_port

LONG = "Please summarise the following text carefully. " * 6


async def test_turns_succeed_without_reuse_when_redis_is_down() -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with router_stack(redis_url=dead_redis, policy={"params": {"skip_prefill_max_tokens": 0}},
                            signing_keys={"k1": "0123456789abcdef0123456789abcdef"}) as st:
        messages = [{"role": "user", "content": LONG}]
        for _ in range(2):
            r = await st.client.post(
                "/v1/chat/completions", headers={"X-Session-ID": "s1"},
                json={"model": "fake-model", "messages": messages, "stream": True,
                      "max_tokens": 8, "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            kva = chunks[-1]["kvagent"]
            assert kva["cache_token"] is None and kva["reused_tokens"] == 0
            answer = "".join(c["choices"][0]["delta"].get("content") or ""
                             for c in chunks if c.get("choices"))
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": "And then?"}]
        metrics = (await st.client.get("/metrics")).text
        assert 'reason="store_unavailable"' in metrics
