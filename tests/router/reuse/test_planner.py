"""The reuse planner: what may be reused (never wrong KV), the P-leg params, path choice."""

from __future__ import annotations

import copy
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvagent_server.router.reuse import transfer
from kvagent_server.router.reuse.paths import CostModel, LinearCost, PathCosts, choose_path
from kvagent_server.router.reuse.planner import ReusePlan, common_prefix_len, plan_reuse
from kvagent_server.router.reuse.transfer import (
    release_transfer_params,
    retained_tokens,
    reuse_transfer_params,
)
from kvagent_server.router.store.handle import Handle

NOW = 1_800_000_000.0
BS = 16


def d_params(n_tokens: int, block_size: int = BS, groups: int = 1, *, flat: bool = False,
             seed: int = 0) -> dict:
    """kv_transfer_params shaped like vLLM 0.32's decode node returns them."""
    rng = random.Random(seed)
    n_blocks = math.ceil(n_tokens / block_size)
    ids = [rng.sample(range(10_000), n_blocks) for _ in range(groups)]
    return {
        "do_remote_prefill": False, "do_remote_decode": True,
        "remote_block_ids": ids[0] if flat else ids,
        "remote_engine_id": "d-engine", "remote_request_id": "chatcmpl-1",
        "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1, "dcp_size": 1,
        "pp_size": 1, "remote_num_tokens": n_tokens, "remote_blocks_expiry_time": 123.5,
        "transfer_mode": "READ",
    }


def make_handle(token_ids: list[int], *, block_size: int = BS, computed: int | None = None,
                params: dict | None = None, **overrides: object) -> Handle:
    """A handle as D leaves it: KV for every token but the last sampled one."""
    n = len(token_ids) - 1 if computed is None else computed
    fields = {"handle_id": "h1", "tenant": "acme", "session": "s1", "decode_node": "d0",
              "decode_epoch": "e1",
              "kv_transfer_params": params if params is not None else d_params(n, block_size),
              "token_ids": token_ids, "block_size": block_size, "created_at": NOW - 10,
              "expires_at": NOW + 400} | overrides
    return Handle(**fields)  # type: ignore[arg-type]


def plan(prompt: list[int], handle: Handle | None, threshold: int = 0, **kw: object
         ) -> ReusePlan:
    return plan_reuse(prompt, handle, threshold=threshold, now=NOW, **kw)  # type: ignore[arg-type]


# A synthetic chat transcript as token ids: distinct ranges so a mismatch is a mismatch.
SYSTEM = list(range(1000, 1040))          # 40
USER1 = list(range(2000, 2030))           # 30
ASSIST_HDR = [7, 8, 9]                    # 3
THINK = [50] + list(range(3000, 3018)) + [51]  # <think> ... </think>: 20
ANSWER = list(range(4000, 4025))          # 25
EOS = [2]
END_TURN = [3, 4]
USER2 = list(range(5000, 5030))
TURN1_PROMPT = SYSTEM + USER1 + ASSIST_HDR          # 73 tokens
TURN1_OUTPUT = THINK + ANSWER + EOS                 # 46 tokens
CACHED = TURN1_PROMPT + TURN1_OUTPUT                # 119 tokens, KV for 118


# ------------------------------------------------------------------ common prefix


@pytest.mark.parametrize(("a", "b", "n"), [
    ([], [], 0), ([1], [], 0), ([1, 2], [1, 2], 2), ([1, 2, 3], [1, 2], 2),
    ([1, 2], [1, 3], 1), ([0], [1], 0), (list(range(5000)), list(range(5000)), 5000),
    (list(range(5000)), [*range(4321), -1], 4321), (list(range(1025)), list(range(1024)), 1024),
])
def test_common_prefix_len(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)
    assert common_prefix_len(tuple(a), b) == n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=1500), st.lists(st.integers(0, 3), max_size=1500))
