"""The multi-turn benchmark's GPU layout, rendered and checked without a GPU.

    python -m benchmarks.multiturn.cuda_plan                 # every configuration, JSON
    python -m benchmarks.multiturn.cuda_plan --parse         # and vLLM's parser reads each

For each configuration (`nodes.ALL_CONFIGS`) the bundle settings of `--device cuda` are
validated by the bundle's own `validate_config` and rendered by `bundle.render.plan` on a host
with one GPU (what `kvagent-server up` would start), and the aggregated node's environment
and arguments are built; `check()` then asserts what one GPU shared by P and D needs:
device cuda, every node on GPU 0, no CPU pinning or VLLM_CPU_* variables, a KV size per
node, and `--gpu-memory-utilization` fractions that sum to at most `nodes.GPU_MEMORY_TOTAL`.
`tools/gpu/run_device_checks.sh --dry-run` runs this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvagent_server.bundle.render import last_flag

from .nodes import (
    ALL_CONFIGS,
    GPU,
    GPU_MEMORY_TOTAL,
    VLLM_MODULE,
    BenchConfig,
    aggregated_args,
    aggregated_device,
    bundle_settings,
)

#: Placeholder ports (nothing binds them here).
_PORT0 = 19000


def render_config(config: BenchConfig, work: Path, *, kv_cache_gib: int = 2,
                  model: str | None = None, engine_args: list[str] | None = None,
                  python: str | None = None) -> dict[str, Any]:
    """One configuration's cuda layout: the settings, and each node's argv and env."""
    if config.kind == "aggregated":  # as `nodes.aggregated_node` launches it
        from kvagent_server.models.builtin import builtin_model

        builtin = builtin_model(model)
        if builtin is None:
            raise ValueError(f"aggregated: {model!r} is not a built-in model id")
        env, device_args = aggregated_device("cuda", kv_cache_gib=kv_cache_gib,
                                             serve_env=builtin.serve_env())
        argv = [python or sys.executable, "-m", VLLM_MODULE,
                *aggregated_args(str(builtin.path()), _PORT0,
                                 builtin.serve_args(builtin.max_model_len)),
                *device_args, *(engine_args or []), *config.node_args]
        return {"name": config.name, "kind": config.kind, "device": "cuda",
                "nodes": [{"name": "aggregated", "argv": argv, "env": env,
                           "cuda_device": env.get("CUDA_VISIBLE_DEVICES")}]}
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.render import HostFacts, PlanInputs, plan
    from kvagent_server.config import validate_config

    n = 2 * config.prefill_count + 3
    settings = bundle_settings(config, work / config.name / "run",
                               list(range(_PORT0, _PORT0 + n)), cores=[0, 1],
                               kv_cache_gib=kv_cache_gib, startup_timeout_s=300,
                               model=model, device="cuda", engine_args=engine_args)
    cfg = validate_config(settings)
    gathered = gather_inputs(cfg, build_model=False)  # the model's path; nothing built
    inputs = PlanInputs(host=HostFacts(cpu_cores=gathered.host.cpu_cores, gpu_count=1),
                        model=gathered.model, python=python or sys.executable,
                        role_env=gathered.role_env, role_args=gathered.role_args)
    bp = plan(cfg, inputs)
    return {"name": config.name, "kind": config.kind, "device": bp.device,
            "settings": json.loads(json.dumps(settings, default=str)),
            "nodes": [{"name": s.name, "argv": list(s.argv), "env": s.env,
                       "cuda_device": s.cuda_device, "cpu_bind": s.cpu_bind}
                      for s in bp.nodes],
            "router": list(bp.router.argv) if bp.router else None}


def check(rendered: dict[str, Any]) -> list[str]:
    """What is wrong with one rendered configuration for one shared GPU (empty: nothing)."""
    name = rendered["name"]
    problems: list[str] = []
    if rendered["device"] != "cuda":
        problems.append(f"{name}: device {rendered['device']}, not cuda")
    share = 0.0
    for node in rendered["nodes"]:
        where = f"{name}/{node['name']}"
        env, argv = node["env"], node["argv"]
        if env.get("CUDA_VISIBLE_DEVICES") != GPU or node.get("cuda_device") != GPU:
            problems.append(f"{where}: CUDA_VISIBLE_DEVICES {env.get('CUDA_VISIBLE_DEVICES')!r}"
                            f", not {GPU!r}")
        cpu_env = sorted(k for k in env if k.startswith("VLLM_CPU_"))
        if cpu_env or node.get("cpu_bind"):
            problems.append(f"{where}: CPU settings {cpu_env or node.get('cpu_bind')}")
        if last_flag(argv, "--kv-cache-memory-bytes") is None:
            problems.append(f"{where}: no --kv-cache-memory-bytes")
        fraction = last_flag(argv, "--gpu-memory-utilization")
        if fraction is None:
            problems.append(f"{where}: no --gpu-memory-utilization")
        else:
            share += float(fraction)
    if share > GPU_MEMORY_TOTAL:
        problems.append(f"{name}: GPU memory fractions sum to {share:.2f} > {GPU_MEMORY_TOTAL}")
    rendered["gpu_memory_share"] = round(share, 4)
    return problems


def vllm_parse(rendered: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own parser on each node's arguments (needs vllm importable; any platform)."""
    from benchmarks._vllm_cli import parse_node_argv

    out = {}
    for node in rendered["nodes"]:
        _, engine = parse_node_argv(node["argv"])
        ktc = engine.kv_transfer_config
        out[node["name"]] = {
            "gpu_memory_utilization": engine.gpu_memory_utilization,
            "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
            "block_size": engine.block_size,
            "kv_connector": ktc.kv_connector if ktc else None,
            "kv_buffer_device": ktc.kv_buffer_device if ktc else None}
    return out


def render_all(work: Path, configs: list[str] | None = None, *, parse: bool = False,
               **kwargs: Any) -> dict[str, Any]:
    """Every configuration rendered and checked; `ok` when none has a problem."""
    out: dict[str, Any] = {"ok": True, "configs": {}}
    for name in configs or list(ALL_CONFIGS):
        try:
            rendered = render_config(ALL_CONFIGS[name], work, **kwargs)
        except Exception as exc:  # noqa: BLE001 - report every configuration
            rendered = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
            problems = [f"{name}: {rendered['error']}"]
        else:
            problems = check(rendered)
            if parse:
                try:
                    rendered["vllm_parsed"] = vllm_parse(rendered)
                except Exception as exc:  # noqa: BLE001 - no vLLM here: say so
                    rendered["vllm_parsed"] = f"not parsed: {type(exc).__name__}: {exc}"
        rendered["problems"] = problems
        out["configs"][name] = rendered
        out["ok"] = out["ok"] and not problems
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.cuda_plan",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvagent-mt-cuda-plan"),
                    help="run-dir root the settings name (nothing is written)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--engine-arg", action="append", default=[], dest="engine_args")
    ap.add_argument("--parse", action="store_true",
                    help="also parse each node's arguments with vLLM's parser")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(ALL_CONFIGS)}")
    result = render_all(a.work, names, parse=a.parse, kv_cache_gib=a.kv_cache_gib,
                        model=a.model, engine_args=a.engine_args)
    text = json.dumps(result, indent=2, default=str)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    for name, r in result["configs"].items():
        print(f"{name}: " + ("; ".join(r["problems"]) if r["problems"] else
                             f"ok (GPU memory share {r.get('gpu_memory_share')})"),
              file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
