"""`python -m benchmarks compare`: every arm on the same workload, in an ABBA order, into
one report.

    python -m benchmarks compare --quick
    python -m benchmarks compare --workload short-tool --arms aggregated,kvagent --reps 4

Each run brings one arm up, warms it with one unrelated request, drives the workload and
stops it before the next starts (two arms at once would fight for the cores). The report
(`report.md`) and its summary (`summary.json`, schema 2) go to `--out`, by default a fresh
folder under the system's temporary directory; the per-request records go beside them in
`raw/`, never into the repository unless `--out` points there.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gzip
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.multiturn.driver import ScheduledSession, run_sessions, run_workload
from benchmarks.multiturn.nodes import ContentionWatch, Endpoint, log_tails, wait_until_alone
from benchmarks.multiturn.results import RequestRecord
from benchmarks.multiturn.run import (
    _log,
    _sigterm,
    _text_with_tool_calls,
    _warmup,
    machine,
)
from benchmarks.multiturn.workload import Workload, generate

from . import summary as summary_mod
from .arms import (
    ARMS,
    DEFAULT_ARMS,
    DEFAULT_TIERS,
    TIER_DIR,
    Arm,
    KvBudget,
    TierBudget,
    flag_rows,
    parse_arms,
    serve_arm,
    subject_of,
)
from .workloads import WORKLOADS, NamedWorkload, workload

REPO = Path(__file__).resolve().parents[2]
#: The default SLOs. The ITL bound is the fixed bound the registered load runs were judged
#: against; the router's stall cap is set from D's step time, not from it.
DEFAULT_TTFT_MS = 2000.0
DEFAULT_ITL_MS = 40.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks compare",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke size: the workload's small version, one ABBA pair")
    p.add_argument("--workload", default="agent", choices=list(WORKLOADS))
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated, from {','.join(ARMS)} (default "
                   f"{','.join(DEFAULT_ARMS)})")
    p.add_argument("--reps", type=int, help="repetitions; odd ones run the arms in reverse "
                   "(default 2, ABBA; --quick 2)")
    p.add_argument("--out", type=Path, help="report folder (default: a new temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=DEFAULT_TTFT_MS,
                   help="SLO `ttft`: a session's later-turn TTFT p90 bound (ms)")
    p.add_argument("--itl-ms", type=float, default=DEFAULT_ITL_MS,
                   help="SLO `itl`: a session's inter-token gap p99 bound (ms)")
    p.add_argument("--kv-gib", type=int,
                   help="KV space of every arm in GiB, over its nodes, even (default: the "
                   "workload's)")
    p.add_argument("--kv-tokens", type=int,
                   help="a tighter KV cap of every arm in tokens, over its nodes (default: "
                   "the workload's)")
    p.add_argument("--tier-host-gib", type=float, default=DEFAULT_TIERS.host_gib,
                   help="host tier of every tiered arm in GiB, over its nodes, split evenly")
    p.add_argument("--tier-disk-gib", type=float, default=DEFAULT_TIERS.disk_gib,
                   help="disk tier of every tiered arm in GiB (one directory per arm)")
    p.add_argument("--model", default=None, help="built-in model id (default kvagent-demo)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--wait-alone", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait this long for vLLM processes not started "
                   "here to exit (fail the run if they remain); 0: do not check")
    return p


def commit() -> str | None:
    """HEAD, marked `-dirty` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO,
                               check=False).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def sessions_of(nw: NamedWorkload, wl: Workload) -> list[ScheduledSession]:
    """The waiting workload's sessions: staggered starts, `think_s` before each later turn."""
    rng = random.Random(nw.spec.seed)
    return [ScheduledSession(c, i * nw.stagger_s,
                             tuple(nw.think_s * rng.uniform(0.9, 1.1)
                                   for _ in range(len(c.turns) - 1)))
            for i, c in enumerate(wl.conversations)]


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def tier_counters(roots: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per node, its prompt tokens cached by source (`vllm:prompt_tokens_cached_by_source`:
    device, host, disk...) and external prefix cache hits in tokens, from its /metrics;
    a node that does not answer is left out (the counters describe, they decide nothing)."""
    import httpx

    out: dict[str, dict[str, float]] = {}
    for node, root in roots.items():
        try:
            text = httpx.get(f"{root}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            continue
        out[node] = parse_tier_counters(text)
    return out


def parse_tier_counters(text: str) -> dict[str, float]:
    """One node's /metrics text: prompt tokens cached per source (summed over the other
    labels) and `external_hits` (tokens loaded through a connector: NIXL or a tier)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "vllm:prompt_tokens_cached_by_source_total":
                key = sample.labels.get("source", "?")
            elif sample.name == "vllm:external_prefix_cache_hits_total":
                key = "external_hits"
            else:
                continue
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def node_roots(eps: list[Endpoint]) -> dict[str, str]:
    """Each vLLM node's root URL: a bundle's P and D nodes, else the endpoints themselves."""
    roots: dict[str, str] = {}
    for i, ep in enumerate(eps):
        if ep.prefill_urls or ep.decode_urls:
            roots.update({f"prefill-{j}": u.rstrip("/") for j, u in enumerate(ep.prefill_urls)})
            roots.update({f"decode-{j}": u.rstrip("/") for j, u in enumerate(ep.decode_urls)})
        else:
            roots["node" if len(eps) == 1 else f"node{i}"] = ep.base_url.removesuffix("/v1")
    return roots


