"""A seeded, bounded slice of the attack run (tools/attack/run.py --quick): every
attack at a tenth of its size against the router served as `python -m
kvagent_server.router` serves it, with a well-behaved client beside.

What must hold on any machine: the router survives, its RSS and fds stay under the caps,
the well-behaved client never fails, no caller reuses another's KV, request abuse is
rejected. The TTFT target (2x quiet) is checked by the full run recorded in
docs/reliability.md: on a shared machine a 10 % slice is too short to judge it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_attack_slice(tmp_path: Path) -> None:
    out = tmp_path / "attack.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.attack.run", "--quick",
         "--seed", "7", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(), check=False, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    for name in ("router_alive", "rss_under_cap", "fds_under_cap", "good_client_never_failed",
                 "no_hijack", "request_abuse_rejected"):
        assert checks[name], (name, json.dumps(result["phases"], indent=1)[-4000:])
    phases = result["phases"]
    assert phases["slow_headers"]["attack"]["answers"].get("408", 0) > 0
    assert phases["slow_bodies"]["attack"]["statuses"].get("408", 0) > 0
    assert phases["header_flood_200mib"]["attack"]["mib_sent_before_close_max"] < 16
    assert phases["slow_readers"]["attack"]["router_slow_clients_cut"] >= 1
