"""API keys to tenants: anonymous mode, key checks, salts, configuration errors."""

from __future__ import annotations

import logging

import pytest
from kvagent_server.router.auth.tenancy import (
    DEFAULT_TENANT,
    AuthError,
    TenantResolver,
    bearer_key,
    derive_cache_salt,
)
from kvagent_server.router.settings import RouterSettings, TenantSettings


def two_tenants() -> RouterSettings:
    return RouterSettings(tenants=[
        TenantSettings(name="acme", api_keys=["sk-acme-1", "sk-acme-2"],
                       max_concurrent_streams=8),
        TenantSettings(name="globex", api_keys=["sk-globex"], cache_salt="fixed-salt"),
    ])


def test_no_tenants_means_one_anonymous_tenant_and_no_key_check() -> None:
    resolver = TenantResolver(RouterSettings())
    assert resolver.anonymous
    for header in (None, "", "Bearer EMPTY", "Bearer anything", "garbage"):
        tenant = resolver.resolve(header)
        assert tenant.name == DEFAULT_TENANT
        assert tenant.cache_salt == derive_cache_salt(DEFAULT_TENANT)
        assert tenant.max_concurrent_streams == 64


def test_keys_map_to_their_tenant() -> None:
    resolver = TenantResolver(two_tenants())
    assert not resolver.anonymous
    assert resolver.resolve("Bearer sk-acme-1").name == "acme"
    assert resolver.resolve("Bearer sk-acme-2").name == "acme"
    assert resolver.resolve("bearer sk-globex").name == "globex"
    assert resolver.resolve("  BEARER   sk-globex  ").name == "globex"
    assert resolver.resolve("Bearer sk-acme-1").max_concurrent_streams == 8


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic sk-acme-1",
                                    "sk-acme-1", "Token sk-acme-1"])
def test_missing_key(header: str | None) -> None:
    with pytest.raises(AuthError) as info:
        TenantResolver(two_tenants()).resolve(header)
    assert info.value.reason == "missing_api_key"
    assert info.value.status_code == 401


@pytest.mark.parametrize("key", ["sk-acme", "sk-acme-10", "SK-ACME-1", "sk-acme-1 x",
                                 "sk-globe", "x" * 10_000, "ünïcode"])
def test_unknown_key_is_rejected_and_never_echoed(key: str) -> None:
    with pytest.raises(AuthError) as info:
        TenantResolver(two_tenants()).resolve(f"Bearer {key}")
    assert info.value.reason == "invalid_api_key"
    assert key not in str(info.value)


def test_cache_salt_is_configured_or_derived_deterministically() -> None:
    tenants = TenantResolver(two_tenants()).tenants
    assert tenants["globex"].cache_salt == "fixed-salt"
    assert tenants["acme"].cache_salt == derive_cache_salt("acme")
    # the same on every replica and restart: a fresh resolver derives the same salt
    assert TenantResolver(two_tenants()).tenants["acme"].cache_salt == tenants["acme"].cache_salt
    assert derive_cache_salt("acme") != derive_cache_salt("globex")
    assert derive_cache_salt("acme") != derive_cache_salt("acme ")
    assert len(derive_cache_salt("acme")) == 32


def test_configuration_errors_are_loud_and_do_not_leak_keys() -> None:
    with pytest.raises(ValueError, match="twice"):
        TenantResolver(RouterSettings(tenants=[TenantSettings(name="a", api_keys=["k1"]),
                                               TenantSettings(name="a", api_keys=["k2"])]))
    with pytest.raises(ValueError) as info:
        TenantResolver(RouterSettings(tenants=[TenantSettings(name="a", api_keys=["dup"]),
                                               TenantSettings(name="b", api_keys=["dup"])]))
    assert "dup" not in str(info.value)
    with pytest.raises(ValueError, match="no API key"):
        TenantResolver(RouterSettings(tenants=[TenantSettings(name="a")]))
    with pytest.raises(ValueError, match="empty"):
        TenantResolver(RouterSettings(tenants=[TenantSettings(name="a", api_keys=[""])]))


def test_keys_are_not_kept_in_clear_nor_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    resolver = TenantResolver(two_tenants())
    with pytest.raises(AuthError):
        resolver.resolve("Bearer sk-wrong-key")
    resolver.resolve("Bearer sk-acme-1")
    assert "sk-" not in caplog.text
    assert "sk-acme-1" not in repr(vars(resolver))
    assert "sk-acme-1" not in repr(resolver.resolve("Bearer sk-acme-1"))


@pytest.mark.parametrize(("header", "key"), [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Bearer a b", "a b"), (None, None),
    ("Bearer", None), ("Basic abc", None), ("", None),
])
def test_bearer_key(header: str | None, key: str | None) -> None:
    assert bearer_key(header) == key
