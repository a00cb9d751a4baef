"""`python -m benchmarks.multiturn.node_trace DIR [--json OUT]`: the table of a trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.multiturn.node_trace import timeline


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.node_trace",
                                description=__doc__)
    p.add_argument("folder", type=Path, help="a configuration's node_trace/ folder")
    p.add_argument("--json", type=Path, help="also write the summary and the rows here")
    args = p.parse_args(argv)
    rows = timeline.turns(timeline.requests(timeline.read_events(args.folder)))
    if not rows:
        print(f"no traced turns in {args.folder}", file=sys.stderr)
        return 1
    summ = timeline.summary(rows)
    print(timeline.markdown(summ))
    if args.json:
        args.json.write_text(json.dumps({"summary": summ, "turns": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
