"""A seeded, bounded slice of the differential fuzz (tools/fuzz) on the shared bundle:
agent conversations Hypothesis draws, every turn ≡ its prompt recomputed under a fresh salt
(0 cached), reused tokens never past the verified common prefix. Its negative control
hands P shifted blocks and must find mismatches. The long run is tools/fuzz/run.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from benchmarks.api import CASES, EDIT_TEXTS, Runner, Target

from .e2e_helpers import ALPHA_KEY, BETA_KEY, E2E

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Every operation once, always run first (the generated examples add random mixes).
EVERY_OP: list[tuple[Any, ...]] = [
    ("tool", "compact"), ("edit", 0, EDIT_TEXTS[0]), ("retry",), ("race",),
    ("truncate", 40), ("strip", 1), ("delete", 0), ("fork", "Ok."), ("long",),
    ("tool", "spaced_sorted")]


def target(e: E2E, *, shift: bool = False) -> Target:
    # Besides the throwaway salt the router gives a shifted turn: the control's sessions
    # live under another tenant than the tests after it.
    return Target.demo(e.base_url, e.prefill_url, e.model, BETA_KEY if shift else ALPHA_KEY,
                       shift_blocks=shift)


@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@example(ops=EVERY_OP)
@given(ops=CASES)
def test_fuzz_reuse_equals_recompute(e2e: E2E, ops: list[tuple[Any, ...]]) -> None:
    with httpx.Client() as client:
        runner = Runner(target(e2e), client)
        runner.run_case(ops)
    stats = runner.stats.as_dict()
    print("fuzz case:", ops, stats)
    assert stats["mismatches"] == 0 and stats["bound_violations"] == 0, stats


def test_fuzz_negative_control_finds_mismatches(e2e: E2E) -> None:
    """With shifted blocks handed to P, the same checks must fail."""
    with httpx.Client() as client:
        runner = Runner(target(e2e, shift=True), client)
        runner.run_case([("long",), ("tool", "as_sent"), ("long",), ("tool", "compact")])
    stats = runner.stats.as_dict()
    print("fuzz negative control:", stats)
    assert stats["pd_reuse_turns"] > 0, stats
    assert stats["mismatches"] > 0, stats
