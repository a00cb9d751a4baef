"""The plugin's pure parts, without vLLM: version gate, node env, stream injection, patches."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvagent_server import vllm_plugin
from kvagent_server.vllm_plugin import (
    affinity,
    env,
    idle_wait,
    import_hooks,
    nixl_delay,
    stream_params,
    tokenize_render,
    version,
)

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_num_tokens": 255,
          "remote_blocks_expiry_time": 12.5}


# --- version gate -------------------------------------------------------------------------

@pytest.mark.parametrize("v", ["0.32.0", "0.32.7", "0.33.0", "0.33.1rc1", "0.32.0+cpu"])
def test_supported_versions(v: str) -> None:
    assert version.is_supported(v)
    version.check(v)


@pytest.mark.parametrize("v", ["0.31.9", "0.34.0", "1.0.0", "dev", "", "0"])
def test_unsupported_versions_refuse_loudly(v: str) -> None:
    assert not version.is_supported(v)
    with pytest.raises(version.UnsupportedVLLMVersion, match="not supported"):
        version.check(v)


def test_a_release_with_known_gaps_runs_only_when_named() -> None:
    with pytest.raises(version.UnsupportedVLLMVersion, match="KVAGENT_ALLOW_VLLM: 0.26"):
        version.check("0.26.0")
    with pytest.raises(version.UnsupportedVLLMVersion):
        version.check("0.26.0", "0.25,0.27")
    gap = version.check("0.26.0", " 0.25 , 0.26")
    assert gap is not None and "early release" in gap
    assert version.check("0.33.0", "0.26") is None  # supported: nothing to warn about
    with pytest.raises(version.UnsupportedVLLMVersion):
        version.check("0.31.0", "0.31")  # not a release with known gaps


# --- node env -----------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_env_enables_plugin_and_quiets_idle(role: str) -> None:
    e = env.node_env(role)
    assert e[env.PLUGIN_ENV] == "1"
    assert int(e[env.NIXL_DELAY_ENV]) >= 1000
    assert int(e[env.SPIN_ENV]) < int(e[env.IDLE_POLL_ENV])
    assert e["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    assert all(isinstance(v, str) for v in e.values())
    assert "--enable-prompt-tokens-details" in env.node_args(role)


def test_bad_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown node role"):
        env.node_env("both")
    with pytest.raises(ValueError):
        env.node_args("p")


# --- stream injection ---------------------------------------------------------------------

def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def test_params_are_added_at_top_level() -> None:
    ev = _event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3}})
    out = stream_params.add_params_to_event(ev, PARAMS)
    assert out.endswith("\n\n") and out.startswith("data: ")
    obj = json.loads(out[6:])
    assert obj["kv_transfer_params"] == PARAMS
    assert obj["usage"] == {"prompt_tokens": 3}


@pytest.mark.parametrize("ev", [
    "data: [DONE]\n\n",
    "data: not json\n\n",
    ": comment\n\n",
    _event({"error": {"message": "boom"}}),
    _event({"id": "x", "kv_transfer_params": {"already": True}}),
])
def test_events_left_alone(ev: str) -> None:
    assert stream_params.add_params_to_event(ev, PARAMS) == ev


def test_only_last_data_event_gets_params() -> None:
    evs = [_event({"n": 1}), _event({"n": 2}), "data: [DONE]\n\n"]
    out = stream_params.inject_into_last_data_event(evs, PARAMS)
    assert out[0] == evs[0] and out[2] == evs[2]
    assert json.loads(out[1][6:])["kv_transfer_params"] == PARAMS


@dataclass
class FakeOutput:
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None


async def _outputs(items: list[Any]):
    for item in items:
        yield item


def _fake_stream_generator(log: list[str]):
    """Mimics vLLM: one chunk per engine output, then a usage chunk, then [DONE]."""

    async def chat_completion_stream_generator(self: Any, request: Any, result_generator: Any,
                                               request_id: str) -> Any:
        async for res in result_generator:
            log.append("out")
            yield _event({"id": request_id, "choices": [{"finished": res.finished}]})
        yield _event({"id": request_id, "choices": [], "usage": {}})
        yield "data: [DONE]\n\n"

    return chat_completion_stream_generator


async def test_wrapped_generator_streams_unbuffered_and_tags_the_final_chunk() -> None:
    log: list[str] = []
    wrapped = stream_params.wrap_stream_generator(_fake_stream_generator(log))
    outs = [FakeOutput(False), FakeOutput(False), FakeOutput(True, PARAMS)]
    got: list[str] = []
    async for ev in wrapped(None, None, _outputs(outs), "r1"):
        got.append(ev)
        # Chunks before the final output are relayed as soon as they are produced.
        if len(got) <= 2:
            assert len(log) == len(got)
    assert got[-1] == "data: [DONE]\n\n"
    objs = [json.loads(e[6:]) for e in got[:-1]]
    assert [("kv_transfer_params" in o) for o in objs] == [False, False, False, True]
    assert objs[-1]["kv_transfer_params"] == PARAMS
    assert "usage" in objs[-1]


async def test_wrapped_generator_without_params_is_unchanged() -> None:
    log: list[str] = []
    original = _fake_stream_generator(log)
    outs = [FakeOutput(False), FakeOutput(True, None)]
    plain = [e async for e in original(None, None, _outputs(outs), "r")]
    wrapped = [e async for e in stream_params.wrap_stream_generator(original)(
        None, None, _outputs(outs), "r")]
    assert wrapped == plain


async def test_completion_waits_for_every_prompt() -> None:
    """Completions stream (index, output) pairs; only the last finished prompt counts."""
    watch = stream_params.OutputWatch(expected=2)
    watch.observe((0, FakeOutput(True, {"a": 1})))
    assert not watch.finished
    watch.observe((1, FakeOutput(True, {"b": 2})))
    assert watch.finished and watch.params == {"b": 2}


def test_patch_module_is_idempotent() -> None:
    mod = types.ModuleType("vllm.entrypoints.openai.chat_completion.serving")

    class OpenAIServingChat:
        chat_completion_stream_generator = _fake_stream_generator([])

    mod.OpenAIServingChat = OpenAIServingChat  # type: ignore[attr-defined]
    assert stream_params.patch_module(mod)
    first = OpenAIServingChat.chat_completion_stream_generator
    assert not stream_params.patch_module(mod)
    assert OpenAIServingChat.chat_completion_stream_generator is first


def test_wrap_rejects_a_changed_signature() -> None:
    async def chat_completion_stream_generator(self: Any, request: Any, results: Any) -> Any:
        yield ""

    with pytest.raises(TypeError, match="result_generator"):
        stream_params.wrap_stream_generator(chat_completion_stream_generator)


# --- idle wait ----------------------------------------------------------------------------

class FakeScheduler:
    def __init__(self, finished_pending: bool, unfinished: bool) -> None:
        self.finished_pending, self.unfinished = finished_pending, unfinished

    def has_requests(self) -> bool:
        return self.finished_pending or self.unfinished

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


@pytest.mark.parametrize(("pending", "unfinished", "expected"), [
    (True, False, True), (False, False, False), (True, True, False), (False, True, False),
])
def test_only_connector_work(pending: bool, unfinished: bool, expected: bool) -> None:
    assert idle_wait.only_connector_work(FakeScheduler(pending, unfinished)) is expected


def test_wait_for_input_times_out_and_wakes_early() -> None:
    q: queue.Queue[int] = queue.Queue()
    t = time.monotonic()
    idle_wait.wait_for_input(q, 0.2)
    assert time.monotonic() - t >= 0.19
    threading.Timer(0.05, q.put, args=(1,)).start()
    t = time.monotonic()
    idle_wait.wait_for_input(q, 60.0)
    assert time.monotonic() - t < 30.0  # woken by the item, not the 60 s timeout
    assert q.get_nowait() == 1  # the item is left for the engine loop


def _fake_core_module(scheduler: FakeScheduler, executed: bool):
    mod = types.ModuleType("vllm.v1.engine.core")

    class EngineCoreProc:
        def __init__(self) -> None:
            self.scheduler = scheduler
            self.input_queue: queue.Queue[int] = queue.Queue()
            self.batch_queue = None

        def _process_engine_step(self) -> bool:
            return executed

    mod.EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    return mod


def test_engine_step_waits_only_when_just_holding_blocks() -> None:
    holding = _fake_core_module(FakeScheduler(True, False), executed=False)
    assert idle_wait.patch_module(holding, 150)
    assert not idle_wait.patch_module(holding, 150)
    core = holding.EngineCoreProc()
    t = time.monotonic()
    assert core._process_engine_step() is False
    assert time.monotonic() - t >= 0.14

    busy = _fake_core_module(FakeScheduler(True, True), executed=False)
    idle_wait.patch_module(busy, 60_000)
    t = time.monotonic()
    busy.EngineCoreProc()._process_engine_step()
    assert time.monotonic() - t < 30.0  # no 60 s wait


def _spin_module(polled: list[int | None]) -> tuple[types.ModuleType, type]:
    """A stand-in for `shm_broadcast` whose `SpinCondition.wait` records its polls."""
    mod = types.ModuleType("shm")

    class SpinCondition:
        def __init__(self, is_reader: bool, busy_loop_s: float = 1) -> None:
            self.is_reader, self.busy_loop_s = is_reader, busy_loop_s
            self.last_read = time.monotonic()

        def wait(self, timeout_ms: int | None = None) -> None:
            polled.append(timeout_ms)

    mod.SpinCondition = SpinCondition  # type: ignore[attr-defined]
    return mod, SpinCondition


def test_spin_window_is_capped_for_readers_only() -> None:
    mod, SpinCondition = _spin_module([])
    assert idle_wait.patch_spin_module(mod, 20)
    assert SpinCondition(True).busy_loop_s == pytest.approx(0.02)
    assert SpinCondition(False, 0).busy_loop_s == 0
    assert SpinCondition(True, 0.005).busy_loop_s == 0.005


def test_readers_nap_inside_the_spin_window_and_poll_after_it() -> None:
    polled: list[int | None] = []
    mod, SpinCondition = _spin_module(polled)
    assert idle_wait.patch_spin_module(mod, 20, nap_us=2000)
    reader = SpinCondition(True)
    t = time.monotonic()
    reader.wait(50)
    assert time.monotonic() - t >= 0.0019 and polled == []  # napped, did not poll
    reader.last_read -= 1.0  # the window has passed
    reader.wait(50)
    assert polled == [50]


@pytest.mark.parametrize("cpu, want", [(True, env.CPU_SPIN_NAP_US), (False, 0)])
def test_readers_nap_by_default_on_cpu_only(monkeypatch: pytest.MonkeyPatch, cpu: bool,
                                            want: int) -> None:
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_cpu=lambda: cpu)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    assert idle_wait.default_nap_us() == want


def test_no_nap_keeps_vllms_wait() -> None:
    mod, SpinCondition = _spin_module([])
    original = SpinCondition.wait
    assert idle_wait.patch_spin_module(mod, 20)
    assert SpinCondition.wait is original


# --- NIXL delay ---------------------------------------------------------------------------

def test_nixl_agent_gets_the_delay() -> None:
    seen: list[int] = []

    class Config:
        pthrDelay = -1

    bindings = types.SimpleNamespace(
        nixlAgent=lambda name, cfg: seen.append(cfg.pthrDelay) or f"agent:{name}",
        nixlAgentConfig=Config, DRAM_SEG=7)
    api = types.ModuleType("nixl_cu12._api")
    api.nixlBind = bindings  # type: ignore[attr-defined]
    assert nixl_delay.patch_api_module(api, 5000)
    assert not nixl_delay.patch_api_module(api, 5000)
    cfg = api.nixlBind.nixlAgentConfig()
    cfg.pthrDelay = 0  # what nixl_agent.__init__ does
    assert api.nixlBind.nixlAgent("a", cfg) == "agent:a"
    assert seen == [5000]
    assert api.nixlBind.DRAM_SEG == 7


# --- /tokenize of a Mistral-tokenizer chat -------------------------------------------------

def test_tokenize_prepares_mistral_chats_like_the_chat_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lazy `tool_calls` become a list and ids are cut to 9 characters, with vLLM's own
    helpers, before `/tokenize` renders a chat for a Mistral tokenizer (only then)."""
    import asyncio

    import vllm.utils.mistral as vllm_mistral

    monkeypatch.setattr(vllm_mistral, "is_mistral_tokenizer", lambda tok: tok == "mistral")
    mod = types.ModuleType("serving")
    seen: list[Any] = []

    class TokenizeChatRequest:
        def __init__(self) -> None:
            call = {"id": "call_0123456789", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}
            self.messages = [{"role": "assistant", "tool_calls": iter([call])},
                             {"role": "tool", "tool_call_id": "call_0123456789"}]

    class ServingTokenization:
        def __init__(self, tokenizer: str) -> None:
            self.renderer = types.SimpleNamespace(tokenizer=tokenizer)

        async def create_tokenize(self, request: Any, raw_request: Any) -> str:
            seen.append(request.messages)
            return "ok"

    mod.TokenizeChatRequest = TokenizeChatRequest  # type: ignore[attr-defined]
    mod.ServingTokenization = ServingTokenization  # type: ignore[attr-defined]
    assert tokenize_render.patch_module(mod) and not tokenize_render.patch_module(mod)
    assert asyncio.run(ServingTokenization("mistral").create_tokenize(
        TokenizeChatRequest(), None)) == "ok"
    calls = seen[-1][0]["tool_calls"]
    assert isinstance(calls, list) and calls[0]["id"] == "123456789"
    assert seen[-1][1]["tool_call_id"] == "123456789"
    asyncio.run(ServingTokenization("hf").create_tokenize(TokenizeChatRequest(), None))
    assert not isinstance(seen[-1][0]["tool_calls"], list)


