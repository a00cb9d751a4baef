"""The plan and its rendering: exact commands, environment, pinning, and vLLM's own parser."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.bundle.render import (
    BUILTIN_DEFAULT_MAX_TOKENS,
    HostFacts,
    ModelSource,
    PlanInputs,
    format_cpu_list,
    parse_cpu_list,
    partition_cores,
    plan,
    plan_to_dict,
    render_json,
    render_shell,
)
from kvagent_server.config import ConfigError
from support import pd_config

from .bundle_helpers import fake_inputs

KV_P = ('{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu",'
        '"engine_id":"default-prefill-0","kv_connector_extra_config":{"bidirectional_kv_xfer":'
        'true,"kv_recompute_threshold":64,"decoder_kv_blocks_ttl":480}}')


def test_default_plan_golden() -> None:
    bp = plan(pd_config({"run_dir": "/run/x"}), fake_inputs())
    p, d = bp.nodes
    py = sys.executable
    assert p.argv == (
        py, "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/m", "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", "8100", "--block-size", "128",
        "--enable-prefix-caching", "--kv-transfer-config", KV_P,
        "--kv-events-config", ('{"enable_kv_cache_events":true,"publisher":"zmq",'
                               '"endpoint":"ipc:///run/x/kv-events-prefill-0.ipc",'
                               '"topic":"kvagent"}'),
    )
    assert p.env == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "UCX_TLS": "tcp,self,sm",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
    }
    assert p.cpu_affinity == (0,) and d.cpu_affinity == (1,)  # every thread, not only OMP's
    # D's steps on CPU: 512 tokens, a prompt at most 128 while others share D; P: vLLM's
    assert d.argv[d.argv.index("--max-num-batched-tokens") + 1] == "512"
    assert d.argv[d.argv.index("--long-prefill-token-threshold") + 1] == "128"
    kv_d = json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])
    assert kv_d["kv_role"] == "kv_consumer" and kv_d["engine_id"] == "default-decode-0"
    assert d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert d.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # P on core 0, D on core 1
    assert (p.url, d.url) == ("http://127.0.0.1:8100", "http://127.0.0.1:8200")
    assert p.health_url == "http://127.0.0.1:8100/health"
    assert bp.router is not None
    assert bp.router.argv == (
        py, "-m", "kvagent_server.router", "--host", "127.0.0.1", "--port", "8000",
        "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
        "--model", "m", "--settings", "/run/x/router-settings.json",
    )
    assert bp.router.health_url == "http://127.0.0.1:8000/health"
    # The router is told the node facts it must agree with.
    assert bp.router_settings["nodes"]["block_size"] == 128
    assert bp.router_settings["nodes"]["kv_recompute_threshold"] == 64
    assert bp.router_settings["retention"]["decode_blocks_ttl_s"] == 480
    assert bp.router_settings["engine"]["kv_events"] == {  # ipc: bind_host is not a wildcard
        url: {"endpoint": f"ipc:///run/x/kv-events-{role}-0.ipc", "topic": "kvagent",
              "hash_algo": "sha256", "hash_seed": None}
        for url, role in ((p.url, "prefill"), (d.url, "decode"))}


def test_builtin_models_answer_at_most_a_bounded_length_by_default() -> None:
    """A random-weight built-in model almost never ends an answer; vLLM's own default for a
    request without `max_tokens` is the rest of the context, so the README's two-turn
    example ran its first answer to 16384 tokens and the second turn hit HTTP 400."""
    flag = ["--override-generation-config",
            json.dumps({"max_new_tokens": BUILTIN_DEFAULT_MAX_TOKENS}, separators=(",", ":"))]

    def overrides(cfg: dict[str, Any], served: str) -> list[list[str]]:
        inputs = PlanInputs(host=HostFacts(cpu_cores=(0, 1), gpu_count=0),
                            model=ModelSource(model="/models/m", served_name=served),
                            python=sys.executable)
        out = []
        for node in plan(pd_config(cfg), inputs).nodes:
            at = [i for i, a in enumerate(node.argv) if a == "--override-generation-config"]
            out.append([a for i in at for a in node.argv[i:i + 2]])
        return out

    assert BUILTIN_DEFAULT_MAX_TOKENS <= 512
    for cfg, served in (({}, "kvagent-demo"), ({"model": "kvagent-demo"}, "kvagent-demo"),
                        ({"model": "kvagent-demo-tekken"}, "kvagent-demo-tekken"),
                        ({"model": "kvagent-demo-vlm"}, "kvagent-demo-vlm")):
        assert overrides(cfg, served) == [flag, flag], cfg  # P and D alike
    # Any other model keeps its own generation config (a real model stops by itself).
    assert overrides({"model": "/models/m"}, "m") == [[], []]
    # A role's own flag comes later, so it wins (vLLM takes the last one).
    own = ["--override-generation-config", '{"max_new_tokens":2048}']
    assert overrides({"decode": {"extra_args": own}}, "kvagent-demo") == [flag, flag + own]


def test_router_settings_follow_the_nodes() -> None:
    from kvagent_server.config import ConfigError

    cfg = pd_config({"block_size": 32, "decoder_kv_blocks_ttl_s": 300,
                           "kv_recompute_threshold": 100, "router": {"reuse": False}})
    settings = plan(cfg, fake_inputs()).router_settings
    assert (settings["nodes"]["block_size"], settings["retention"]["decode_blocks_ttl_s"],
            settings["nodes"]["kv_recompute_threshold"], settings["reuse"]) == (32, 300, 100, False)
    clash = pd_config({"router": {"nodes": {"block_size": 16}}})  # nodes: 128 on CPU
    with pytest.raises(ConfigError) as info:
        plan(clash, fake_inputs())
    assert info.value.problems == [
        ("router.nodes.block_size: 16 disagrees with the nodes' block_size (128); set block_size "
        "instead, the bundle passes it on")]
    same = pd_config({"router": {"nodes": {"block_size": 16}}, "device": "cuda"})
    assert plan(same, fake_inputs(gpus=2)).router_settings["nodes"]["block_size"] == 16


def test_router_knows_the_decode_nodes_prompt_step() -> None:
    """D's prompt cap per shared step, as the nodes will run it (extra_args win), reaches
    the router; off or unknown: None; a hand-set value must agree."""
    from kvagent_server.config import ConfigError

    def step(raw: dict[str, Any], **kw: Any) -> Any:
        return plan(pd_config(raw), fake_inputs(**kw)).router_settings["policy"]["params"][
            "decode_prompt_step_tokens"]

    assert step({}) == 128  # the CPU default
    assert step({"decode": {"extra_args": ["--long-prefill-token-threshold=64"]}}) == 64
    assert step({"decode": {"long_prefill_token_threshold": 0}}) is None  # off
    assert step({"device": "cuda"}, gpus=2) is None  # vLLM's default: off
    assert step({"decode": {"count": 2}, "cpu_pinning": False}) == 128
    assert step({"router": {"policy": {"params": {"decode_prompt_step_tokens": 128}}}}) == 128
    assert step({"router": {"decode_prompt_step_tokens": 128}}) == 128  # the older flat key
    with pytest.raises(ConfigError, match="router.policy.params.decode_prompt_step_tokens: 64 "
                                          "disagrees"):
        step({"router": {"policy": {"params": {"decode_prompt_step_tokens": 64}}}})
    # a policy that does not read D's step is not given it (its model would refuse it)
    fixed = plan(pd_config({"router": {"policy": {"name": "pd_reuse"}}}), fake_inputs())
    assert fixed.router_settings["policy"] == {"name": "pd_reuse", "params": {}}


def test_router_gets_the_models_placeholder_tokens_unless_configured(tmp_path: Any) -> None:
    """A local model's config.json names its image/video/audio tokens: the router gets
    them, so a changed image stops reuse at its position; a configured list wins."""
    from dataclasses import replace

    from kvagent_server.bundle.inputs import placeholder_token_ids

    (tmp_path / "config.json").write_text(json.dumps(
        {"image_token_id": 7, "video_token_index": 9, "vocab_size": 100,
         "text_config": {"image_token_id": 3}}))
    assert placeholder_token_ids(tmp_path) == (7, 9)
    assert placeholder_token_ids(tmp_path / "missing") == ()
    assert placeholder_token_ids(Path("org/hub-name")) == ()
    inputs = fake_inputs()
    inputs = replace(inputs, model=replace(inputs.model, mm_placeholder_token_ids=(7, 9)))
    cfg = pd_config({})
    assert plan(cfg, inputs).router_settings["identity"]["mm_placeholder_token_ids"] == [7, 9]
    assert plan(cfg, fake_inputs()).router_settings["identity"]["mm_placeholder_token_ids"] == []
    own = pd_config({"router": {"identity": {"mm_placeholder_token_ids": [5]}}})
    assert plan(own, inputs).router_settings["identity"]["mm_placeholder_token_ids"] == [5]


def test_every_knob_reaches_the_command() -> None:
    cfg = pd_config({
        "name": "lab", "served_model_name": "agent", "bind_host": "0.0.0.0",
        "advertise_host": "10.0.0.5", "kv_cache_gib": 6, "max_model_len": 8192,
        "block_size": 32, "decoder_kv_blocks_ttl_s": 300, "kv_recompute_threshold": 128,
        "kv_connector_extra": {"num_threads": 2},
        "prefill": {"count": 2, "prefix_caching": False, "extra_args": ["--enforce-eager"],
                    "extra_env": {"FOO": "1"}},
        "decode": {"ports": [9001], "side_channel_ports": [6001]},
        "router": {"host": "0.0.0.0", "port": 9000},
    })
    inputs = PlanInputs(
        host=HostFacts(cpu_cores=tuple(range(8)), gpu_count=0),
        model=ModelSource(model="/m", served_name="ignored", extra_args=("--dtype", "float32")),
        python="/py", role_env={"decode": {"PLUGIN": "d"}},
        role_args={"prefill": ("--plugin-p",)},
    )
    bp = plan(cfg, inputs)
    p0, p1, d0 = bp.nodes
    assert [n.name for n in bp.nodes] == ["prefill-0", "prefill-1", "decode-0"]
    assert p1.argv[p1.argv.index("--port") + 1] == "8101"
    assert p1.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert p0.argv[-4:] == ("--dtype", "float32", "--plugin-p", "--enforce-eager")
    assert "--no-enable-prefix-caching" in p0.argv and "--enable-prefix-caching" in d0.argv
    for flag, value in (("--max-model-len", "8192"), ("--block-size", "32"),
                        ("--served-model-name", "agent"), ("--host", "0.0.0.0")):
        assert p0.argv[p0.argv.index(flag) + 1] == value
    kv = json.loads(p0.argv[p0.argv.index("--kv-transfer-config") + 1])
    assert kv["engine_id"] == "lab-prefill-0"
    assert kv["kv_connector_extra_config"] == {
        "bidirectional_kv_xfer": True, "kv_recompute_threshold": 128,
        "decoder_kv_blocks_ttl": 300, "num_threads": 2}
    assert p0.env["FOO"] == "1" and "FOO" not in d0.env
    assert d0.env["PLUGIN"] == "d" and "PLUGIN" not in p0.env
    assert d0.env["VLLM_CPU_KVCACHE_SPACE"] == "6"
    # 8 cores, 3 nodes: disjoint contiguous groups, prefill first.
    assert [n.env["VLLM_CPU_OMP_THREADS_BIND"] for n in bp.nodes] == ["0-2", "3-5", "6-7"]
    # Others reach the nodes at the advertised host; the launcher too (bind is a wildcard).
    assert d0.url == "http://10.0.0.5:9001"
    assert d0.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
    assert d0.health_url == "http://10.0.0.5:9001/health"
    assert bp.router is not None and bp.router.url == "http://10.0.0.5:9000"
    assert "http://10.0.0.5:8101" in bp.router.argv


def test_gpu_plan() -> None:
    cfg = pd_config({"device": "auto", "decode": {"count": 2}, "kv_cache_gib": 4})
    bp = plan(cfg, fake_inputs(gpus=4))
    assert bp.device == "cuda"
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in bp.nodes] == ["0", "1", "2"]
    for n in bp.nodes:
        assert "UCX_TLS" not in n.env and "VLLM_CPU_OMP_THREADS_BIND" not in n.env
        kv = json.loads(n.argv[n.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_buffer_device"] == "cuda"
        assert n.argv[n.argv.index("--kv-cache-memory-bytes") + 1] == str(4 * 1024**3)
        assert n.argv[n.argv.index("--block-size") + 1] == "16"
    explicit = pd_config({"device": "cuda", "prefill": {"cuda_devices": ["3"]}})
    assert [n.cuda_device for n in plan(explicit, fake_inputs(gpus=4)).nodes] == ["3", "0"]


def test_auto_is_cpu_without_gpu() -> None:
    assert plan(pd_config({}), fake_inputs(gpus=0)).device == "cpu"


def test_explicit_cpu_binds_and_core_subset() -> None:
    cfg = pd_config({"cpu_cores": [2, 3, 4, 5], "decode": {"cpu_binds": ["0-1"]},
                           "prefill": {"count": 2}})
    bp = plan(cfg, fake_inputs(cores=tuple(range(6))))
    assert [n.cpu_bind for n in bp.nodes] == ["2-3", "4-5", "0-1"]


@pytest.mark.parametrize(
    ("cores", "parts", "expected"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([4, 5, 6], 3, [[4], [5], [6]]),
        ([0, 1, 2, 3, 4, 5, 6], 3, [[0, 1, 2], [3, 4], [5, 6]]),
    ],
)
def test_partition_cores(cores: list[int], parts: int, expected: list[list[int]]) -> None:
    out = partition_cores(cores, parts)
    assert out == expected
    assert sorted(c for part in out for c in part) == sorted(cores)


def test_partition_rejects_too_many_parts() -> None:
    with pytest.raises(ValueError):
        partition_cores([0], 2)


def test_format_cpu_list() -> None:
    assert format_cpu_list([0]) == "0"
    assert format_cpu_list([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,7,9-10") == (0, 1, 2, 3, 7, 9, 10)
    assert parse_cpu_list(format_cpu_list([5, 1, 2])) == (1, 2, 5)
    assert parse_cpu_list("0-1|2-3") == (0, 1, 2, 3)  # one list per rank: their union
    for names_no_cores in ("auto", "nobind", "", "1-", "a-b"):
        assert parse_cpu_list(names_no_cores) is None


def test_process_pinning_follows_the_settings() -> None:
    def affinities(settings: dict[str, Any], **kw: Any) -> list[Any]:
        return [n.cpu_affinity for n in plan(pd_config(settings),
                                             fake_inputs(**kw)).nodes]

    assert affinities({"cpu_cores": [2, 3, 4, 5]}, cores=tuple(range(6))) == [
        (2, 3), (4, 5)]
    assert affinities({"pin_processes": False}) == [None, None]
    assert affinities({"cpu_pinning": False}) == [None, None]
    assert affinities({"device": "cuda"}, gpus=2) == [None, None]
    # A bind the user set through the environment: pinned to it, unless it names no cores
    assert affinities({"decode": {"extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}}) == [
        (0,), (0, 1)]
    assert affinities({"decode": {"extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "auto"}}}) == [
        (0,), None]


def test_step_token_budget() -> None:
    def flag_values(flag: str, settings: dict[str, Any], **kw: Any) -> list[str | None]:
        nodes = plan(pd_config(settings), fake_inputs(**kw)).nodes
        return [n.argv[n.argv.index(flag) + 1] if flag in n.argv else None for n in nodes]

    def budgets(settings: dict[str, Any], **kw: Any) -> list[str | None]:
        return flag_values("--max-num-batched-tokens", settings, **kw)

    def caps(settings: dict[str, Any], **kw: Any) -> list[str | None]:
        return flag_values("--long-prefill-token-threshold", settings, **kw)

    assert budgets({}) == [None, "512"] and caps({}) == [None, "128"]
    assert budgets({"device": "cuda"}, gpus=2) == [None, None]
    assert caps({"device": "cuda"}, gpus=2) == [None, None]
    assert budgets({"prefill": {"max_num_batched_tokens": 4096},
                    "decode": {"max_num_batched_tokens": 256}}) == ["4096", "256"]
    assert caps({"prefill": {"long_prefill_token_threshold": 64},
                 "decode": {"long_prefill_token_threshold": 0}}) == ["64", None]  # 0: off
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        pd_config({"decode": {"max_num_batched_tokens": 0}})
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        pd_config({"decode": {"long_prefill_token_threshold": -1}})


def test_no_router() -> None:
    bp = plan(pd_config({"router_enabled": False}), fake_inputs())
    assert bp.router is None and len(bp.processes) == 2
    assert "router" not in render_shell(bp).split("kvagent bundle")[1].split("\n")[0]


def _shell_commands(text: str) -> list[list[str]]:
    """Commands of a rendered script (comments, heredoc bodies skipped)."""
    joined = text.replace("\\\n", " ")
    out, in_heredoc = [], False
    for line in joined.splitlines():
        if in_heredoc:
            in_heredoc = line != "EOF"
            continue
        if line.startswith("cat >"):
            in_heredoc = True
            continue
        if line.strip() and not line.startswith("#") and not line.startswith("mkdir"):
            out.append(shlex.split(line))
    return out


def test_shell_output_is_the_plan_copy_pasteable() -> None:
    cfg = pd_config({"run_dir": "/run/y", "prefill": {"extra_args": ["--x", "a b'c"]},
                           "router": {"signing_keys": {"k": "topsecretvalue-0123456789"}}})
    bp = plan(cfg, fake_inputs())
    text = render_shell(bp)
    cmds = _shell_commands(text)
    assert len(cmds) == 3
    for spec, cmd in zip(bp.processes, cmds, strict=True):
        if spec.env:
            assert cmd[0] == "env"
            n = len(spec.env)
            assert dict(a.split("=", 1) for a in cmd[1:1 + n]) == spec.env
            cmd = cmd[1 + n:]
        if spec.cpu_affinity:  # the shell pins what the supervisor pins at launch
            assert cmd[:3] == ["taskset", "-c", format_cpu_list(spec.cpu_affinity)]
            cmd = cmd[3:]
        assert tuple(cmd) == spec.argv
    assert "topsecretvalue" not in text and '"k": "***"' in text
    assert "topsecretvalue-0123456789" in render_shell(bp, reveal_secrets=True)
    # The settings heredoc is the JSON the router will read.
    body = text.split("<<'EOF'\n")[1].split("\nEOF")[0]
    assert json.loads(body)["port"] == 8000


def test_json_output() -> None:
    bp = plan(pd_config({"run_dir": "/run/z"}), fake_inputs())
    data = json.loads(render_json(bp))
    assert data == json.loads(json.dumps(plan_to_dict(bp)))
    assert [n["name"] for n in data["nodes"]] == ["prefill-0", "decode-0"]
    assert data["nodes"][0]["argv"] == list(bp.nodes[0].argv)
    assert data["nodes"][1]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert data["router"]["settings_path"] == "/run/z/router-settings.json"


def test_with_engine_id_replaces_only_the_connector_engine_id() -> None:
    from kvagent_server.bundle.render import incarnation_engine_id, with_engine_id

    kv = {"kv_connector": "NixlConnector", "engine_id": "b-decode-0", "kv_role": "kv_consumer"}
    argv = ["vllm", "--port", "1", "--kv-transfer-config", json.dumps(kv), "--x"]
    out = with_engine_id(argv, "b-decode-0-1a2b3c4d")
    assert json.loads(out[4]) == {**kv, "engine_id": "b-decode-0-1a2b3c4d"}
    assert out[:4] == argv[:4] and out[5:] == argv[5:]
    assert with_engine_id(["vllm", "--port", "1"], "x") == ["vllm", "--port", "1"]
    no_id = ["vllm", "--kv-transfer-config", json.dumps({"kv_connector": "X"})]
    assert with_engine_id(no_id, "x") == no_id
    a, b = incarnation_engine_id("b-decode-0"), incarnation_engine_id("b-decode-0")
    assert a != b and a.startswith("b-decode-0-") and b.startswith("b-decode-0-")
