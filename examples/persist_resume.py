"""Persist a session to JSON, load it later (another process, another day), continue.

``Session.save`` writes the history, the session id and the options, including the last
answer's cache token and its expiry. A session loaded before that expiry sends the token
with its next turn, and the router reuses the KV the decode node kept. After it, the turn
is recomputed and nothing else changes. Tools and secrets are code, not data: pass them
again to ``Session.load``.

    kvagent-server up                  # in another shell
    python examples/persist_resume.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvagent import Session, TurnResult

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")

SYSTEM = "You are a patient tutor. Explain one idea per answer, in two sentences. " * 8


def main(base_url: str = BASE_URL, model: str = MODEL, path: str | Path | None = None
         ) -> tuple[list[TurnResult], list[TurnResult]]:
    """Two turns, save, load, two more turns; returns (before, after) answers."""
    path = Path(path or Path(tempfile.mkdtemp(prefix="kvagent-")) / "session.json")
    with Session(base_url, model, system=SYSTEM, max_tokens=32, temperature=0.0) as first:
        before = [first.send("What is a KV cache?"), first.send("Why is prefill expensive?")]
        first.save(path)
    print(f"saved {len(first.messages)} messages of {first.session_id} to {path} "
          f"(token: {'yes' if first.cache_token else 'no'})")

    # ... later, maybe in another process: the conversation picks up where it stopped.
    with Session.load(path, base_url=base_url) as resumed:
        assert resumed.session_id == first.session_id
        assert resumed.cache_token == first.cache_token
        after = [resumed.send("And decode?"), resumed.send("Summarise all three answers.")]
    for n, answer in enumerate([*before, *after], 1):
        usage = answer.usage
        print(f"turn {n}{' (resumed)' if n > len(before) else ''}: prompt="
              f"{usage.prompt_tokens if usage else '?'} cached="
              f"{usage.cached_tokens if usage else '?'} path={answer.path}")
    return before, after


if __name__ == "__main__":
    main()
