"""The load mode's shell without vLLM: open-arrival sessions against a scripted endpoint,
the configurations it adds, and its CLI's schedule (real servers: see docs/benchmarks.md,
"Goodput under load")."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from kvagent_server.config import validate_config
from kvagent_server.router.turns.policy import CostModelPolicy, policy_for
from kvagent_server.vllm_plugin.env import DEFAULT_SPIN_MS, SPIN_ENV

from benchmarks.api import (
    ALL_CONFIGS,
    ALWAYS_SKIP_P,
    CONFIGS,
    STEP_BUDGET_ARG,
    ScheduledSession,
    WorkloadSpec,
    bundle_settings,
    cuda_plan,
    generate,
    load,
    run_sessions,
    shared_prefill_binds,
)


def _stream(text: str) -> str:
    chunks = [{"choices": [{"index": 0, "delta": {"content": text}}]},
              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1}}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


class SlowFor:
    """Answers at once, except requests of the sessions in `stall` (never, in practice)."""

    def __init__(self, stall: set[str]) -> None:
        self.stall = stall
        self.seen: list[tuple[str, float]] = []
        self.t0 = time.perf_counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        sid = request.headers["x-session-id"]
        self.seen.append((sid, time.perf_counter() - self.t0))
        if any(sid.endswith(s) for s in self.stall):
            await asyncio.sleep(30)
        return httpx.Response(200, text=_stream("ok"),
                              headers={"content-type": "text/event-stream"})


def sessions(n: int, turns: int, starts: list[float], think: list[float]
             ) -> list[ScheduledSession]:
    wl = generate(WorkloadSpec(conversations=n, turns=turns, system_prompt_tokens=20,
                               context_tokens=20, tool_result_tokens=(5, 10), max_tokens=4))
    return [ScheduledSession(c, s, think) for c, s in zip(wl.conversations, starts, strict=True)]


async def test_sessions_arrive_at_their_offsets_and_think_between_turns() -> None:
    ss = sessions(2, 3, [0.0, 0.3], [0.2, 0.1])
    ep = SlowFor(set())
    records, cancelled, wall = await run_sessions(
        "http://bench/v1", "m", ss, 4, config="c", run_id="r", deadline_s=10,
        transport=httpx.MockTransport(ep))
    assert cancelled == [] and len(records) == 6 and wall < 5
    by = {(r.conversation, r.turn): r for r in records}
    a, b = (s.conversation.id for s in ss)
    assert by[(b, 0)].start_s >= 0.3 > by[(a, 0)].start_s
    # turn 1 waits >= 0.2 s after turn 0 ends, turn 2 >= 0.1 s after turn 1
    assert by[(a, 1)].start_s >= by[(a, 0)].start_s + 0.2
    assert by[(a, 2)].start_s >= by[(a, 1)].start_s + 0.1
    assert {sid for sid, _ in ep.seen} == {f"r.{a}", f"r.{b}"}


async def test_deadline_cancels_running_sessions_and_keeps_finished_turns() -> None:
    ss = sessions(2, 2, [0.0, 0.0], [0.0])
    stalled = ss[1].conversation.id
    records, cancelled, wall = await run_sessions(
        "http://bench/v1", "m", ss, 4, config="c", run_id="r", deadline_s=0.5,
        transport=httpx.MockTransport(SlowFor({stalled})))
    assert cancelled == [stalled] and 0.5 <= wall < 5
    assert sorted((r.conversation, r.turn) for r in records) == [
        (ss[0].conversation.id, 0), (ss[0].conversation.id, 1)]


def test_load_configurations() -> None:
    assert set(CONFIGS) < set(ALL_CONFIGS)  # the multi-turn run's four are untouched
    kva, d_direct = ALL_CONFIGS["kvagent"], ALL_CONFIGS["kvagent_always_d_direct"]
    pd_reuse, two_p = ALL_CONFIGS["kvagent_always_pd_reuse"], ALL_CONFIGS["kvagent_2p"]
    assert kva.skip_prefill_max_tokens is None  # the cost model decides
    assert d_direct.skip_prefill_max_tokens == ALWAYS_SKIP_P and d_direct.reuse
    assert pd_reuse.skip_prefill_max_tokens == 0 and pd_reuse.reuse
    assert two_p.prefill_count == 2 and two_p.reuse
    assert all(n in ALL_CONFIGS for n in load.DEFAULT_CONFIGS)


def test_shared_prefill_binds() -> None:
    assert shared_prefill_binds([0, 1], 2) == (["0", "0"], "1")
    assert shared_prefill_binds([0, 1, 2, 3, 4], 3) == (["0-2", "0-2", "0-2"], "3-4")
    with pytest.raises(ValueError):
        shared_prefill_binds([0], 2)


@pytest.mark.parametrize("name", list(ALL_CONFIGS))
def test_bundle_settings_validate(name: str, tmp_path: Path) -> None:
    c = ALL_CONFIGS[name]
    if c.kind != "bundle":
        return
    n = 2 * c.prefill_count + 3
    cfg = validate_config(bundle_settings(c, tmp_path, list(range(9000, 9000 + n)),
                                          cores=[0, 1], kv_cache_gib=1,
                                          startup_timeout_s=60))
    assert cfg.prefill.count == c.prefill_count and cfg.router.reuse == c.reuse
    assert cfg.router.policy.model_dump() == c.router_policy()
    chosen = policy_for(cfg.router, c.topology)  # the policy takes every parameter set
    if isinstance(chosen, CostModelPolicy):
        assert chosen.costs.skip_prefill_max_tokens == c.skip_prefill_max_tokens
        assert chosen.counts_work == (c.queue_aware_paths is not False)
    assert cfg.router.server_timing and cfg.router.port == 9000 + n - 1
    assert cfg.prefill.prefix_caching == c.prefill_prefix_caching
    assert cfg.block_size == c.block_size
    assert cfg.prefill.extra_env == {**c.node_env, **c.prefill_env}
    assert cfg.decode.extra_env == c.node_env
    if c.prefill_count > 1:  # P nodes share core 0; D keeps core 1 as in 1P+1D
        assert cfg.prefill.cpu_binds == ["0", "0"] and cfg.decode.cpu_binds == ["1"]
    with pytest.raises(ValueError):
        bundle_settings(c, tmp_path, [1, 2], cores=[0, 1], kv_cache_gib=1,
                        startup_timeout_s=60)


def test_a_configurations_node_env_overrides_the_plugins_default(tmp_path: Path) -> None:
    """`node_env` reaches every node's environment over the plugin's own setting, and
    `prefill_env` only the P node's."""
    for name, want in (("kvagent_spin1", "1"), ("kvagent", str(DEFAULT_SPIN_MS))):
        nodes = cuda_plan.render_config(ALL_CONFIGS[name], tmp_path / name)["nodes"]
        assert [n["env"][SPIN_ENV] for n in nodes] == [want, want]
    nodes = cuda_plan.render_config(ALL_CONFIGS["kvagent_pspin1"], tmp_path / "p")["nodes"]
    assert {n["name"]: n["env"][SPIN_ENV] for n in nodes} == {
        "prefill-0": "1", "decode-0": str(DEFAULT_SPIN_MS)}
    assert DEFAULT_SPIN_MS != 1


