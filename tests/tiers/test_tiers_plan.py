"""The tiers inside the bundle: config key, plan (what `up` runs), CLI errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kvagent_server.bundle.render import HostFacts, ModelSource, PlanInputs, plan
from kvagent_server.cli.app import app
from kvagent_server.config import ConfigError, load_config
from support import pd_config
from typer.testing import CliRunner


def inputs(gpus: int) -> PlanInputs:
    return PlanInputs(host=HostFacts(cpu_cores=(0, 1), gpu_count=gpus),
                      model=ModelSource(model="/models/m", served_name="m"),
                      python=sys.executable)


def tiered(tmp_path: Path, **tiers: Any) -> dict[str, Any]:
    return {"run_dir": str(tmp_path / "run"), "device": "cuda",
            "kv_tiers": {"cpu": {"size_gib": 8},
                         "disk": {"path": str(tmp_path / "kv"), "shared": True},
                         "hash_seed": 42, **tiers}}


def kv_of(argv: tuple[str, ...]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_plan_wraps_nixl_on_every_node(tmp_path: Path) -> None:
    bp = plan(pd_config(tiered(tmp_path)), inputs(gpus=2))
    for node in bp.nodes:
        kv = kv_of(node.argv)
        assert kv["kv_connector"] == "MultiConnector"
        assert kv["engine_id"] == node.engine_id
        nixl, off = kv["kv_connector_extra_config"]["connectors"]
        assert nixl["kv_connector"] == "NixlConnector" and "engine_id" not in nixl
        assert nixl["kv_role"] == ("kv_producer" if node.role == "prefill" else "kv_consumer")
        assert off["kv_connector_extra_config"]["secondary_tiers"][0]["root_dir"] == str(
            tmp_path / "kv")
        i = node.argv.index("--prefix-caching-hash-algo")
        assert node.argv[i + 1] == "sha256"
        assert node.env["PYTHONHASHSEED"] == "42"


def test_roles_limit_the_tiers(tmp_path: Path) -> None:
    bp = plan(pd_config(tiered(tmp_path, roles=["decode"])), inputs(gpus=2))
    p, d = bp.nodes
    assert kv_of(p.argv)["kv_connector"] == "NixlConnector"
    assert "PYTHONHASHSEED" not in p.env and "--prefix-caching-hash-algo" not in p.argv
    assert kv_of(d.argv)["kv_connector"] == "MultiConnector"


def test_user_env_still_wins(tmp_path: Path) -> None:
    data = tiered(tmp_path)
    data["decode"] = {"extra_env": {"PYTHONHASHSEED": "7"}}
    _, d = plan(pd_config(data), inputs(gpus=2)).nodes
    assert d.env["PYTHONHASHSEED"] == "7"


def test_cpu_plan_runs_the_tiers_on_kvagents_worker(tmp_path: Path) -> None:
    data = tiered(tmp_path)
    data["device"] = "auto"
    for node in plan(pd_config(data), inputs(gpus=0)).nodes:
        nixl, off = kv_of(node.argv)["kv_connector_extra_config"]["connectors"]
        assert nixl["kv_connector"] == "NixlConnector"
        extra = off["kv_connector_extra_config"]
        assert extra["spec_name"] == "KvagentTieringSpec"
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "KvagentFsTier" and tier["n_read_threads"] == 2


def test_default_config_is_unchanged() -> None:
    cfg = pd_config({})
    assert not cfg.kv_tiers.enabled
    p, _ = plan(cfg, inputs(gpus=0)).nodes
    assert "--prefix-caching-hash-algo" not in p.argv


def test_yaml_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("kv_tiers:\n  cpu: {size_gib: 0}\n  disk: {path: relative/dir}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = "\n".join(info.value.problems)
    assert "kv_tiers.cpu.size_gib" in text and "kv_tiers.disk.path" in text


def test_cli_render_reports_what_cpu_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text(f"model: /models/m\ndevice: cpu\nkv_tiers:\n  backend: lmcache\n"
                    f"  cpu: {{size_gib: 1}}\nrun_dir: {tmp_path / 'run'}\n")
    result = CliRunner().invoke(app, ["render", "-c", str(path)])
    assert result.exit_code == 2
    assert "lmcache needs device=cuda" in result.output
