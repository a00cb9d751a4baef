"""Fleet simulator CLI: check it against recorded real runs, then sweep the fleet.

    python -m benchmarks.fleet_sim.run validate          # sim vs the recorded runs
    python -m benchmarks.fleet_sim.run sweep             # the full sweep (a few minutes)
    python -m benchmarks.fleet_sim.run sweep --smoke     # a seeded slice (seconds)
    python -m benchmarks.fleet_sim.run redis             # RedisStore on a real redis-server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvagent_server.bundle.processes import stop_groups

from benchmarks._procs import free_ports
from benchmarks.fleet_sim import calibrate
from benchmarks.fleet_sim.profiles import Profile, glm_constants, gpu_profile
from benchmarks.fleet_sim.sim import SimConfig, Simulation, summarize
from benchmarks.fleet_sim.workload import FleetSpec

HERE = Path(__file__).resolve().parent


def machine_profile() -> Profile:
    """This machine's profile: measured constants, fixed latencies fitted on the fit half
    of the quiet recorded run (`calibrate`)."""
    return calibrate.machine_profile()


# ------------------------------------------------------------------ validation


def validate() -> dict[str, Any]:
    """Fit on the quiet run's fit half; compare on its held-out half and the other quiet
    run (and, marked in sample, on the fit half itself)."""
    return calibrate.validate()


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f}"


def validation_markdown(doc: dict[str, Any]) -> str:
    sw = doc["swapped_profile"]
    out = [(f"Constants fitted on conversations {', '.join(doc['fit_set'])} of "
           f"`{doc['fit_run']}` (every configuration; split `random.Random("
           f"{doc['split_seed']})`, half of the conversations); judged on the held-out "
           f"{', '.join(doc['held_out'])} and on all of `{doc['other_run']}` "
           "(concurrency 1). Swapped halves: fitted on the held-out half instead "
           f"(P {sw['prefill_fixed_s'] * 1e3:.0f} ms, d_direct "
           f"{sw['d_direct_fixed_s'] * 1e3:.0f} ms fixed), judged on the first. TTFT in "
           "ms, real / simulated (error); \u2713: every figure of the row within 25%."), "",
           ("| fitted on | judged on | set | config | turns | TTFT p50 | later-turn p50 | "
            "TTFT p90 | later-turn p90 | within 25% |"), "|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("p50", "later_p50", "p90", "later_p90")
    for r in doc["rows"]:
        cells = [f"{_ms(r['real'][k])} / {_ms(r['sim'][k])} ({r['err'][k]:+.0%})" for k in keys]
        if all(abs(r["err"][k]) <= 0.25 for k in keys):
            verdict = "\u2713"
        elif all(abs(r["err"][k]) <= 0.25 for k in keys[:2]):
            verdict = "medians only"
        else:
            verdict = "no"
        out.append(f"| {r['fit_on']} | {r['judged_on']} | {r['set']} | `{r['config']}` | "
                   f"{r['n']} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(out)


def by_turn_markdown(row: dict[str, Any]) -> str:
    turns = sorted(row["real_by_turn"], key=int)
    head = "| median TTFT by turn (ms) | " + " | ".join(str(t) for t in turns) + " |"
    real = " | ".join(f"{row['real_by_turn'][t] * 1e3:.0f}" for t in turns)
    sim = " | ".join(f"{row['sim_by_turn'].get(t, math.nan) * 1e3:.0f}" for t in turns)
    return "\n".join([head, "|---" * (len(turns) + 1) + "|", f"| real | {real} |",
                      f"| simulated | {sim} |"])


# ------------------------------------------------------------------ sweep

#: The GPU profile's base point and axes: each axis is swept with the others at the base.
BASE = {"sessions": 300, "turns_per_s": 10.0, "pd": (2, 4), "capacity_x": 1.0, "ttl_s": 480.0}
AXES: dict[str, list[Any]] = {
    "sessions": [100, 300, 1000, 3000, 10000],
    "turns_per_s": [2.0, 5.0, 10.0, 20.0, 40.0],
    "pd": [(1, 1), (1, 2), (2, 4), (4, 8)],
    "capacity_x": [0.25, 0.5, 1.0, 2.0, 4.0],
    # Token lifetime = TTL - 60 s margin; the base point's sessions think 30 s on average.
    "ttl_s": [90.0, 120.0, 240.0, 480.0],
}
#: Per-axis changes to the base point: at 1x D KV the watermark evicts a handle within
#: seconds, long before any TTL, so the TTL is swept where memory is ample.
AXIS_BASE: dict[str, dict[str, Any]] = {"ttl_s": {"capacity_x": 4.0}}
#: This machine's profile prefills ~20x slower: one P node recomputes ~0.5 turns/s.
CPU_BASE = {"sessions": 30, "turns_per_s": 0.3, "pd": (1, 1), "capacity_x": 1.0,
            "ttl_s": 480.0}
CPU_AXES: dict[str, list[Any]] = {"sessions": [10, 30, 100, 300, 1000],
                                  "pd": [(1, 1), (1, 2), (2, 4), (4, 8)]}
SMOKE_AXES: dict[str, list[Any]] = {"sessions": [20, 60]}
SMOKE_BASE = {"sessions": 20, "turns_per_s": 4.0, "pd": (1, 2), "capacity_x": 1.0,
              "ttl_s": 480.0}


def point(profile: Profile, p: dict[str, Any], *, reuse: bool, seed: int,
          duration_s: float | None) -> dict[str, Any]:
    think = p["sessions"] / p["turns_per_s"]
    # Long enough that most sessions take several turns.
    duration = duration_s or max(300.0, min(1200.0, 2.5 * think))
    spec = FleetSpec(seed=seed, sessions=p["sessions"], turns_per_s=p["turns_per_s"],
                     duration_s=duration)
    cfg = SimConfig(n_prefill=p["pd"][0], n_decode=p["pd"][1], reuse=reuse,
                    p_prefix_cache=reuse, ttl_s=p["ttl_s"], seed=seed,
                    d_kv_blocks=max(1, int(profile.d_kv_blocks * p["capacity_x"])))
    sim = Simulation(profile, cfg)
    t0 = time.process_time()
    records = asyncio.run(sim.run_fleet(spec))
    out = summarize(sim, records, span_s=sim.now)
    out["sim_cpu_s"] = time.process_time() - t0
    out["duration_s"] = duration
    return out


def sweep(plan: list[tuple[Profile, dict[str, Any], dict[str, list[Any]]]], *,
          seed: int, duration_s: float | None = None) -> list[dict[str, Any]]:
    """For each (profile, base point, axes): every axis value with the others at base."""
    rows = []
    for profile, base, axes in plan:
        for axis in axes:
            for value in axes[axis]:
                p = {**base, **AXIS_BASE.get(axis, {}), axis: value}
                on = point(profile, p, reuse=True, seed=seed, duration_s=duration_s)
                off = point(profile, p, reuse=False, seed=seed, duration_s=duration_s)
                rows.append({"profile": profile.name, "axis": axis, "value": value,
                             "params": {**p, "pd": list(p["pd"])}, "reuse": on,
                             "no_reuse": off})
                print(f"{profile.name} {axis}={value}: reuse {on['reuse_rate']:.0%}, "
                      f"TTFT p50 {on['ttft_p50'] * 1e3:.0f} ms vs {off['ttft_p50'] * 1e3:.0f} "
                      f"ms, {on['turns']} turns, sim {on['sim_cpu_s'] + off['sim_cpu_s']:.1f} s",
                      flush=True)
    return rows


# ------------------------------------------------------------------ Redis


REDIS_SESSIONS = [100, 300, 1000]


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, Any]]:
    """A throwaway redis-server on a free loopback port (no persistence); stopped after."""
    import redis

    port = free_ports(1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", client
        finally:
            stop_groups(proc)


def _commandstats(client: Any) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in client.info("commandstats").items()}


def redis_sweep(profile: Profile, *, seed: int) -> list[dict[str, Any]]:
    """The sessions axis with the router's `RedisStore` on a real Redis: round trips and
    the Redis commands they run (`INFO commandstats`, Lua-internal calls included)."""
    rows = []
    with redis_server() as (url, client):
        for sessions in REDIS_SESSIONS:
            client.flushall()
            client.config_resetstat()
            p = {**BASE, "sessions": sessions}
            think = p["sessions"] / p["turns_per_s"]
            spec = FleetSpec(seed=seed, sessions=sessions, turns_per_s=p["turns_per_s"],
                             duration_s=max(300.0, min(1200.0, 2.5 * think)))
            sim = Simulation(profile, SimConfig(n_prefill=p["pd"][0], n_decode=p["pd"][1],
                                                seed=seed, redis_url=url))
            t0 = time.perf_counter()
            records = asyncio.run(sim.run_fleet(spec))
            wall = time.perf_counter() - t0
            out = summarize(sim, records, span_s=sim.now)
            stats = _commandstats(client)
            stats.pop("config|resetstat", None)
            stats.pop("flushall", None)
            stats.pop("info", None)
            n = max(1, out["turns"])
            row = {"profile": profile.name, "sessions": sessions, "turns": out["turns"],
                   "reuse_rate": out["reuse_rate"], "store_ops_per_turn": out["store_ops_per_turn"],
                   "redis_commands_per_turn": sum(stats.values()) / n,
                   "redis_commands": stats, "router_cpu_us_per_turn": out["router_cpu_us_per_turn"],
                   "wall_s": wall, "redis_used_memory": int(client.info("memory")["used_memory"])}
            rows.append(row)
            print(f"redis sessions={sessions}: {row['store_ops_per_turn']:.2f} round trips and "
                  f"{row['redis_commands_per_turn']:.2f} commands per turn, router CPU "
                  f"{row['router_cpu_us_per_turn']:.0f} µs/turn", flush=True)
    return rows


def redis_table(rows: list[dict[str, Any]]) -> str:
    out = [("| sessions | turns | reuse | store round trips / turn | Redis commands / turn | "
           "commands (total) | router CPU µs / turn | Redis memory at end |"),
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in sorted(r["redis_commands"].items(),
                                                      key=lambda kv: -kv[1]))
        out.append(f"| {r['sessions']} | {r['turns']} | {r['reuse_rate']:.0%} | "
                   f"{r['store_ops_per_turn']:.2f} | {r['redis_commands_per_turn']:.2f} | {top} | "
                   f"{r['router_cpu_us_per_turn']:.0f} | "
                   f"{r['redis_used_memory'] / 2**20:.0f} MiB |")
    return "\n".join(out)


def _label(axis: str, value: Any) -> str:
    if axis == "pd":
        return f"{value[0]}:{value[1]}"
    if axis == "capacity_x":
        return f"{value}x"
    return f"{value:g}" if isinstance(value, float) else str(value)


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for profile in sorted({r["profile"] for r in rows}):
        for axis in dict.fromkeys(r["axis"] for r in rows if r["profile"] == profile):
            pts = [r for r in rows if r["profile"] == profile and r["axis"] == axis]
            xs = list(range(len(pts)))
            labels = [_label(axis, r["value"]) for r in pts]
            fig, ax = plt.subplots(2, 3, figsize=(13, 7))
            on = [r["reuse"] for r in pts]
            off = [r["no_reuse"] for r in pts]
            panels = [
                ("reuse rate (later turns)", [("reuse", [o["reuse_rate"] for o in on])]),
                ("TTFT (s)", [("p50 reuse", [o["ttft_p50"] for o in on]),
                              ("p90 reuse", [o["ttft_p90"] for o in on]),
                              ("p50 no reuse", [o["ttft_p50"] for o in off]),
                              ("p90 no reuse", [o["ttft_p90"] for o in off])]),
                ("D KV held (fraction)", [("retained, mean", [o["d_retained_mean"] for o in on]),
                                          ("used, mean", [o["d_used_mean"] for o in on]),
                                          ("evicted handles / turn",
                                           [o["watermark_evicted_handles"] / max(1, o["turns"])
                                            for o in on])]),
                ("transfer MB / turn", [("reuse", [o["transfer_bytes_per_turn"] / 1e6 for o in on]),
                                        ("no reuse",
                                         [o["transfer_bytes_per_turn"] / 1e6 for o in off])]),
                ("router CPU µs / turn", [("turn code", [o["router_cpu_us_per_turn"] for o in on]),
                                          ("retention guard",
                                           [o["retention_cpu_us_per_turn"] for o in on])]),
                ("store ops / turn", [("reuse", [o["store_ops_per_turn"] for o in on])]),
            ]
            for a, (title, series) in zip(ax.flat, panels, strict=True):
                for name, ys in series:
                    a.plot(xs, ys, marker="o", label=name)
                a.set_title(title)
                a.set_xticks(xs, labels)
                a.set_xlabel(axis)
                a.grid(alpha=0.3)
                if len(series) > 1:
                    a.legend(fontsize=7)
            fig.suptitle(f"{profile}: sweep of {axis} (others at the base point)")
            fig.tight_layout()
            path = out / f"sweep_{profile}_{axis}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            paths.append(path)
        # TTFT distributions along the sessions axis, with and without reuse.
        pts = [r for r in rows if r["profile"] == profile and r["axis"] == "sessions"]
        if pts:
            fig, a = plt.subplots(figsize=(7, 4.5))
            qs = [q / 100 for q in range(1, 100)]
            for r in pts:
                line, = a.plot([t * 1e3 for t in r["reuse"]["ttft_quantiles"]], qs,
                               label=f"{r['value']} sessions, reuse")
                a.plot([t * 1e3 for t in r["no_reuse"]["ttft_quantiles"]], qs, ls="--",
                       color=line.get_color(), label=f"{r['value']} sessions, no reuse")
            a.set_xscale("log")
            a.set_xlabel("TTFT (ms)")
            a.set_ylabel("fraction of turns")
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
            a.set_title(f"{profile}: TTFT CDF")
            fig.tight_layout()
            path = out / f"ttft_cdf_{profile}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            paths.append(path)
    return paths


def table(rows: list[dict[str, Any]]) -> str:
    out = [("| profile | swept | value | turns | turns/s | reuse | TTFT p50 / p90 (ms) | "
            "no reuse p50 / p90 (ms) | D retained mean / peak | D used mean | evicted / turn "
            "| admission waits | MB moved / turn (no reuse) | router CPU µs / turn (+guard) "
            "| store ops / turn |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on, off = r["reuse"], r["no_reuse"]
        out.append(
            f"| {r['profile']} | {r['axis']} | {_label(r['axis'], r['value'])} | {on['turns']} "
            f"| {on['turns_per_s']:.1f} | {on['reuse_rate']:.0%} | {on['ttft_p50'] * 1e3:.0f} / "
            f"{on['ttft_p90'] * 1e3:.0f} | {off['ttft_p50'] * 1e3:.0f} / "
            f"{off['ttft_p90'] * 1e3:.0f} | {on['d_retained_mean']:.0%} / "
            f"{on['d_retained_peak']:.0%} | {on['d_used_mean']:.0%} | "
            f"{on['watermark_evicted_handles'] / max(1, on['turns']):.2f} | "
            f"{on['admission_waits']} | {on['transfer_bytes_per_turn'] / 1e6:.0f} "
            f"({off['transfer_bytes_per_turn'] / 1e6:.0f}) | "
            f"{on['router_cpu_us_per_turn']:.0f} (+{on['retention_cpu_us_per_turn']:.0f}) | "
            f"{on['store_ops_per_turn']:.2f} |")
    return "\n".join(out)


def profiles_markdown(profiles: list[Profile]) -> str:
    out = [("| profile | block | KV bytes / token | prefill F + per token | d_direct F + per "
            "token | + per token per context token | transfer | decode step | D KV blocks |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        out.append(f"| {p.name} | {p.block_size} | {p.kv_bytes_per_token:,} | "
                   f"{p.prefill_fixed_s * 1e3:.0f} ms + {p.prefill_per_token_s * 1e6:.1f} µs | "
                   f"{p.d_direct_fixed_s * 1e3:.0f} ms + {p.d_direct_per_token_s * 1e6:.1f} µs | "
                   f"{p.per_token_per_context_s * 1e9:.1f} ns | "
                   f"{p.xfer_bytes_per_s / 1e9:.2f} GB/s | {p.decode_step_s * 1e3:.1f} ms | "
                   f"{p.d_kv_blocks:,} |")
    glm_p, glm_x = glm_constants()
    out.append(f"\nGLM figures under the same assumptions: prefill {glm_p * 1e6:.1f} µs/token, "
               f"transfer {glm_x * 1e6:.1f} µs/token.")
    return "\n".join(out)


def _jsonable(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_jsonable(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="replay recorded real runs and compare TTFT")
    v.add_argument("--out", type=Path, default=HERE / "results")
    s = sub.add_parser("sweep", help="sweep sessions, turns/s, P:D, D KV capacity, TTL")
    s.add_argument("--out", type=Path, default=HERE / "results")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--smoke", action="store_true", help="a small seeded slice (seconds)")
    s.add_argument("--plots", type=Path, default=HERE / "results" / "plots",
                   help="where the PNGs go (not committed: no doc embeds them)")
    r = sub.add_parser("redis", help="the sessions axis on a real redis-server (ops count)")
    r.add_argument("--out", type=Path, default=HERE / "results")
    r.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "validate":
        doc = validate()
        (args.out / "validation.json").write_text(json.dumps(_jsonable(doc), indent=1))
        md = validation_markdown(doc)
        (args.out / "validation.md").write_text(md + "\n")
        first = next(r for r in doc["rows"] if r["set"] == "held out")
        (args.out / "validation-by-turn.md").write_text(
            f"`{first['config']}`, held-out conversations of `{first['run']}`:\n\n"
            + by_turn_markdown(first) + "\n")
        profiles = [gpu_profile(), machine_profile()]
        (args.out / "profiles.md").write_text(profiles_markdown(profiles) + "\n")
        print(md)
        return 0
    if args.cmd == "redis":
        rows = redis_sweep(gpu_profile(), seed=args.seed)
        (args.out / "redis.json").write_text(json.dumps(_jsonable(rows), indent=1))
        md = redis_table(rows)
        (args.out / "redis.md").write_text(md + "\n")
        print(md)
        return 0
    profiles = [gpu_profile(), machine_profile()]
    t0 = time.perf_counter()
    if args.smoke:
        plan = [(profiles[0], SMOKE_BASE, SMOKE_AXES)]
        rows = sweep(plan, seed=args.seed, duration_s=60.0)
    else:
        plan = [(profiles[0], BASE, AXES), (profiles[1], CPU_BASE, CPU_AXES)]
        rows = sweep(plan, seed=args.seed)
    wall = time.perf_counter() - t0
    doc = {"profiles": [p.model_dump() for p in profiles],
           "bases": {p.name: {**b, "pd": list(b["pd"])} for p, b, _ in plan},
           "seed": args.seed, "wall_s": wall, "rows": rows}
    (args.out / ("sweep-smoke.json" if args.smoke else "sweep.json")).write_text(
        json.dumps(_jsonable(doc), indent=1))
    md = table(rows)
    (args.out / ("sweep-smoke.md" if args.smoke else "sweep.md")).write_text(md + "\n")
    if not args.smoke:
        (args.out / "profiles.md").write_text(profiles_markdown(profiles) + "\n")
    if not args.smoke:
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plots)
    print(md)
    print(f"wall {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