# --- affinity -----------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_worker_affinity_is_restored() -> None:
    mod = types.ModuleType("base_worker")
    before = os.sched_getaffinity(0)
    target = {max(before)}

    done = threading.Event()
    started: list[threading.Thread] = []

    class NixlBaseConnectorWorker:
        def __init__(self) -> None:
            os.sched_setaffinity(0, target)
            # a thread of the connector's (a progress thread): it inherits `target`
            started.append(threading.Thread(target=done.wait))
            started[0].start()

    mod.NixlBaseConnectorWorker = NixlBaseConnectorWorker  # type: ignore[attr-defined]

    def body() -> None:
        assert affinity.patch_module(mod)
        NixlBaseConnectorWorker()
        result.append(os.sched_getaffinity(0))
        assert started[0].native_id is not None
        result.append(os.sched_getaffinity(started[0].native_id))
        result.append(os.sched_getaffinity(bystander.native_id))

    ready = threading.Event()
    bystander = threading.Thread(target=lambda: (os.sched_setaffinity(0, target),
                                                 ready.set(), done.wait()))
    bystander.start()  # a thread of before the connector: left as it is
    assert ready.wait(10) and bystander.native_id is not None
    result: list[set[int]] = []
    th = threading.Thread(target=body)  # a thread of its own: affinity is per thread
    th.start()
    th.join()
    done.set()
    assert result == [before, before, target]


