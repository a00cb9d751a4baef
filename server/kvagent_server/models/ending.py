"""How the built-in random-weight models end their turns: a *level chain* written into the
weights by hand.

A random model never picks its end-of-turn token on purpose, so every greedy answer would run
to `max_tokens` (and an agent reading `max_tokens` as an error gives up). Instead:

- `levels` x `per_level` of the vocabulary's *rarest* tokens (the highest ids of a BPE
  vocabulary, which ordinary prompts rarely end with) become *answer tokens*, each given a
  level 1..levels (a fixed shuffle). Every other token, EOS and the specials included, is a
  *start token* (level 0).
- After a start token (the `\\n` that ends `<|im_start|>assistant\\n`) the model picks an answer
  token from levels 1..`first_max`; after a level-l token one from level l+1; after the last
  level, EOS. So an answer is `levels - first + 1` tokens and then EOS: between
  `levels - first_max + 1` and `levels`, never more, whatever the prompt.
- *Which* token of the allowed level comes next is the random model's own choice, made from
  the whole context: the first token (so also the answer's length) and every later one depend
  on the prompt's KV exactly as before.

Mechanism: `control_dims(levels)` residual dimensions (the last ones) form a side channel
from the current token to the head. The embedding writes the token's level there (one-hot of
`level // 16` and of `level % 16`, or one "start" dimension), the layers neither read it (their
input norms are zero there) nor write it (`o_proj`/`down_proj` rows zero), and the head's row
of each answer token reads the level before its own, EOS's the last level. A candidate of the
right level gets two units of bias, one sharing half of the level code one unit, any other
token none. One unit is `gain / rms(x)` and two random logits differ by at most
`max_random_spread * |x_ctx| / rms(x)` (Cauchy-Schwarz; `x_ctx` is the residual outside the
control dims), so `gain = max_random_spread * bound` makes the level rule hold at every step
for every context with `|x_ctx| <= bound`; each model sets `bound` to about twice the largest
`|x_ctx|` measured offline (tools/model_endings/check.py). The random logits among
same-level candidates are untouched, so the choice within a level is the random head's; the
bias only shifts them all by the same few hundred, whose float32 rounding (~1e-5) is far
below their usual gaps.

`center_head` takes the mean answer-start state out of the head, so that the first token
(and with it the answer's length) follows the context rather than the fixed suffix every
chat prompt ends with.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Levels are coded as (level // _LO, level % _LO), one-hot each.
_LO = 16


@dataclass(frozen=True)
class EndingPlan:
    """Which tokens form the chain, and how long an answer can be."""

    levels: int  # answer tokens before EOS when the first token is level 1 (the bound)
    first_max: int  # highest level the first answer token may have (sets the minimum)
    level_of: dict[int, int]  # answer token id -> level (1..levels)

    @property
    def min_answer_tokens(self) -> int:
        """Fewest answer tokens before EOS (EOS not counted)."""
        return self.levels - self.first_max + 1

    @property
    def max_answer_tokens(self) -> int:
        """Most answer tokens before EOS (EOS not counted)."""
        return self.levels


def control_dims(levels: int) -> int:
    """Residual dimensions the level code takes: hi and lo one-hots, plus "start"."""
    return levels // _LO + 1 + _LO + 1


def plan_levels(vocab_size: int, reserved: Sequence[int], *, levels: int, first_max: int,
                per_level: int, seed: int,
                eligible: Callable[[int], bool] | None = None) -> EndingPlan:
    """Give the `levels * per_level` highest ids not in `reserved` (and `eligible`, when given)
    a level each (a seeded shuffle, so neighbouring merges spread over levels)."""
    if not 1 <= first_max <= levels:
        raise ValueError("first_max must lie in 1..levels")
    skip = set(reserved)
    ids = (t for t in range(vocab_size - 1, -1, -1)
           if t not in skip and (eligible is None or eligible(t)))
    pool = list(itertools.islice(ids, levels * per_level))
    if len(pool) < levels * per_level:
        raise ValueError("vocabulary too small for the level chain")
    random.Random(seed).shuffle(pool)
    return EndingPlan(levels, first_max, {t: 1 + i // per_level for i, t in enumerate(pool)})


def _code(level: int, levels: int) -> tuple[int, int]:
    """The two control-dim offsets that code `level` (hi one-hot, then lo one-hot)."""
    return level // _LO, levels // _LO + 1 + level % _LO


def shape_model(*, plan: EndingPlan, embed: Any, lm_head: Any, final_norm: Any,
                layers: Sequence[Any], eos_id: int, bias_unit: float) -> None:
    """Write the chain into a Llama-style decoder's weights, in place (under `no_grad`).

    `layers` are decoder layers with `input_layernorm`, `post_attention_layernorm`,
    `self_attn.o_proj` and `mlp.down_proj`; `bias_unit` is the final norm's gain on the control
    dims (one unit of level bias is `bias_unit / rms(residual)` in the logits).
    """
    hidden = embed.weight.shape[1]
    n = control_dims(plan.levels)
    ctl = slice(hidden - n, hidden)
    start = n - 1
    for layer in layers:
        layer.input_layernorm.weight[ctl] = 0.0
        layer.post_attention_layernorm.weight[ctl] = 0.0
        layer.self_attn.o_proj.weight[ctl, :] = 0.0
        layer.mlp.down_proj.weight[ctl, :] = 0.0
    final_norm.weight[ctl] = bias_unit
    emb = embed.weight[:, ctl]
    emb.zero_()
    emb[:, start] = 1.0  # every token is a start token ...
    head = lm_head.weight[:, ctl]
    head.zero_()
    for token, level in plan.level_of.items():
        hi, lo = _code(level, plan.levels)
        emb[token, start] = 0.0  # ... but the answer tokens
        emb[token, hi] = 1.0
        emb[token, lo] = 1.0
        hi, lo = _code(level - 1, plan.levels)
        head[token, hi] = 1.0
        head[token, lo] = 1.0
        if level <= plan.first_max:
            head[token, start] = 2.0
    hi, lo = _code(plan.levels, plan.levels)
    head[eos_id, hi] = 1.0
    head[eos_id, lo] = 1.0
    embed.weight[:, ctl] = emb
    lm_head.weight[:, ctl] = head



def max_random_spread(lm_head: Any, levels: int) -> float:
    """Twice the largest norm of a head row outside the control dims: two random logits
    differ by at most this times `|x_ctx| / rms(x)` (Cauchy-Schwarz)."""
    import torch

    n = control_dims(levels)
    return 2.0 * float(torch.linalg.vector_norm(lm_head.weight.detach()[:, :-n], dim=-1).max())


def set_gain(final_norm: Any, gain: float, levels: int) -> None:
    """Set the final norm's gain on the control dims: one unit of level bias in the logits is
    `gain / rms(residual)`."""
    final_norm.weight[-control_dims(levels):] = gain


def center_head(lm_head: Any, start_states: Any, levels: int) -> None:
    """Take the mean of `start_states` (final-norm outputs where an answer starts, one row per
    calibration prompt) out of every head row, in place.

    Every chat prompt ends in the same `<|im_start|>assistant\\n`, so the state the first answer
    token is read from is mostly that suffix's and only a little the context's: argmax would
    pick the same first token (so the same answer length) for most prompts. Without the common
    direction the first token follows the context.
    """
    import torch

    n = control_dims(levels)
    mean = start_states[:, :-n].mean(0)
    unit = mean / torch.linalg.vector_norm(mean)
    rows = lm_head.weight[:, :-n]
    rows -= torch.outer(rows @ unit, unit)
    lm_head.weight[:, :-n] = rows
