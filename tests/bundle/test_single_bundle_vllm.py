"""`topology: single` on real vLLM: `kvagent-server up` starts one engine node and the
router, and a conversation's second turn reuses the first turn's KV on that node.

One node, two turns: the short proof that the bundle's single rendering runs (the node
holds a finished turn's blocks, the router serves it with no prefill node).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvagent import Session
from kvagent_server.config import dump_config
from support import bundle_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

#: Long enough to span several KV blocks (128 tokens each on CPU).
DOCUMENT = "\n".join(f"Week {n}: {37 * n} orders shipped, {n % 5} late, {n % 3} returned."
                     for n in range(1, 41))


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagent_server.cli", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


def test_up_single_serves_a_conversation_and_reuses_kv(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    cfg = bundle_config(tmp_path / "run", topology="single")
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

        with Session(f"{status['router_url']}/v1", status["model"], system="You are terse.",
                     temperature=0.0, max_tokens=16) as s:
            first = s.send(f"Summarise the report.\n\n{DOCUMENT}")
            second = s.send("And the risks?")
        assert first.text is not None and second.text is not None
        assert second.reused_tokens is not None and second.reused_tokens > 0, (
            second.path, second.reused_tokens)
        assert second.usage is not None and second.usage.cached_tokens > 0
    finally:
        down = cli("down", "--run-dir", run_dir, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