# --- import hooks and registration --------------------------------------------------------

def test_when_imported_runs_after_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kva_hook_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    import_hooks.when_imported("kva_hook_probe", lambda m: seen.append(m.VALUE + 1))
    assert seen == []
    import kva_hook_probe  # noqa: F401

    assert seen == [42]
    import_hooks.when_imported("kva_hook_probe", lambda m: seen.append(0))
    assert seen == [42, 0]
    sys.modules.pop("kva_hook_probe", None)


def test_register_is_inert_without_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.PLUGIN_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would now fail
    vllm_plugin.register()


def test_register_refuses_an_untested_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.PLUGIN_ENV, "1")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.40.0"))
    with pytest.raises(version.UnsupportedVLLMVersion, match="0.40.0"):
        vllm_plugin.register()


def test_register_rejects_bad_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.PLUGIN_ENV, "1")
    monkeypatch.setenv(env.NIXL_DELAY_ENV, "soon")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    with pytest.raises(ValueError, match=env.NIXL_DELAY_ENV):
        vllm_plugin.register()


def test_load_failures_recompute_when_a_connector_exists() -> None:
    from kvagent_server.vllm_plugin import load_failure

    mod = types.ModuleType("vllm.v1.core.sched.scheduler")

    class Scheduler:
        def __init__(self, connector: object | None) -> None:
            self.connector = connector
            self.recompute_kv_load_failures = connector is None

    mod.Scheduler = Scheduler  # type: ignore[attr-defined]
    assert load_failure.patch_module(mod)
    assert not load_failure.patch_module(mod)
    assert Scheduler(object()).recompute_kv_load_failures is True
    assert Scheduler(None).recompute_kv_load_failures is True


