"""GPU check of the KV tiers: a node rendered from the bundle config with a CPU and an fs
tier, filled beyond its GPU KV capacity, must serve a repeated prefix from a lower tier.

Run through check_tiers.sh. `--dry-run` renders the node and parses it with vLLM's own
argument parser without starting anything (works on a CPU-only machine).

Checks (each one a line in the JSON report, `ok` true/false):
1. cpu_tier_hit: prefix A, then enough other prompts to evict A from GPU memory, then A
   again: vllm:external_prefix_cache_hits rises by about A's length (the connector served
   it) and vllm:kv_offload_load_bytes rises (bytes came back from the offload tier).
2. fs_files: block files appeared under the fs tier's directory.
3. fs_tier_hit: the node is restarted (the CPU tier is process memory, so it is gone);
   A again is still an external hit: it came from the fs tier.
4. tier_events (the router's placement side, tier_events.py): the node publishes KV
   events as the bundle renders them (`--kv-events-config`, ipc socket in the run dir);
   the router's own subscriber and index listen in this process. Once A is evicted from
   GPU memory (before A is sent again), the index must hold all of A's blocks (hashed by
   the router from /tokenize ids with the node's hash settings) in the cpu tier and none
   on GPU, and the router's placement must prefer this node for A over an idle empty
   node. After the restart the index's view is recorded (`after_restart`, no verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvagent_server.bundle.inputs import gather_inputs
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.bundle.render import BundlePlan, HostFacts, PlanInputs, ProcessSpec, plan
from kvagent_server.config import validate_config
from kvagent_server.router.kv.hashing import BlockHasher
from kvagent_server.router.nodes.prompt_ids import tokenize_request

from benchmarks._vllm_cli import parse_node_argv
from tools.gpu.tier_events import (
    EventListener,
    a_in_cpu,
    event_source,
    judge,
    snapshot,
    synthetic_check,
)

BLOCK = 16


def render_bundle(work: Path, model: str | None, gpu_blocks: int, port: int) -> BundlePlan:
    """A 1P+1D bundle with both tiers, exactly as `kvagent-server up` would render it
    (KV events on, the default); the check starts its prefill-0 only."""
    cfg = validate_config({
        "name": "tiercheck", "topology": "pd", "model": model, "device": "cuda",
        "run_dir": str(work / "run"),
        "block_size": BLOCK, "router_enabled": False,
        # GPU KV holds exactly one max-length request: vLLM accepts that, and a few
        # prompts evict everything before them.
        "max_model_len": gpu_blocks * BLOCK,
        "prefill": {"ports": [port], "cuda_devices": ["0"],
                    "extra_args": ["--num-gpu-blocks-override", str(gpu_blocks),
                                   "--max-num-seqs", "4"]},
        "decode": {"ports": [port + 1], "cuda_devices": ["0"]},
        "kv_tiers": {"cpu": {"size_gib": 1}, "disk": {"path": str(work / "fs-tier")},
                     "min_prefix_tokens": BLOCK, "roles": ["prefill"]},
    })
    gathered = gather_inputs(cfg, build_model=True)
    inputs = PlanInputs(host=HostFacts(cpu_cores=gathered.host.cpu_cores, gpu_count=1),
                        model=gathered.model, python=sys.executable,
                        role_env=gathered.role_env, role_args=gathered.role_args)
    return plan(cfg, inputs)


def vllm_parse(node: ProcessSpec) -> dict[str, Any]:
    ns, engine = parse_node_argv(node.argv)
    ktc, kec = engine.kv_transfer_config, engine.kv_events_config
    return {"kv_connector": ktc.kv_connector,
            "children": [c["kv_connector"] for c in
                         ktc.kv_connector_extra_config.get("connectors", [])],
            "hash_algo": ns.prefix_caching_hash_algo,
            "kv_events": None if kec is None else {
                "enabled": kec.enable_kv_cache_events, "publisher": kec.publisher,
                "endpoint": kec.endpoint, "topic": kec.topic}}


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and ("prefix_cache" in m.group(1) or "kv_offload" in m.group(1)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def token_ids(url: str, model: str, prompt: str) -> list[int]:
    """The prompt's token ids from the node's /tokenize, with the router's request body."""
    body = tokenize_request({"model": model, "prompt": prompt}, chat=False)
    req = urllib.request.Request(f"{url}/tokenize", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return list(json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"])


def complete(url: str, model: str, prompt: str) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


def start(node: ProcessSpec, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **node.env}
    if "PYTHONHASHSEED" not in node.env:  # the router's source says "unset": make it so
        env.pop("PYTHONHASHSEED", None)
    proc = subprocess.Popen(list(node.argv), env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"node exited with {proc.returncode}; see {log}")
        try:
            urllib.request.urlopen(node.health_url, timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    stop(proc)
    raise SystemExit(f"node not healthy after 900 s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """The node and its group, 30 s before SIGKILL: a GPU engine stops slower than a CPU one."""
    stop_groups(proc, grace=30.0)


def prompt(i: int, words: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(words))


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvagent-tiercheck"))
    ap.add_argument("--model", default=None, help="default: kvagent's demo model, built here")
    ap.add_argument("--gpu-blocks", type=int, default=64,
                    help="GPU KV blocks (x16 tokens): small, so a few prompts evict A")
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--words", type=int, default=100,
                    help="words per prompt (the demo tokenizer makes ~4 tokens of each)")
    ap.add_argument("--events-wait", type=float, default=30.0,
                    help="seconds to wait for A's CPU-tier KV events (tier_events)")
    ap.add_argument("--out", type=Path, default=None, help="JSON report path")
    ap.add_argument("--dry-run", action="store_true",
                    help="render and parse only; tier_events runs on synthetic events")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    bundle = render_bundle(a.work, a.model, a.gpu_blocks, a.port)
    node = bundle.by_name("prefill-0")
    source = event_source(bundle.router_settings, node.url)
    report: dict[str, Any] = {"argv": list(node.argv), "env": node.env,
                              "parsed": vllm_parse(node),
                              "kv_events_source": source.model_dump(), "checks": {}}
    if a.dry_run:
        # Not a check of vLLM: the router's subscriber, index and placement against
        # vLLM-encoded events on the rendered endpoint (what tier_events does for real).
        synthetic = synthetic_check(node.name, source, block_size=BLOCK)
        report["synthetic_tier_events"] = synthetic
        print(json.dumps(report, indent=2))
        return 0 if synthetic["ok"] else 1
    url = node.url
    served = node.argv[node.argv.index("--served-model-name") + 1]
    log = a.work / "node.log"
    checks = report["checks"]
    a_prompt = prompt(0, a.words)
    listener = EventListener(node.name, source)
    try:
        proc = start(node, log)
        try:
            listener.start()  # the node has bound its publisher by the time it is healthy
            time.sleep(1.0)  # let the SUB socket join before the first event
            a_ids = token_ids(url, served, a_prompt)
            a_keys = BlockHasher(source.hash_algo, source.hash_seed).keys(a_ids, BLOCK)
            complete(url, served, a_prompt)  # A
            # Other prompts: together several times the GPU KV capacity, so A is evicted.
            n_fill = max(4, (a.gpu_blocks * BLOCK * 3) // max(4 * a.words, 1))
            for i in range(1, n_fill + 1):
                complete(url, served, prompt(i, a.words))
            time.sleep(2)  # offload stores complete asynchronously
            # tier_events before A comes back: reloading A re-announces it on GPU.
            arrived = listener.wait_for(lambda idx: a_in_cpu(idx, node.name, a_keys),
                                        a.events_wait)
            verdict = listener.read(lambda idx: judge(idx, node.name, source, a_ids,
                                                      block_size=BLOCK))
            verdict.update(waited_for_events=arrived, bad_messages=listener.bad_messages,
                           prompt_tokens=len(a_ids))
            verdict["ok"] = verdict["ok"] and listener.bad_messages == 0
            checks["tier_events"] = verdict
            before = metrics(url)
            complete(url, served, a_prompt)
            after = metrics(url)
            hits = delta(after, before, "vllm:external_prefix_cache_hits")
            loaded = delta(after, before, "vllm:kv_offload_load_bytes")
            checks["cpu_tier_hit"] = {"ok": hits >= BLOCK and loaded > 0,
                                      "external_hit_tokens": hits, "load_bytes": loaded,
                                      "fill_prompts": n_fill}
            files = [p for p in (a.work / "fs-tier").rglob("*") if p.is_file()]
            checks["fs_files"] = {"ok": len(files) > 0, "files": len(files)}
        finally:
            stop(proc)
        proc = start(node, log)  # CPU tier gone with the process; fs tier files remain
        try:
            before = metrics(url)
            complete(url, served, a_prompt)
            after = metrics(url)
            hits = delta(after, before, "vllm:external_prefix_cache_hits")
            checks["fs_tier_hit"] = {"ok": hits >= BLOCK, "external_hit_tokens": hits}
            time.sleep(2)
            # The new process numbers its batches from 0 again: the index must have
            # noticed (resets >= 1) and relearned A from the new node's events.
            checks["tier_events"]["after_restart"] = listener.read(
                lambda idx: snapshot(idx, node.name, a_keys))
        finally:
            stop(proc)
    finally:
        listener.stop()
    report["ok"] = all(c["ok"] for c in checks.values())
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
