"""The format-forced common prefix per turn (no server, a fake renderer)."""

from __future__ import annotations

from benchmarks.api import WorkloadSpec, common_prefix, generate, shared_by_turn


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def _words(messages: list[dict], tools: list[dict]) -> list[int]:
    """An append-only renderer: one id per message."""
    return [hash((m["role"], str(m.get("content")))) % 10_000 for m in messages]


def _moving(messages: list[dict], tools: list[dict]) -> list[int]:
    """A renderer that puts a marker before the last user message (like tools in Mistral's
    format): a new user message changes everything after the first one."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    ids = [hash((m["role"], str(m.get("content")))) % 10_000 for m in messages]
    return ids[:last_user] + [-1] + ids[last_user:]


def test_append_only_format_shares_every_previous_prompt() -> None:
    workload = generate(WorkloadSpec.quick(0))
    rows = shared_by_turn(workload, _words)
    for turn, prompt, shared in rows[1:]:
        assert 0 < shared < prompt, (turn, prompt, shared)
    previous = {t: p for t, p, _ in rows}
    assert all(shared == previous[t - 1] for t, _, shared in rows[1:])


def test_moving_marker_cuts_the_prefix_at_a_new_user_message() -> None:
    spec = WorkloadSpec.quick(0).model_copy(update={"user_turn_probability": 1.0})
    rows = shared_by_turn(generate(spec), _moving)
    # Turn k's history is system, user, then k (assistant, user) pairs: turn k+1 keeps only
    # the ids before turn k's marker (system, user 1, then k-1 pairs).
    for turn, _, shared in rows[1:]:
        assert shared == spec.conversations * (2 * turn - 1), turn
