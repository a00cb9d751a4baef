"""This machine's cost profile: measured where a benchmark measured it, the rest fitted on
half of a quiet recorded run, and checked on the other half and on a second quiet run.

The recorded run is `benchmarks/multiturn/results/20261201T110904Z` (2026-12-01, no
foreign vLLM process on the host: `foreign_vllm_max` 0 in every configuration): 4
conversations x 8 turns, 2 in flight, five P/D configurations over the same
conversations. Its conversations are split by a seeded rule (`split_conversations`) into a
fit half and a held-out half, the same halves in every configuration. A replay always
runs all four conversations (the held-out ones are the fit ones' contention: their
prompt sizes are workload, read from the records, never their timings), but the fit sees
only the fit half's TTFTs and the check reports the held-out half's. The concurrency-1 run
recorded just before on the same quiet host (`20261201T110522Z-c1`) is held out whole.

Constants and where they come from:

- KV transfer bandwidth: `benchmarks/nixl_bandwidth`, the quiet host's 20-pull median of
  a 64 MiB NIXL READ with the bundle's `tcp,self,sm`, 256 KiB descriptors (8.48 GB/s).
- Compute per new token, and its growth with the context before it (attention): the
  floor benchmark (`benchmarks/multiturn/floor.py`), which re-ran 17 of the quiet run's
  later turns alone on one real vLLM-CPU engine against exactly the prefix they reused
  and timed each: `engine_ttft = F + n·p + q·n·(c + (n-1)/2)` for n new tokens after c
  cached ones, least squares. P and `d_direct` (the same engine on D) share `p` and `q`.
  The floor's samples come from all four conversations (it is a separate measurement of
  the engine, re-run alone, not the recorded TTFTs the check compares), so it is not split.
- Decode step: the median TPOT of the fit half's requests.
- Fitted on the fit half (what no benchmark isolates): P's fixed latency per leg and the
  fixed part of a `d_direct` turn (router tokenization, the HTTP hops, scheduling, D's
  first step, and on this 2-core host the CPU the other engine and processes take), by a
  grid search minimising the squared log error of simulated vs real TTFT per request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fleet_sim.profiles import (
    DEMO_BLOCK_SIZE,
    DEMO_D_KV_BLOCKS,
    DEMO_KV_BYTES_PER_TOKEN,
    Profile,
    _lstsq_nonneg,
)
from benchmarks.fleet_sim.sim import SimConfig, Simulation
from benchmarks.fleet_sim.workload import _workload_index, conversations_from_results

HERE = Path(__file__).resolve().parent
RECORDED = HERE.parent / "multiturn" / "results"
QUIET = RECORDED / "20261201T110904Z" / "results.json"
QUIET_C1 = RECORDED / "20261201T110522Z-c1" / "results.json"
FLOORS = [QUIET.parent / "floor-kvagent.json", QUIET.parent / "floor-kvagent_always_pd_reuse.json"]
NIXL = HERE.parent / "nixl_bandwidth" / "results-quiet-block-256k-x20.json"
NIXL_TLS = "tcp,self,sm"
SPLIT_SEED = 0


@dataclass(frozen=True)
class Replayed:
    """How the simulator reproduces one recorded configuration."""

    reuse: bool
    p_prefix_cache: bool
    settings: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None  # None: the profile's


#: The cost model told never to skip P (`router.policy`): every reuse is a pull.
NEVER_SKIP_P: dict[str, Any] = {"name": "cost_model", "params": {"skip_prefill_max_tokens": 0}}

#: The recorded P/D configurations the simulator replays (the aggregated one has no P/D).
REPLAYED: dict[str, Replayed] = {
    "kvagent": Replayed(reuse=True, p_prefix_cache=True),
    "kvagent_always_pd_reuse": Replayed(reuse=True, p_prefix_cache=True,
                                        settings={"policy": NEVER_SKIP_P}),
    "kvagent_always_pd_reuse_block512": Replayed(reuse=True, p_prefix_cache=True,
                                                 settings={"policy": NEVER_SKIP_P},
                                                 block_size=512),
    "pd_noreuse_pcache_on": Replayed(reuse=False, p_prefix_cache=True),
    "pd_noreuse_pcache_off": Replayed(reuse=False, p_prefix_cache=False),
}


# ------------------------------------------------------------------ the split


def _configs(results: Path) -> list[dict[str, Any]]:
    return json.loads(Path(results).read_text())["configs"]


def split_conversations(results: Path = QUIET, *, seed: int = SPLIT_SEED) -> tuple[
        frozenset[str], frozenset[str]]:
    """(fit, held out): half of the run's conversations drawn by `random.Random(seed)`,
    the same halves in every configuration."""
    convs = sorted({r["conversation"] for c in _configs(results) for r in c["records"]},
                   key=_workload_index)
    fit = frozenset(random.Random(seed).sample(convs, len(convs) // 2))
    return fit, frozenset(convs) - fit


def observed(results: Path, conversations: frozenset[str]) -> dict[str, dict[tuple[str, int],
                                                                           dict[str, Any]]]:
    """The recorded outcomes (TTFT, TPOT, path) of `conversations` only, per configuration:
    the only door through which recorded timings reach the fit or the check."""
    out: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for c in _configs(results):
        if c["name"] not in REPLAYED:
            continue
        for r in c["records"]:
            if r["conversation"] in conversations and r.get("ttft_s") is not None \
                    and not r.get("error"):
                out.setdefault(c["name"], {})[(r["conversation"], r["turn"])] = {
                    "ttft_s": r["ttft_s"], "tpot_s": r.get("tpot_s"), "path": r.get("path")}
    return out


# ------------------------------------------------------------------ measured constants


def nixl_bytes_per_s(path: Path = NIXL, tls: str = NIXL_TLS) -> float:
    data = json.loads(Path(path).read_text())
    return float(next(n for n in data["nixl"] if n["tls"] == tls)["median_gbps"]) * 1e9


def engine_compute(floors: list[Path] = FLOORS) -> tuple[float, float, float, int]:
    """(fixed s, s per new token, s per new token per context token, samples) from the
    floor benchmark's lone-engine TTFTs."""
    rows, y = [], []
    for f in floors:
        for s in json.loads(Path(f).read_text())["samples"]:
            c = s["engine_cached_tokens"]
            n = s["prompt_tokens"] - c
            rows.append([1.0, n, n * (c + (n - 1) / 2)])
            y.append(s["engine_ttft_s"])
    fixed, p, q = _lstsq_nonneg(rows, y)
    return fixed, p, q, len(y)


