"""`python -m benchmarks outside`: the same arms as `compare`, measured by someone else's
harness (aiperf, pinned), into one report.

    python -m benchmarks outside                          # aggregated vs kvagent
    python -m benchmarks outside --arms aggregated,kvagent,kvagent-pd --reps 2

aiperf is installed on first use into its own virtual environment (it pins libraries
vLLM also uses, so it never shares one with the engine): `--aiperf PATH` names an
`aiperf` executable instead. Each run brings one arm up (as `compare` does, same KV
budget), warms it, runs aiperf against it, and stops it; the arms alternate in ABBA
order. The report (`report.md`, `summary.json`) goes to `--out`, aiperf's own per-request
export beside it in `raw/`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.compare.arms import ARMS, Arm, KvBudget, parse_arms, serve_arm
from benchmarks.compare.run import commit
from benchmarks.compare.workloads import DEFAULT_KV
from benchmarks.multiturn.nodes import ContentionWatch, wait_until_alone
from benchmarks.multiturn.run import _log, _sigterm, _warmup, machine

from .harness import (
    AIPERF_VERSION,
    Shape,
    aiperf_argv,
    markdown,
    ratios,
    read_records,
    summarize,
)

DEFAULT_ARMS = "aggregated,kvagent"
SUBJECT = "kvagent"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks outside",
                                description=(__doc__ or "").split("\n\n")[0])
    d = Shape()
    p.add_argument("--arms", default=DEFAULT_ARMS,
                   help=f"comma-separated, from {','.join(a for a in ARMS if a != 'affine-2')}"
                   f" (default {DEFAULT_ARMS}; the first kvagent arm is the subject)")
    p.add_argument("--reps", type=int, default=1, help="repetitions; odd ones run the arms "
                   "in reverse (default 1)")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="requests in flight at most (aiperf's clients)")
    p.add_argument("--isl", type=int, default=d.isl, help="tokens per user message")
    p.add_argument("--osl", type=int, default=d.osl, help="tokens per answer")
    p.add_argument("--delay-ms", type=int, default=d.delay_ms,
                   help="between a conversation's answer and its next turn")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--kv-gib", type=int, default=DEFAULT_KV.gib,
                   help="KV space of every arm in GiB, over its nodes")
    p.add_argument("--model", default=None, help="built-in model id (default kvagent-demo)")
    p.add_argument("--aiperf", type=Path, help="an aiperf executable to use (default: "
                   f"aiperf {AIPERF_VERSION}, installed on first use)")
    p.add_argument("--out", type=Path, help="report folder (default: a new temporary one)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one arm's aiperf run may take before it is stopped")
    p.add_argument("--wait-alone", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait this long for vLLM processes not started "
                   "here to exit (fail the run if they remain); 0: do not check")
    return p


def aiperf_home() -> Path:
    return Path.home() / ".cache" / "kvagent" / f"aiperf-{AIPERF_VERSION}"


def ensure_aiperf(given: Path | None) -> str:
    """The aiperf executable: `given`, or the pinned version in its own venv (created and
    installed from the package index the first time, a few minutes; a stamp written last
    marks an install that finished)."""
    if given is not None:
        if not given.is_file():
            raise SystemExit(f"--aiperf {given}: no such file")
        return str(given)
    home = aiperf_home()
    exe, stamp = home / "bin" / "aiperf", home / ".kvagent-installed"
    if exe.is_file() and stamp.is_file():
        return str(exe)
    _log(f"installing aiperf {AIPERF_VERSION} into {home} (once; a few minutes)")
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    f"aiperf=={AIPERF_VERSION}"], check=True)
    stamp.write_text(AIPERF_VERSION + "\n")
    return str(exe)


def tokenizer_of(model: str | None) -> str:
    """The served model's tokenizer directory (aiperf sizes its prompts with it; the hub
    is never asked)."""
    from kvagent_server.models.builtin import builtin_model

    built = builtin_model(model)
    if built is None:
        if model and Path(model).is_dir():
            return model
        raise SystemExit(f"--model {model}: not a built-in model id or a local directory")
    return str(built.ensure(None))


def run_arm(arm: Arm, exe: str, shape: Shape, work: Path, args: argparse.Namespace,
            kv: KvBudget) -> dict[str, Any]:
    """Up, warm, aiperf, down. A failure is recorded, not raised."""
    out: dict[str, Any] = {"arm": arm.name}
    try:
        if args.wait_alone > 0:
            wait_until_alone(args.wait_alone, log=_log)
        t0 = time.perf_counter()
        with serve_arm(arm, work, kv=kv, startup_timeout_s=args.startup_timeout,
                       model=args.model) as (eps, _route):
            ep = eps[0]
            out["startup_s"] = round(time.perf_counter() - t0, 1)
            _log(f"{arm.name}: up in {out['startup_s']:.0f} s; aiperf: {shape.requests} "
                 "requests")
            _warmup(ep.base_url, ep.model)
            argv = aiperf_argv(exe, shape, url=ep.base_url.removesuffix("/v1"),
                               model=ep.model, tokenizer=tokenizer_of(args.model),
                               artifact_dir=work / "aiperf")
            t1 = time.perf_counter()
            with ContentionWatch() as watch, open(work / "aiperf.log", "w") as log:
                proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.run_timeout, check=False)
            out["wall_s"] = round(time.perf_counter() - t1, 1)
            out["foreign_vllm"] = watch.max
        export = work / "aiperf" / "profile_export.jsonl"
        if proc.returncode != 0 or not export.is_file():
            tail = (work / "aiperf.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"aiperf exited {proc.returncode}:\n{tail}")
        records = read_records(export.read_text().splitlines())
        out["records"] = records
        out["summary"] = summarize(records)
        s = out["summary"]
        _log(f"{arm.name}: done in {out['wall_s']:.0f} s: later TTFT p90 "
             f"{s['later_ttft_ms']['p90']} ms, TPOT p99 {s['tpot_ms']['p99']} ms, "
             f"{s['errors']} error(s)")
    except Exception as exc:  # noqa: BLE001 - one broken arm must not lose the others
        out["error"] = f"{type(exc).__name__}: {exc}"
        _log(f"{arm.name}: FAILED: {out['error']}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        arms = parse_arms(args.arms)
        shape = Shape(args.conversations, args.turns, args.concurrency, args.isl, args.osl,
                      args.delay_ms, args.seed)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    if any(a.kind == "affine" for a in arms):
        raise SystemExit("error: affine-2 routes sessions in kvagent's own client; the "
                         "outside harness drives one endpoint per arm")
    if args.reps < 1:
        raise SystemExit("error: --reps must be >= 1")
    subject = next((a.name for a in arms if a.name.startswith(SUBJECT)), arms[-1].name)
    exe = ensure_aiperf(args.aiperf)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvagent-outside-"))
    out.mkdir(parents=True, exist_ok=True)
    kv = KvBudget(gib=args.kv_gib)
    command = "python -m benchmarks outside " + " ".join(sys.argv[1:] if argv is None
                                                        else argv)
    runs: list[dict[str, Any]] = []
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        for rep in range(args.reps):
            for i, arm in enumerate(arms if rep % 2 == 0 else arms[::-1]):
                work = out / "work" / f"{rep}-{i}-{arm.name}"
                work.mkdir(parents=True, exist_ok=True)
                run = run_arm(arm, exe, shape, work, args, kv)
                run["rep"] = rep
                runs.append(run)
                export = work / "aiperf" / "profile_export.jsonl"
                if export.is_file():
                    raw = out / "raw" / f"{rep}-{arm.name}.jsonl.gz"
                    raw.parent.mkdir(exist_ok=True)
                    raw.write_bytes(gzip.compress(export.read_bytes()))
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(out / "work", ignore_errors=True)
    report = build_report(runs, arms, subject, shape, command)
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    _log(f"report: {out / 'report.md'}")
    print(markdown(report))
    return 0 if all("summary" in r for r in runs) else 1


def build_report(runs: list[dict[str, Any]], arms: list[Arm], subject: str, shape: Shape,
                 command: str) -> dict[str, Any]:
    """Per arm, its repetitions' records pooled into one summary; the subject's ratios to
    every other arm; each run's own summary kept in `runs`."""
    arms_out: dict[str, dict[str, Any]] = {}
    for a in arms:
        mine = [r for r in runs if r["arm"] == a.name]
        failed = [r["error"] for r in mine if "error" in r]
        records = [rec for r in mine for rec in r.get("records", [])]
        arms_out[a.name] = ({"summary": summarize(records), "runs": len(mine),
                             "failed_runs": len(failed)} if records
                            else {"error": failed[0] if failed else "not run"})
    subj = arms_out.get(subject, {}).get("summary")
    rat = {name: ratios(subj, a["summary"]) for name, a in arms_out.items()
           if name != subject and subj is not None and a.get("summary") is not None}
    kept = [{k: v for k, v in r.items() if k != "records"} for r in runs]
    return {"schema": 1, "aiperf": AIPERF_VERSION, "command": command, "commit": commit(),
            "machine": machine(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "shape": asdict(shape), "subject": subject, "arms": arms_out, "ratios": rat,
            "runs": kept,
            "foreign_vllm_max": max((r.get("foreign_vllm") or 0 for r in runs), default=0)}


if __name__ == "__main__":
    raise SystemExit(main())
