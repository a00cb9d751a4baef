"""The real Claude Code, Codex and OpenCode CLIs, live, against the real bundle.

Each CLI (pinned and installed from npm by `clis.ensure_cli`) runs a three-turn session at
its defaults, told only the router's URL, the model and a key: Claude Code `-p` then
`-p --continue` twice, Codex `exec` then `exec resume --last` twice, OpenCode `run` then
`run --continue` twice. A recording proxy (`clis.Recorder`) between the CLI and the router
keeps every request. The contract (docs/agents/index.md): every request answered, every
request of a later turn reuses KV (the router's report and the CLI's own usage), the router
identifies the conversation from what the CLI sends, and the CLI shows no error.

What a random-weight model cannot drive a CLI to (tool loops, subagents, compaction) is
replayed from recorded sessions instead (test_agent_replay_vllm.py).

The suite's shared bundle serves the three CLIs: its context is 32k tokens
(`support.SUITE_MAX_MODEL_LEN`), because Claude Code's first request alone is ~29k tokens (its
system prompt and tool schemas).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import clis
import httpx
import pytest
import replay
from kvagent_server.bundle.runstate import LOG_DIR
from kvagent_server.router.http.conversation import from_agents
from support import (
    SUITE_MAX_MODEL_LEN,
    KVAgentBundle,
    skip_unless_required,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

CLIS = ("claude", "codex", "opencode")
PROMPTS = ["Say hello.", "Now say goodbye.", "Thanks, that is all."]
#: One CLI invocation's limit (a turn on the CPU demo model takes well under a minute).
TURN_TIMEOUT_S = 420.0
API_KEY = "sk-kvagent-live-cli"
#: The APIs each CLI speaks to the router at its defaults.
APIS = {"claude": "/v1/messages", "codex": "/v1/responses", "opencode": "/v1/chat/completions"}
TURN_PATHS = tuple(APIS.values())


@dataclass
class Played:
    """One CLI's session: its runs (one per turn) and the exchanges of each run."""

    name: str
    runs: list[clis.Run]
    turns: list[list[clis.Exchange]]  # per run, in order
    requests_before: dict[str, float]
    requests_after: dict[str, float]
    router_log: str  # what the router logged during the session

    def report(self) -> str:
        lines = [f"{self.name}:"]
        for run, exchanges in zip(self.runs, self.turns, strict=True):
            lines.append(run.summary())
            lines += ["  " + x.line() for x in exchanges]
        return "\n".join(lines)

    def model_requests(self, turn: int) -> list[clis.Exchange]:
        return [x for x in self.turns[turn]
                if x.method == "POST" and x.path.split("?")[0] in TURN_PATHS]


@pytest.fixture(scope="module")
def cli_bundle(kvagent_bundle: KVAgentBundle) -> KVAgentBundle:
    """The suite's bundle (`SUITE_MAX_MODEL_LEN` holds Claude Code's first request); each
    play measures its own share of the router's counters and log."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason or "kvagent bundle unavailable")
    return kvagent_bundle


@pytest.fixture(scope="module")
def played(cli_bundle: KVAgentBundle, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Played]:
    """Each CLI's session, played once (lazily, by `play`) and shared by its tests."""
    return {}