def measured_profile(fit: dict[str, dict[tuple[str, int], dict[str, Any]]], *,
                     name: str = "cpu-demo") -> Profile:
    """The measured constants, fixed latencies still 0. `fit`: `observed` of the fit set."""
    _, p, q, n_floor = engine_compute()
    tpot = [o["tpot_s"] for recs in fit.values() for o in recs.values()
            if o.get("tpot_s") is not None]
    bw = nixl_bytes_per_s()
    return Profile(
        name=name, block_size=DEMO_BLOCK_SIZE, kv_bytes_per_token=DEMO_KV_BYTES_PER_TOKEN,
        prefill_fixed_s=0.0, prefill_per_token_s=p, d_direct_fixed_s=0.0,
        d_direct_per_token_s=p, per_token_per_context_s=q, xfer_fixed_s=0.0,
        xfer_bytes_per_s=bw, decode_step_s=float(statistics.median(tpot)),
        d_kv_blocks=DEMO_D_KV_BLOCKS,
        source=f"NIXL {NIXL_TLS} {bw / 1e9:.2f} GB/s ({NIXL.name}); per-token compute and "
               f"attention from {n_floor} floor samples; decode step = median TPOT of "
               f"{len(tpot)} fit-half requests")


# ------------------------------------------------------------------ replay


