"""The rendered tier config against the installed vLLM: its parser, config classes and source.

Each fact `engine/tiers.py` relies on (why MultiConnector, why no engine_id in children, why no
--kv-offloading-size, why GPU only) is checked here against the real code, so an upgrade
that changes one fails loudly instead of starting a broken node.
"""

from __future__ import annotations

import copy
import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.engine import tiers as tiers_mod
from kvagent_server.engine.tiers import KVTiers, render_tiers

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")

SITE = Path(vllm.__file__).parent.parent

NIXL_D: dict[str, Any] = {
    "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
    "engine_id": "b-decode-0",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 480},
}


@pytest.fixture(scope="module")
def parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def both_tiers(tmp_path: Path, **kw: Any) -> KVTiers:
    return KVTiers.model_validate({"cpu": {"size_gib": 2},
                                  "disk": {"path": str(tmp_path / "kv"), "shared": True},
                                  "hash_seed": 1234, **kw})


def rendered_argv(t: KVTiers, base: dict[str, Any] | None) -> list[str]:
    out = render_tiers(t, role="decode", device="cuda", base_kv_transfer_config=base,
                       block_size=16)
    return ["--model", "/models/m", "--block-size", "16", "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(out.kv_transfer_config), *out.args]


def test_vllm_parser_accepts_the_rendered_node(parser: Any, tmp_path: Path) -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ns = parser.parse_args(rendered_argv(both_tiers(tmp_path, hash_algo="sha256_cbor"), NIXL_D))
    assert ns.prefix_caching_hash_algo == "sha256_cbor"
    assert ns.kv_offloading_size is None  # never: it would replace NIXL (see below)
    ktc = EngineArgs.from_cli_args(ns).kv_transfer_config
    assert isinstance(ktc, KVTransferConfig)
    assert ktc.kv_connector == "MultiConnector" and ktc.kv_role == "kv_consumer"
    assert ktc.engine_id == "b-decode-0"
    assert ktc.has_connector("NixlConnector") and ktc.has_connector("OffloadingConnector")
    assert ktc.is_kv_consumer and not ktc.is_kv_producer


def test_multiconnector_children_resolve_to_real_connectors(tmp_path: Path) -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    kv = render_tiers(both_tiers(tmp_path), role="decode", device="cuda",
                      base_kv_transfer_config=NIXL_D, block_size=16).kv_transfer_config
    assert kv is not None
    vc = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv))
    resolved = MultiConnector._get_connector_classes_and_configs(vc)
    (nixl_cls, nixl_vc), (off_cls, off_vc) = resolved
    assert issubclass(nixl_cls, NixlConnector) or nixl_cls.__name__.startswith("Nixl")
    assert off_cls is OffloadingConnector
    assert nixl_vc.kv_transfer_config.engine_id == "b-decode-0"
    assert off_vc.kv_transfer_config.engine_id == "b-decode-0"
    assert nixl_vc.kv_transfer_config.kv_role == "kv_consumer"
    assert nixl_vc.kv_transfer_config.kv_connector_extra_config["bidirectional_kv_xfer"]
    assert off_vc.kv_transfer_config.kv_role == "kv_both"


def test_nixl_and_offloading_agree_on_the_kv_layout(tmp_path: Path) -> None:
    """MultiConnector refuses children that need different KV cache layouts."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    kv = render_tiers(both_tiers(tmp_path), role="decode", device="cuda",
                      base_kv_transfer_config=NIXL_D, block_size=16).kv_transfer_config
    assert kv is not None
    vc = types.SimpleNamespace(
        kv_transfer_config=KVTransferConfig(**kv),
        model_config=types.SimpleNamespace(use_mla=False),
        attention_config=types.SimpleNamespace(hisparse_config=None))
    assert MultiConnector.get_required_kvcache_layout(vc) == "LBHNC"


def test_child_engine_id_would_crash_multiconnector() -> None:
    """Why render_tiers strips engine_id from the NIXL child."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    bad = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer",
                           engine_id="x", kv_connector_extra_config={"connectors": [NIXL_D]})
    with pytest.raises(TypeError, match="engine_id"):
        MultiConnector._get_connector_classes_and_configs(
            types.SimpleNamespace(kv_transfer_config=bad))


def test_kv_offloading_size_replaces_nixl() -> None:
    """Why the bundle never renders --kv-offloading-size beside NIXL."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.config.vllm import VllmConfig

    holder = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(kv_offloading_size=2.0,
                                           kv_offloading_backend="native"),
        kv_transfer_config=KVTransferConfig(**copy.deepcopy(NIXL_D)))
    VllmConfig._post_init_kv_transfer_config(holder)
    assert holder.kv_transfer_config.kv_connector != "NixlConnector"
    assert holder.kv_transfer_config.kv_role == "kv_both"


def test_tiering_spec_and_fs_tier_accept_the_rendered_keys(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import Locality
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    kv = render_tiers(both_tiers(tmp_path, cpu={"size_gib": 1, "eviction": "arc"}),
                      role="prefill", device="cuda", base_kv_transfer_config=None,
                      block_size=16).kv_transfer_config
    assert kv is not None
    extra = kv["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    for policy in ("lru", "arc"):  # every value CPUTier.eviction allows
        assert policy in CachePolicyFactory._registry
    assert extra["eviction_policy"] == "arc"
    (tier,) = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(tier)
    assert tier_cls.__name__ == "FileSystemTierManager"
    Locality(tier["locality"])
    params = inspect.signature(tier_cls.__init__).parameters
    kwargs = {k: v for k, v in tier.items() if k != "type"}
    assert set(kwargs) <= set(params), set(kwargs) - set(params)


def test_cpu_platform_refuses_native_offloading() -> None:
    """The error render_tiers raises early is the one vLLM would raise at first use."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip("a GPU platform: offloading works here")
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0",), 0),), worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False, extra_config={"cpu_bytes_to_use": 1 << 20},
        engine_id="e", model=OffloadingModelConfig("m", "float16"),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False))
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        CPUOffloadingSpec(cfg).get_worker(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("const", "needle"), [
    ("CPU_OFFLOAD_PLATFORM_CHECK", "current_platform.is_cuda_alike()"),
    ("LMCACHE_CUDA_DEVICE", 'torch.device(f"cuda:'),
    ("KV_OFFLOADING_SIZE_CLOBBERS", 'kv_offloading_backend == "native"'),
    ("MULTI_CONNECTOR_ENGINE_ID", "KVTransferConfig("),
    ("TIERING_NO_STORE_THRESHOLD", "store_threshold"),
])
def test_source_references_point_at_the_right_lines(const: str, needle: str) -> None:
    path, line = getattr(tiers_mod, const).rsplit(":", 1)
    text = (SITE / path).read_text().splitlines()[int(line) - 1]
    assert needle in text, f"{const}: {path}:{line} is now {text.strip()!r}"


def test_hash_algos_match_vllm() -> None:
    import typing

    from vllm.config.cache import PrefixCachingHashAlgo

    assert set(typing.get_args(PrefixCachingHashAlgo)) == set(
        typing.get_args(tiers_mod.HashAlgo))