def test_a_configurations_step_budget_and_pinning_reach_its_nodes(tmp_path: Path) -> None:
    """D's step budget and the pinning reach the bundle's settings and D's command line
    only; `node_args` the aggregated node's, after the run's own engine arguments."""
    def budget(args: list[str]) -> str | None:
        return args[args.index(STEP_BUDGET_ARG) + 1] if STEP_BUDGET_ARG in args else None

    def settings(name: str) -> dict:
        return bundle_settings(ALL_CONFIGS[name], tmp_path, list(range(9000, 9005)),
                               cores=[0, 1], kv_cache_gib=1, startup_timeout_s=60)

    old = validate_config(settings("kvagent_pin_off_d_steps_2048"))
    assert old.pin_processes is False and old.decode.max_num_batched_tokens == 2048
    assert old.decode.long_prefill_token_threshold == 0
    assert old.prefill.max_num_batched_tokens is None
    new = validate_config(settings("kvagent"))  # the bundle's defaults
    assert new.pin_processes is True and new.decode.max_num_batched_tokens is None
    assert new.decode.long_prefill_token_threshold is None
    steps_128 = validate_config(settings("kvagent_d_steps_128")).decode
    assert (steps_128.max_num_batched_tokens, steps_128.long_prefill_token_threshold) == (
        128, 0)
    p_cap = validate_config(settings("kvagent_p_cap512"))
    assert p_cap.prefill.long_prefill_token_threshold == 512
    assert p_cap.decode.long_prefill_token_threshold is None
    p_argv = {n["name"]: n["argv"] for n in cuda_plan.render_config(
        ALL_CONFIGS["kvagent_p_cap512"], tmp_path / "p")["nodes"]}["prefill-0"]
    assert p_argv[p_argv.index("--long-prefill-token-threshold") + 1] == "512"
    rendered = cuda_plan.render_config(ALL_CONFIGS["kvagent_d_steps_2048"], tmp_path / "c")
    nodes = {n["name"]: n["argv"] for n in rendered["nodes"]}
    assert budget(nodes["decode-0"]) == "2048" and budget(nodes["prefill-0"]) is None
    agg = cuda_plan.render_config(ALL_CONFIGS["aggregated_chunk256"], tmp_path / "a",
                                  engine_args=["-O0"])["nodes"][0]["argv"]
    assert budget(agg) == "256" and agg.index("-O0") < agg.index(STEP_BUDGET_ARG)


def test_cli_config_order_and_levels() -> None:
    names = [c.name for c in load.parse_configs("kvagent,aggregated,kvagent_2p")]
    assert names == ["aggregated", "kvagent", "kvagent_2p"]  # the probe's host first
    with pytest.raises(SystemExit):
        load.parse_configs("kvagent,nope")
    args = load.parser().parse_args(["--levels", "1,3"])
    assert args.levels == [1, 3] and args.level_s == 30 and args.turns == 4
    for bad in ("2,1", "0,1", "1,x", "1,1"):
        with pytest.raises(SystemExit):
            load.parser().parse_args(["--levels", bad])


def test_level_sessions_identical_for_every_configuration() -> None:
    args: argparse.Namespace = load.parser().parse_args(["--level-s", "60"])
    a, b = load.level_sessions(args, 4), load.level_sessions(args, 4)
    assert [(s.conversation, s.start_s, list(s.think_s)) for s in a] == [
        (s.conversation, s.start_s, list(s.think_s)) for s in b]
    assert all(len(s.think_s) == args.turns - 1 and len(s.conversation.turns) == args.turns
               for s in a)
    other = load.level_sessions(args, 8)
    assert {s.conversation.id for s in a}.isdisjoint(s.conversation.id for s in other)
    assert len(other) > len(a)  # twice the offered rate (same window)
