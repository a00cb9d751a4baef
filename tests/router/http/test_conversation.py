"""Which conversation a request continues: kvagent's id, agents' own ids, content.

Pure resolution first (`http.conversation`), then the router on fake P/D nodes: agents'
headers and caller-scoped content lookup make later turns reuse, subagents and threads
keep their own handles, and nothing crosses API keys.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fakes import router_stack
from kvagent_server.router.http.conversation import digest, from_agents
from kvagent_server.router.settings import RouterSettings, TenantSettings

SYSTEM = "You are a careful coding agent. Use tools when needed. " * 6
FRESH = ("pd_fresh", "d_fresh")  # a first turn: on P, or on D while P is busy
REUSED = ("pd_reuse", "d_direct")


def reused_later(paths: list[str]) -> bool:
    return paths[0] in FRESH and all(p in REUSED for p in paths[1:])


def key(headers: dict[str, str], body: dict[str, Any] | None = None) -> str | None:
    found = from_agents({k.lower(): v for k, v in headers.items()}, body or {})
    return None if found is None else found.key


# ------------------------------------------------------------------ pure resolution


def test_claude_code_subagents_are_branches_of_their_own() -> None:
    main = key({"X-Claude-Code-Session-Id": "s1"})
    sub_a = key({"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "a",
                 "X-Claude-Code-Parent-Agent-Id": "root"})
    sub_b = key({"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "b"})
    assert len({main, sub_a, sub_b}) == 3
    assert main == key({"x-claude-code-session-id": "s1"})  # header names are case-blind
    assert main is not None and "s1" not in main  # never stored raw


def test_codex_spellings_threads_windows_and_side_requests() -> None:
    base = {"session-id": "S", "thread-id": "T", "x-codex-window-id": "T:0"}
    root = key(base)
    assert root == key({"session_id": "S", "thread_id": "T", "x-codex-window-id": "T:0"})
    assert key({**base, "thread-id": "child"}) != root
    assert key({**base, "x-codex-window-id": "T:1"}) != root  # a new window
    compaction = json.dumps({"request_kind": "compaction", "thread_id": "T"})
    assert key({**base, "x-codex-turn-metadata": compaction}) != root
    turn = json.dumps({"request_kind": "turn"})
    assert key({**base, "x-codex-turn-metadata": turn}) == root
    assert key({**base, "x-codex-turn-metadata": "{not json"}) == root


def test_the_documented_order() -> None:
    cc = {"X-Claude-Code-Session-Id": "c"}
    codex = {"session-id": "x"}
    body = {"prompt_cache_key": "p", "metadata": {"user_id": json.dumps({"session_id": "m"})}}
    assert from_agents({k.lower(): v for k, v in {**cc, **codex}.items()}, body).source == (
        "claude_code")
    assert from_agents(codex, body).source == "codex"
    assert from_agents({"x-session-affinity": "o"}, body).source == "opencode"
    assert from_agents({}, body).source == "prompt_cache_key"
    assert from_agents({}, {"metadata": body["metadata"]}).source == "metadata_user_id"
    assert from_agents({}, {}) is None


@pytest.mark.parametrize(("user_id", "session"), [
    (json.dumps({"device_id": "d", "account_uuid": "a", "session_id": "s-1"}), "s-1"),
    ("user_abc123_account_9f_session_0b6c9c8e-1d2e-4a5b-8c7d-112233445566",
     "0b6c9c8e-1d2e-4a5b-8c7d-112233445566"),
    ("user_abc123", None),  # a person, not a conversation
    (json.dumps({"device_id": "d"}), None),
    ("{broken", None),
])
def test_metadata_user_id_session_part(user_id: str, session: str | None) -> None:
    found = key({}, {"metadata": {"user_id": user_id}})
    assert found == (None if session is None else f"mu-{digest(session)}")


# ------------------------------------------------------------------ through the router


def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "fake-model", "messages": messages, "max_tokens": 16}


async def converse(client: Any, first: str, turns: int, headers: dict[str, str]) -> list[str]:
    """A client that resends the whole history each turn; the paths of its turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": first}]
    paths = []
    for i in range(turns):
        resp = await client.post("/v1/chat/completions", json=chat(messages), headers=headers)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        paths.append(out["kvagent"]["path"])
        messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"{first} -- follow-up {i}"}]
    return paths


async def test_agent_headers_reuse_and_subagents_keep_their_own() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        main = {"X-Claude-Code-Session-Id": "cc-1"}
        sub = {**main, "X-Claude-Code-Agent-Id": "agent-7"}
        paths = await asyncio.gather(converse(st.client, "Fix the bug in parser.py", 3, main),
                                     converse(st.client, "Search the repo for TODOs", 3, sub))
        assert all(reused_later(p) for p in paths), paths
        assert not st.cluster.events_of("wrong_kv")