def test_a_failed_pull_is_not_offered_again() -> None:
    from kvagent_server.vllm_plugin import load_failure

    mod = types.ModuleType("pull_scheduler")

    class NixlPullConnectorScheduler:
        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            return 640 - num_computed, True

    mod.NixlPullConnectorScheduler = NixlPullConnectorScheduler  # type: ignore[attr-defined]
    assert load_failure.patch_pull_scheduler(mod)
    sched = NixlPullConnectorScheduler()
    fresh = types.SimpleNamespace(kv_transfer_params={"do_remote_decode": True,
                                                      "remote_block_ids": [[1]]})
    assert sched.get_num_new_matched_tokens(fresh, 0) == (640, True)
    fresh.kv_transfer_params["_remote_blocks_processed"] = True
    assert sched.get_num_new_matched_tokens(fresh, 0) == (0, False)
    d_side = types.SimpleNamespace(kv_transfer_params={"do_remote_prefill": False,
                                                       "_remote_blocks_processed": True})
    assert sched.get_num_new_matched_tokens(d_side, 0) == (640, True)


# --- decode retention: every retained sequence expires; early release -----------------------

def _retention_scheduler() -> Any:
    """A stand-in for vLLM 0.32's NixlPullConnectorScheduler.request_finished: a finished
    decode-side request with params is retained (deadline stamped in `_reqs_need_send`)."""
    from kvagent_server.vllm_plugin import retention

    mod = types.ModuleType("pull_scheduler")

    class NixlPullConnectorScheduler:
        is_bidirectional_kv_xfer_enabled = True

        def __init__(self) -> None:
            self._reqs_need_send: dict[str, float] = {}
            self._reqs_in_batch: set[str] = set()

        def on_new_request(self, request: Any) -> None:
            return None

        def request_finished(self, request: Any, block_ids: Any) -> Any:
            params = request.kv_transfer_params
            if not params:
                return False, None
            if params.get("do_remote_decode"):  # a P request: leased to a decode node
                self._reqs_need_send[request.request_id] = time.perf_counter() + 30
                return True, {"do_remote_prefill": True, "do_remote_decode": False,
                              "remote_request_id": request.request_id}
            if params.get("do_remote_prefill"):  # a P/D decode leg: already in a batch
                self._reqs_in_batch.add(request.request_id)
            self._reqs_need_send[request.request_id] = time.perf_counter() + 480
            return True, {"do_remote_prefill": False, "do_remote_decode": True,
                          "remote_request_id": request.request_id}

    mod.NixlPullConnectorScheduler = NixlPullConnectorScheduler  # type: ignore[attr-defined]
    assert retention.patch_module(mod)
    assert not retention.patch_module(mod)
    return NixlPullConnectorScheduler()