def test_common_prefix_len_matches_the_naive_definition(a: list[int], b: list[int]) -> None:
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b) == naive


# ------------------------------------------------------------------ the conversations


def test_exact_continuation_reuses_every_whole_block_of_the_cache() -> None:
    prompt = CACHED + END_TURN + USER2 + ASSIST_HDR
    p = plan(prompt, make_handle(CACHED), threshold=64)
    # KV exists for 118 tokens (the last sampled token, EOS, was never fed back).
    assert (p.reason, p.reuse_tokens, p.common_prefix, p.cached_tokens) == ("hit", 112, 118, 118)


def test_stripped_reasoning_reuses_only_the_previous_prompt() -> None:
    """A chat template that drops <think>..</think> from history (vLLM #43094)."""
    prompt = TURN1_PROMPT + ANSWER + EOS + END_TURN + USER2 + ASSIST_HDR
    p = plan(prompt, make_handle(CACHED), threshold=64)
    assert (p.reason, p.common_prefix, p.reuse_tokens) == ("prefix_partial", 73, 64)


def test_rerendered_tool_call_reuses_up_to_the_first_changed_token() -> None:
    call = [60, *range(6000, 6040), 61]  # <tool_call>{json}</tool_call>
    cached = TURN1_PROMPT + call + EOS
    rerendered = [60, *range(6000, 6010), 999, *range(6011, 6040), 61]  # spacing differs
    prompt = TURN1_PROMPT + rerendered + END_TURN + [70, 71, 72] + ASSIST_HDR
    p = plan(prompt, make_handle(cached), threshold=0)
    assert p.common_prefix == 73 + 11
    assert p.reuse_tokens == 80 and p.reason == "prefix_partial"


def test_edit_in_the_middle_falls_below_threshold() -> None:
    prompt = list(CACHED) + USER2
    prompt[50] = 77777
    p = plan(prompt, make_handle(CACHED), threshold=64)
    assert (p.reason, p.reuse_tokens, p.common_prefix) == ("below_threshold", 0, 50)
    p = plan(prompt, make_handle(CACHED), threshold=16)
    assert (p.reason, p.reuse_tokens) == ("prefix_partial", 48)


def test_prompt_shorter_than_the_cache() -> None:
    p = plan(CACHED[:60], make_handle(CACHED))
    # common 60, at least one token left to compute -> 59 usable -> 48 aligned
    assert (p.reason, p.reuse_tokens, p.common_prefix) == ("prefix_partial", 48, 60)


def test_identical_prompt_leaves_one_token_to_compute() -> None:
    # the same turn-1 prompt again (a retry): 73 tokens, 72 usable, 64 aligned
    assert plan(TURN1_PROMPT, make_handle(CACHED)).reuse_tokens == 64
    # the prompt equals the cached tokens exactly and is block aligned: 128 tokens
    tokens = list(range(128))
    h = make_handle(tokens, computed=128)
    p = plan(tokens, h)
    assert (p.reuse_tokens, p.reason) == (112, "hit")  # never all 128


def test_divergence_at_the_first_token_and_inside_the_first_block() -> None:
    other = [42] + CACHED[1:]
    assert plan(other, make_handle(CACHED)).reason == "diverged_at_0"
    inside = CACHED[:5] + [42] + CACHED[6:]
    p = plan(inside, make_handle(CACHED), threshold=0)
    assert (p.reason, p.reuse_tokens, p.common_prefix) == ("below_threshold", 0, 5)


