"""Node-side hooks of the node trace (`benchmarks.multiturn.node_trace`), loaded by
Python's `site` in every process of a node started with this folder on `PYTHONPATH`.

They time a request's stages inside a vLLM 0.32 node, where the router cannot see: the
API server's parse and render (arrival -> `rendered`), the engine core's queue and
schedule, the NIXL pull (`read_start`; `kv_received`, the step that reports it done;
`remote_kv_done`, the next schedule that takes the request back), the first token (in
the engine core, then `api_output` in the API server), and a whole answer returned by
the chat handler (`responded`, before it is serialized). Each event is one JSON line,
appended to `$KVAGENT_NODE_TRACE_DIR/<process>-<pid>.jsonl`, with the wall clock
(`time.time()`, comparable across processes). Inert unless the kvagent plugin is on
(`KVAGENT_PLUGIN=1`) and the directory is set; a hook that fails to apply is skipped.
Benchmark instrumentation: it patches vLLM internals by name and may need updating with
vLLM.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, TextIO

#: `node_trace.DIR_ENV`, spelled out: nodes cannot import the benchmarks package.
_DIR = os.environ.get("KVAGENT_NODE_TRACE_DIR", "")
_NODE = "node"
#: This process's trace file, opened on its first event (line-buffered: a line per event
#: reaches the file at once, without an open per event on the scheduler's path).
_out: tuple[int, TextIO] | None = None
#: Per event, the requests it was emitted for (`_emit_once`).
_seen: dict[str, set[str]] = {}


def _emit(ev: str, req: str, **extra: Any) -> None:
    global _out
    pid = os.getpid()
    line = json.dumps({"t": time.time(), "node": _NODE, "pid": pid, "ev": ev, "req": req,
                       **extra})
    try:
        if _out is None or _out[0] != pid:  # first event, or a forked child
            _out = (pid, open(os.path.join(_DIR, f"{_NODE}-{pid}.jsonl"), "a",  # noqa: SIM115 - kept open for the process's life
                              buffering=1))
        _out[1].write(line + "\n")
    except OSError:
        pass


def _emit_once(ev: str, req: str) -> None:
    """`ev` for `req`, the first time only (this process's memory of it is bounded)."""
    seen = _seen.setdefault(ev, set())
    if req in seen:
        return
    if len(seen) > 100_000:
        seen.clear()
    seen.add(req)
    _emit(ev, req)


def _serving(module: Any) -> None:
    cls = module.OpenAIServingChat
    original = cls.create_chat_completion

    @functools.wraps(original)
    async def create_chat_completion(self: Any, request: Any, raw_request: Any = None,
                                     *args: Any, **kwargs: Any) -> Any:
        if raw_request is not None:  # read back when the request id is made
            raw_request.state.kvagent_arrived = time.time()
        out = await original(self, request, raw_request, *args, **kwargs)
        answer_id = getattr(out, "id", None)  # a whole answer (a P leg), not a stream
        if isinstance(answer_id, str):
            _emit("responded", answer_id)
        return out

    cls.create_chat_completion = create_chat_completion


def _base_serving(module: Any) -> None:
    cls = module.BaseServing
    original = cls._base_request_id

    @functools.wraps(original)
    def base_request_id(raw_request: Any, default: str | None = None) -> Any:
        out = original(raw_request, default)
        # The chat endpoint makes its id once the prompt is rendered.
        arrived = getattr(getattr(raw_request, "state", None), "kvagent_arrived", None)
        if arrived is not None:
            _emit("rendered", f"chatcmpl-{out}", arrived=arrived)
        return out

    cls._base_request_id = staticmethod(base_request_id)


def _scheduler(module: Any) -> None:
    cls = module.Scheduler
    add, schedule, remote = cls.add_request, cls.schedule, cls._update_waiting_for_remote_kv
    update_wrapped = False

    @functools.wraps(add)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _emit("sched_add", request.request_id, prompt=request.num_prompt_tokens)
        return add(self, request, *args, **kwargs)

    def wrap_update(update: Any) -> Any:
        @functools.wraps(update)
        def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
            res = update(self, *args, **kwargs)
            # The step that reports a KV load done (D may emit P's token in that step).
            for req_id in self.finished_recving_kv_req_ids:
                _emit_once("kv_received", req_id)
            for outputs in res.values():
                for o in outputs.outputs:
                    if o.new_token_ids:
                        _emit_once("first_token", o.request_id)
            return res
        return update_from_output

    @functools.wraps(schedule)
    def schedule_(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Wrap `update_from_output` on the first step, not at import: the kvagent plugin
        # patches it later (D emitting P's token), and this wrapper must see what the
        # patched method returns.
        nonlocal update_wrapped
        if not update_wrapped:
            cls.update_from_output = wrap_update(cls.update_from_output)
            update_wrapped = True
        out = schedule(self, *args, **kwargs)
        for r in out.scheduled_new_reqs:
            _emit("sched_new", r.req_id, tokens=out.num_scheduled_tokens.get(r.req_id),
                  computed=r.num_computed_tokens)
        return out

    @functools.wraps(remote)
    def update_waiting(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _emit("remote_kv_done", request.request_id)
        return remote(self, request, *args, **kwargs)

    cls.add_request, cls.schedule = add_request, schedule_
    cls._update_waiting_for_remote_kv = update_waiting


def _output_processor(module: Any) -> None:
    cls = module.OutputProcessor
    original = cls.process_outputs

    @functools.wraps(original)
    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any
                        ) -> Any:
        for o in engine_core_outputs:  # the API server got a request's first token
            if o.new_token_ids:
                _emit_once("api_output", o.request_id)
        return original(self, engine_core_outputs, *args, **kwargs)

    cls.process_outputs = process_outputs


def _pull_worker(module: Any) -> None:
    cls = module.NixlPullConnectorWorker
    original = cls._read_blocks_for_req

    @functools.wraps(original)
    def read_blocks_for_req(self: Any, req_id: str, meta: Any, *args: Any, **kwargs: Any
                            ) -> Any:
        _emit("read_start", req_id, blocks=len(getattr(meta, "local_block_ids", ()) or ()))
        return original(self, req_id, meta, *args, **kwargs)

    cls._read_blocks_for_req = read_blocks_for_req


_HOOKS = {
    "vllm.entrypoints.openai.chat_completion.serving": _serving,
    "vllm.entrypoints.serve.engine.serving": _base_serving,
    "vllm.v1.core.sched.scheduler": _scheduler,
    "vllm.v1.engine.output_processor": _output_processor,
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker": _pull_worker,
}


def _install() -> None:
    global _NODE
    from kvagent_server.bundle.processes import PROCESS_ENV
    from kvagent_server.vllm_plugin.import_hooks import when_imported

    _NODE = os.environ.get(PROCESS_ENV, _NODE)

    for name, hook in _HOOKS.items():
        def safe(module: Any, hook: Any = hook) -> None:
            try:
                hook(module)
            except Exception as exc:  # noqa: BLE001 - a trace must never break a node
                _emit("hook_failed", module.__name__, error=repr(exc))
        when_imported(name, safe)


if _DIR:
    try:
        from kvagent_server.vllm_plugin import enabled

        if enabled():
            _install()
    except ImportError:
        pass
