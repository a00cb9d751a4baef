"""No cache token, however forged, makes a node read someone else's blocks.

Two tenants with two sessions each hold live conversations. Hypothesis picks a requester
and a token from every token issued so far (live, consumed, other session's, other
tenant's) and mangles it: bit flips, truncation, junk, replay, re-signed for the wrong
tenant or session, expired, signed with an unknown key. The requester sends its next
turn with it. Oracle, from what the fake nodes recorded (not from the router's view):
every transfer handle the P leg received names blocks D retained for the requester's own
conversation (each conversation's first message carries an owner marker that ends up in
D's retained tokens); no fake node saw a wrong-KV read; the reply is clean and 200.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fakes import FakeCluster, Stack, decode_ids, router_stack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.keys import KeyRing
from reliability_support import LoopBridge, leaks

TENANTS = [{"name": "acme", "api_keys": ["sk-acme-0123456789"], "max_concurrent_streams": 8},
           {"name": "globex", "api_keys": ["sk-globex-9876543210"]}]
KEYS = {"acme": "sk-acme-0123456789", "globex": "sk-globex-9876543210"}
OWNERS = [(t, s) for t in ("acme", "globex") for s in ("s1", "s2")]
FILLER = "Context to keep: the quick brown fox jumps over the lazy dog. " * 3
OWNER_RE = re.compile(r"owner=(\w+)/(\w+);")
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."


@dataclass
class Conversation:
    tenant: str
    session: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages = [{"role": "user",
                          "content": f"owner={self.tenant}/{self.session}; {FILLER}"}]


@dataclass
class World:
    stack: Stack
    convs: dict[tuple[str, str], Conversation]
    #: Every token issued, with the conversation it was issued to.
    issued: list[tuple[str, tuple[str, str]]] = field(default_factory=list)
    latest: dict[tuple[str, str], str] = field(default_factory=dict)


async def send(world: World, owner: tuple[str, str], token: str | None) -> dict[str, Any]:
    """The owner's next turn, with `token`; checks the oracle on what the nodes received."""
    st_ = world.stack
    conv = world.convs[owner]
    if len(conv.messages) > 12:
        conv.reset()
    p = st_.prefill[0]
    seen = len(p.requests)
    headers = {"Authorization": f"Bearer {KEYS[owner[0]]}", "X-Session-ID": owner[1]}
    if token is not None:
        headers["X-KVAgent-Cache-Token"] = token
    body = {"model": "fake-model", "messages": conv.messages, "stream": True,
            "stream_options": {"include_usage": True}}
    r = await st_.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert not leaks(st_, r.content)
    for sent in p.requests[seen:]:
        params = sent.get("kv_transfer_params") or {}
        if not params.get("remote_block_ids"):
            continue  # a fresh P leg: reads nothing
        held = st_.cluster.retained[(params["remote_engine_id"], params["remote_request_id"])]
        marker = OWNER_RE.search(decode_ids(held.tokens))
        assert marker is not None and marker.groups() == owner, (
            f"P leg of {owner} was handed blocks of {marker and marker.groups()}")
    assert not st_.cluster.events_of("wrong_kv"), st_.cluster.events_of("wrong_kv")
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    last = json.loads(data[-1])
    kva = last["kvagent"]
    answer = "".join((json.loads(d)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                     for d in data[:-1] if json.loads(d).get("choices"))
    conv.messages += [{"role": "assistant", "content": answer},
                      {"role": "user", "content": f"and then? {len(conv.messages)}"}]
    if kva["cache_token"]:
        world.issued.append((kva["cache_token"], owner))
        world.latest[owner] = kva["cache_token"]
    return kva


def mangle(token: str, how: str, data: st.DataObject, world: World,
           requester: tuple[str, str], source: tuple[str, str]) -> str | None:
    """One hostile variant of `token` (None: send no token at all)."""
    codec: TokenCodec = world.stack.router.codec
    now = int(time.time())
    if how == "none":
        return None
    if how == "as_is":  # live, replayed, or another conversation's: whatever it is
        return token
    if how == "substitute":
        i = data.draw(st.integers(0, 4095)) % len(token)
        c = data.draw(st.sampled_from(ALPHABET))
        c = c if c != token[i] else ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)]
        return token[:i] + c + token[i + 1:]
    if how == "truncate":
        return token[:data.draw(st.integers(0, 4095)) % len(token)]
    if how == "extend":
        return token + data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=8))
    claims = codec.decode(token, now=now) if how != "junk" else None
    if how == "rebind":  # validly signed, but for the requester (handle of `source`)
        assert claims is not None
        return codec.encode(tenant=requester[0], session=requester[1], handle=claims.handle,
                            iat=now, exp=now + 60)
    if how == "expired":
        assert claims is not None
        return codec.encode(tenant=claims.tenant, session=claims.session,
                            handle=claims.handle, iat=now - 600, exp=now - 1)
    if how == "foreign_key":
        assert claims is not None
        other = TokenCodec(KeyRing({codec.keys.active_kid: secrets.token_bytes(32)},
                                   codec.keys.active_kid))
        return other.encode(tenant=requester[0], session=requester[1], handle=claims.handle,
                            iat=now, exp=now + 60)
    return data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=300))


