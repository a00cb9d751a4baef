"""`python -m benchmarks SUBCOMMAND ...`: the benchmarks that have one command.

    python -m benchmarks compare --quick
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _compare(argv: list[str]) -> int:
    from benchmarks.compare.run import main

    return main(argv)


COMPARE_HELP = ("every arm (aggregated, affine-2, pd-noreuse, kvagent) on one workload, into "
                "one report")
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "compare": (_compare, COMPARE_HELP),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: python -m benchmarks SUBCOMMAND [ARGS]\n\nsubcommands:", file=sys.stderr)
        for name, (_, what) in SUBCOMMANDS.items():
            print(f"  {name:10s} {what}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run, _ = SUBCOMMANDS[argv[0]]
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
