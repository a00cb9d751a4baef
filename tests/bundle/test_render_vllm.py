"""Every rendered node command parses with vLLM's own parser (vLLM installed)."""

from __future__ import annotations

import pytest
from kvagent_server.bundle.render import BUILTIN_DEFAULT_MAX_TOKENS, HostFacts, PlanInputs, plan
from kvagent_server.config import validate_config


@pytest.fixture(scope="module")
def vllm_parser():
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed"
        pytest.skip(f"vLLM is not importable ({exc!r}); install the engine: "
                    "kvagent-server install-engine")

    def parse(args: list[str]):
        return make_arg_parser(FlexibleArgumentParser()).parse_args(args)

    return parse


@pytest.mark.vllm
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_parses_every_rendered_command(vllm_parser, device: str) -> None:
    from kvagent_server.bundle.inputs import gather_inputs

    cfg = validate_config({
        "topology": "pd", "device": device, "prefill": {"count": 2, "prefix_caching": False},
        "decode": {"count": 2}, "block_size": 32, "max_model_len": 4096,
        "cpu_pinning": False,
    })
    real = gather_inputs(cfg, build_model=False)  # demo model args + plugin args, as `up`
    inputs = PlanInputs(host=HostFacts(cpu_cores=(0, 1), gpu_count=4), model=real.model,
                        python=real.python, role_env=real.role_env, role_args=real.role_args)
    bp = plan(cfg, inputs)
    for node in bp.nodes:
        assert node.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
        args = vllm_parser(list(node.argv[3:]))
        kv = args.kv_transfer_config
        assert kv.kv_connector == "NixlConnector"
        assert kv.kv_role == ("kv_producer" if node.role == "prefill" else "kv_consumer")
        assert kv.kv_buffer_device == device
        assert kv.engine_id == node.engine_id
        assert kv.kv_connector_extra_config["bidirectional_kv_xfer"] is True
        assert kv.kv_connector_extra_config["kv_recompute_threshold"] == 64
        assert kv.kv_connector_extra_config["decoder_kv_blocks_ttl"] == 480
        assert args.port == node.port and args.host == "127.0.0.1"
        assert args.enable_prefix_caching is (node.role == "decode")
        assert args.block_size == 32 and args.max_model_len == 4096
        assert args.served_model_name == ["kvagent-demo"]
        assert args.override_generation_config == {"max_new_tokens": BUILTIN_DEFAULT_MAX_TOKENS}
        if device == "cuda":
            assert args.kv_cache_memory_bytes == 2 * 1024**3


@pytest.mark.vllm
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_parses_the_single_node(vllm_parser, device: str) -> None:
    """`topology: single`: one node, NIXL `kv_both`, prefix caching, the plugin's args."""
    from kvagent_server.bundle.inputs import gather_inputs

    cfg = validate_config({"topology": "single", "device": device, "block_size": 32,
                           "max_model_len": 4096})
    real = gather_inputs(cfg, build_model=False)
    inputs = PlanInputs(host=HostFacts(cpu_cores=(0, 1), gpu_count=1), model=real.model,
                        python=real.python, role_env=real.role_env, role_args=real.role_args)
    (node,) = plan(cfg, inputs).nodes
    args = vllm_parser(list(node.argv[3:]))
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_buffer_device) == (
        "NixlConnector", "kv_both", device)
    assert kv.kv_connector_extra_config["decoder_kv_blocks_ttl"] == 480
    assert args.enable_prefix_caching and args.enable_prompt_tokens_details