@pytest.mark.parametrize(("common", "prompt_len", "expected"), [
    (15, 100, 0), (16, 100, 16), (17, 100, 16), (31, 100, 16), (32, 100, 32),
    (33, 100, 32), (64, 100, 64), (64, 65, 64), (64, 64, 48), (65, 65, 64), (16, 16, 0),
    (16, 17, 16), (1, 2, 0), (0, 1, 0),
])
def test_block_alignment_edges(common: int, prompt_len: int, expected: int) -> None:
    cached = list(range(200))
    prompt = cached[:common] + [-1] * (prompt_len - common)
    prompt = [t if t >= 0 else 99_999 for t in prompt]
    p = plan(prompt, make_handle(cached), threshold=0)
    assert p.reuse_tokens == expected
    assert p.reuse_tokens % BS == 0
    assert p.reuse_tokens <= min(common, prompt_len - 1) or p.reuse_tokens == 0


def test_reuse_is_capped_by_what_d_computed_not_by_what_it_returned() -> None:
    tokens = list(range(100))
    # D reports KV for only 40 tokens (e.g. a short stop): never reuse past that
    h = make_handle(tokens, computed=40)
    p = plan(tokens + [1000], h)
    assert (p.cached_tokens, p.reuse_tokens, p.reason) == (40, 32, "hit")


def test_empty_prompt_reuses_nothing() -> None:
    assert plan([], make_handle(CACHED)).reuse_tokens == 0


@pytest.mark.parametrize(("threshold", "expected"), [(0, 112), (64, 112), (112, 112),
                                                     (113, 0), (10_000, 0)])
def test_threshold(threshold: int, expected: int) -> None:
    p = plan(CACHED + USER2, make_handle(CACHED), threshold=threshold)
    assert p.reuse_tokens == expected
    assert p.reason == ("hit" if expected else "below_threshold")


def test_prefill_block_size_aligns_to_both_nodes() -> None:
    tokens = list(range(180))  # KV for 179
    assert plan(tokens + [999], make_handle(tokens)).reuse_tokens == 176
    p = plan(tokens + [999], make_handle(tokens), prefill_block_size=32)
    assert p.reuse_tokens == 160  # lcm(16, 32) = 32
    p = plan(tokens + [999], make_handle(tokens), prefill_block_size=24)
    assert p.reuse_tokens == 144  # lcm(16, 24) = 48
    with pytest.raises(ValueError):
        plan(tokens, make_handle(tokens), prefill_block_size=0)


# ------------------------------------------------------------------ refusals


def test_refusal_reasons_in_precedence_order() -> None:
    h = make_handle(CACHED)
    prompt = CACHED + USER2
    assert plan(prompt, h, enabled=False).reason == "reuse_disabled"
    assert plan(prompt, h, rejected="expired").label == "token_rejected:expired"
    assert plan(prompt, None).reason == "no_handle"
    assert plan(prompt, h, tenant="globex").reason == "other_tenant"
    assert plan(prompt, h, tenant="acme", session="s2").reason == "other_session"
    assert plan(prompt, h, tenant="acme", session="s1").reason == "hit"
    expired = make_handle(CACHED, expires_at=NOW)
    assert plan(prompt, expired).reason == "expired"
    assert plan(prompt, h, node_epoch="e2").reason == "stale_epoch"
    assert plan(prompt, h, node_epoch="e1").reason == "hit"
    assert plan(prompt, h, node_healthy=False).reason == "node_unhealthy"
    for refused in (plan(prompt, h, enabled=False), plan(prompt, None),
                    plan(prompt, h, node_healthy=False)):
        assert refused.reuse_tokens == 0


@pytest.mark.parametrize("mutate", [
    lambda p: p.pop("remote_num_tokens"),
    lambda p: p.update(remote_num_tokens=True),
    lambda p: p.update(remote_num_tokens="118"),
    lambda p: p.update(remote_num_tokens=-1),
    lambda p: p.pop("remote_block_ids"),
    lambda p: p.update(remote_block_ids=[]),
    lambda p: p.update(remote_block_ids="1,2"),
    lambda p: p.update(remote_block_ids=[[1, 2], "x"]),
    lambda p: p.update(remote_block_ids=[[1, "2"]]),
    # a sliding-window group exports only its in-window tail: not position-aligned
    lambda p: p.update(remote_block_ids=[p["remote_block_ids"][0], [5, 6]]),
    # a Mamba group exports one state slot
    lambda p: p.update(remote_block_ids=[p["remote_block_ids"][0], [9]]),
])
def test_unusable_kv_layouts_are_refused(mutate) -> None:
    params = d_params(118)
    mutate(params)
    p = plan(CACHED + USER2, make_handle(CACHED, params=params))
    assert (p.reason, p.reuse_tokens) == ("unsupported_kv_layout", 0)


