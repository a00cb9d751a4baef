"""`python -m tools.gpu.check_tiers --dry-run` renders and parses with the installed vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
@pytest.mark.slow
def test_dry_run_renders_and_parses(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")
    out = subprocess.run(
        [sys.executable, "-m", "tools.gpu.check_tiers", "--dry-run",
         "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    endpoint = f"ipc://{tmp_path}/run/kv-events-prefill-0.ipc"
    assert report["parsed"] == {"kv_connector": "MultiConnector",
                                "children": ["NixlConnector", "OffloadingConnector"],
                                "hash_algo": "sha256",
                                "kv_events": {"enabled": True, "publisher": "zmq",
                                              "endpoint": endpoint, "topic": "kvagent"}}
    assert report["kv_events_source"] == {"endpoint": endpoint, "topic": "kvagent",
                                          "hash_algo": "sha256", "hash_seed": None}
    argv = report["argv"]
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    offload = json.loads(argv[argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert offload["self_describing_kv_events"] is True
    assert (tmp_path / "fs-tier").is_dir()
    # tier_events' judge, fed vLLM-encoded events (hashed by vLLM's own functions) over
    # the rendered ipc socket through the router's subscriber.
    synthetic = report["synthetic_tier_events"]
    assert synthetic["ok"] and synthetic["events_arrived"], synthetic
    assert synthetic["a_blocks_in_cpu"] == synthetic["a_blocks"] == 25
    assert synthetic["chosen"] == "prefill-0" and synthetic["reason"] == "tier_hit"
