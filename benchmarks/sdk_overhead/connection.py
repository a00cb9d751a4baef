"""Turn-to-first-byte with and without reuse of the session's TCP connection.

A local HTTP/1.1 server (``sse_server.py``) streams a short chat-completion answer; two
sessions send the same turns, interleaved so machine load hits both alike:

* ``reuse``    - the default: each stream is read to its end, the connection goes back to
  httpx's pool and the next turn reuses it;
* ``no reuse`` - an ``httpx.Client`` keeping no idle connections: every turn connects anew
  (what the SDK did before it read streams past ``[DONE]``).

Reported: ``time_to_first_chunk`` (request sent to first SSE chunk, connect included) in
ms, min / median / p90, and the TCP connections each server accepted.

    python -m benchmarks.sdk_overhead.connection                 # 300 turns each
    python -m benchmarks.sdk_overhead.connection --turns 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Any

import httpx
from kvagent import Session

from .sse_server import MODEL, base_url, serve


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples)
    return {"min": ms[0], "median": statistics.median(ms),
            "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))]}


def run(turns: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"reuse": [], "no reuse": []}
    connections: dict[str, int] = {}
    with serve(tail_delay=0.0) as reuse_server, serve(tail_delay=0.0) as fresh_server:
        fresh_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        with Session(base_url(reuse_server), MODEL) as reuse, fresh_client, \
                Session(base_url(fresh_server), MODEL, http_client=fresh_client) as fresh:
            reuse.send("warm-up")
            fresh.send("warm-up")
            for i in range(turns):
                for name, session in (("reuse", reuse), ("no reuse", fresh)):
                    # A fresh history each turn: only the connection differs between runs.
                    session.truncate(0)
                    result = session.send(f"turn {i}")
                    assert result.time_to_first_chunk is not None
                    samples[name].append(result.time_to_first_chunk)
        connections = {"reuse": reuse_server.connections, "no reuse": fresh_server.connections}
    return {"turns": turns, "ttfb_ms": {k: _stats(v) for k, v in samples.items()},
            "connections": connections, "python": sys.version.split()[0],
            "httpx": httpx.__version__, "machine": platform.machine(),
            "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    out = run(args.turns)
    print(f"{out['turns']} turns each, time to first chunk in ms (min / median / p90); "
          f"load {out['load_avg_1m']:.2f} on {out['cpus']} CPUs")
    for name, value in out["ttfb_ms"].items():
        print(f"  {name:<9} {value['min']:7.3f} {value['median']:7.3f} {value['p90']:7.3f}"
              f"   ({out['connections'][name]} TCP connections)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
