"""benchmarks/gpu/check_tiers.py renders a node vLLM accepts (its --dry-run, no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_dry_run_renders_and_parses(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_tiers.py"), "--dry-run",
         "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["parsed"] == {"kv_connector": "MultiConnector",
                                "children": ["NixlConnector", "OffloadingConnector"],
                                "hash_algo": "sha256"}
    argv = report["argv"]
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert (tmp_path / "fs-tier").is_dir()