def test_extra_trailing_blocks_are_tolerated() -> None:
    params = d_params(118)
    params["remote_block_ids"][0].append(4242)  # e.g. a lookahead slot
    assert plan(CACHED + USER2, make_handle(CACHED, params=params)).reuse_tokens == 112


# ------------------------------------------------------------------ P-leg params


def test_reuse_params_cut_every_group_to_the_reused_blocks() -> None:
    params = d_params(118, groups=2)
    h = make_handle(CACHED, params=params)
    out = reuse_transfer_params(h, 64)
    assert out["remote_block_ids"] == [params["remote_block_ids"][0][:4],
                                       params["remote_block_ids"][1][:4]]
    assert out["remote_num_tokens"] == 64
    assert (out["do_remote_decode"], out["do_remote_prefill"]) == (True, False)
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                "tp_size", "dcp_size", "pp_size", "remote_blocks_expiry_time",
                "transfer_mode"):
        assert out[key] == params[key]


def test_reuse_params_do_not_touch_the_handle() -> None:
    h = make_handle(CACHED)
    before = copy.deepcopy(h.kv_transfer_params)
    out = reuse_transfer_params(h, 64)
    out["remote_block_ids"][0].append(1)
    assert h.kv_transfer_params == before


def test_reuse_params_keep_a_flat_block_list_flat() -> None:
    params = d_params(118, flat=True)
    out = reuse_transfer_params(make_handle(CACHED, params=params), 32)
    assert out["remote_block_ids"] == params["remote_block_ids"][:2]


@pytest.mark.parametrize("n", [0, -16, 8, 17, 128, 10_000])
def test_reuse_params_refuse_unaligned_or_excess_counts(n: int) -> None:
    with pytest.raises(ValueError):
        reuse_transfer_params(make_handle(CACHED), n)


def test_reuse_params_refuse_an_unusable_layout() -> None:
    params = d_params(118)
    del params["remote_num_tokens"]
    with pytest.raises(ValueError):
        reuse_transfer_params(make_handle(CACHED, params=params), 16)


def test_fresh_and_release_params() -> None:
    assert transfer.fresh() == {"do_remote_decode": True, "do_remote_prefill": False}
    h = make_handle(CACHED)
    rel = release_transfer_params(h)
    assert rel["remote_num_tokens"] == 0
    assert rel["remote_block_ids"] == h.kv_transfer_params["remote_block_ids"]
    assert (rel["do_remote_decode"], rel["do_remote_prefill"]) == (True, False)
    assert h.kv_transfer_params["remote_num_tokens"] == 118


# ------------------------------------------------------------------ planner properties


tokens_st = st.lists(st.integers(0, 5), min_size=0, max_size=300)


@settings(max_examples=500, deadline=None)
@given(cached=tokens_st, prompt=tokens_st, bs=st.sampled_from([1, 2, 4, 16, 32]),
       threshold=st.integers(0, 96), computed_gap=st.integers(0, 3))
