"""Config validation: every class of bad input gets one precise line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from bundle.bundle_helpers import fake_inputs
from kvagent_server.bundle.render import plan
from kvagent_server.config import (
    BundleConfig,
    ConfigError,
    dump_config,
    load_config,
    validate_config,
)


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    return info.value.problems


def test_defaults_are_valid_and_documented_values() -> None:
    cfg = validate_config({})
    assert cfg.prefill.count == 1 and cfg.decode.count == 1
    assert cfg.bind_host == "127.0.0.1" and cfg.advertise_host == "127.0.0.1"
    assert cfg.decoder_kv_blocks_ttl_s == 480 and cfg.kv_recompute_threshold == 64
    assert cfg.restart_limit == 3 and cfg.router_enabled
    assert cfg.node_ports("prefill") == [8100] and cfg.node_ports("decode") == [8200]
    assert cfg.side_channel_ports("prefill") == [5600]
    assert cfg.side_channel_ports("decode") == [5700]
    assert cfg.resolved_run_dir() == Path("~/.cache/kvagent/run/default").expanduser()


def test_unknown_key_names_its_path_and_suggests() -> None:
    assert problems({"prefil": {}}) == ["prefil: unknown key (did you mean 'prefill'?)"]
    assert problems({"decode": {"prot_base": 1}}) == [
        "decode.prot_base: unknown key (did you mean 'port_base'?)"]
    assert problems({"router": {"signing_key": {}}}) == [
        "router.signing_key: unknown key (did you mean 'signing_keys'?)"]
    assert problems({"zzz": 1}) == ["zzz: unknown key"]


def test_type_errors_show_path_and_value() -> None:
    assert problems({"prefill": {"count": "two"}}) == [
        ("prefill.count: Input should be a valid integer, unable to parse string as an "
        "integer (got 'two')")]
    assert problems({"device": "tpu"}) == [
        "device: Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"]
    assert problems({"decode": {"count": 0}}) == [
        "decode.count: Input should be greater than or equal to 1 (got 0)"]
    assert problems({"prefill": {"ports": [8100, "x"]}}) == [
        ("prefill.ports[1]: Input should be a valid integer, unable to parse string as an "
        "integer (got 'x')")]


def test_several_problems_one_line_each() -> None:
    lines = problems({"kv_cache_gib": 0, "restart_limit": -1})
    assert lines == [
        "kv_cache_gib: Input should be greater than or equal to 1 (got 0)",
        "restart_limit: Input should be greater than or equal to 0 (got -1)",
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"prefill": {"port_base": 8200}},
         "ports: 8200 is used by both prefill[0].port and decode[0].port"),
        ({"router": {"port": 5700}},
         "ports: 5700 is used by both decode[0].side_channel_port and router.port"),
        ({"prefill": {"count": 2, "port_base": 5599}},
         "ports: 5600 is used by both prefill[1].port and prefill[0].side_channel_port"),
        ({"decode": {"side_channel_ports": [8100]}},
         "ports: 8100 is used by both prefill[0].port and decode[0].side_channel_port"),
    ],
)
def test_port_clash_between_any_two_listeners(data: dict, expected: str) -> None:
    assert expected in problems(data)


def test_router_port_may_be_reused_when_router_is_off() -> None:
    cfg = validate_config({"router_enabled": False, "router": {"port": 8100}})
    assert cfg.router.port == 8100


def test_explicit_lists_must_match_count() -> None:
    assert problems({"prefill": {"count": 2, "ports": [9000]}}) == [
        "prefill.ports: 1 given for 2 node(s) (prefill.count)"]
    assert problems({"decode": {"cpu_binds": ["0", "1"]}}) == [
        "decode.cpu_binds: 2 given for 1 node(s) (decode.count)"]


def test_port_range_overflow() -> None:
    assert problems({"decode": {"count": 3, "port_base": 65534}}) == [
        "decode.port_base: 65534 + 3 nodes exceeds 65535"]
    assert problems({"prefill": {"ports": [70000]}}) == [
        "prefill.ports[0]: 70000 is not a port (1-65535)"]


def test_ttl_must_exceed_router_safety_margin() -> None:
    assert problems({"decoder_kv_blocks_ttl_s": 60}) == [
        ("decoder_kv_blocks_ttl_s: 60 s must be above router.token_safety_margin_s (60 s), "
        "or every cache token would be expired when issued")]
    assert validate_config({"decoder_kv_blocks_ttl_s": 30,
                            "router": {"token_safety_margin_s": 10}}).decoder_kv_blocks_ttl_s == 30


def test_cuda_without_gpu_is_rejected_by_the_plan() -> None:
    with pytest.raises(ConfigError) as info:
        plan(validate_config({"device": "cuda"}), fake_inputs(gpus=0))
    assert info.value.problems == [
        "device: cuda requested but no GPU is visible on this machine (use device: cpu or auto)"]


def test_more_nodes_than_cores_when_pinning() -> None:
    cfg = validate_config({"prefill": {"count": 2}})
    with pytest.raises(ConfigError) as info:
        plan(cfg, fake_inputs(cores=(0, 1)))
    assert info.value.problems == [
        ("prefill.count + decode.count: 3 nodes to pin but only 2 core(s) (0-1); lower the "
        "counts, list more cpu_cores, give explicit cpu_binds, or set cpu_pinning: false")]
    # Without pinning the same bundle is allowed (nodes share vLLM's `auto` binding).
    bp = plan(cfg.model_copy(update={"cpu_pinning": False}), fake_inputs(cores=(0, 1)))
    assert {n.env["VLLM_CPU_OMP_THREADS_BIND"] for n in bp.nodes} == {"auto"}


def test_cpu_cores_must_exist_here() -> None:
    with pytest.raises(ConfigError) as info:
        plan(validate_config({"cpu_cores": [0, 7]}), fake_inputs(cores=(0, 1)))
    assert info.value.problems == [
        "cpu_cores: core(s) 7 are not available here (available: 0-1)"]
    assert problems({"cpu_cores": [1, 1]}) == ["cpu_cores: core(s) [1] listed twice"]


def test_more_nodes_than_gpus() -> None:
    with pytest.raises(ConfigError) as info:
        plan(validate_config({"device": "cuda", "decode": {"count": 2}}), fake_inputs(gpus=2))
    assert info.value.problems == [
        ("prefill.count + decode.count: 3 nodes need a GPU each but only 2 GPU(s) are free "
        "(of 2 visible)")]


def test_yaml_file_and_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("prefill:\n  count: 1\n  extra_args: ['--enforce-eager']\n"
                    "decoder_kv_blocks_ttl_s: 300\n")
    cfg = load_config(path, {"prefill.count": 2, "router.port": 9000})
    assert cfg.prefill.count == 2  # the flag wins
    assert cfg.prefill.extra_args == ["--enforce-eager"]  # the rest of the file stays
    assert cfg.decoder_kv_blocks_ttl_s == 300
    assert cfg.router.port == 9000


def test_yaml_errors_are_precise(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  count: [1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.problems[0].startswith(f"{bad}: line 3, column 1: invalid YAML")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(listy)
    assert info.value.problems == [f"{listy}: the top level must be a mapping of keys"]
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.problems == [
        f"{tmp_path / 'missing.yaml'}: cannot read (No such file or directory)"]


def test_nested_unknown_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("router:\n  tenants:\n    - name: a\n      api_key: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "router.tenants[0].api_key: unknown key (did you mean 'api_keys'?)"]


def test_dump_roundtrips_with_secrets() -> None:
    cfg = validate_config({"router": {"signing_keys": {"k1": "s" * 32}},
                           "run_dir": "/tmp/x"})
    again = BundleConfig.model_validate(dump_config(cfg))
    assert again == cfg
    assert again.router.signing_keys["k1"].get_secret_value() == "s" * 32


def test_partly_given_role_keeps_its_own_port_defaults() -> None:
    cfg = validate_config({"decode": {"count": 2}})
    assert cfg.node_ports("decode") == [8200, 8201]
    assert cfg.side_channel_ports("decode") == [5700, 5701]


def test_three_listeners_on_one_port() -> None:
    assert problems({"decode": {"port_base": 8100}, "router": {"port": 8100}}) == [
        "ports: 8100 is used by prefill[0].port, decode[0].port and router.port"]


def test_dump_keeps_defaults_unset() -> None:
    """A dumped config reloads to the same plan: defaults stay defaults (nothing pinned)."""
    cfg = validate_config({"decode": {"count": 2}, "router": {"reuse": False}})
    again = BundleConfig.model_validate(dump_config(cfg))
    assert again == cfg
    assert again.router.model_fields_set == {"reuse"}
    assert plan(again, fake_inputs(cores=(0, 1, 2))).router_settings == plan(
        cfg, fake_inputs(cores=(0, 1, 2))).router_settings
