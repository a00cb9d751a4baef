"""Property tests: a token decodes to exactly the claims it was issued with, or not at all."""

from __future__ import annotations

import string

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kvagent.protocol import MAX_TOKEN_BYTES
from kvagent_server.router.auth.cache_token import (
    TokenClaims,
    TokenCodec,
    TokenError,
    verify_binding,
)
from kvagent_server.router.auth.keys import KeyRing

RING = KeyRing({"k1": b"1" * 32, "k2": b"2" * 32}, "k2")
CODEC = TokenCodec(RING)
NOW = 1_800_000_000
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

names = st.text(min_size=1, max_size=40)
session_ids = st.text(alphabet=string.ascii_letters + string.digits + "._:-", min_size=1,
                      max_size=128)
claims_st = st.builds(
    dict, tenant=names, session=session_ids,
    handle=st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1,
                   max_size=32),
    iat=st.integers(0, NOW), exp=st.integers(NOW + 1, NOW + 10_000),
)


@FUZZ
@given(claims=claims_st)
def test_round_trip_is_exact(claims: dict) -> None:
    token = CODEC.encode(**claims)
    assert len(token.encode()) <= MAX_TOKEN_BYTES
    assert CODEC.decode(token, now=NOW) == TokenClaims(kid="k2", **claims)


@FUZZ
@given(claims=claims_st, data=st.data())
def test_any_edit_decodes_to_the_original_claims_or_fails(claims: dict, data: st.DataObject
                                                          ) -> None:
    """Tokens never decode to claims they were not issued for."""
    token = CODEC.encode(**claims)
    pos = data.draw(st.integers(0, len(token)))
    cut = data.draw(st.integers(0, 4))
    insert = data.draw(st.text(alphabet=string.ascii_letters + string.digits + "-_.=",
                               max_size=4))
    edited = token[:pos] + insert + token[pos + cut:]
    assume(edited != token)
    try:
        decoded = CODEC.decode(edited, now=NOW)
    except TokenError as exc:
        assert exc.reason in {"malformed", "bad_signature", "unknown_key"}
    else:  # pragma: no cover - only reachable if the edit was a no-op in disguise
        raise AssertionError(f"edited token {edited!r} decoded to {decoded!r}")


@FUZZ
@given(junk=st.text(max_size=300))
def test_arbitrary_text_never_decodes(junk: str) -> None:
    try:
        CODEC.decode(junk, now=NOW)
    except TokenError:
        return
    raise AssertionError(f"{junk!r} decoded")


@FUZZ
@given(junk=st.binary(max_size=200))
def test_arbitrary_payload_with_fake_mac_never_decodes(junk: bytes) -> None:
    import base64

    payload = base64.urlsafe_b64encode(junk).rstrip(b"=").decode()
    mac = base64.urlsafe_b64encode(bytes(32)).rstrip(b"=").decode()
    try:
        CODEC.decode(f"kva1.{payload}.{mac}", now=NOW)
    except TokenError as exc:
        assert exc.reason in {"malformed", "bad_signature", "unknown_key"}
        return
    raise AssertionError("decoded")


@FUZZ
@given(a=claims_st, b=claims_st)
def test_binding_only_accepts_the_issuing_tenant_and_session(a: dict, b: dict) -> None:
    claims = CODEC.decode(CODEC.encode(**a), now=NOW)
    verdict = verify_binding(claims, b["tenant"], b["session"])
    if (a["tenant"], a["session"]) == (b["tenant"], b["session"]):
        assert verdict is None
    elif a["tenant"] != b["tenant"]:
        assert verdict == "other_tenant"
    else:
        assert verdict == "other_session"


@FUZZ
@given(claims=claims_st)
def test_tokens_of_another_ring_never_verify(claims: dict) -> None:
    other = TokenCodec(KeyRing({"k2": b"x" * 32}, "k2"))
    try:
        CODEC.decode(other.encode(**claims), now=NOW)
    except TokenError as exc:
        assert exc.reason == "bad_signature"
        return
    raise AssertionError("a token signed with another key verified")