def _req(rid: str, params: dict[str, Any] | None) -> Any:
    return types.SimpleNamespace(request_id=rid, kv_transfer_params=params)


def test_a_d_direct_request_joins_the_batch_so_its_deadline_counts() -> None:
    sched = _retention_scheduler()
    delay, out = sched.request_finished(_req("a", {"do_remote_prefill": False}), ([1],))
    assert delay and out is not None
    # Without this the worker never stamps the deadline and the blocks never expire.
    assert "a" in sched._reqs_in_batch and "a" in sched._reqs_need_send
    assert sched.request_finished(_req("plain", None), ([1],)) == (False, None)
    assert "plain" not in sched._reqs_in_batch


def test_release_moves_only_retained_deadlines_to_now() -> None:
    sched = _retention_scheduler()
    sched.request_finished(_req("a", {"do_remote_prefill": False}), ([1],))
    sched._reqs_need_send.clear()  # the step that sent a's deadline to the worker
    before = time.perf_counter()
    sched.request_finished(_req("b", {"do_remote_prefill": False,
                                      "kvagent_release": ["a", "running", "b", 7]}), ([2],))
    assert before <= sched._reqs_need_send["a"] <= time.perf_counter()
    assert "running" not in sched._reqs_need_send  # never retained here: ignored
    assert sched._reqs_need_send["b"] > time.perf_counter() + 400  # not itself
    sched._reqs_need_send.clear()
    sched.request_finished(_req("c", {"do_remote_prefill": False,
                                      "kvagent_release": ["a"]}), ([3],))
    assert "a" not in sched._reqs_need_send  # released once only


def test_a_release_only_request_is_not_retained() -> None:
    sched = _retention_scheduler()
    sched.request_finished(_req("a", {"do_remote_prefill": False}), ([1],))
    sched._reqs_need_send.clear()
    assert sched.request_finished(_req("r", {"kvagent_release": ["a"]}), ([9],)) == (
        False, None)
    assert "r" not in sched._reqs_need_send and "r" not in sched._reqs_in_batch
    assert "a" in sched._reqs_need_send


def test_a_pure_release_frees_as_the_scheduler_adds_it() -> None:
    """A full KV cache cannot run the release request (nor a request queued before it):
    it must act before any queue or allocation."""
    sched = _retention_scheduler()
    sched.request_finished(_req("a", {"do_remote_prefill": False}), ([1],))
    sched._reqs_need_send.clear()
    before = time.perf_counter()
    sched.on_new_request(_req("r", {"kvagent_release": ["a"]}))
    assert before <= sched._reqs_need_send["a"] <= time.perf_counter()
    sched._reqs_need_send.clear()  # named again: released once only
    sched.on_new_request(_req("r2", {"kvagent_release": ["a"]}))
    assert sched._reqs_need_send == {}
    # a release riding on a real request waits for it to finish (it reuses those blocks)
    sched.request_finished(_req("b", {"do_remote_prefill": False}), ([2],))
    sched._reqs_need_send.clear()
    sched.on_new_request(_req("c", {"do_remote_prefill": False, "kvagent_release": ["b"]}))
    assert "b" not in sched._reqs_need_send


def test_a_node_that_pulled_as_p_and_decoded_retains_as_d_when_asked() -> None:
    """`d_pull` (replicas): the request pulled a prefix with a P leg's params and decoded
    the answer; `kvagent_retain` finishes it as a decode node's request, retained for the
    decode TTL and releasable, not leased to a decode node that never comes."""
    sched = _retention_scheduler()
    pull = {"do_remote_decode": True, "remote_block_ids": [[4, 5]], "remote_num_tokens": 32}
    _, leased = sched.request_finished(_req("p", dict(pull)), ([1],))
    assert leased is not None and leased["do_remote_prefill"]  # without: a P lease
    delay, out = sched.request_finished(_req("m", {**pull, "kvagent_retain": True}), ([2],))
    assert delay and out is not None
    assert out["do_remote_decode"] and not out["do_remote_prefill"]
    assert sched._reqs_need_send["m"] > time.perf_counter() + 400  # the decode TTL
    assert "m" in sched._reqs_in_batch
    sched._reqs_need_send.clear()
    sched.on_new_request(_req("r", {"kvagent_release": ["m", "p"]}))
    assert list(sched._reqs_need_send) == ["m"]  # releasable; the P lease is not