def play(cache: dict[str, Played], b: KVAgentBundle, name: str,
         tmp_path_factory: pytest.TempPathFactory) -> Played:
    if name in cache:
        return cache[name]
    root = tmp_path_factory.mktemp(f"cli-{name}")
    if shutil.which("npm") is None or shutil.which("node") is None:
        skip_unless_required("node and npm are not installed (the CLIs install with npm)")
    # A failed install fails here, with npm's own output: never a skip.
    clis.ensure_cli(name)
    home, work = root / "home", root / "work"
    work.mkdir(parents=True)
    # A project, as a user runs an agent in (Codex refuses to run outside a git repository).
    subprocess.run(["git", "init", "-q", str(work)], check=True, timeout=60)
    with clis.Recorder(b.router_url) as rec:
        s = clis.session(name, home=home, base_url=rec.url, model=b.model, api_key=API_KEY,
                         prompts=PROMPTS)
        before = _requests_by_status(b.router_url)
        log = _router_log(b)
        log_start = log.stat().st_size
        runs, turns = [], []
        for argv in s.turns:
            mark = rec.mark()
            runs.append(clis.run(argv, env=s.env, cwd=work, timeout=TURN_TIMEOUT_S))
            turns.append(rec.since(mark))
        after = _requests_by_status(b.router_url)
    with open(log, "rb") as f:
        f.seek(log_start)
        logged = f.read().decode("utf-8", "replace")
    cache[name] = Played(name, runs, turns, before, after, logged)
    return cache[name]


def _router_log(b: KVAgentBundle) -> Path:
    assert b.run_dir is not None
    path = Path(b.run_dir, LOG_DIR, "router.log")
    assert path.exists(), f"no router log at {path}"
    return path


