"""What a chat format lets a router reuse, without any server: render each turn of a
workload with a built-in model's tokenizer and count the tokens it shares, position for
position, with the previous turn's prompt.

    python -m benchmarks.multiturn.prefix --quick --model kvagent-demo-tekken

That common prefix is an upper bound on reuse that no router can beat without changing the
answer (KV at a position depends on every token before it). The live benchmark's
`reused_tokens` can be lower: block alignment, the model's answer re-tokenized, expiry.
Assistant answers are a fixed placeholder here (the live run uses the model's).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from .workload import Workload, WorkloadSpec, assistant_message, generate

Render = Callable[[list[dict], list[dict]], list[int]]
PLACEHOLDER_ANSWER = "Done."


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_by_turn(workload: Workload, render: Render, *, text_with_tool_calls: bool = True
                   ) -> list[tuple[int, int, int]]:
    """(turn, prompt tokens, tokens shared with the previous turn's prompt), summed over
    the conversations, per turn index."""
    sums: dict[int, list[int]] = {}
    for conv in workload.conversations:
        history: list[dict] = []
        previous: list[int] = []
        for i, turn in enumerate(conv.turns):
            if turn.assistant is not None:
                history.append(assistant_message(
                    turn.assistant, PLACEHOLDER_ANSWER, keep_recorded=False,
                    text_with_tool_calls=text_with_tool_calls))
            history.extend(turn.messages)
            ids = render(history, conv.tools)
            row = sums.setdefault(i, [0, 0])
            row[0] += len(ids)
            row[1] += common_prefix(previous, ids) if i else 0
            previous = ids
    return [(t, p, s) for t, (p, s) in sorted(sums.items())]


def renderer(model: str | None, cache_dir: Path | None = None) -> Render:
    """The prompt token ids vLLM would build for a built-in model (same renderer)."""
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(model)
    if builtin is None:
        raise SystemExit(f"--model: {model!r} is not a built-in model id")
    path = str(builtin.ensure(cache_dir))
    if builtin.name == "kvagent-demo-tekken":
        from transformers.tokenization_mistral_common import MistralCommonBackend

        mistral = MistralCommonBackend.from_pretrained(path)

        def render_mistral(messages: list[dict], tools: list[dict]) -> list[int]:
            return list(mistral.apply_chat_template(
                _mistral_ids(messages), tools=tools, tokenize=True,
                add_generation_prompt=True, return_dict=False))
        return render_mistral
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)

    def render_hf(messages: list[dict], tools: list[dict]) -> list[int]:
        return list(hf.apply_chat_template(messages, tools=tools, tokenize=True,
                                           add_generation_prompt=True, return_dict=False))
    return render_hf


def _mistral_ids(messages: list[dict]) -> list[dict]:
    """Tool-call ids as vLLM hands them to mistral_common: the last 9 characters."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": c["id"][-9:]} for c in m["tool_calls"]]
        if m.get("role") == "tool" and m.get("tool_call_id"):
            m["tool_call_id"] = m["tool_call_id"][-9:]
        out.append(m)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn.prefix",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="built-in model id (default: kvagent-demo)")
    p.add_argument("--quick", action="store_true", help="the quick workload (else the full)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    spec = WorkloadSpec.quick(args.seed) if args.quick else WorkloadSpec.full(args.seed)
    from kvagent_server.models.builtin import builtin_model

    builtin = builtin_model(args.model)
    rows = shared_by_turn(generate(spec), renderer(args.model),
                          text_with_tool_calls=builtin is None or builtin.text_with_tool_calls)
    print("| turn | prompt tokens | shared with the previous prompt | share |")
    print("|---|---|---|---|")
    for turn, prompt, shared in rows:
        share = f"{100 * shared / prompt:.0f} %" if turn else "–"
        print(f"| {turn} | {prompt} | {shared if turn else '–'} | {share} |")
    later = rows[1:]
    total = sum(r[1] for r in later)
    print(f"\nLater turns: {sum(r[2] for r in later)} of {total} prompt tokens shared "
          f"({100 * sum(r[2] for r in later) / max(total, 1):.0f} %).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
