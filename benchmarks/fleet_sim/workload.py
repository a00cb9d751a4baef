"""Conversations the simulator replays: how many tokens each turn appends (pure).

A session's prompt at turn k is its prompt at turn k-1, the answer it got, and
`new_tokens[k]` new tokens (tool results, a user reply); turn 0's `new_tokens` is the
whole first prompt, of which `shared_prefix` tokens (system prompt and tool schemas) are
the same in every session.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class Script(BaseModel):
    model_config = ConfigDict(frozen=True)

    new_tokens: list[int] = Field(min_length=1)


class FleetSpec(BaseModel):
    """A steady population of agent sessions, each a conversation of `turns` turns that is
    replaced by a new one when it ends. Sizes in tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    sessions: int = Field(default=1000, ge=1)
    turns_per_s: float = Field(default=10.0, gt=0)
    duration_s: float = Field(default=600.0, gt=0)
    turns: int = Field(default=8, ge=1)
    shared_prefix: int = Field(default=1500, ge=0)
    context: tuple[int, int] = (3000, 6000)
    tail: tuple[int, int] = (120, 500)
    max_tokens: int = Field(default=24, ge=1)

    def script(self, rng: random.Random) -> Script:
        first = self.shared_prefix + rng.randint(*self.context)
        return Script(new_tokens=[first] + [rng.randint(*self.tail)
                                            for _ in range(self.turns - 1)])

    @property
    def think_s(self) -> float:
        """Mean gap between a session's turns that yields `turns_per_s` over the fleet."""
        return self.sessions / self.turns_per_s


def scripts_from_results(results_json: Path, *, config: str = "kvagent") -> tuple[
        list[Script], int, int, int]:
    """The conversations of a recorded multi-turn benchmark run, as scripts.

    Returns (scripts in the order the benchmark started them, concurrency, max_tokens,
    shared prefix): each turn's new tokens are its recorded `prompt_tokens` minus the
    previous prompt and answer.
    """
    named, conc, answer, shared = conversations_from_results(results_json, config=config)
    return [s for _, s in named], conc, answer, shared


def conversations_from_results(results_json: Path, *, config: str = "kvagent") -> tuple[
        list[tuple[str, Script]], int, int, int]:
    """As `scripts_from_results`, each script with its recorded conversation id (a
    replay's session `i` is the `i`-th of them). Reads only the workload side of the
    records (conversation, turn, prompt/completion/cached token counts), never their
    timings: the benchmark's driver starts conversations in workload order
    (`conv-<seed>-<index>`) as its semaphore frees a slot."""
    data = json.loads(Path(results_json).read_text())
    wl = data["workload"]
    answer = int(wl["max_tokens"])
    chosen = next(c for c in data["configs"] if c["name"] == config)
    convs: dict[str, list[dict]] = {}
    for r in chosen["records"]:
        convs.setdefault(r["conversation"], []).append(r)
    scripts = []
    for conv, records in convs.items():
        records.sort(key=lambda r: r["turn"])
        new, prev = [], 0
        for r in records:
            n = r["prompt_tokens"] - prev
            new.append(max(1, n))
            prev = r["prompt_tokens"] + (r.get("completion_tokens") or answer)
        scripts.append((conv, Script(new_tokens=new)))
    scripts.sort(key=lambda cs: _workload_index(cs[0]))
    # The shared prefix: what P had cached on the first turn of a later conversation.
    later_first = [r.get("cached_tokens") or 0 for c in convs.values() for r in c
                   if r["turn"] == 0]
    shared = max(later_first) if later_first else 0
    return scripts, int(wl["concurrency"]), answer, shared


def _workload_index(conversation: str) -> tuple[int, str]:
    tail = conversation.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, conversation)
