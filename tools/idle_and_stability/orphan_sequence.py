"""Replay the sequence that hung P in the design notes, and time every leg.

Twice: turn 1 (P leg, then a non-streamed D leg that returns D's handle), a recompute
probe and a reuse pull on P whose D legs never come (orphans), a wait past P's lease
(default 30 s), then three fresh P legs with a timeout. On a timeout, py-spy dumps every
engine-core and worker process into the log dir and the script exits 3.

    PYTHONPATH=tests:tests/vllm_plugin python tools/idle_and_stability/orphan_sequence.py --no-plugin
    PYTHONPATH=tests:tests/vllm_plugin python tools/idle_and_stability/orphan_sequence.py --plugin
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
# The plugin tests' helpers, found through PYTHONPATH=tests:tests/vllm_plugin (README.md).
import flow
from pd import PDPair


def dump(pair: PDPair, log_dir: Path, tag: str) -> None:
    spy = shutil.which("py-spy")
    if not spy:
        return
    for node in pair.nodes:
        for pid in node.pids():
            name = psutil.Process(pid).name()
            if "Worker" in name or "EngineCore" in name:
                out = subprocess.run([spy, "dump", "--native", "--pid", str(pid)],
                                     capture_output=True, text=True, timeout=120, check=False)
                path = log_dir / f"{tag}-{node.role}-{name.replace(':', '_')}-{pid}.txt"
                path.write_text(out.stdout + out.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--wait-s", type=float, default=40.0, help="> P's kv_lease_duration (30)")
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--log-dir", default="/tmp/kvagent-bench-orphans")
    args = ap.parse_args()
    rng = random.Random(7)
    log_dir = Path(args.log_dir)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 8000) for _ in range(n)]

    def timed(label: str, fn, *a, **kw):
        t = time.monotonic()
        out = fn(*a, **kw)
        print(f"{label}: {time.monotonic() - t:.2f}s", flush=True)
        return out

    with PDPair.start(log_dir=log_dir, plugin=args.plugin, ttl_s=480) as pair:
        for it in range(args.iterations):
            p1 = prompt(2100)
            p = timed(f"{it} P leg", flow.p_leg, pair.p.url, p1)
            body = {"model": flow.MODEL, "prompt": p1, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "kv_transfer_params": p["kv_transfer_params"]}
            d = timed(f"{it} D leg", httpx.post, pair.d.url + "/v1/completions",
                      json=body, timeout=600).json()
            timed(f"{it} orphan recompute probe", flow.p_leg, pair.p.url, prompt(2100))
            timed(f"{it} orphan reuse pull", flow.p_leg, pair.p.url, p1 + prompt(100),
                  flow.reuse_params(d["kv_transfer_params"]))
            time.sleep(args.wait_s)
            for k in range(3):
                t = time.monotonic()
                try:
                    flow.p_leg(pair.p.url, prompt(2000), timeout=args.timeout_s)
                except httpx.HTTPError as exc:
                    print(f"{it} HANG on P leg {k} after {time.monotonic() - t:.1f}s: {exc!r}")
                    dump(pair, log_dir, f"it{it}")
                    return 3
                print(f"{it} post-expiry P leg {k}: {time.monotonic() - t:.2f}s", flush=True)
    print("no hang")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