def test_release_ids_are_bounded_and_typed() -> None:
    from kvagent_server.vllm_plugin import retention

    assert retention.release_ids(None) == []
    assert retention.release_ids({"kvagent_release": "a"}) == []
    assert retention.release_ids({"kvagent_release": ["a", "a", "", 3, "b"]}) == ["a", "b"]
    many = [f"r{i}" for i in range(1000)]
    assert len(retention.release_ids({"kvagent_release": many})) == (
        retention.MAX_RELEASES_PER_REQUEST)


def test_a_decode_pull_past_the_lease_is_computed_locally() -> None:
    """A D leg that reaches a (stalled) decode node after P's lease reads nothing from P:
    the request's remote prefill is switched off before the connector plans a read."""
    import time

    from kvagent_server.vllm_plugin import load_failure

    mod = types.ModuleType("pull_scheduler")
    seen: list[bool] = []

    class NixlPullConnectorScheduler:
        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            remote = bool(request.kv_transfer_params.get("do_remote_prefill"))
            seen.append(remote)
            return (640 - num_computed, True) if remote else (0, False)

    mod.NixlPullConnectorScheduler = NixlPullConnectorScheduler  # type: ignore[attr-defined]
    assert load_failure.patch_pull_scheduler(mod)
    sched = NixlPullConnectorScheduler()

    def d_leg(read_by: Any) -> Any:
        return types.SimpleNamespace(request_id="r", kv_transfer_params={
            "do_remote_prefill": True, load_failure.READ_BY_KEY: read_by})

    assert sched.get_num_new_matched_tokens(d_leg(time.time() + 60), 0) == (640, True)
    late = d_leg(time.time() - 1)
    assert sched.get_num_new_matched_tokens(late, 0) == (0, False)
    assert late.kv_transfer_params["do_remote_prefill"] is False
    assert seen == [True, False]
    # No deadline (an older router) or a malformed one: vLLM's behaviour is unchanged.
    assert sched.get_num_new_matched_tokens(d_leg(None), 0) == (640, True)
    assert sched.get_num_new_matched_tokens(d_leg("soon"), 0) == (640, True)
    assert not load_failure.read_too_late({"do_remote_prefill": False,
                                           load_failure.READ_BY_KEY: 0}, time.time())


def test_router_and_plugin_agree_on_the_read_by_key() -> None:
    from kvagent_server.router.reuse import transfer
    from kvagent_server.vllm_plugin import load_failure

    assert transfer.READ_BY_KEY == load_failure.READ_BY_KEY
    p = {"do_remote_prefill": True}
    assert transfer.with_read_by(p, 5.0) == {"do_remote_prefill": True, "kvagent_read_by": 5.0}
    assert p == {"do_remote_prefill": True}


# --- pull check: P pulls only the blocks its own prompt repeats -----------------------------