def drive_arm(arm: Arm, nw: NamedWorkload, wl: Workload, run: summary_mod.ArmRun,
              work_dir: Path, args: argparse.Namespace, kv: KvBudget,
              tiers: TierBudget = DEFAULT_TIERS) -> None:
    """Up, warm, drive, down; fills `run`. A failure is recorded, not raised."""
    tag = f"[{run.position + 1}] {arm.name} (rep {run.rep})"
    if args.wait_alone > 0:
        wait_until_alone(args.wait_alone, log=_log)
    done = 0
    total = sum(len(c.turns) for c in wl.conversations)

    def progress(r: RequestRecord) -> None:
        nonlocal done
        done += 1
        status = r.error or (f"ttft {r.ttft_s * 1000:.0f} ms" if r.ttft_s is not None else "")
        _log(f"  {tag} {done}/{total} {r.conversation} turn {r.turn}: prompt "
             f"{r.prompt_tokens} cached {r.cached_tokens} reused {r.reused_tokens} {status}")

    t0 = time.perf_counter()
    cdir = work_dir / f"{run.position:02d}-{arm.name}"
    try:
        _log(f"{tag}: starting ({arm.description})")
        with serve_arm(arm, cdir, kv=kv, tiers=tiers,
                       startup_timeout_s=args.startup_timeout, model=args.model) as (eps, route):
            run.startup_s = time.perf_counter() - t0
            _log(f"{tag}: up in {run.startup_s:.0f} s")
            for ep in eps:
                _warmup(ep.base_url, ep.model)
            run_id = f"cmp{run.position}"
            text_tools = _text_with_tool_calls(args.model)
            with ContentionWatch() as watch:
                if nw.think_s > 0:
                    sessions = sessions_of(nw, wl)
                    bound = max(s.start_s for s in sessions) + nw.turns * (
                        nw.think_s * 1.1 + args.request_timeout)
                    records, cancelled, wall = asyncio.run(run_sessions(
                        eps[0].base_url, eps[0].model, sessions, wl.max_tokens,
                        config=arm.name, run_id=run_id, deadline_s=bound,
                        timeout_s=args.request_timeout, on_record=progress,
                        text_with_tool_calls=text_tools, route=route))
                    if cancelled:
                        run.error = f"{len(cancelled)} session(s) cancelled at {bound:.0f} s"
                else:
                    records, wall = asyncio.run(run_workload(
                        eps[0].base_url, eps[0].model, wl, config=arm.name, run_id=run_id,
                        timeout_s=args.request_timeout, on_record=progress,
                        text_with_tool_calls=text_tools, route=route))
            run.records, run.wall_s, run.foreign_vllm = records, wall, watch.max
            if arm.tier:
                run.tier_counters = tier_counters(node_roots(eps))
                run.disk_used_bytes = dir_bytes(cdir / TIER_DIR)
        errors = [r.error for r in run.records if r.error]
        if errors:
            run.error = f"{len(errors)} request(s) failed; first: {errors[0]}"
        _log(f"{tag}: done in {wall:.0f} s, stopped"
             + (f" ({watch.max} foreign vLLM processes ran meanwhile)" if watch.max else ""))
    except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others
        run.status, run.error = "failed", f"{type(exc).__name__}: {exc}"
        _log(f"{tag}: FAILED: {run.error}")
        tails = "\n".join(log_tails(p) for p in sorted(cdir.rglob("logs")) if p.is_dir())
        if tails:
            _log(tails[-4000:])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        arms = parse_arms(args.arms)
        nw = workload(args.workload, quick=args.quick, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    reps = args.reps or 2
    kv = KvBudget(gib=args.kv_gib or nw.kv.gib,
                  tokens=args.kv_tokens if args.kv_tokens is not None else nw.kv.tokens)
    try:
        tiers = TierBudget(host_gib=args.tier_host_gib, disk_gib=args.tier_disk_gib)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    wl = generate(nw.spec)
    now = dt.datetime.now(dt.UTC)
    out = args.out or Path(tempfile.gettempdir()) / "kvagent-compare" / (
        f"{now:%Y%m%dT%H%M%SZ}-{nw.name}")
    out.mkdir(parents=True, exist_ok=True)
    command = ["python", "-m", "benchmarks", "compare",
               *(argv if argv is not None else sys.argv[1:])]
    slo = summary_mod.Slo(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)
    _log(f"compare: workload {nw.name} ({len(wl.conversations)} sessions x "
         f"{nw.turns} turns), arms {', '.join(a.name for a in arms)}, {reps} repetition(s); "
         f"SLOs ttft p90 <= {slo.ttft_ms:g} ms, itl p99 <= {slo.itl_ms:g} ms; out {out}")
    try:
        flags = flag_rows(arms, kv=kv, model=args.model, tiers=tiers)
    except Exception as exc:  # noqa: BLE001 - the table is a description, not the run
        _log(f"flags table not rendered: {exc}")
        flags = []
    order = summary_mod.run_order([a.name for a in arms], reps)
    runs = [summary_mod.ArmRun(arm=a, rep=rep, position=i) for i, (rep, a) in enumerate(order)]
    previous = signal.signal(signal.SIGTERM, _sigterm)
    t_start = time.perf_counter()
    interrupted = False
    try:
        for run in runs:
            drive_arm(ARMS[run.arm], nw, wl, run, out / "work", args, kv, tiers)
            _log(f"compare: {run.position + 1}/{len(runs)} runs done, "
                 f"{time.perf_counter() - t_start:.0f} s in")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the arm is stopped; report what ran
        interrupted = True
        for run in runs:
            if run.wall_s is None and run.status == "ok":
                run.status, run.error = "interrupted", "not run to the end"
        _log("compare: interrupted; writing the report of what ran")
    finally:
        signal.signal(signal.SIGTERM, previous)
    raw = out / "raw" / "records.jsonl.gz"
    raw.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(raw, "wt") as f:
        for run in runs:
            for r in run.records:
                f.write(json.dumps({"rep": run.rep, "position": run.position,
                                    **r.model_dump(mode="json")}) + "\n")
    s = summary_mod.summary(
        command=command, commit=commit(), machine=machine(),
        date=now.isoformat(timespec="seconds"),
        workload={"name": nw.name, "why": nw.why, "spec": nw.spec.model_dump(mode="json"),
                  "fingerprint": wl.fingerprint(), "kv_gib": kv.gib, "kv_tokens": kv.tokens,
                  "think_s": nw.think_s, "stagger_s": nw.stagger_s, "quick": args.quick,
                  "tier_host_gib": tiers.host_gib, "tier_disk_gib": tiers.disk_gib},
        slo=slo, arms={a.name: a.description for a in arms},
        memory={a.name: a.memory(kv, tiers) for a in arms},
        order=[{"position": r.position, "rep": r.rep, "arm": r.arm, "status": r.status,
                "error": r.error, "startup_s": r.startup_s, "wall_s": r.wall_s,
                "foreign_vllm": r.foreign_vllm, "disk_used_bytes": r.disk_used_bytes,
                "tier_counters": r.tier_counters,
                "ttft_later_p50_ms": summary_mod.later_ttft_p50_ms(r)} for r in runs],
        flags=flags, runs=runs, subject=subject_of([a.name for a in arms]),
        raw_records=str(raw))
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "report.md").write_text(summary_mod.report_md(s))
    _log(f"wrote {out / 'report.md'} and {out / 'summary.json'}")
    print(summary_mod.report_md(s))
    if interrupted:
        return 130
    return 0 if all(r.status == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
