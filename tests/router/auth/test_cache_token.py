"""The cache-token codec: round trip, every kind of damage, keys, expiry, size."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from kvagent.protocol import MAX_TOKEN_BYTES
from kvagent_server.router.auth.cache_token import (
    TOKEN_PREFIX,
    TokenClaims,
    TokenCodec,
    TokenError,
    verify_binding,
)
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.settings import RouterSettings

KEY_A = b"A" * 32
KEY_B = b"B" * 32
NOW = 1_800_000_000


def ring(kid: str = "k1", key: bytes = KEY_A) -> KeyRing:
    return KeyRing({kid: key}, kid)


def issue(codec: TokenCodec, **overrides: object) -> str:
    claims = {"tenant": "acme", "session": "conv-42", "handle": "h_abc123",
              "iat": NOW, "exp": NOW + 420} | overrides
    return codec.encode(**claims)  # type: ignore[arg-type]


def reason(codec: TokenCodec, token: str, now: float = NOW + 1) -> str:
    with pytest.raises(TokenError) as info:
        codec.decode(token, now=now)
    return info.value.reason


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(payload: dict, key: bytes = KEY_A) -> str:
    """A token signed like the codec signs, with an arbitrary payload."""
    signed = f"kva1.{b64(json.dumps(payload, separators=(',', ':')).encode())}"
    mac = hmac.new(key, signed.encode(), hashlib.sha256).digest()
    return f"{signed}.{b64(mac)}"


GOOD_WIRE = {"k": "k1", "t": "acme", "s": "conv-42", "h": "h1", "i": NOW, "e": NOW + 60}


# ------------------------------------------------------------------ round trip


def test_round_trip_returns_the_issued_claims() -> None:
    codec = TokenCodec(ring())
    token = issue(codec)
    assert codec.decode(token, now=NOW + 1) == TokenClaims(
        kid="k1", tenant="acme", session="conv-42", handle="h_abc123", iat=NOW, exp=NOW + 420)


def test_format_is_prefix_payload_mac_in_urlsafe_alphabet() -> None:
    token = issue(TokenCodec(ring()))
    prefix, payload, mac = token.split(".")
    assert prefix == TOKEN_PREFIX == "kva1"
    assert len(base64.urlsafe_b64decode(mac + "=" * (-len(mac) % 4))) == 32
    assert set(payload + mac) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))) == {
        "k": "k1", "t": "acme", "s": "conv-42", "h": "h_abc123", "i": NOW, "e": NOW + 420}


def test_unicode_tenant_and_session_round_trip() -> None:
    codec = TokenCodec(ring())
    token = issue(codec, tenant="Zürich-团队", session="s:1.2-3_x")
    claims = codec.decode(token, now=NOW)
    assert (claims.tenant, claims.session) == ("Zürich-团队", "s:1.2-3_x")
    token.encode("ascii")  # the token itself stays ASCII


def test_realistic_token_is_far_below_the_limit() -> None:
    token = issue(TokenCodec(ring()), session="s" * 128, handle="h" * 22)
    assert len(token) < 400


# ------------------------------------------------------------------ damage


def test_every_single_byte_change_is_rejected() -> None:
    codec = TokenCodec(ring())
    token = issue(codec)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.="
    for i, original in enumerate(token):
        for replacement in alphabet:
            if replacement == original:
                continue
            damaged = token[:i] + replacement + token[i + 1:]
            assert reason(codec, damaged) in {"malformed", "bad_signature", "unknown_key"}, (
                i, replacement)


def test_every_bit_flip_is_rejected() -> None:
    codec = TokenCodec(ring())
    raw = bytearray(issue(codec).encode())
    for i in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            try:
                text = flipped.decode("ascii")
            except UnicodeDecodeError:
                text = flipped.decode("latin-1")
            assert reason(codec, text) in {"malformed", "bad_signature", "unknown_key"}


def test_every_truncation_and_extension_is_rejected() -> None:
    codec = TokenCodec(ring())
    token = issue(codec)
    for n in range(len(token)):
        assert reason(codec, token[:n]) in {"malformed", "bad_signature"}
    for suffix in ("A", "=", ".", ".x", "AA", "\n", " "):
        assert reason(codec, token + suffix) in {"malformed", "bad_signature"}
    for prefix in (" ", "x", "."):
        assert reason(codec, prefix + token) in {"malformed", "bad_signature"}


def test_swapped_parts_between_two_valid_tokens_are_rejected() -> None:
    codec = TokenCodec(ring())
    t1 = issue(codec, handle="h1")
    t2 = issue(codec, handle="h2")
    p1, p2 = t1.split(".")[1], t2.split(".")[1]
    m1, m2 = t1.split(".")[2], t2.split(".")[2]
    assert reason(codec, f"kva1.{p1}.{m2}") == "bad_signature"
    assert reason(codec, f"kva1.{p2}.{m1}") == "bad_signature"


def test_noncanonical_base64_of_the_same_mac_is_rejected() -> None:
    codec = TokenCodec(ring())
    token = issue(codec)
    head, mac = token.rsplit(".", 1)
    # 32 bytes -> 43 chars; the last char carries 2 unused bits. Setting them spells
    # the same bytes differently; a strict decoder refuses the second spelling.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(mac[-1])
    other = alphabet[last ^ 1]
    assert reason(codec, f"{head}.{mac[:-1]}{other}") == "malformed"


@pytest.mark.parametrize("bad", [
    "", ".", "..", "kva1", "kva1.", "kva1..", "kva1.abc", "kva2.e30.AAAA", "KVA1.e30.AAAA",
    "kva1.e30.AAAA.AAAA", "kva1.!!!.AAAA", "kva1.e30=.AAAA", "kva1.e30.", "kva1..AAAA",
    "kva1.e30.A", "kva1.e30.AAAAA", "kva1.e30+/.AAAA", "kva1.é30.AAAA",
])
def test_garbage_is_malformed(bad: str) -> None:
    assert reason(TokenCodec(ring()), bad) == "malformed"


def test_non_string_input_is_malformed() -> None:
    with pytest.raises(TokenError) as info:
        TokenCodec(ring()).decode(b"kva1.x.y", now=NOW)  # type: ignore[arg-type]
    assert info.value.reason == "malformed"


def test_oversize_token_is_too_long_before_any_parsing() -> None:
    codec = TokenCodec(ring())
    assert reason(codec, "kva1." + "A" * MAX_TOKEN_BYTES + ".x") == "too_long"
    assert reason(codec, "x" * (MAX_TOKEN_BYTES + 1)) == "too_long"
    # exactly at the limit is parsed (and here found malformed, not too long)
    assert reason(codec, "x" * MAX_TOKEN_BYTES) == "malformed"


def test_encode_refuses_a_token_over_the_limit() -> None:
    with pytest.raises(ValueError, match="limit"):
        issue(TokenCodec(ring()), session="s" * 2000)


def test_encode_refuses_inconsistent_claims() -> None:
    codec = TokenCodec(ring())
    with pytest.raises(ValueError):
        issue(codec, exp=NOW - 1)
    with pytest.raises(ValueError):
        issue(codec, tenant="")


# ------------------------------------------------------------------ signed but wrong


def test_a_correctly_signed_payload_still_needs_every_field_and_type() -> None:
    codec = TokenCodec(ring())
    assert codec.decode(forge(GOOD_WIRE), now=NOW).handle == "h1"
    missing = {k: v for k, v in GOOD_WIRE.items() if k != "h"}
    extra = GOOD_WIRE | {"x": 1}
    for payload in (missing, extra, GOOD_WIRE | {"i": "1"}, GOOD_WIRE | {"e": True},
                    GOOD_WIRE | {"e": 1.5}, GOOD_WIRE | {"t": ""}, GOOD_WIRE | {"h": 3},
                    GOOD_WIRE | {"i": NOW + 100}, GOOD_WIRE | {"i": -1}):
        assert reason(codec, forge(payload), now=NOW) == "malformed", payload


def test_payload_that_is_not_an_object_is_malformed() -> None:
    codec = TokenCodec(ring())
    for body in (b"[]", b"1", b"null", b'"k1"', b"{", b"\xff\xfe"):
        signed = f"kva1.{b64(body)}"
        mac = b64(hmac.new(KEY_A, signed.encode(), hashlib.sha256).digest())
        assert reason(codec, f"{signed}.{mac}") == "malformed"


# ------------------------------------------------------------------ keys


def test_wrong_key_is_a_bad_signature() -> None:
    token = issue(TokenCodec(ring("k1", KEY_A)))
    assert reason(TokenCodec(ring("k1", KEY_B)), token) == "bad_signature"


def test_unknown_key_id() -> None:
    token = issue(TokenCodec(ring("old", KEY_A)))
    assert reason(TokenCodec(ring("new", KEY_A)), token) == "unknown_key"


def test_rotated_ring_signs_with_new_key_and_still_verifies_old_tokens() -> None:
    old_ring = ring("k1", KEY_A)
    old_token = issue(TokenCodec(old_ring))
    new_ring = old_ring.rotated("k2", KEY_B)
    codec = TokenCodec(new_ring)
    new_token = issue(codec)
    assert codec.decode(old_token, now=NOW).kid == "k1"
    assert codec.decode(new_token, now=NOW).kid == "k2"
    # a router that has not rotated yet cannot verify the new key's tokens
    assert reason(TokenCodec(old_ring), new_token) == "unknown_key"
    # once the old key is retired its tokens stop verifying
    assert reason(TokenCodec(new_ring.without("k1")), old_token) == "unknown_key"


def test_key_id_in_payload_cannot_pick_another_key() -> None:
    ring2 = KeyRing({"k1": KEY_A, "k2": KEY_B}, "k1")
    codec = TokenCodec(ring2)
    token = issue(codec)
    _, payload, mac = token.split(".")
    wire = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    # re-point kid at the other key but keep the MAC made with KEY_A
    relabeled = b64(json.dumps(wire | {"k": "k2"}, separators=(",", ":")).encode())
    assert reason(codec, f"kva1.{relabeled}.{mac}") == "bad_signature"


def test_keyring_from_settings_uses_first_key_and_verifies_all() -> None:
    settings = RouterSettings(signing_keys={"b2": "y" * 32, "a1": "x" * 32})
    keyring = KeyRing.from_settings(settings)
    assert keyring.active_kid == "b2"
    assert keyring.key("a1") == b"x" * 32
    assert TokenCodec(keyring).decode(issue(TokenCodec(keyring)), now=NOW).kid == "b2"


def test_keyring_generate_is_random_and_without_settings_keys() -> None:
    a, b = KeyRing.generate(), KeyRing.from_settings(RouterSettings())
    assert a.active_kid != b.active_kid
    assert a.key(a.active_kid) != b.key(b.active_kid)
    assert reason(TokenCodec(b), issue(TokenCodec(a))) == "unknown_key"


@pytest.mark.parametrize(("keys", "active"), [
    ({}, "k"), ({"k": b"short"}, "k"), ({"bad kid": KEY_A}, "bad kid"),
    ({"k.1": KEY_A}, "k.1"), ({"k": KEY_A}, "other"),
])
def test_keyring_rejects_bad_configuration(keys: dict, active: str) -> None:
    with pytest.raises(ValueError):
        KeyRing(keys, active)


def test_keyring_repr_hides_key_material() -> None:
    text = repr(ring("k1", b"secret-secret-secret"))
    assert "secret" not in text and "k1" in text


def test_rotation_cannot_redefine_an_existing_kid() -> None:
    with pytest.raises(ValueError):
        ring("k1", KEY_A).rotated("k1", KEY_B)
    with pytest.raises(ValueError):
        ring("k1", KEY_A).without("k1")


# ------------------------------------------------------------------ expiry and binding


def test_expiry_boundary() -> None:
    codec = TokenCodec(ring())
    token = issue(codec, iat=NOW, exp=NOW + 10)
    assert codec.decode(token, now=NOW + 9.999).exp == NOW + 10
    assert reason(codec, token, now=NOW + 10) == "expired"
    assert reason(codec, token, now=NOW + 10_000) == "expired"


def test_expiry_is_checked_only_after_the_signature() -> None:
    """An expired forgery says bad_signature, not expired: no oracle on valid claims."""
    codec = TokenCodec(ring())
    token = issue(codec, exp=NOW + 1)
    forged = token[:-2] + ("AA" if token[-2:] != "AA" else "BA")
    assert reason(codec, forged, now=NOW + 100) in {"bad_signature", "malformed"}


def test_verify_binding_is_the_callers_check() -> None:
    codec = TokenCodec(ring())
    claims = codec.decode(issue(codec), now=NOW)
    assert verify_binding(claims, "acme", "conv-42") is None
    assert verify_binding(claims, "globex", "conv-42") == "other_tenant"
    assert verify_binding(claims, "acme", "conv-43") == "other_session"
    assert verify_binding(claims, "globex", "conv-43") == "other_tenant"
    assert verify_binding(claims, "acme", "conv-4") == "other_session"
    assert verify_binding(claims, "acme", "conv-42 ") == "other_session"