def replay(profile: Profile, results: Path, config: str) -> dict[tuple[str, int], dict[str, Any]]:
    """One recorded configuration replayed: (conversation, turn) -> simulated TTFT, path."""
    how = REPLAYED[config]
    if how.block_size is not None:
        profile = profile.model_copy(update={"block_size": how.block_size})
    named, conc, max_tokens, shared = conversations_from_results(results, config=config)
    sim = Simulation(profile, SimConfig(reuse=how.reuse, p_prefix_cache=how.p_prefix_cache,
                                        p_session_cache=how.p_prefix_cache,
                                        settings=dict(how.settings)))
    records = asyncio.run(sim.run_replay([s for _, s in named], concurrency=conc,
                                         max_tokens=max_tokens, shared_prefix=shared))
    return {(named[r.session][0], r.turn): {"ttft_s": r.ttft, "path": r.path}
            for r in records if not math.isnan(r.ttft)}


def _loss(profile: Profile, results: Path,
          fit: dict[str, dict[tuple[str, int], dict[str, Any]]]) -> float:
    err = 0.0
    for config, real in fit.items():
        sim = replay(profile, results, config)
        err += sum((math.log(sim[k]["ttft_s"]) - math.log(v["ttft_s"])) ** 2
                   for k, v in real.items())
    return err


#: Grid of the fitted fixed latencies (seconds): coarse, then 1 ms around the best.
COARSE = [i / 100 for i in range(31)]
FINE_STEP, FINE_HALF = 0.001, 10


def fit_fixed(base: Profile, results: Path,
              fit: dict[str, dict[tuple[str, int], dict[str, Any]]], *,
              coarse: list[float] = COARSE, fine_half: int = FINE_HALF,
              rounds: int = 2) -> Profile:
    """Coordinate search over (P's fixed latency, `d_direct`'s fixed part)."""
    cur = {"prefill_fixed_s": 0.05, "d_direct_fixed_s": 0.05}

    def loss(**kw: float) -> float:
        return _loss(base.model_copy(update={**cur, **kw}), results, fit)

    for grid in ("coarse", "fine"):
        for _ in range(rounds):
            for key in ("prefill_fixed_s", "d_direct_fixed_s"):
                values = (coarse if grid == "coarse" else
                          [max(0.0, cur[key] + FINE_STEP * i)
                           for i in range(-fine_half, fine_half + 1)])
                cur[key] = min(dict.fromkeys(values), key=lambda v: (loss(**{key: v}), v))
    return base.model_copy(update=cur)


def fit_profile(results: Path = QUIET, fit_set: frozenset[str] | None = None, *,
                name: str = "cpu-demo", **search: Any) -> Profile:
    """This machine's profile from the fit half of `results` (see the module docstring)."""
    fit_set = split_conversations(results)[0] if fit_set is None else fit_set
    fit = observed(results, fit_set)
    base = measured_profile(fit, name=name)
    prof = fit_fixed(base, results, fit, **search)
    n = sum(len(v) for v in fit.values())
    return prof.model_copy(update={"source": (
        f"{base.source}; P and d_direct fixed latencies fitted to {n} requests of the fit "
        f"half ({', '.join(sorted(fit_set, key=_workload_index))}) of {results.parent.name}")})


@functools.cache
def machine_profile() -> Profile:
    return fit_profile()


# ------------------------------------------------------------------ the check


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q * 100)) if values else math.nan


def _stats(ttft: dict[tuple[str, int], float]) -> dict[str, float]:
    all_, later = list(ttft.values()), [v for (_, t), v in ttft.items() if t > 0]
    return {"n": len(all_), "p50": _pct(all_, 0.5), "p90": _pct(all_, 0.9),
            "later_p50": _pct(later, 0.5), "later_p90": _pct(later, 0.9)}


