"""The multi-turn benchmark's `--device cuda` layout, checked without a GPU or an engine:
every configuration's nodes share GPU 0 with memory fractions that fit together, nothing
CPU-specific is left, and the default (CPU) settings are what they were before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.api import (
    ALL_CONFIGS,
    CONFIGS,
    ConfigResult,
    aggregated_device,
    bundle_settings,
    cuda_plan,
    gpu_memory_fraction,
)
from benchmarks.api import multiturn_run as run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "run_device_checks.sh"
PORTS5 = [9000, 9001, 9002, 9003, 9004]
PORTS7 = [9000, 9001, 9002, 9003, 9004, 9005, 9006]


@pytest.mark.parametrize("name", list(ALL_CONFIGS))
def test_cuda_layout_of_every_configuration(name: str, tmp_path: Path) -> None:
    rendered = cuda_plan.render_config(ALL_CONFIGS[name], tmp_path)
    assert cuda_plan.check(rendered) == []
    assert rendered["device"] == "cuda"
    nodes = rendered["nodes"]
    expected = 1 if ALL_CONFIGS[name].kind == "aggregated" else ALL_CONFIGS[name].prefill_count + 1
    assert len(nodes) == expected
    for node in nodes:  # one GPU for all, no CPU pinning or CPU engine settings
        assert node["env"]["CUDA_VISIBLE_DEVICES"] == "0" and node["cuda_device"] == "0"
        assert not [k for k in node["env"] if k.startswith("VLLM_CPU_")]
        assert node.get("cpu_bind") is None and "UCX_TLS" not in node["env"]
        argv = node["argv"]
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2 * 1024**3)
    share = sum(float(n["argv"][n["argv"].index("--gpu-memory-utilization") + 1])
                for n in nodes)
    assert 0 < share <= 0.95
    if "settings" in rendered:
        s = rendered["settings"]
        assert s["device"] == "cuda" and s["cpu_pinning"] is False
        assert "cpu_binds" not in s["prefill"] and "cpu_binds" not in s["decode"]
        assert s["prefill"]["cuda_devices"] == ["0"] * ALL_CONFIGS[name].prefill_count
        assert s["decode"]["cuda_devices"] == ["0"]


def test_gpu_memory_fractions() -> None:
    assert gpu_memory_fraction(1) == gpu_memory_fraction(2) == 0.4
    for n in range(1, 6):
        assert n * gpu_memory_fraction(n) <= 0.9
    with pytest.raises(ValueError):
        gpu_memory_fraction(0)


def test_check_catches_a_bad_layout(tmp_path: Path) -> None:
    rendered = cuda_plan.render_config(ALL_CONFIGS["kvagent"], tmp_path)
    rendered["nodes"][1]["env"]["CUDA_VISIBLE_DEVICES"] = "1"
    rendered["nodes"][0]["env"]["VLLM_CPU_KVCACHE_SPACE"] = "2"
    argv = rendered["nodes"][0]["argv"]
    argv[argv.index("--gpu-memory-utilization") + 1] = "0.9"
    problems = cuda_plan.check(rendered)
    assert any("decode-0: CUDA_VISIBLE_DEVICES" in p for p in problems)
    assert any("VLLM_CPU_KVCACHE_SPACE" in p for p in problems)
    assert any("sum to 1.30" in p for p in problems)


def _router(port: int, **params: object) -> dict:
    """The router section a configuration renders: `cost_model` with `params`."""
    return {"port": port, "reuse": True, "server_timing": True,
            "policy": {"name": "cost_model", "params": params}}


def test_cpu_settings_unchanged(tmp_path: Path) -> None:
    """The default device renders exactly what the benchmark rendered before --device."""
    common = {"model": None, "run_dir": str(tmp_path), "kv_cache_gib": 2,
              "startup_timeout_s": 900.0, "topology": "pd"}
    got = bundle_settings(ALL_CONFIGS["kvagent"], tmp_path, PORTS5, cores=[0, 1],
                          kv_cache_gib=2, startup_timeout_s=900.0)
    assert got == {
        "name": "mtbench-kvagent", **common,
        "prefill": {"count": 1, "ports": [9000], "side_channel_ports": [9001],
                    "prefix_caching": True},
        "decode": {"ports": [9002], "side_channel_ports": [9003]},
        "router": _router(9004)}
    got = bundle_settings(ALL_CONFIGS["kvagent_2p"], tmp_path, PORTS7, cores=[0, 1],
                          kv_cache_gib=2, startup_timeout_s=900.0)
    assert got == {
        "name": "mtbench-kvagent-2p", **common,
        "prefill": {"count": 2, "ports": [9000, 9001], "side_channel_ports": [9002, 9003],
                    "prefix_caching": True, "cpu_binds": ["0", "0"]},
        "decode": {"ports": [9004], "side_channel_ports": [9005], "cpu_binds": ["1"]},
        "router": _router(9006)}
    got = bundle_settings(ALL_CONFIGS["kvagent_always_pd_reuse_block512"], tmp_path, PORTS5,
                          cores=[0, 1], kv_cache_gib=2, startup_timeout_s=900.0)
    assert got == {
        "block_size": 512, "name": "mtbench-kvagent-always-pd-reuse-block512", **common,
        "prefill": {"count": 1, "ports": [9000], "side_channel_ports": [9001],
                    "prefix_caching": True},
        "decode": {"ports": [9002], "side_channel_ports": [9003]},
        # A fixed policy keeps every first turn on P, as P/D is designed.
        "router": _router(9004, skip_prefill_max_tokens=0, fresh_on_decode="never")}
    for c in ALL_CONFIGS.values():
        if c.kind != "bundle":
            continue
        ports = PORTS7 if c.prefill_count == 2 else PORTS5
        kw = {"cores": [0, 1], "kv_cache_gib": 2, "startup_timeout_s": 900.0}
        default = bundle_settings(c, tmp_path, ports, **kw)
        assert bundle_settings(c, tmp_path, ports, device="cpu", **kw) == default
        assert "device" not in default and "cuda_devices" not in default["prefill"]
        assert "extra_args" not in default["prefill"]


def test_aggregated_device_env() -> None:
    env, args = aggregated_device("cpu", kv_cache_gib=2, serve_env={"A": "1"}, ncpu=2)
    assert env == {"A": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
                   "VLLM_CPU_OMP_THREADS_BIND": "0-1"} and args == []
    env, _ = aggregated_device("cpu", kv_cache_gib=1, serve_env={}, cpu_bind="3")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    env, args = aggregated_device("cuda", kv_cache_gib=2, serve_env={"A": "1"}, ncpu=2)
    assert env == {"A": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert args == ["--kv-cache-memory-bytes", str(2 * 1024**3),
                    "--gpu-memory-utilization", "0.4", "--block-size", "16"]


def test_cli_device_defaults_to_cpu() -> None:
    args = run.parser().parse_args([])
    assert args.device == "cpu" and args.engine_args == [] and args.time_budget == 0
    args = run.parser().parse_args(["--device", "cuda", "--engine-arg=-O0"])
    assert args.device == "cuda" and args.engine_args == ["-O0"]
    from benchmarks.api import load

    assert load.parser().parse_args([]).device == "cpu"
    assert "device" not in run.machine()
    assert run.machine("cuda")["device"] == "cuda"


def test_time_budget_skips_what_would_not_fit() -> None:
    now = [0.0]
    ran: list[tuple[str, float | None]] = []

    def fake(c, startup):  # each configuration takes 100 s
        ran.append((c.name, startup))
        now[0] += 100.0
        return ConfigResult(name=c.name, description=c.description, status="ok")

    configs = list(CONFIGS.values())
    out = run.run_within_budget(configs, 250.0, fake, startup_timeout_s=900.0,
                                clock=lambda: now[0])
    assert [r.status for r in out] == ["ok", "ok", "skipped", "skipped"]
    assert ran == [("kvagent", 250.0), ("pd_noreuse_pcache_off", 150.0)]
    assert "time-budget" in (out[2].error or "")
    ran.clear()
    out = run.run_within_budget(configs, 0.0, fake, startup_timeout_s=900.0)
    assert [r.status for r in out] == ["ok"] * 4 and all(s is None for _, s in ran)


@pytest.mark.slow
def test_device_script_dry_run(tmp_path: Path) -> None:
    """The prepared GPU script's --dry-run: no GPU, no node; every configuration passes."""
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "sdk"), str(ROOT / "server"), str(ROOT)])}
    out = subprocess.run([str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    plan = json.loads((tmp_path / "cuda-plan.json").read_text())
    assert plan["ok"] and set(plan["configs"]) == set(ALL_CONFIGS)
    assert "benchmarks.multiturn.run --device cuda --quick" in out.stdout
    assert "tools/gpu/check_tiers.sh" in out.stdout
