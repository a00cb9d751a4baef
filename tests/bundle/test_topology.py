"""`topology: auto | pd | single`: the rule `auto` follows, and what `single` renders."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest
from kvagent_server.bundle.inputs import plugin_needs
from kvagent_server.bundle.render import (
    HostFacts,
    ModelSource,
    PlanInputs,
    plan,
    plan_to_dict,
    render_shell,
)
from kvagent_server.bundle.supervisor import Bundle
from kvagent_server.bundle.topology import resolve_topology
from kvagent_server.cli.app import app
from kvagent_server.config import ConfigError, validate_config
from typer.testing import CliRunner

from .bundle_helpers import fake_inputs

CPU_REASON = ("auto: on CPU P/D halves each engine's cores (1.37-2.0x slower than one "
              "node on 2 cores, docs/benchmarks.md)")


def host(cores: int = 2, gpus: int = 0) -> HostFacts:
    return HostFacts(cpu_cores=tuple(range(cores)), gpu_count=gpus)


@pytest.mark.parametrize(("config", "facts", "expected"), [
    ({}, host(), ("single", CPU_REASON)),
    ({}, host(64), ("single", CPU_REASON)),
    ({"device": "cuda"}, host(gpus=1),
     ("single", "auto: 1 GPU visible; P/D needs one per node (2)")),
    ({}, host(gpus=1), ("single", "auto: 1 GPU visible; P/D needs one per node (2)")),
    ({}, host(gpus=2), ("pd", "auto: 2 GPUs visible, one per P/D node")),
    ({}, host(gpus=8), ("pd", "auto: 8 GPUs visible, one per P/D node")),
    ({"device": "cpu"}, host(gpus=2), ("single", CPU_REASON)),
    # What the config describes: several nodes of a role, or a placed prefill node.
    ({"decode": {"count": 2}}, host(),
     ("pd", "auto: 1 prefill + 2 decode nodes configured; single runs one")),
    ({"prefill": {"count": 2}}, host(gpus=1),
     ("pd", "auto: 2 prefill + 1 decode nodes configured; single runs one")),
    ({"prefill": {"hosts": ["10.0.0.11"]}}, host(),
     ("pd", "auto: prefill.hosts places a prefill node")),
    ({"prefill": {"cuda_devices": ["0"]}}, host(gpus=1),
     ("pd", "auto: prefill.cuda_devices places a prefill node")),
    # Explicit settings always win.
    ({"topology": "pd"}, host(), ("pd", "set in the config")),
    ({"topology": "single"}, host(gpus=4), ("single", "set in the config")),
])
def test_auto_rule(config: dict[str, Any], facts: HostFacts, expected: tuple[str, str]) -> None:
    choice = resolve_topology(validate_config(config), facts)
    assert tuple(choice) == expected
    assert choice.line() == f"topology: {expected[0]} ({expected[1]})"


def test_single_runs_exactly_one_node() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"topology": "single", "decode": {"count": 2}})
    assert info.value.problems == [
        ("decode.count: topology single runs exactly one node (got 2); set decode.count: 1, "
        "or topology: pd for several")]
    # The prefill section is not checked against anything in single (it is ignored).
    clash = {"prefill": {"count": 3, "ports": [8200, 8201, 8202]}}
    validate_config({"topology": "single", **clash})
    with pytest.raises(ConfigError, match="8200 is used by both prefill"):
        validate_config({"topology": "pd", **clash})


def _kv(argv: tuple[str, ...]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_single_on_cpu_is_one_node_on_every_core() -> None:
    role_env, role_args = plugin_needs()
    inputs = PlanInputs(host=host(cores=8), model=ModelSource(model="/m", served_name="m"),
                        python=sys.executable, role_env=role_env, role_args=role_args)
    bp = plan(validate_config({"run_dir": "/run/s"}), inputs)
    assert (bp.topology, bp.topology_reason) == ("single", CPU_REASON)
    (node,) = bp.nodes
    assert (node.name, node.role, node.url) == ("decode-0", "decode", "http://127.0.0.1:8200")
    assert node.cpu_bind == "0-7" and node.cpu_affinity == tuple(range(8))
    assert node.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"
    kv = _kv(node.argv)
    assert (kv["kv_connector"], kv["kv_role"], kv["engine_id"]) == (
        "NixlConnector", "kv_both", "default-decode-0")
    assert kv["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 480
    assert "--enable-prefix-caching" in node.argv
    assert "--kv-events-config" not in node.argv  # one node: nothing to place
    assert node.env["KVAGENT_PLUGIN"] == "1" and "--enable-prompt-tokens-details" in node.argv
    # Today's D flags: short prompt steps while others share the node.
    assert node.argv[node.argv.index("--long-prefill-token-threshold") + 1] == "128"
    assert bp.router is not None
    argv = bp.router.argv
    assert "--prefill" not in argv and argv.count("--decode") == 1
    assert argv[argv.index("--decode") + 1] == node.url
    assert bp.router_settings["engine"]["kv_events"] == {}
    assert bp.router_settings["policy"]["params"]["decode_prompt_step_tokens"] == 128


def test_single_on_one_gpu_renders_instead_of_refusing() -> None:
    cfg = validate_config({"device": "cuda", "run_dir": "/run/g"})
    bp = plan(cfg, fake_inputs(gpus=1))
    (node,) = bp.nodes
    assert bp.device == "cuda" and bp.topology == "single"
    assert node.env["CUDA_VISIBLE_DEVICES"] == node.cuda_device == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in node.env
    assert _kv(node.argv)["kv_buffer_device"] == "cuda"
    assert node.argv[node.argv.index("--kv-cache-memory-bytes") + 1] == str(2 * 1024**3)
    assert "--long-prefill-token-threshold" not in node.argv  # GPUs: vLLM's defaults
    # What `up` builds before starting anything: it no longer refuses.
    assert Bundle(cfg, inputs=fake_inputs(gpus=1)).plan.nodes == bp.nodes
    # P/D asked for on one GPU still refuses, and says what would run.
    with pytest.raises(ConfigError, match="need a GPU each.*topology: single runs one node"):
        plan(validate_config({"device": "cuda", "topology": "pd"}), fake_inputs(gpus=1))


def test_auto_on_two_gpus_is_the_pd_plan() -> None:
    auto = plan(validate_config({"device": "cuda"}), fake_inputs(gpus=2))
    pd = plan(validate_config({"device": "cuda", "topology": "pd"}), fake_inputs(gpus=2))
    assert auto.topology == "pd" and auto.topology_reason.startswith("auto: 2 GPUs")
    assert [n.name for n in auto.nodes] == ["prefill-0", "decode-0"]
    assert [n.cuda_device for n in auto.nodes] == ["0", "1"]
    assert [_kv(n.argv)["kv_role"] for n in auto.nodes] == ["kv_producer", "kv_consumer"]
    assert dataclasses.replace(auto, topology_reason="") == dataclasses.replace(
        pd, topology_reason="")


def test_explicit_pd_on_cpu_is_unchanged() -> None:
    bp = plan(validate_config({"topology": "pd"}), fake_inputs())
    assert [(n.name, n.cpu_bind) for n in bp.nodes] == [("prefill-0", "0"), ("decode-0", "1")]
    assert bp.router is not None and "--prefill" in bp.router.argv
    assert bp.notes == ()


def test_single_notes_what_it_ignores_and_renders_it() -> None:
    cfg = validate_config({"topology": "single", "prefill": {"extra_args": ["-O0"]},
                           "run_dir": "/run/n"})
    bp = plan(cfg, fake_inputs())
    assert bp.notes == ("prefill: ignored (topology single runs one node, from decode)",)
    assert all("-O0" not in n.argv for n in bp.nodes)
    shell = render_shell(bp)
    assert "# kvagent bundle 'default': one node on cpu + router\n" in shell
    assert "# topology: single (set in the config)\n" in shell
    assert "# note: prefill: ignored" in shell
    assert "prefill-0" not in shell and "--prefill" not in shell
    data = plan_to_dict(bp)
    assert (data["topology"], data["topology_reason"]) == ("single", "set in the config")
    assert [n["name"] for n in data["nodes"]] == ["decode-0"]


def test_single_on_another_machine_uses_the_decode_host() -> None:
    cfg = validate_config({"topology": "single", "bind_host": "0.0.0.0",
                           "decode": {"hosts": ["10.0.0.12"]},
                           "router": {"host": "0.0.0.0"}})
    bp = plan(cfg, fake_inputs())
    (node,) = bp.nodes
    assert node.url == "http://10.0.0.12:8200"
    assert node.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.12"
    assert bp.router is not None and bp.router.argv.count("--decode") == 1
    assert "http://10.0.0.12:8200" in bp.router.argv


def test_cli_render_prints_the_choice_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """`render --device cuda` on a one-GPU machine (faked) renders one node."""
    import kvagent_server.bundle.inputs as inputs_mod

    monkeypatch.setattr(inputs_mod, "count_gpus", lambda: 1)
    res = CliRunner().invoke(app, ["render", "-m", "/models/m", "--device", "cuda",
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    line = "topology: single (auto: 1 GPU visible; P/D needs one per node (2))"
    assert line in res.stderr and line not in res.stdout
    data = json.loads(res.stdout)
    assert data["topology"] == "single" and [n["cuda_device"] for n in data["nodes"]] == ["0"]


def test_the_demo_shows_pd_and_says_what_auto_would_run(tmp_path: Any) -> None:
    from kvagent_server.demo.agent import auto_note, demo_config

    cfg = demo_config(None, tmp_path, 8000)
    bp = plan(cfg, fake_inputs())
    assert bp.topology == "pd" and [n.role for n in bp.nodes] == ["prefill", "decode"]
    assert auto_note(cfg, host()) == (
        "The demo runs P/D to show the mechanism; on this machine `kvagent-server up` would "
        f"run topology: single ({CPU_REASON}).")
    assert auto_note(cfg, host(gpus=2)).endswith(
        "would run topology: pd (auto: 2 GPUs visible, one per P/D node).")


# ------------------------------------------------------------------ replicas


def test_replicas_needs_two_nodes_and_auto_never_picks_it() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"topology": "replicas"})
    assert info.value.problems == [
        ("decode.count: topology replicas runs at least two nodes (got 1); set "
         "decode.count: 2 or more, or topology: single for one")]
    cfg = validate_config({"topology": "replicas", "decode": {"count": 2}})
    assert tuple(resolve_topology(cfg, host())) == ("replicas", "set in the config")
    # auto on what replicas would suit picks what it picked before: pd for two nodes.
    two = validate_config({"decode": {"count": 2}})
    assert resolve_topology(two, host(gpus=2)).topology == "pd"
    # The prefill section is not checked against anything (it is ignored).
    validate_config({"topology": "replicas", "decode": {"count": 2},
                     "prefill": {"count": 3, "ports": [8200, 8201, 8202]}})


def test_replicas_on_cpu_is_n_kv_both_nodes_each_on_its_own_cores() -> None:
    role_env, role_args = plugin_needs()
    inputs = PlanInputs(host=host(cores=8), model=ModelSource(model="/m", served_name="m"),
                        python=sys.executable, role_env=role_env, role_args=role_args)
    cfg = validate_config({"topology": "replicas", "decode": {"count": 3},
                           "run_dir": "/run/r", "prefill": {"extra_args": ["-O0"]}})
    bp = plan(cfg, inputs)
    assert (bp.topology, bp.topology_reason) == ("replicas", "set in the config")
    assert [(n.name, n.role, n.url, n.cpu_bind) for n in bp.nodes] == [
        ("decode-0", "decode", "http://127.0.0.1:8200", "0-2"),
        ("decode-1", "decode", "http://127.0.0.1:8201", "3-5"),
        ("decode-2", "decode", "http://127.0.0.1:8202", "6-7")]
    assert [n.side_channel_port for n in bp.nodes] == [5700, 5701, 5702]
    for i, node in enumerate(bp.nodes):
        kv = _kv(node.argv)
        assert (kv["kv_role"], kv["engine_id"]) == ("kv_both", f"default-decode-{i}")
        assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        assert node.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(5700 + i)
        assert node.env["KVAGENT_PLUGIN"] == "1" and "--enable-prefix-caching" in node.argv
        assert "--kv-events-config" not in node.argv and "-O0" not in node.argv
    assert bp.router is not None
    argv = bp.router.argv
    assert "--prefill" not in argv and argv.count("--decode") == 3
    assert [argv[k + 1] for k, a in enumerate(argv) if a == "--decode"] == [
        n.url for n in bp.nodes]
    assert bp.notes == (("prefill: ignored (topology replicas runs decode.count nodes, "
                        "from decode)"),)
    shell = render_shell(bp)
    assert "# kvagent bundle 'default': 3 replica nodes on cpu + router\n" in shell
    assert "# topology: replicas (set in the config)\n" in shell
    assert "prefill-0" not in shell


def test_replicas_on_gpus_is_one_node_per_gpu_or_a_clear_refusal() -> None:
    cfg = validate_config({"device": "cuda", "topology": "replicas",
                           "decode": {"count": 2}, "run_dir": "/run/g"})
    bp = plan(cfg, fake_inputs(gpus=2))
    assert [n.cuda_device for n in bp.nodes] == ["0", "1"]
    assert [_kv(n.argv)["kv_buffer_device"] for n in bp.nodes] == ["cuda", "cuda"]
    with pytest.raises(ConfigError, match=r"decode.count: 2 nodes need a GPU each but only "
                                          r"1 GPU\(s\) are free"):
        plan(cfg, fake_inputs(gpus=1))
    with pytest.raises(ConfigError, match="decode.count: 3 nodes to pin but only 2 core"):
        plan(validate_config({"topology": "replicas", "decode": {"count": 3}}), fake_inputs())


def test_replicas_on_several_machines_uses_the_decode_hosts() -> None:
    cfg = validate_config({"topology": "replicas", "bind_host": "0.0.0.0",
                           "decode": {"count": 2, "hosts": ["10.0.0.12", "10.0.0.13"]},
                           "router": {"host": "0.0.0.0"}})
    bp = plan(cfg, fake_inputs())
    assert [n.url for n in bp.nodes] == ["http://10.0.0.12:8200", "http://10.0.0.13:8201"]
    assert [n.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for n in bp.nodes] == [
        "10.0.0.12", "10.0.0.13"]
    assert bp.router is not None and bp.router.argv.count("--decode") == 2
