"""The run log as data: `benchmarks/index.jsonl`, one line per recorded run of any benchmark
or tool, in the schema below (version 1).

A run's raw per-request records stay out of git; its line keeps what a reader quotes (the
command, the machine, the headline figures) and says where the data is: in the tree, or
at the commit that last had it (`git show <commit>:<path>`).

    python -m benchmarks.index --check        # validate every line (the tests do too)
    python -m benchmarks.index --markdown     # the appendix, docs/benchmarks-log.md
    python -m benchmarks.index --add DIR      # append a multi-turn or load results folder
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "benchmarks" / "index.jsonl"
LOG_MD = ROOT / "docs" / "benchmarks-log.md"
SCHEMA = 1

#: The last commit whose tree still holds every raw record and probe folder removed since:
#: `git show <this>:benchmarks/multiturn/results/<run>/results.json.gz > results.json.gz`.
RAW_RECORDS_COMMIT = "b7cb55e69738da42d499748b013bcecb480948dc"

Kind = Literal["compare", "outside", "decode-ab", "multiturn", "multiturn-load", "first-token-ab", "router-overhead", "load",
               "nixl-bandwidth", "fleet-sim", "fuzz", "attack", "soak", "multihost", "gpu",
               "idle-stability"]
Figure = float | int | str | bool | None


class Machine(BaseModel):
    """What the run recorded about its host; the 2-core VM was an Intel Xeon on some days
    and an AMD EPYC on others, so a figure is compared only on the same `cpu`."""

    model_config = ConfigDict(extra="forbid")
    cpu: str | None = None
    cores: int | None = None
    memory_gib: float | None = None
    gpu: str | None = None


class Data(BaseModel):
    """Where the run's files are. `path` is relative to the repository root; `in_tree` says
    whether the working tree has it; `commit` has what the tree lacks (all of it, or the
    folder's files beyond `kept`): `git show <commit>:<path>/<file>` brings it back."""

    model_config = ConfigDict(extra="forbid")
    path: str
    in_tree: bool
    commit: str | None = None
    #: What the tree keeps of a folder (summary.md, NOTE.md, ...); empty: the whole of it.
    kept: list[str] = Field(default_factory=list)


class Run(BaseModel):
    """One recorded run."""

    model_config = ConfigDict(extra="forbid")
    schema_: Literal[1] = Field(SCHEMA, alias="schema")
    id: str
    kind: Kind
    date: str  # ISO 8601, UTC; a day when only the day was recorded
    label: str | None = None  # what the docs call it ("run 27", "quiet full run")
    command: str | None = None
    commit: str | None = None  # the code measured, when the run recorded it
    machine: Machine | None = None
    #: No foreign vLLM process ran beside it (`foreign_vllm_max == 0` everywhere), when known.
    quiet: bool | None = None
    figures: dict[str, Figure] = Field(default_factory=dict)
    data: Data
    note: str | None = None

    def line(self) -> str:
        return json.dumps(self.model_dump(by_alias=True, exclude_defaults=False),
                          ensure_ascii=False, separators=(",", ":"))


def read(path: Path = INDEX) -> list[Run]:
    """Every line, validated; ids unique, in date order."""
    runs = [Run.model_validate_json(line) for line in path.read_text().splitlines() if line]
    ids = [r.id for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"duplicate run ids in {path}: {dup}")
    return runs


def problems(runs: Sequence[Run], root: Path = ROOT) -> list[str]:
    """What a line claims about the tree that is not so."""
    out = []
    for r in runs:
        where = root / r.data.path
        if r.data.in_tree and not where.exists():
            out.append(f"{r.id}: {r.data.path} is not in the tree")
        if r.data.in_tree:
            out += [f"{r.id}: {r.data.path}/{k} is not in the tree"
                    for k in r.data.kept if not (where / k).exists()]
        if (r.data.kept or not r.data.in_tree) and not r.data.commit:
            out.append(f"{r.id}: files out of the tree and no commit to restore them from")
    dates = [r.date for r in runs]
    if dates != sorted(dates):
        out.append("lines are not in date order")
    return out


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _machine(m: dict[str, Any] | None) -> Machine | None:
    if not m:
        return None
    gpu = m.get("gpu")
    return Machine(cpu=m.get("cpu"), cores=m.get("cores") or m.get("cpus"),
                   memory_gib=m.get("memory_gib"), gpu=None if gpu in (None, "none") else gpu)


def _multiturn_figures(report: dict[str, Any]) -> tuple[dict[str, Figure], bool | None]:
    figures: dict[str, Figure] = {}
    foreign: list[int] = []
    for c in report.get("configs", []):
        name = c["name"]
        if c.get("foreign_vllm_max") is not None:
            foreign.append(c["foreign_vllm_max"])
        s = c.get("summary")
        if c.get("status") != "ok" or not s:
            figures[f"{name}.status"] = c.get("status")
            continue
        figures[f"{name}.later_ttft_p50_ms"] = _ms(s["ttft_later_turns_s"].get("p50"))
        if s.get("reuse_rate_later_turns") is not None:
            figures[f"{name}.reuse_later"] = round(s["reuse_rate_later_turns"], 3)
    for k, v in (report.get("targets") or {}).get("ratios", {}).items():
        figures[f"ratio.{k}"] = None if v is None else round(v, 3)
    return figures, (max(foreign) == 0 if foreign else None)


def _load_figures(report: dict[str, Any]) -> tuple[dict[str, Figure], bool | None]:
    t = report.get("targets") or {}
    figures: dict[str, Figure] = {}
    foreign: list[int] = []
    for c in report.get("configs", []):
        levels = c.get("levels") or []
        foreign += [lv["foreign_vllm_max"] for lv in levels
                    if lv.get("foreign_vllm_max") is not None]
        figures[f"{c['name']}.sessions_met"] = sum(lv["sessions_met"] for lv in levels)
        figures[f"{c['name']}.sessions"] = sum(lv["sessions"] for lv in levels)
    for name, g in (t.get("peak_goodput") or {}).items():
        figures[f"{name}.peak_goodput"] = g
    if t.get("kvagent_over_best_baseline") is not None:
        figures["kvagent_over_best_baseline"] = t["kvagent_over_best_baseline"]
        figures["best_baseline"] = t.get("best_baseline")
    for k in ("kvagent_itl_p99_s", "aggregated_itl_p99_s"):
        if t.get(k) is not None:
            figures[k.replace("_s", "_ms")] = _ms(t[k])
    seed = (report.get("load") or {}).get("seed")
    if seed is not None:
        figures["seed"] = seed
    return figures, (max(foreign) == 0 if foreign else None)


def read_results(folder: Path) -> dict[str, Any] | None:
    """A results folder's report: results.json, results.json.gz, else levels.json (a load
    run's report without its records); None when the folder has none of them."""
    for name in ("results.json", "results.json.gz", "levels.json"):
        f = folder / name
        if f.is_file():
            data = f.read_bytes()
            loaded: dict[str, Any] = json.loads(gzip.decompress(data) if name.endswith(".gz")
                                                else data)
            return loaded
    return None


def entry_from_results(folder: Path, report: dict[str, Any], *, root: Path = ROOT,
                       label: str | None = None) -> Run:
    """The line of a multi-turn (`run`, `load` or `first_token`) results folder."""
    is_load = "load" in report and "slo" in report
    kind: Kind = ("multiturn-load" if is_load else "first-token-ab"
                  if folder.name.endswith("first-token-ab") else "multiturn")
    if kind == "multiturn-load":
        figures, quiet = _load_figures(report)
    elif kind == "multiturn":
        figures, quiet = _multiturn_figures(report)
    else:
        figures, quiet = {k: v for k, v in report.items()
                          if isinstance(v, int | float | str) and k != "command"}, None
    command = report.get("command")
    return Run(id=folder.name, kind=kind, date=str(report.get("created_at") or folder.name[:8]),
               label=label, command=" ".join(command) if isinstance(command, list) else command,
               commit=report.get("commit"), machine=_machine(report.get("machine")),
               quiet=quiet, figures=figures,
               data=Data(path=folder.resolve().relative_to(root.resolve()).as_posix(),
                         in_tree=True))


def entry_from_compare(folder: Path, s: dict[str, Any], *, root: Path = ROOT,
                       label: str | None = None) -> Run:
    """The line of a `python -m benchmarks compare` folder (its summary.json): per arm the
    later-turn TTFT p50/p90, ITL p99 and goodput under the SLO `both`."""
    figures: dict[str, Figure] = {"workload": s["workload"]["name"]}
    for arm, a in s["arms"].items():
        f = a["figures"]
        if not f.get("requests"):
            continue
        later = f.get("ttft_later_ms") or {}
        figures[f"{arm}.later_ttft_p50_ms"] = _round(later.get("p50"))
        figures[f"{arm}.later_ttft_p90_ms"] = _round(later.get("p90"))
        figures[f"{arm}.itl_p99_ms"] = _round(f.get("itl_p99_ms"))
        figures[f"{arm}.goodput_both"] = (f.get("goodput") or {}).get("both", {}).get("fraction")
    return Run(id=folder.name, kind="compare", date=s["date"], label=label,
               command=" ".join(s["command"]), commit=s.get("commit"),
               machine=_machine(s.get("machine")),
               quiet=s.get("foreign_vllm_max") == 0 if "foreign_vllm_max" in s else None,
               figures=figures,
               data=Data(path=folder.resolve().relative_to(root.resolve()).as_posix(),
                         in_tree=True))


def entry_from_outside(folder: Path, s: dict[str, Any], *, root: Path = ROOT,
                       label: str | None = None) -> Run:
    """The line of a `python -m benchmarks outside` folder (its summary.json, which names
    its harness): per arm the later-turn TTFT p50/p90 and TPOT p99 as the harness measured."""
    figures: dict[str, Figure] = {"harness": f"aiperf {s['aiperf']}"}
    for arm, a in s["arms"].items():
        f = a.get("summary")
        if not f:
            continue
        figures[f"{arm}.later_ttft_p50_ms"] = _round(f["later_ttft_ms"]["p50"])
        figures[f"{arm}.later_ttft_p90_ms"] = _round(f["later_ttft_ms"]["p90"])
        figures[f"{arm}.tpot_p99_ms"] = _round(f["tpot_ms"]["p99"])
    return Run(id=folder.name, kind="outside", date=s["date"], label=label,
               command=s["command"], commit=s.get("commit"), machine=_machine(s.get("machine")),
               quiet=s.get("foreign_vllm_max") == 0, figures=figures,
               data=Data(path=folder.resolve().relative_to(root.resolve()).as_posix(),
                         in_tree=True))


def entry_from_decode_ab(folder: Path, s: dict[str, Any], *, root: Path = ROOT,
                         label: str | None = None) -> Run:
    """The line of a `python -m benchmarks decode-ab` folder: per stream count and target
    the TPOT p50, and each target's paired difference from the baseline."""
    figures: dict[str, Figure] = {"base": s["base"]}
    for streams, block in s["results"].items():
        for target, f in block["targets"].items():
            figures[f"{streams}x.{target}.tpot_p50_ms"] = f["tpot_ms"]["p50"]
        for target, p in block["paired"].items():
            figures[f"{streams}x.{target}.paired_diff_ms"] = p["median_diff_ms"]
    return Run(id=folder.name, kind="decode-ab", date=s["date"], label=label,
               command=" ".join(s["command"]), commit=s.get("commit"),
               machine=_machine(s.get("machine")), quiet=s.get("foreign_vllm_max") == 0,
               figures=figures,
               data=Data(path=folder.resolve().relative_to(root.resolve()).as_posix(),
                         in_tree=True))


def _round(v: Any) -> int | None:
    return None if v is None else round(v)


def _fmt(v: Figure) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "–" if v is None else str(v)


def markdown(runs: Iterable[Run]) -> str:
    """The appendix: every run in date order, one row each, generated from the index."""
    lines = [
        "# Benchmark run log",
        "",
        "Generated from `benchmarks/index.jsonl` by `python -m benchmarks.index --markdown`;",
        "do not edit by hand. One row per recorded run; *data* is the run's folder or file,",
        "in the tree, or at the commit named (`git show <commit>:<path>`). Figures are",
        "medians in ms unless named otherwise; compare them only between rows with the same",
        "CPU (the 2-core VM was an Intel Xeon on 2026-11-30, 2026-12-02 07:00–07:30 and from",
        "2026-12-04 21:29 on, an AMD EPYC between).",
        "",
        "| date (UTC) | id | kind | label | CPU | quiet | headline figures | data |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        cpu = r.machine.cpu if r.machine and r.machine.cpu else "–"
        quiet = {True: "yes", False: "no", None: "–"}[r.quiet]
        figs = "; ".join(f"{k} {_fmt(v)}" for k, v in r.figures.items())
        data = (f"`{r.data.path}` at {(r.data.commit or '')[:10]}" if not r.data.in_tree
                else f"`{r.data.path}` (rest at {(r.data.commit or '')[:10]})" if r.data.kept
                else f"`{r.data.path}`")
        cells = [r.date[:16].replace("T", " "), f"`{r.id}`", r.kind, r.label or "",
                 cpu, quiet, figs, data]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write(runs: Iterable[Run], path: Path = INDEX) -> None:
    path.write_text("".join(r.line() + "\n" for r in runs))


def missing_records(path: Path) -> FileNotFoundError:
    """The error for a results folder (or its results.json) whose raw records are out of the
    tree: it names the command that brings them back."""
    folder = path.parent if path.suffix in (".json", ".gz") else path
    try:
        shown = folder.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        shown = str(folder)
    return FileNotFoundError(
        f"{path}: no results.json. A committed run keeps its summary only; its raw records "
        f"are in git history: git show {RAW_RECORDS_COMMIT[:12]}:{shown}/results.json.gz > "
        f"{shown}/results.json.gz (or raw.tar.gz; see benchmarks/index.jsonl)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.index",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="validate every line")
    ap.add_argument("--markdown", action="store_true", help="print the run log appendix")
    ap.add_argument("--add", type=Path, metavar="DIR", help="append a results folder's line")
    ap.add_argument("--label", help="with --add: what the docs call the run")
    args = ap.parse_args(argv)
    runs = read()
    if args.add and (args.add / "summary.json").is_file():
        summary = json.loads((args.add / "summary.json").read_text())
        entry = (entry_from_outside if "aiperf" in summary
                 else entry_from_decode_ab if summary.get("benchmark") == "decode-ab"
                 else entry_from_compare)
        runs.append(entry(args.add, summary, label=args.label))
        write(sorted(runs, key=lambda r: r.date))
    elif args.add:
        report = read_results(args.add)
        if report is None:
            print(f"{args.add}: no results.json, results.json.gz or levels.json",
                  file=sys.stderr)
            return 1
        runs.append(entry_from_results(args.add, report, label=args.label))
        write(sorted(runs, key=lambda r: r.date))
    if args.check or not (args.markdown or args.add):
        bad = problems(runs)
        for p in bad:
            print(p, file=sys.stderr)
        if bad:
            return 1
        print(f"{len(runs)} runs, schema {SCHEMA}: ok", file=sys.stderr)
    if args.markdown:
        sys.stdout.write(markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
