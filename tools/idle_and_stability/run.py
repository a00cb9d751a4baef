"""Idle CPU and recompute-time stability of one real 1P+1D vLLM/NIXL pair.

Runs the same script with the kvagent plugin off (stock vLLM/NIXL behaviour) and on:

    PYTHONPATH=tests:tests/vllm_plugin python tools/idle_and_stability/run.py --no-plugin --out before.json
    PYTHONPATH=tests:tests/vllm_plugin python tools/idle_and_stability/run.py --plugin --out after.json

Measures (P pinned to core 0, D to core 1):
1. where each worker's compute (main) thread may run;
2. idle CPU of the whole bundle (all processes of both nodes) over `--idle-s` seconds,
   before any request and again while D retains a finished turn's blocks;
3. `--samples` turns, each a fresh ~`--tokens`-token prompt: the P leg (a full recompute on
   P, timed) followed by its D leg; median / p90 / max of the P-leg time;
4. the orphaned-P-leg sequence that hung before: P legs whose D leg never comes, wait past
   P's lease, then fresh P legs with a timeout; on a hang, py-spy dumps P's worker.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
# The plugin tests' helpers, found through PYTHONPATH=tests:tests/vllm_plugin (README.md).
import flow
from pd import PDPair


def bundle_cpu(pids: list[int], seconds: float) -> tuple[float, dict[str, float]]:
    """Percent of one core used by `pids` over `seconds`, total and per process name."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    start = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    per: dict[str, float] = {}
    for p in procs:
        try:
            used = sum(p.cpu_times()[:2]) - start[p.pid]
            key = f"{p.pid}:{p.name()}"
        except psutil.NoSuchProcess:
            continue
        per[key] = round(100.0 * used / seconds, 1)
    return round(sum(per.values()), 1), per


def main_thread_affinity(pair: PDPair) -> dict[str, list[int]]:
    out = {}
    for node in pair.nodes:
        for pid in node.pids():
            try:
                if "Worker" in psutil.Process(pid).name():
                    out[node.role] = sorted(os.sched_getaffinity(pid))
            except psutil.NoSuchProcess:
                pass
    return out


def worker_pid(pair: PDPair, role: str) -> int | None:
    node = pair.p if role == "prefill" else pair.d
    for pid in node.pids():
        if "Worker" in psutil.Process(pid).name():
            return pid
    return None


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 8000) for _ in range(n)]


def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    p90 = s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]
    return {"median": round(statistics.median(s), 3), "p90": round(p90, 3),
            "max": round(s[-1], 3), "min": round(s[0], 3),
            "p90_over_median": round(p90 / statistics.median(s), 2)}


def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(1234)
    log_dir = Path(args.log_dir)
    t0 = time.monotonic()
    result: dict[str, object] = {"plugin": args.plugin, "tokens": args.tokens}
    with PDPair.start(log_dir=log_dir, plugin=args.plugin, ttl_s=args.ttl,
                      lease_s=args.lease) as pair:
        result["startup_s"] = round(time.monotonic() - t0, 1)
        result["main_thread_affinity"] = main_thread_affinity(pair)
        time.sleep(3)
        result["idle_fresh"] = bundle_cpu(pair.pids(), args.idle_s)
        print("idle (no request yet):", result["idle_fresh"][0], "% of one core", flush=True)

        times, d_times = [], []
        for i in range(args.samples):
            pr = prompt(rng, args.tokens)
            t = time.monotonic()
            p = flow.p_leg(pair.p.url, pr, timeout=args.leg_timeout)
            times.append(time.monotonic() - t)
            t = time.monotonic()
            flow.d_leg(pair.d.url, pr, p["kv_transfer_params"], 4, timeout=args.leg_timeout)
            d_times.append(time.monotonic() - t)
            print(f"turn {i}: P leg {times[-1]:.3f}s  D leg {d_times[-1]:.3f}s", flush=True)
        result["p_leg_s"] = [round(x, 3) for x in times]
        result["p_leg_stats"] = stats(times)
        result["d_leg_stats"] = stats(d_times)
        time.sleep(2)
        result["idle_d_retaining"] = bundle_cpu(pair.pids(), args.idle_s)
        print("idle (D retains blocks):", result["idle_d_retaining"][0], "%", flush=True)

        # The orphaned-P-leg sequence.
        orphans = [flow.p_leg(pair.p.url, prompt(rng, args.tokens), timeout=args.leg_timeout)
                   for _ in range(2)]
        result["orphans"] = len(orphans)
        time.sleep(args.lease + 5)
        after = []
        hung = False
        for _ in range(3):
            t = time.monotonic()
            try:
                flow.p_leg(pair.p.url, prompt(rng, args.tokens), timeout=args.hang_timeout)
                after.append(round(time.monotonic() - t, 3))
            except Exception as exc:  # noqa: BLE001 (any failure here is the finding)
                hung = True
                after.append(f"FAILED after {time.monotonic() - t:.1f}s: {exc!r}")
                pid = worker_pid(pair, "prefill")
                spy = shutil.which("py-spy")
                if pid and spy:
                    dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)],
                                          capture_output=True, text=True, timeout=120, check=False)
                    (log_dir / "hang_pyspy.txt").write_text(dump.stdout + dump.stderr)
                break
        result["after_lease_expiry_p_legs_s"] = after
        result["hang"] = hung
        print("after orphan leases expired:", after, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=120)
    ap.add_argument("--lease", type=int, default=15, help="P's kv_lease_duration (s)")
    ap.add_argument("--leg-timeout", type=float, default=300.0)
    ap.add_argument("--hang-timeout", type=float, default=90.0)
    ap.add_argument("--log-dir", default="/tmp/kvagent-bench-idle")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