def _offer(tokens: list[int], n: int, block: int = 4) -> dict[str, Any]:
    from kvagent_server.router.reuse import transfer

    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_num_tokens": n,
            "remote_block_ids": [list(range(100, 100 + n // block))],
            transfer.EXPECT_KEY: transfer.expect(tokens[:n], block)}


def test_pull_check_keeps_an_offer_the_prompt_repeats() -> None:
    from kvagent_server.router.reuse.transfer import EXPECT_KEY, VERIFIED_KEY
    from kvagent_server.vllm_plugin.pull_check import check_offer

    held = list(range(20))
    params = _offer(held, 16)
    assert check_offer(params, held + [7, 7], 4) == 16
    assert params["remote_num_tokens"] == 16 and params["remote_block_ids"] == [
        [100, 101, 102, 103]]
    assert params[VERIFIED_KEY] == 16 and EXPECT_KEY not in params
    assert check_offer(params, [], 4) is None  # checked once: the scheduler may ask again


@pytest.mark.parametrize(("prompt", "local_block", "want"), [
    (list(range(9)) + [99] * 11, 4, 8),   # differs in block 3: blocks 1-2 only
    ([99] + list(range(1, 20)), 4, 0),    # differs in block 1: nothing
    (list(range(13)) + [99] * 7, 8, 8),   # 12 verified; P's blocks of 8: whole ones of both
    (list(range(16)), 4, 12),              # the prompt is the offer: one token left to compute
    (list(range(6)), 4, 4),                # a shorter prompt
])
def test_pull_check_cuts_the_offer_to_the_verified_blocks(prompt: list[int], local_block: int,
                                                          want: int) -> None:
    from kvagent_server.vllm_plugin.pull_check import check_offer

    params = _offer(list(range(20)), 16)
    assert check_offer(params, prompt, local_block) == want
    assert params["remote_num_tokens"] == want
    # Blocks are cut to those verified; with none, they stay so D hears P is done.
    assert params["remote_block_ids"] == [list(range(100, 100 + (want // 4 if want else 4)))]


@pytest.mark.parametrize("expected", [None, "x", {"block_size": 0, "digests": []},
                                      {"block_size": 4, "digests": "ab"}])
def test_pull_check_refuses_a_malformed_offer(expected: object) -> None:
    from kvagent_server.router.reuse.transfer import EXPECT_KEY
    from kvagent_server.vllm_plugin.pull_check import check_offer

    params = {**_offer(list(range(20)), 16), EXPECT_KEY: expected}
    assert check_offer(params, list(range(20)), 4) == 0
    assert params["remote_num_tokens"] == 0


def test_pull_check_patch_cuts_before_vllm_and_echoes_the_count() -> None:
    from kvagent_server.router.reuse.transfer import VERIFIED_KEY
    from kvagent_server.vllm_plugin import load_failure, pull_check

    mod = types.ModuleType("pull_scheduler")

    class NixlPullConnectorScheduler:
        block_size = 4

        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            n = request.kv_transfer_params["remote_num_tokens"] - num_computed
            return (n, True) if n > 0 else (0, False)

        def request_finished(self, request: Any, block_ids: Any) -> Any:
            return True, {"do_remote_prefill": True, "remote_request_id": request.request_id}

    mod.NixlPullConnectorScheduler = NixlPullConnectorScheduler  # type: ignore[attr-defined]
    assert load_failure.patch_pull_scheduler(mod)  # another patch on the same method
    assert pull_check.patch_module(mod)
    assert not pull_check.patch_module(mod)
    sched = NixlPullConnectorScheduler()
    req = types.SimpleNamespace(request_id="r1", prompt_token_ids=list(range(9)) + [99] * 11,
                                kv_transfer_params=_offer(list(range(20)), 16))
    assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
    assert sched.request_finished(req, [[1]])[1][VERIFIED_KEY] == 8
    plain = types.SimpleNamespace(request_id="r2", prompt_token_ids=[1, 2],
                                  kv_transfer_params={"do_remote_prefill": False})
    assert VERIFIED_KEY not in sched.request_finished(plain, [[1]])[1]


def test_block_digests_chain_and_ignore_a_partial_block() -> None:
    from kvagent_server.router.reuse.transfer import block_digests, verified_tokens

    a, b = block_digests(list(range(10)), 4), block_digests([0, 1, 2, 3, 9, 5, 6, 7], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_digests([0] * 4 + list(range(4, 8)), 4)[1] != a[1]  # chained over block 1
    with pytest.raises(ValueError):
        block_digests([1], 0)
    assert verified_tokens(list(range(10)), {"block_size": 4, "digests": a}) == 8


# --- first token (D emits P's token and computes from it) ---------------------------------

def _d_request(**over: Any) -> Any:
    """A decode-side request whose KV load from P just finished (vLLM `Request` shape)."""
    from kvagent_server.router.reuse.transfer import FIRST_TOKEN_KEY

    sp = types.SimpleNamespace(n=1, logprobs=None, prompt_logprobs=None, min_tokens=0,
                               max_tokens=16, seed=None, temperature=0.0, eos_token_id=2,
                               stop_token_ids=[7])
    fields: dict[str, Any] = {
        "kv_transfer_params": {"do_remote_prefill": True, FIRST_TOKEN_KEY: 42},
        "sampling_params": sp, "pooling_params": None, "num_output_tokens": 0,
        "num_computed_tokens": 100, "num_prompt_tokens": 100, "prompt_embeds": None,
        "mm_features": [], "use_structured_output": False}
    for key, value in over.items():
        if hasattr(sp, key):
            setattr(sp, key, value)
        else:
            fields[key] = value
    return types.SimpleNamespace(**fields)


def test_first_token_taken_only_where_d_would_sample_it_the_same_way() -> None:
    from kvagent_server.vllm_plugin.first_token import takes_first_token

    def takes(**over: Any) -> int | None:
        return takes_first_token(_d_request(**over), max_model_len=4096, vocab_size=1000)

    assert takes() == 42
    assert takes(temperature=0.7) == 42  # unseeded sampling: P drew from the same law
    declined = [
        {"kv_transfer_params": {"do_remote_prefill": True}},
        {"kv_transfer_params": {"do_remote_prefill": True, "kvagent_first_token": True}},
        {"kv_transfer_params": {"do_remote_prefill": True, "kvagent_first_token": -1}},
        {"kv_transfer_params": {"do_remote_prefill": True, "kvagent_first_token": 1000}},
        {"kv_transfer_params": None},
        {"num_computed_tokens": 99},  # the load did not bring the whole prompt
        {"num_output_tokens": 1},  # already took it
        {"num_prompt_tokens": 4095, "num_computed_tokens": 4095},  # no room for a second
        {"mm_features": ["image"]}, {"use_structured_output": True},
        {"logprobs": 1}, {"prompt_logprobs": 0}, {"n": 2}, {"min_tokens": 3},
        {"max_tokens": 1}, {"seed": 7, "temperature": 0.7},
        {"eos_token_id": 42}, {"stop_token_ids": [42]},
    ]
    for over in declined:
        assert takes(**over) is None, over
    assert takes(seed=7) == 42  # greedy: the seed draws nothing


def test_first_token_patches_emit_the_token_and_seed_the_worker_state() -> None:
    from kvagent_server.router.reuse.transfer import FIRST_TOKEN_KEY
    from kvagent_server.vllm_plugin import first_token

    class Outs:
        def __init__(self, outputs: list[Any]) -> None:
            self.outputs = outputs

    engine = types.ModuleType("vllm.v1.engine")
    engine.EngineCoreOutput = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    engine.EngineCoreOutputs = Outs  # type: ignore[attr-defined]
    sched_mod = types.ModuleType("scheduler")

    class Scheduler:
        max_model_len = 4096
        vllm_config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(async_scheduling=False),
            speculative_config=None, use_v2_model_runner=False,
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
            model_config=types.SimpleNamespace(get_vocab_size=lambda: 1000))
        kv_cache_manager = types.SimpleNamespace(estimate_cached_tokens=lambda r: 100)

        def __init__(self) -> None:
            self.finished_recving_kv_req_ids: set[str] = set()
            self.failed_recving_kv_req_ids: set[str] = set()
            self.requests: dict[str, Any] = {}

        def update_from_output(self, so: Any, mro: Any) -> dict[int, Any]:
            return {}

    sched_mod.Scheduler = Scheduler  # type: ignore[attr-defined]
    sys.modules["vllm.v1.engine"], saved = engine, sys.modules.get("vllm.v1.engine")
    try:
        assert first_token.patch_scheduler_module(sched_mod)
    finally:
        if saved is None:
            del sys.modules["vllm.v1.engine"]
        else:
            sys.modules["vllm.v1.engine"] = saved
    assert not first_token.patch_scheduler_module(sched_mod)
    s = Scheduler()
    tokens: list[int] = []
    stats = types.SimpleNamespace(finalize=lambda n: tokens.append(-n))
    ok = _d_request(request_id="a", client_index=0, trace_headers=None,
                    append_output_token_ids=tokens.append, take_prefill_stats=lambda: stats,
                    take_events=lambda: None)
    failed = _d_request(request_id="b", client_index=0)
    s.requests = {"a": ok, "b": failed}
    s.finished_recving_kv_req_ids = {"a", "b"}
    s.failed_recving_kv_req_ids = {"b"}
    out = s.update_from_output(None, None)
    assert tokens == [42, -100]  # appended, then the prefill stats finalized
    assert [(o.request_id, o.new_token_ids, o.prefill_stats) for o in out[0].outputs] == [
        ("a", [42], stats)]
    s.requests["a"] = _d_request(request_id="a", client_index=0)
    s.vllm_config = types.SimpleNamespace(**{**vars(Scheduler.vllm_config),
                                            "use_v2_model_runner": True})
    assert s.update_from_output(None, None) == {}  # bookkeeping it does not follow

    batch_mod = types.ModuleType("gpu_input_batch")

    class InputBatch:
        def add_request(self, request: Any) -> list[int]:
            return list(request.output_token_ids)

    batch_mod.InputBatch = InputBatch  # type: ignore[attr-defined]
    assert first_token.patch_input_batch_module(batch_mod)
    params = {"do_remote_prefill": True, FIRST_TOKEN_KEY: 42}

    def state(computed: int) -> Any:
        return types.SimpleNamespace(
            output_token_ids=[], prompt_token_ids=[5] * 10, num_computed_tokens=computed,
            sampling_params=types.SimpleNamespace(extra_args={"kv_transfer_params": params}))

    assert InputBatch().add_request(state(10)) == [42]  # the scheduler took the token
    assert InputBatch().add_request(state(9)) == []  # D recomputes the last prompt token