def compare(profile: Profile, results: Path, conversations: frozenset[str], *,
            set_name: str) -> list[dict[str, Any]]:
    """Real vs simulated TTFT of `conversations`, per replayed configuration present."""
    real_all = observed(results, conversations)
    rows = []
    for config in REPLAYED:
        if config not in real_all:
            continue
        sim_all = replay(profile, results, config)
        real = {k: v["ttft_s"] for k, v in real_all[config].items()}
        sim = {k: sim_all[k]["ttft_s"] for k in real}
        rs, ss = _stats(real), _stats(sim)
        row: dict[str, Any] = {"set": set_name, "run": results.parent.name, "config": config,
                               "conversations": sorted(conversations, key=_workload_index),
                               "n": rs["n"], "real": rs, "sim": ss,
                               "err": {k: ss[k] / rs[k] - 1 for k in rs if k != "n"},
                               "real_paths": dict(sorted(_count(
                                   real_all[config][k]["path"] for k in real).items())),
                               "sim_paths": dict(sorted(_count(
                                   sim_all[k]["path"] for k in real).items())),
                               "real_by_turn": _by_turn(real), "sim_by_turn": _by_turn(sim)}
        rows.append(row)
    return rows


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[str(i)] = out.get(str(i), 0) + 1
    return out


def _by_turn(ttft: dict[tuple[str, int], float]) -> dict[int, float]:
    turns: dict[int, list[float]] = {}
    for (_, t), v in ttft.items():
        turns.setdefault(t, []).append(v)
    return {t: statistics.median(v) for t, v in sorted(turns.items())}


@dataclass(frozen=True)
class Check:
    """One comparison: a profile fitted on `fit_set` of the quiet run, judged on
    `judged` conversations of `results`."""

    fit_set: frozenset[str]
    results: Path
    judged: frozenset[str]
    in_sample: bool = False

    @property
    def held_out(self) -> bool:
        """No judged request is one the fit saw."""
        return self.results != QUIET or not (self.judged & self.fit_set)


def plan() -> list[Check]:
    """The checks `validate` runs: the seeded split's held-out half and the other quiet
    run; the same with the halves swapped (a second, independent fold); and, marked in
    sample, the seeded fit half itself."""
    fit_set, held = split_conversations(QUIET)
    c1_all = frozenset(r["conversation"] for c in _configs(QUIET_C1) for r in c["records"])
    return [Check(fit_set, QUIET, held), Check(fit_set, QUIET_C1, c1_all),
            Check(held, QUIET, fit_set), Check(held, QUIET_C1, c1_all),
            Check(fit_set, QUIET, fit_set, in_sample=True)]


def _names(convs: frozenset[str]) -> str:
    return ", ".join(sorted(convs, key=_workload_index))


def validate() -> dict[str, Any]:
    checks = plan()
    profiles = {checks[0].fit_set: machine_profile()}
    rows = []
    for chk in checks:
        assert chk.held_out != chk.in_sample, chk
        if chk.fit_set not in profiles:
            profiles[chk.fit_set] = fit_profile(QUIET, chk.fit_set)
        prof = profiles[chk.fit_set]
        for r in compare(prof, chk.results, chk.judged,
                         set_name="in sample" if chk.in_sample else "held out"):
            r["fit_on"] = _names(chk.fit_set)
            r["judged_on"] = ("all (other run)" if chk.results != QUIET
                              else _names(chk.judged))
            rows.append(r)
    fit_set, held = checks[0].fit_set, checks[0].judged
    return {"fit_run": QUIET.parent.name, "other_run": QUIET_C1.parent.name,
            "fit_set": sorted(fit_set, key=_workload_index),
            "held_out": sorted(held, key=_workload_index), "split_seed": SPLIT_SEED,
            "profile": profiles[fit_set].model_dump(),
            "swapped_profile": profiles[held].model_dump(), "rows": rows}