MUTATIONS = ["none", "as_is", "substitute", "truncate", "extend", "rebind", "expired",
             "foreign_key", "junk"]


async def test_no_token_reads_another_conversations_blocks() -> None:
    cluster = FakeCluster()
    async with router_stack(cluster=cluster, tenants=TENANTS,
                            policy={"params": {"skip_prefill_max_tokens": 0}},
                            signing_keys={"k1": "0" * 32}) as stack:
        world = World(stack, {o: Conversation(*o) for o in OWNERS})
        for conv in world.convs.values():
            conv.reset()
            await send(world, (conv.tenant, conv.session), None)
        reused = {"n": 0}

        @settings(max_examples=60, deadline=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            requester = data.draw(st.sampled_from(OWNERS), label="requester")
            # An index, not sampled_from(world.issued): the pool grows between examples
            # and hypothesis needs the same draws to mean the same choices.
            pick = data.draw(st.integers(0, 1 << 16), label="source")
            token, source = world.issued[pick % len(world.issued)]
            how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
            if how in ("rebind", "expired", "foreign_key") and source == requester:
                # A token of the requester's own conversation re-signed for itself is
                # what the router itself would sign; forge only other conversations'.
                how = "junk"
            presented = mangle(token, how, data, world, requester, source)
            kva = loop_run(send(world, requester, presented))
            legit = presented is not None and presented == world.latest.get(requester)
            if kva["path"] in ("pd_reuse", "d_direct"):
                reused["n"] += 1
                # Only the requester's own token reuses (or none/empty: its latest handle).
                assert not presented or legit or (how == "as_is" and source == requester)

        loop_run = LoopBridge()
        await loop_run.start(run)
        assert reused["n"] > 0  # the oracle saw real reads, not just refusals



async def test_a_validly_signed_token_naming_another_sessions_handle_is_refused() -> None:
    """Even a token signed with the real key (a key holder's forgery) that binds this
    session to another session's handle neither reuses nor releases that handle."""
    async with router_stack(tenants=TENANTS, policy={"params": {"skip_prefill_max_tokens": 0}},
                            signing_keys={"k1": "0" * 32}) as stack:
        world = World(stack, {o: Conversation(*o) for o in OWNERS})
        for conv in world.convs.values():
            conv.reset()
        victim, thief = ("acme", "s1"), ("acme", "s2")
        await send(world, victim, None)
        await send(world, thief, None)
        codec: TokenCodec = stack.router.codec
        now = int(time.time())
        claims = codec.decode(world.latest[victim], now=now)
        forged = codec.encode(tenant="acme", session="s2", handle=claims.handle, iat=now,
                              exp=now + 60)
        kva = await send(world, thief, forged)  # the oracle in send() checks the P leg
        assert kva["path"] == "recompute"