def _requests_by_status(router_url: str) -> dict[str, float]:
    """`kvagent_router_requests_total` summed per status (every turn the router served)."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'kvagent_router_requests_total\{([^}]*)\} (\S+)$', line)
        if m:
            status = re.search(r'status="(\d+)"', m.group(1))
            key = status.group(1) if status else "?"
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


@pytest.fixture(params=CLIS)
def session(request: pytest.FixtureRequest, played: dict[str, Played], cli_bundle: KVAgentBundle,
            tmp_path_factory: pytest.TempPathFactory) -> Played:
    return play(played, cli_bundle, request.param, tmp_path_factory)


def _token_session(report: dict[str, object] | None) -> str | None:
    """The session a reuse report's cache token is bound to (the token's payload claim
    `s`, docs/protocol.md): which conversation the router filed the turn under."""
    token = (report or {}).get("cache_token")
    if not isinstance(token, str) or token.count(".") != 2:
        return None
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    session = claims.get("s")
    return session if isinstance(session, str) else None


# --------------------------------------------------------------------------- the tests


def test_every_request_answered(session: Played) -> None:
    """The CLI spoke its API, every request it sent got a 2xx, and the router counted no
    refused or failed turn."""
    p = session
    sent = [x for turn in p.turns for x in turn]
    assert sent, p.report()
    assert all(p.model_requests(i) for i in range(len(p.turns))), p.report()
    assert {x.path.split("?")[0] for x in sent if x.method == "POST"} <= {
        APIS[p.name], "/v1/messages/count_tokens"}, p.report()
    failed = [x for x in sent if not 200 <= x.status < 300]
    assert not failed, "\n".join(
        [x.line() + "\n    " + x.answer[:600] + "\n    request: " + x.body.decode()[:4000]
         for x in failed]) + "\n" + p.report()
    served = {k: v - p.requests_before.get(k, 0.0) for k, v in p.requests_after.items()}
    assert {k: v for k, v in served.items() if v and not k.startswith("2")} == {}, served
    turns = sum(len(p.model_requests(i)) for i in range(len(p.turns)))
    assert sum(v for k, v in served.items() if k.startswith("2")) >= turns, served
    troubles = [line for line in p.router_log.splitlines()
                if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not troubles, p.router_log[-6000:]


def test_no_error_surfaced(session: Played) -> None:
    """Every invocation exits 0 and the CLI shows no error (its own JSON events, stderr):
    the model ended each turn itself, so Claude Code neither retried past `max_tokens` nor
    reported `max_output_tokens`."""
    p = session
    for run in p.runs:
        assert run.returncode == 0 and not run.timed_out, p.report()
        assert clis.surfaced_errors(p.name, run) == [], p.report()


def test_later_turns_reuse(session: Played) -> None:
    """Every model request of turns 2 and 3 continued held KV (the router's report), and
    the CLI's own usage counts cached input tokens on those turns."""
    p = session
    assert len(p.runs) == len(PROMPTS), p.report()
    for turn in range(1, len(p.runs)):
        requests = p.model_requests(turn)
        missed = [x for x in requests if not (
            x.kvagent and x.kvagent.get("path") in replay.REUSE_PATHS and x.reused_tokens > 0)]
        assert requests and not missed, p.report()
        cached = clis.cached_tokens(p.name, p.runs[turn])
        if p.name in clis.CUMULATIVE_USAGE:  # the session's total so far: this run's share
            cached -= clis.cached_tokens(p.name, p.runs[turn - 1])
        assert cached > 0, p.report()


def test_session_identified(session: Played) -> None:
    """The router files every turn under the conversation the CLI names, the way the
    Agents page says: Claude Code's `X-Claude-Code-Session-Id`, Codex's `session-id` /
    `thread-id`, OpenCode's `x-session-id` (kvagent's own header, which it sends beside
    `x-session-affinity`); one conversation across the three invocations."""
    p = session
    requests = [x for i in range(len(p.turns)) for x in p.model_requests(i)]
    keys = set()
    untokened = 0
    for x in requests:
        if p.name == "opencode":
            expected = x.headers.get("x-session-id")
            assert expected and x.headers.get("x-session-affinity") == expected, x.headers
        else:
            agent = from_agents(x.headers, x.json or {})
            assert agent is not None and agent.source == {"claude": "claude_code",
                                                          "codex": "codex"}[p.name], x.headers
            expected = agent.key
        keys.add(expected)
        if _token_session(x.kvagent) is None and p.name == "opencode":
            untokened += 1  # a branch of the session: checked against the router's log
            continue
        assert _token_session(x.kvagent) == expected, x.line()
    assert len(keys) == 1, keys
    # OpenCode's title request shares the session id. When its answer is held before the
    # conversation's first request arrives, the conversation does not continue the
    # session's latest held turn: the router serves it as a branch of that session, found
    # by content, with no cache token (docs/router.md, "Stored responses and branches").
    # The router's log names the session and the branch: one branch for the conversation.
    branched = _branches(p.router_log)
    assert len(branched) == untokened, (untokened, p.router_log[-3000:])
    assert {s for s, _ in branched} <= keys and len({b for _, b in branched}) <= 1, branched


def _branches(router_log: str) -> list[tuple[str, str]]:
    """(session, branch) of each turn the router logged as a branch of a named session."""
    return re.findall(r"session (\S+): the turn does not continue .* branch (\S+)", router_log)


def test_first_request_size(session: Played) -> None:
    """Records what the CLI sends first (its size shows in the test's output with -rA);
    checks it fits the bundle's context with room to answer."""
    p = session
    # The agent's first turn: the first request with tools (OpenCode titles its session
    # first, without tools). Nothing is held yet, so its usage counts the whole prompt.
    first = next(x for x in p.model_requests(0) if (x.json or {}).get("tools"))
    usage_prompt = _prompt_tokens(first)
    print(f"{p.name}: first turn request {len(first.body)} B, {usage_prompt} prompt tokens, "
          f"headers {sorted(first.headers)}")
    for i, run in enumerate(p.runs):
        print(f"  run {i + 1}: exit {run.returncode}, {run.seconds:.1f}s, CLI-reported cached "
              f"{clis.cached_tokens(p.name, run)}; " + "; ".join(
                  f"{(x.kvagent or {}).get('path')} reused {x.reused_tokens}"
                  for x in p.model_requests(i)))
    assert usage_prompt and usage_prompt < SUITE_MAX_MODEL_LEN, first.line()


def _prompt_tokens(x: clis.Exchange) -> int | None:
    found = re.findall(r'"(?:input_tokens|prompt_tokens)":\s*(\d+)', x.answer)
    return max(int(n) for n in found) if found else None
