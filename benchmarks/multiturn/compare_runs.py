"""Two sets of draws of the same seeds, draw by draw, from the recorded results only.

    python -m benchmarks.multiturn.compare_runs [run21|late-p-idle-d|run22]

(from the repository root). It reads the draws' per-request records, which are out of the
tree: restore the folders named below from git history first (`git show
<commit>:<folder>/results.json.gz`, the commit in `benchmarks.index.RAW_RECORDS_COMMIT`);
without them it stops with that command. Its recorded outputs were
`20261204T235834Z-load-l2-p-legs-reported-seed16/compare_runs.txt` (`run21`),
`20261205T004227Z-load-l2-late-p-idle-d-seed13/compare_runs.txt` (`late-p-idle-d`) and
`20261204T235834Z-load-l2-p-legs-reported-seed16/compare_runs-run22.txt` (`run22`), at the
same commit.

`run21` (the default): run 21 (after) against run 20 (before); `late-p-idle-d`: the
first-turn rule tried after run 21 (after) against run 21 (before); `run22`: first turns
on D in its short steps while P computes other legs (after) against run 21 (before),
seven seeds. For each seed: each
run's goodput by its own bounds; both runs judged by the later run's bounds (its idle
probe) and paired session by session, `kvagent` against `kvagent` and the aggregated node
against itself (a control for the hour); and the `d_direct` turns with a delta of 1,000
tokens or more that started while a P leg was in flight (from the client's records: a
P/D turn is on P from its arrival at the router to the end of its `prefill` stage).
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.multiturn.goodput import paired_sessions, rescore_level, sign_test_p
from benchmarks.multiturn.pool import read_report
from benchmarks.multiturn.results import (
    LevelResult,
    LoadConfigResult,
    LoadReport,
    RequestRecord,
)

RESULTS = Path(__file__).resolve().parent / "results"
#: seed -> (before, after)
RUN21 = {
    12: ("20261204T201357Z-load-l2-d-steps-p-legs", "20261205T002757Z-load-l2-p-legs-reported-seed12"),
    13: ("20261204T202542Z-load-l2-d-steps-seed13", "20261205T003340Z-load-l2-p-legs-reported-seed13"),
    14: ("20261204T212936Z-load-l2-defaults-seed14", "20261205T000429Z-load-l2-p-legs-reported-seed14"),
    15: ("20261204T213607Z-load-l2-defaults-seed15", "20261205T001028Z-load-l2-p-legs-reported-seed15"),
    16: ("20261204T214212Z-load-l2-defaults-seed16", "20261204T235834Z-load-l2-p-legs-reported-seed16"),
    17: ("20261204T220825Z-load-l2-defaults-d-steps-seed17",
         "20261205T001624Z-load-l2-p-legs-reported-seed17"),
    18: ("20261204T221728Z-load-l2-defaults-d-steps-seed18",
         "20261205T002206Z-load-l2-p-legs-reported-seed18"),
}
LATE_P_IDLE_D = {
    13: ("20261205T003340Z-load-l2-p-legs-reported-seed13",
         "20261205T004227Z-load-l2-late-p-idle-d-seed13"),
    14: ("20261205T000429Z-load-l2-p-legs-reported-seed14",
         "20261205T005405Z-load-l2-late-p-idle-d-seed14"),
    16: ("20261204T235834Z-load-l2-p-legs-reported-seed16",
         "20261205T004810Z-load-l2-late-p-idle-d-seed16"),
    18: ("20261205T002206Z-load-l2-p-legs-reported-seed18",
         "20261205T005957Z-load-l2-late-p-idle-d-seed18"),
}
RUN22 = {seed: (RUN21[seed][1], f"{stamp}-load-l2-d-fresh-short-steps-seed{seed}")
         for seed, stamp in ((12, "20261205T023656Z"), (13, "20261205T021328Z"), (14, "20261205T021912Z"),
                             (15, "20261205T024241Z"), (16, "20261205T022505Z"), (17, "20261205T024838Z"),
                             (18, "20261205T023059Z"))}
COMPARISONS = {"run21": RUN21, "late-p-idle-d": LATE_P_IDLE_D, "run22": RUN22}


def load(folder: str) -> LoadReport:
    return read_report(RESULTS / folder)


def level(report: LoadReport, config: str) -> LevelResult:
    return next(c for c in report.configs if c.name == config).levels[0]


def only(a: LevelResult, b: LevelResult) -> tuple[int, int]:
    """Sessions met by `a` and not `b`, and the other way round (`paired_sessions`)."""
    pair = paired_sessions(*(LoadConfigResult(name=n, description="", status="ok", levels=[lv])
                             for n, lv in (("a", a), ("b", b))))
    assert pair is not None
    return pair.only_a, pair.only_b


def big_d_direct_beside_p(records: list[RequestRecord], min_delta: int = 1000) -> int:
    legs = [(r.start_s + r.stages_s.get("receive", 0.0),
             r.start_s + r.stages_s.get("receive", 0.0) + r.stages_s["prefill"])
            for r in records
            if r.error is None and r.path in ("pd_reuse", "pd_fresh", "recompute")
            and "prefill" in r.stages_s]
    return sum(1 for r in records
               if r.error is None and r.path == "d_direct"
               and r.prompt_tokens - r.reused_tokens >= min_delta
               and any(a < r.start_s + 0.001 < b for a, b in legs))


def main(which: str = "run21") -> None:
    """`k`/`a`: `kvagent`/aggregated; `21`: the later run, `20`: the earlier one."""
    tot = dict.fromkeys(("k21", "a21", "k20", "a20", "k20_own", "a20_own", "k21_only_vs_a",
                         "a21_only_vs_k", "k21_only", "k20_only", "a21_only", "a20_only",
                         "big20", "big21"), 0)
    for seed, (old_folder, new_folder) in sorted(COMPARISONS[which].items()):
        old, new = load(old_folder), load(new_folder)
        assert new.slo is not None
        turns, limit = int(new.load["turns"]), float(new.load["max_error_rate"])
        k21, a21 = level(new, "kvagent"), level(new, "aggregated")
        k20_own, a20_own = level(old, "kvagent"), level(old, "aggregated")
        k20, a20 = (rescore_level(lv, new.slo, turns=turns, max_error_rate=limit)
                    for lv in (k20_own, a20_own))
        vs = only(k21, a21)
        kk, aa = only(k21, k20), only(a21, a20)
        big = (big_d_direct_beside_p(k20_own.records), big_d_direct_beside_p(k21.records))
        print(f"seed {seed}: after: goodput aggregated {a21.goodput_sessions_per_min} "
              f"kvagent {k21.goodput_sessions_per_min} (met {a21.sessions_met} / "
              f"{k21.sessions_met} of {k21.sessions}; kvagent / aggregated only {vs[0]} / "
              f"{vs[1]}; missed by {k21.missed_by}); before, by its own bounds: aggregated "
              f"{a20_own.goodput_sessions_per_min} kvagent {k20_own.goodput_sessions_per_min}; "
              f"before, by the after run's bounds: met aggregated {a20.sessions_met} kvagent "
              f"{k20.sessions_met}; kvagent after / before only {kk[0]} / {kk[1]}, "
              f"aggregated after / before only {aa[0]} / {aa[1]}; big d_direct beside a P "
              f"leg before: {big[0]}, after: {big[1]}")
        for key, val in (("k21", k21.sessions_met), ("a21", a21.sessions_met),
                         ("k20", k20.sessions_met), ("a20", a20.sessions_met),
                         ("k20_own", k20_own.sessions_met), ("a20_own", a20_own.sessions_met),
                         ("k21_only_vs_a", vs[0]), ("a21_only_vs_k", vs[1]),
                         ("k21_only", kk[0]), ("k20_only", kk[1]), ("a21_only", aa[0]),
                         ("a20_only", aa[1]), ("big20", big[0]), ("big21", big[1])):
            tot[key] += val
    print("pooled:", tot)
    for a, b, what in (("k21_only_vs_a", "a21_only_vs_k", "after: kvagent vs aggregated"),
                       ("k21_only", "k20_only", "kvagent after vs before (after's bounds)"),
                       ("a21_only", "a20_only", "aggregated after vs before (control)")):
        print(f"{what}: {tot[a]} / {tot[b]}, p = {sign_test_p(tot[a], tot[a] + tot[b]):.4f}")


def cli(argv: list[str]) -> int:
    try:
        main(*argv[:1])
    except FileNotFoundError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