async def test_no_identity_reuses_by_content_each_conversation_its_own() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        runs = await asyncio.gather(*(converse(st.client, f"Task {n}: refactor module {n}", 3,
                                               {}) for n in range(3)))
        assert all(reused_later(p) for p in runs), runs
        assert not st.cluster.events_of("wrong_kv") and not st.cluster.open_leases()


async def test_content_reuse_stays_within_the_callers_key() -> None:
    settings = RouterSettings(
        tenants=[TenantSettings(name="t", api_keys=["key-a", "key-b"])],
        policy={"params": {"skip_prefill_max_tokens": 0}},
        nodes={"health_interval_s": 5.0, "kv_recompute_threshold": 64})
    async with router_stack(settings=settings) as st:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        a = {"Authorization": "Bearer key-a"}
        first = (await st.client.post("/v1/chat/completions", json=chat(messages),
                                      headers=a)).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "More"}]
        other = await st.client.post("/v1/chat/completions", json=chat(messages),
                                     headers={"Authorization": "Bearer key-b"})
        assert other.json()["kvagent"]["path"] in FRESH  # key b never finds a's turn
        same = await st.client.post("/v1/chat/completions", json=chat(messages), headers=a)
        assert same.json()["kvagent"]["path"] in REUSED


async def test_content_reuse_off_is_todays_behaviour() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            content_reuse=False) as st:
        assert all(p in FRESH for p in await converse(st.client, "Plan a trip", 2, {}))


# ------------------------------------------------------------------ content keys


def test_content_keys_find_the_held_turn_a_prompt_extends() -> None:
    from kvagent_server.router.reuse.content import BLOCK_TOKENS, held_keys, lookup_keys

    prompt = list(range(1000, 1000 + 5 * BLOCK_TOKENS + 7))
    answer = list(range(50, 50 + 2 * BLOCK_TOKENS + 3))
    held = set(held_keys(len(prompt), prompt + answer, "salt"))
    assert len(held) == 3
    # The next prompt renders the answer's end its own way (its last whole block differs):
    # found one block earlier, the longest prefix first.
    later = prompt + answer[:BLOCK_TOKENS] + [7, 7, 7] + list(range(9000, 9100))
    keys = lookup_keys(later, "salt")
    first = next(i for i, k in enumerate(keys) if k in held)
    assert len(keys) - first == (len(prompt) + len(answer)) // BLOCK_TOKENS - 1
    # An edited system prompt (first block) or another tenant's salt finds nothing.
    assert not set(lookup_keys([1, *later[1:]], "salt")) & held
    assert not set(lookup_keys(later, "other")) & held
    assert held_keys(3, [1, 2, 3], "salt") == [] and lookup_keys([1, 2], "salt") == []


async def test_sharing_only_a_system_prompt_takes_no_other_conversations_turn() -> None:
    """A first turn that shares another conversation's system prompt (and so, when that
    one's prompt ended inside a block, its last indexed block) must not claim its handle:
    the other conversation's next turn still reuses. Padding moves where the prompts end
    relative to the index's blocks."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        for pad in range(0, 32, 4):
            system = SYSTEM + "x" * pad
            a = [{"role": "system", "content": system}, {"role": "user", "content": "A?"}]
            first = (await st.client.post("/v1/chat/completions", json=chat(a))).json()
            b = [{"role": "system", "content": system}, {"role": "user", "content": "B?"}]
            other = (await st.client.post("/v1/chat/completions", json=chat(b))).json()
            assert other["kvagent"]["path"] in FRESH, (pad, other["kvagent"])
            a += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "More."}]
            again = (await st.client.post("/v1/chat/completions", json=chat(a))).json()
            assert again["kvagent"]["path"] in REUSED, (pad, again["kvagent"])
        assert not st.cluster.events_of("wrong_kv")


def test_index_entries_newest_first_bounded_one_per_session() -> None:
    from kvagent_server.router.reuse.content import MAX_ENTRIES, add_entry, entries, extends

    value = None
    for i in range(MAX_ENTRIES + 3):
        value = add_entry(value, 100 + i, f"s{i}")
    value = add_entry(value, 500, "s5")  # a session's newer turn replaces its older line
    got = entries(value)
    assert got[0] == (500, "s5") and len(got) == MAX_ENTRIES
    assert [s for _, s in got].count("s5") == 1 and ("s0" not in [s for _, s in got])
    assert entries(b"junk\n12 \nx y") == []
    assert extends([1, 2, 3, 4], [1, 2, 3, 9, 9], 3) and not extends([1, 2, 4], [1, 2, 3], 3)
    assert not extends([1, 2], [1, 2, 3], 3)
