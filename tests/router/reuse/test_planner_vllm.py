"""The planner's P-leg params against vLLM's own block pairing (vLLM installed; no node)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from kvagent_server.router.reuse.transfer import reuse_transfer_params
from test_planner import BS, CACHED, USER2, make_handle, plan


def _p_side_pairing(params: dict, prompt_len: int, local_cached_blocks: int,
                    apply_prefix_caching) -> list[int]:
    """Which D block each P block is filled from, following vLLM 0.32's P side.

    Scheduler: count = min(remote_num_tokens, prompt) - locally_computed external tokens,
    allocated as new (unhashed) blocks after the local prefix-cache hit. Worker: the
    remote list is end-trimmed to the local list (`_apply_prefix_caching`).
    """
    computed = local_cached_blocks * BS
    count = min(params["remote_num_tokens"], prompt_len) - computed
    if count <= 0:
        return []
    local = list(range(local_cached_blocks, math.ceil((computed + count) / BS)))
    _, remote = apply_prefix_caching([local], [params["remote_block_ids"][0]])
    return list(remote[0])


@pytest.mark.vllm
@pytest.mark.parametrize("local_cached_blocks", [0, 1, 3, 6, 7])
def test_p_pulls_exactly_the_blocks_of_the_reused_positions(local_cached_blocks: int) -> None:
    """Checked against vLLM's own pairing code, including a negative control."""
    base_worker = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
        reason="vLLM is not installed")
    fake_self = SimpleNamespace(_has_mamba=False)

    def apply(local: list[list[int]], remote: list[list[int]]) -> tuple:
        return base_worker.NixlBaseConnectorWorker._apply_prefix_caching(
            fake_self, local, remote, 1, 1)

    h = make_handle(CACHED)  # 118 tokens of KV in 8 blocks
    prompt = CACHED + USER2
    p = plan(prompt, h)
    assert p.reuse_tokens == 112  # 7 blocks
    d_blocks = h.kv_transfer_params["remote_block_ids"][0]
    params = reuse_transfer_params(h, p.reuse_tokens)
    pulled = _p_side_pairing(params, len(prompt), local_cached_blocks, apply)
    # P block for position-block b must come from D's block b, for b in [cached, 7)
    assert pulled == d_blocks[local_cached_blocks:7]
    # Negative control: forwarding D's params uncut pairs P with the wrong D blocks.
    uncut = dict(h.kv_transfer_params, remote_num_tokens=p.reuse_tokens)
    if local_cached_blocks < 7:
        assert _p_side_pairing(uncut, len(prompt), local_cached_blocks, apply) != (
            d_blocks[local_cached_blocks:7])
