"""`topology: single` with `kv_tiers` on real vLLM: `kvagent-server up` starts one engine
node with a host tier and the router, a conversation's second turn reuses the first's KV
on that node, and a conversation the router gave up for room comes back from the node's
host tier as a planned, verified tier reuse whose answer equals a recompute.

What `up` runs on this machine (`auto` picks `single`) with the tiers of the
`kvagent-tiers` benchmark arm, at a test's size: the node's engine KV is tiny (16 blocks
of 128 tokens) and the retention guard's watermark low (0.3), so the spilled
conversation's retained handle is given up at once (the router records it as spilled to
the node's host tier) and two other conversations overwrite what engine memory still
caches of it. The recomputed control is the request sent to the node alone under a fresh
`cache_salt`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvagent import Session
from kvagent_server.config import dump_config
from support import (
    bundle_config,
    cached_by_source,
    free_port,
    ignore_eos_body,
    kv_usage,
    metric_sum,
    random_document,
    recomputed_answer,
    release_nudge,
    session_chat,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

BLOCK = 128
BLOCKS = 16
#: vLLM refuses a context its KV cannot hold whole (one block is vLLM's null block).
MAX_MODEL_LEN = 11 * BLOCK
#: Long enough to span several KV blocks (128 tokens each on CPU).
DOCUMENT = "\n".join(f"Week {n}: {37 * n} orders shipped, {n % 5} late, {n % 3} returned."
                     for n in range(1, 21))
TIMEOUT_S = 120


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagent_server.cli", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)



def test_up_single_with_tiers_reuses_kv_and_loads_a_spilled_conversation(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    cfg = bundle_config(tmp_path / "run", topology="single", max_model_len=MAX_MODEL_LEN,
                        kv_tiers={"cpu": {"size_gib": 0.125}},
                        router={"port": free_port(), "retention": {
                            "decode_room_wait_s": 60, "high_watermark": 0.3,
                            "low_watermark": 0.05, "check_interval_s": 0.5}},
                        decode={"ports": [free_port()], "side_channel_ports": [free_port()],
                                "extra_args": ["--num-gpu-blocks-override", str(BLOCKS)]})
    path = tmp_path / "bundle.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(dump_config(cfg), default=str))))
    run_dir = str(cfg.resolved_run_dir())
    up = cli("up", "-c", str(path), "--detach", timeout=cfg.startup_timeout_s * 2 + 60)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "topology: single (set in the config)" in up.stdout
        status = json.loads(cli("status", "--run-dir", run_dir, "--json", timeout=60).stdout)
        assert status["topology"] == "single" and status["healthy"]
        assert [p["name"] for p in status["processes"]] == ["decode-0", "router"]
        router, model = status["router_url"], status["model"]
        node = next(p["url"] for p in status["processes"] if p["name"] == "decode-0")

        # a conversation through the SDK: its second turn reuses what the node kept or
        # what its tier got (the watermark may give the first turn up at once)
        with Session(f"{router}/v1", model, system="You are terse.", temperature=0.0,
                     max_tokens=16) as s:
            first = s.send(f"Summarise the report.\n\n{DOCUMENT}")
            second = s.send("And the risks?")
        assert first.text is not None and second.text is not None
        assert second.reused_tokens is not None and second.reused_tokens > 0, (
            second.path, second.reused_tokens)
        assert second.usage is not None and second.usage.cached_tokens > 0

        # a conversation given up for room, then overwritten in engine memory
        base = f"{router}/v1"
        messages = random_document(1, 136)
        turn1 = session_chat(base, "spilled", ignore_eos_body(model, messages, 16), timeout=TIMEOUT_S)
        assert turn1["kvagent"]["path"] == "d_fresh", turn1["kvagent"]
        spills = metric_sum(router, "kvagent_router_spills_total")
        release_nudge(node, model)  # the node's host-tier stores of turn 1 are built
        wait_until(lambda: metric_sum(router, "kvagent_router_spills_total") > spills,
                   "the watermark spilled nothing")
        for seed in (2, 3):  # vLLM hands out its free blocks oldest freed first
            session_chat(base, f"other-{seed}", ignore_eos_body(model, random_document(seed, 260), 8),
                         timeout=TIMEOUT_S)
            release_nudge(node, model)
        wait_until(lambda: kv_usage(node) < 0.3, "the node's KV stayed above the watermark")
        time.sleep(1.5)  # a retention round: the router's view of the node is current
        request = ignore_eos_body(model, [*messages, {
            "role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now list the rarest words."}], 16)
        before = cached_by_source(node)
        turn2 = session_chat(base, "spilled", request, turn1["kvagent"]["cache_token"],
                             timeout=TIMEOUT_S)
        got = {k: v - before.get(k, 0.0) for k, v in cached_by_source(node).items()}
        kva = turn2["kvagent"]
        # planned and reported as the tier reuse it is, not a fresh prompt
        assert kva["path"] == "d_direct" and kva["reason"] == "hit:tier_host", (kva, got)
        assert kva["reused_tokens"] >= turn1["usage"]["prompt_tokens"] // BLOCK * BLOCK, kva
        assert got.get("host", 0) > 0, f"the node's host tier served nothing: {got}"
        assert turn2["choices"][0]["message"]["content"] == recomputed_answer(
            node, request, timeout=TIMEOUT_S)
    finally:
        down = cli("down", "--run-dir", run_dir, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