def test_plan_never_reuses_beyond_the_verified_prefix(cached: list[int], prompt: list[int],
                                                      bs: int, threshold: int,
                                                      computed_gap: int) -> None:
    computed = max(0, len(cached) - computed_gap)
    h = make_handle(cached, block_size=bs, computed=computed,
                    params=d_params(computed, bs)) if cached else None
    p = plan(prompt, h, threshold=threshold)
    common = common_prefix_len(prompt, cached)
    assert p.reuse_tokens % bs == 0
    assert p.reuse_tokens <= common
    assert p.reuse_tokens <= computed
    assert p.reuse_tokens < max(len(prompt), 1)
    assert p.reuse_tokens == 0 or p.reuse_tokens >= threshold
    assert prompt[:p.reuse_tokens] == cached[:p.reuse_tokens]
    # and it is the longest such prefix: nothing reusable is left on the table
    best = min(common, computed, max(len(prompt) - 1, 0)) // bs * bs
    assert p.reuse_tokens == (best if best >= threshold and best > 0 else 0)
    if p.reuse_tokens:
        out = reuse_transfer_params(h, p.reuse_tokens)  # type: ignore[arg-type]
        assert out["remote_num_tokens"] == p.reuse_tokens
        assert all(len(g) == p.reuse_tokens // bs for g in out["remote_block_ids"])


# ------------------------------------------------------------------ path choice


def reuse_plan(n: int) -> ReusePlan:
    return ReusePlan(reuse_tokens=n, reason="hit", common_prefix=n, cached_tokens=n)


@pytest.mark.parametrize(("reason", "path"), [
    ("no_handle", "pd_fresh"), ("reuse_disabled", "pd_fresh"),
    ("token_rejected", "recompute"), ("other_session", "recompute"),
    ("diverged_at_0", "recompute"), ("below_threshold", "recompute"),
    ("stale_epoch", "recompute"), ("expired", "recompute"),
])
def test_no_reuse_paths(reason: str, path: str) -> None:
    p = ReusePlan(reuse_tokens=0, reason=reason)
    assert choose_path(p, 100, PathCosts(), skip_prefill_max_tokens=None, d_healthy=True) == path


def test_fixed_skip_threshold() -> None:
    costs = PathCosts()
    kw = {"costs": costs, "d_healthy": True}
    assert choose_path(reuse_plan(2048), 2100, skip_prefill_max_tokens=64, **kw) == "d_direct"
    assert choose_path(reuse_plan(2048), 2112, skip_prefill_max_tokens=64, **kw) == "d_direct"
    assert choose_path(reuse_plan(2048), 2113, skip_prefill_max_tokens=64, **kw) == "pd_reuse"
    assert choose_path(reuse_plan(2048), 2049, skip_prefill_max_tokens=0, **kw) == "pd_reuse"
    assert choose_path(reuse_plan(2048), 2049, costs=costs, d_healthy=False,
                       skip_prefill_max_tokens=10_000) == "pd_reuse"


def test_cost_based_choice_follows_the_estimates() -> None:
    slow_d = PathCosts(d_direct=LinearCost(fixed_s=0, per_token_s=1.0))
    fast_d = PathCosts(d_direct=LinearCost(fixed_s=0, per_token_s=1e-9))
    kw = {"skip_prefill_max_tokens": None, "d_healthy": True}
    assert choose_path(reuse_plan(2048), 2100, slow_d, **kw) == "pd_reuse"
    assert choose_path(reuse_plan(2048), 2100, fast_d, **kw) == "d_direct"
    # priors: a small delta skips P, a large one does not
    assert choose_path(reuse_plan(2048), 2080, PathCosts(), **kw) == "d_direct"
    assert choose_path(reuse_plan(2048), 6000, PathCosts(), **kw) == "pd_reuse"


def test_choose_path_rejects_a_plan_without_a_token_to_compute() -> None:
    with pytest.raises(ValueError):
        choose_path(reuse_plan(64), 64, PathCosts(), skip_prefill_max_tokens=None,
                    d_healthy=True)


def test_cost_model_learns_lines_from_observations() -> None:
    model = CostModel(alpha=0.2)
    assert model.snapshot() == PathCosts()  # priors until something is observed
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(100, 3000)
        model.observe("pd_fresh", n, 0.2 + 0.001 * n)
    for _ in range(200):
        reused, computed = rng.randint(500, 4500), rng.randint(50, 250)
        model.observe("pd_reuse", computed, 0.2 + 0.001 * computed + 0.05 + 1e-5 * reused,
                      reused_tokens=reused)
        model.observe("d_direct", computed, 0.01 + 0.002 * computed)
    costs = model.snapshot()
    assert costs.prefill.fixed_s == pytest.approx(0.2, rel=1e-6)
    assert costs.prefill.per_token_s == pytest.approx(0.001, rel=1e-6)
    assert costs.pull.fixed_s == pytest.approx(0.05, rel=1e-4)
    assert costs.pull.per_token_s == pytest.approx(1e-5, rel=1e-4)
    assert costs.d_direct.fixed_s == pytest.approx(0.01, rel=1e-4)
    assert costs.d_direct.per_token_s == pytest.approx(0.002, rel=1e-6)
    assert costs.d_direct.samples == 200
    # break-even between d_direct and pd_reuse at 4000 reused tokens:
    # 0.01 + 0.002 d  vs  0.25 + 0.001 d + 0.04  ->  d = 280
    kw = {"skip_prefill_max_tokens": None, "d_healthy": True}
    assert choose_path(reuse_plan(4000), 4270, costs, **kw) == "d_direct"
    assert choose_path(reuse_plan(4000), 4290, costs, **kw) == "pd_reuse"


def test_cost_model_keeps_the_prior_slope_without_spread_in_sizes() -> None:
    model = CostModel()
    for _ in range(20):
        model.observe("pd_fresh", 1000, 2.0)
    prefill = model.snapshot().prefill
    assert prefill.per_token_s == PathCosts().prefill.per_token_s
    assert prefill(1000) == pytest.approx(2.0)


def test_cost_model_adapts_to_a_slowdown() -> None:
    model = CostModel(alpha=0.3)
    for i in range(50):
        model.observe("d_direct", 100 + i % 7 * 50, 0.001 * (100 + i % 7 * 50))
    before = model.snapshot().d_direct(300)
    for i in range(50):
        model.observe("d_direct", 100 + i % 7 * 50, 0.01 * (100 + i % 7 * 50))
    after = model.snapshot().d_direct(300)
    assert after == pytest.approx(3.0, rel=0.05) and before == pytest.approx(0.3, rel=0.05)


@pytest.mark.parametrize(("path", "tokens", "seconds"), [
    ("pd_fresh", -1, 1.0), ("pd_fresh", 1, -1.0), ("pd_fresh", 1, float("nan")),
    ("nope", 1, 1.0),
])
def test_cost_model_rejects_bad_observations(path: str, tokens: int, seconds: float) -> None:
    with pytest.raises(ValueError):
        CostModel().observe(path, tokens, seconds)  # type: ignore[arg-type]


def test_retained_tokens_helper() -> None:
    assert retained_tokens(make_handle(CACHED)) == 118
    assert retained_tokens(make_handle(CACHED, computed=200, params=d_params(200))) == 119


def test_paths_are_the_wire_protocols_paths() -> None:
    from typing import get_args

    from kvagent.protocol import PATHS
    from kvagent_server.router.reuse.paths import Path

    assert get_args(Path) == PATHS


def test_plan_label_is_the_reason_or_reason_and_detail() -> None:
    from kvagent_server.router.reuse.planner import Reason, ReusePlan

    assert ReusePlan(reuse_tokens=0, reason=Reason.NO_HANDLE).label == "no_handle"
    assert ReusePlan(reuse_tokens=0, reason=Reason.TOKEN_REJECTED,
                     detail="bad_signature").label == "token_rejected:bad_signature"


def test_shifted_blocks_shift_every_group_by_half_and_leave_the_input_alone() -> None:
    """The negative control's wrong blocks: slot i holds block i-n//2, so half of the blocks
    P attends to are not the conversation's (a permutation would change nothing)."""
    from kvagent_server.router.reuse.transfer import shifted_blocks

    h = make_handle(CACHED)
    params = reuse_transfer_params(h, 96)
    before = copy.deepcopy(params)
    out = shifted_blocks(params)
    assert params == before
    for got, orig in zip(out["remote_block_ids"], params["remote_block_ids"], strict=True):
        k = len(orig) // 2
        assert got == [orig[0]] * (k + 1) + orig[1:len(orig) - k]
        assert len(set(orig) - set(got)) == k
    assert shifted_blocks({"remote_block_ids": [1, 2, 3]})["remote_block_ids"] == [1, 1, 2]
    assert shifted_blocks({"remote_block_ids": [1, 2, 3, 4, 5, 6]})["remote_block_ids"] == [
        1, 1, 1, 1, 2, 3]
    assert shifted_blocks({"remote_block_ids": [7]})["remote_block_ids"] == [7]


# ------------------------------------------------------- d_direct without /tokenize


def test_extension_plan_reuses_every_whole_block_d_holds() -> None:
    from kvagent_server.router.reuse.planner import Reason, extension_plan

    h = make_handle(list(range(100)))  # D holds KV of 99 tokens
    p = extension_plan(h, threshold=0)
    assert p.reuse_tokens == 99 // BS * BS and p.reason is Reason.HIT and not p.tokenized
    assert extension_plan(h, threshold=200).reason is Reason.BELOW_THRESHOLD
    bad = make_handle(list(range(100)), params={"remote_num_tokens": 99})
    assert extension_plan(bad, threshold=0).reason is Reason.UNSUPPORTED_KV_LAYOUT


def test_skip_tokenize_pays_within_a_fixed_threshold_only() -> None:
    from kvagent_server.router.reuse.paths import skip_tokenize_pays

    p = ReusePlan(reuse_tokens=1024, reason="hit")
    kw = {"tokenize_s": 0.01}
    assert skip_tokenize_pays(p, (10, 300), PathCosts(), skip_prefill_max_tokens=300, **kw)
    assert not skip_tokenize_pays(p, (10, 301), PathCosts(), skip_prefill_max_tokens=300,
                                  **kw)
    assert not skip_tokenize_pays(p, (10, 50), PathCosts(), skip_prefill_max_tokens=0, **kw)
    with pytest.raises(ValueError):
        skip_tokenize_pays(p, (0, 5), PathCosts(), skip_prefill_max_tokens=None, **kw)


def test_skip_tokenize_pays_while_d_direct_loses_less_than_the_tokenize() -> None:
    """With the cost model: skip unless somewhere in the range `pd_reuse` beats
    `d_direct` by more than the /tokenize the skip saves."""
    from kvagent_server.router.reuse.paths import skip_tokenize_pays

    # d_direct: 1 ms/token on D; pd_reuse: 20 ms fixed + 0.5 ms/token on P (pull free):
    # they cross at 40 tokens, and pd_reuse leads by 10 ms at 60.
    costs = PathCosts(prefill=LinearCost(fixed_s=0.02, per_token_s=5e-4),
                      pull=LinearCost(fixed_s=0.0, per_token_s=0.0),
                      d_direct=LinearCost(fixed_s=0.0, per_token_s=1e-3))
    p = ReusePlan(reuse_tokens=1024, reason="hit")
    pays = lambda lo, hi, t: skip_tokenize_pays(
        p, (lo, hi), costs, t, skip_prefill_max_tokens=None)
    assert pays(5, 39, 0.0)  # d_direct everywhere
    assert not pays(5, 60, 0.005)  # pd_reuse 10 ms ahead at 60 > a 5 ms tokenize
    assert pays(5, 60, 0.0101)  # ... but not by more than a 10.1 ms one
    assert choose_path(p, 1024 + 60, costs, skip_prefill_max_tokens=None,
                       d_healthy=True) == "pd_reuse"
