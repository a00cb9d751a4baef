"""Offline check of how the built-in demo model ends its answers (transformers, no vLLM).

    python tools/model_endings/check.py --prompts 300 [--long 4] [--out results.json]

Builds the demo model into a temporary directory (or uses `--model DIR`), renders a seeded
set of diverse chats (short and long, with and without tools, multi-turn histories with
tool calls and results, a few up to ~30k tokens) and greedy-decodes each with a 256-token
cap. Reports the answer-length distribution, the share of answers that ended with EOS, how
many distinct answers and first tokens the prompts gave, and the level-bias margin: the
largest residual norm outside the control dims seen at any position, against the gain the
head was built with (models/ending.py). Exit status 1 if any answer did not end within the
bound.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvagent_server.models import demo, ending

CAP = 256
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
]


def _text(rng: random.Random, words: int) -> str:
    parts = []
    for _ in range(words):
        r = rng.random()
        if r < 0.75:
            parts.append(rng.choice(demo._WORDS))
        elif r < 0.85:
            parts.append(str(rng.randint(0, 10**rng.randint(1, 6))))
        elif r < 0.95:
            parts.append(rng.choice(["?", ".", ",", ":", "\n", "(", ")", "{", "}", "-", "'"]))
        else:
            parts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyzÄéß漢字") for _ in
                                 range(rng.randint(2, 9))))
    return " ".join(parts)


def chats(n: int, long: int, seed: int = 7) -> list[dict[str, Any]]:
    """`n` seeded chats of every shape, the last `long` of them ~10k-30k tokens."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        is_long = i >= n - long
        words = rng.randint(10000, 28000) if is_long else rng.choice([1, 3, 10, 40, 200, 1500])
        msgs: list[dict[str, Any]] = []
        if rng.random() < 0.6:
            msgs.append({"role": "system", "content": _text(rng, rng.randint(3, 60))})
        turns = rng.choice([1, 1, 2, 3, 6, 12])
        for t in range(turns):
            msgs.append({"role": "user", "content": _text(rng, max(1, words // turns))})
            if t == turns - 1:
                break
            if rng.random() < 0.4:
                args = json.dumps({"city": rng.choice(["Paris", "Rome"])})
                msgs.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{t}", "type": "function",
                     "function": {"name": "get_weather", "arguments": args}}]})
                msgs.append({"role": "tool", "tool_call_id": f"call_{t}",
                             "content": _text(rng, rng.randint(2, 40))})
            else:
                msgs.append({"role": "assistant", "content": _text(rng, rng.randint(5, 150))})
        out.append({"messages": msgs, "tools": TOOLS if rng.random() < 0.5 else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_dir = args.model or demo.ensure_demo_model(Path(tempfile.mkdtemp()))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    ctl = ending.control_dims(demo.ANSWER_LEVELS)
    largest = [0.0]

    def hook(_m: Any, inputs: tuple[Any, ...]) -> None:
        x = inputs[0][0, :, :-ctl]
        largest[0] = max(largest[0], float(torch.linalg.vector_norm(x, dim=-1).max()))

    model.model.norm.register_forward_pre_hook(hook)
    eos = tok.convert_tokens_to_ids(demo.EOS)
    lengths, ended, answers, firsts, sizes = [], 0, set(), set(), []
    for i, chat in enumerate(chats(args.prompts, args.long)):
        ids = tok.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        sizes.append(len(ids))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=CAP, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        gen = out[0, len(ids):].tolist()
        stop = gen[-1] == eos
        ended += stop
        lengths.append(len(gen) - 1 if stop else len(gen))
        answers.add(tuple(gen))
        firsts.add(gen[0])
        if i % 10 == 9 or len(ids) > 8000:
            print(f"{i + 1} prompts, last {len(ids)} tokens -> {lengths[-1]}", flush=True)
    spread = ending.max_random_spread(model.lm_head, demo.ANSWER_LEVELS)
    gain = float(model.model.norm.weight[-1].detach())
    report = {
        "prompts": len(lengths), "prompt_tokens": {"min": min(sizes), "max": max(sizes),
                                                  "median": statistics.median(sizes)},
        "ended_with_eos": ended, "answer_tokens": {
            "min": min(lengths), "max": max(lengths), "median": statistics.median(lengths),
            "mean": round(statistics.mean(lengths), 1),
            "deciles": statistics.quantiles(lengths, n=10)},
        "distinct_answers": len(answers), "distinct_first_tokens": len(firsts),
        "largest_ctx_residual_norm": round(largest[0], 4),
        "max_random_spread": round(spread, 4), "gain": gain,
        "margin_ratio": round(gain / (spread * largest[0]), 3),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if ended == len(lengths) and max(lengths) <= CAP else 1


if __name__ == "__main__":
    sys.exit(main())
