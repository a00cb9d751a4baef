"""How a turn's legs carry their transfer params (`shapes.LegChoices`), decided with the
turn's path (`turns.policy`): whether D takes the prompt ids and the first token P
computed, releases of unused handles, the test-only shifted blocks. Pure."""

from __future__ import annotations

from kvagent_server.router.reuse import identity
from kvagent_server.router.turns.policy_params import LegParams
from kvagent_server.router.turns.shapes import LegChoices, TurnFacts, TurnRequest

#: Bytes of JSON per prompt token id in P's answer, at most ("151935," is 7).
_ID_JSON_BYTES = 8
#: Tokens a chat template may add beyond the text of the body it renders.
_TEMPLATE_TOKENS = 4096


def forwards_prompt_ids(params: LegParams, req: TurnRequest) -> bool:
    """Whether a turn's D leg takes P's prompt token ids (`forward_prompt_ids`): chat
    requests only, and not where vLLM renders the messages anyway (media, `echo`).

    The ids make P's answer larger, and an answer over `max_upstream_body_bytes` would
    leave P's blocks leased with nobody told where they are; so they are asked for only
    when even one token per byte of the body (a bound: a token covers at least one byte
    of the text it encodes) keeps them within half the cap."""
    if not (params.forward_prompt_ids and req.chat and not req.body.get("echo")
            and not identity.media_parts(req.body)):
        return False
    tokens_at_most = req.body_chars + _TEMPLATE_TOKENS
    return tokens_at_most * _ID_JSON_BYTES <= params.max_upstream_body_bytes // 2


def forwards_first_token(params: LegParams, req: TurnRequest) -> bool:
    """Whether a turn's D leg may take P's token (`forward_first_token`): not for `n` > 1,
    whose samples vLLM draws as separate requests that would all start with it."""
    return params.forward_first_token and req.body.get("n") in (None, 1)


def leg_choices(facts: TurnFacts, params: LegParams) -> LegChoices:
    """How this turn's legs carry their transfer params (`TurnPlan.prefill_params`,
    `TurnPlan.decode_params`, and what D takes from P's answer)."""
    req = facts.req
    return LegChoices(release_unused=params.release_unused,
                      shift_blocks=params.shift_blocks and req.shift_blocks,
                      forward_prompt_ids=forwards_prompt_ids(params, req),
                      forward_first_token=forwards_first_token(params, req),
                      read_within_s=params.read_within_s)
