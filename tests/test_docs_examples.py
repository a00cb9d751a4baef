"""Every Python block in README.md and docs/*.md runs, against the router with fake nodes;
the pages a new user starts from (`BUNDLE_PAGES`) run against the real bundle too.

A page's blocks run in order in one namespace (a later block may use what an earlier one
defined, as a reader would), in a fresh working directory, with:

- `url` and `model` defined: the base URL and model name of the server under test (the
  docs use these names for "your server");
- the docs' literal server `http://127.0.0.1:8000/v1` and model `kvagent-demo` pointed at
  that server: the real router in front of fake P/D nodes (tests/fakes/nodes.py), or, for
  `BUNDLE_PAGES`, also the suite's real bundle (`kvagent_bundle` in tests/conftest.py: vLLM
  P and D nodes with the demo model, as `kvagent-server up` starts them), where each page's
  `BUNDLE_CHECKS` then check what the page promises (e.g. the second turn reuses KV);
- top-level `await` / `async with` allowed (a block is then run with `asyncio.run`).

A block that cannot run here is marked on the line before its fence with
`<!-- docs-test: skip REASON -->`; the reason is required. Any other failure fails the
page's test.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes import Stack
from fakes.threaded import MODEL, threaded_router_stack

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_URL = "http://127.0.0.1:8000/v1"
DOC_MODEL = "kvagent-demo"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\b(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the marker's reason, when marked

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, indent = i, m["fence"], m["indent"]
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i].removeprefix(indent))
            i += 1
        i += 1
        if m["lang"] not in ("python", "py"):
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        skip = marker["reason"].strip() if marker else None
        blocks.append(Block(page, start + 1, textwrap.dedent("\n".join(body)) + "\n", skip))
    return blocks


def test_every_marker_sits_on_a_python_block_and_gives_a_reason() -> None:
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        marked = {b.line for b in python_blocks(page) if b.skip is not None}
        for number, line in enumerate(lines, 1):
            m = MARKER.match(line)
            if not m:
                continue
            assert m["reason"].strip(), f"{page.name}:{number}: a skip marker needs a reason"
            fence = next(n for n in range(number, len(lines)) if lines[n].strip()) + 1
            assert fence in marked, f"{page.name}:{number}: marker not before a python block"


def test_the_docs_have_python_blocks_to_run() -> None:
    runnable = [b for p in PAGES for b in python_blocks(p) if b.skip is None]
    assert len(runnable) >= 15, [b.where() for b in runnable]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with threaded_router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        yield st


def _run(block: Block, namespace: dict[str, object], url: str, model: str) -> None:
    source = block.code.replace(DOC_URL, url).replace(DOC_MODEL, model)
    # Line numbers in tracebacks point into the page.
    tree = ast.increment_lineno(compile(source, str(block.page), "exec", flags=(
        ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)), block.line)
    code = compile(tree, str(block.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if code.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(code, namespace))
    else:
        exec(code, namespace)  # noqa: S102 - our own documentation


#: A valid 1x1 PNG (the smallest real image a docs example can send).
_PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


def _run_page(page: Path, url: str, model: str, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Run the page's unmarked blocks in order against `url`/`model`; the namespace."""
    monkeypatch.chdir(tmp_path)
    # The media files the pages' examples open, as a reader would have them at hand.
    (tmp_path / "cat.png").write_bytes(_PNG_1X1)
    for name in ("KVAGENT_BASE_URL", "KVAGENT_MODEL", "KVAGENT_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    namespace: dict[str, object] = {"__name__": "__main__", "url": url, "model": model}
    ran = 0
    for block in python_blocks(page):
        if block.skip is not None:
            continue
        try:
            _run(block, namespace, url, model)
        except Exception as exc:
            raise AssertionError(
                f"the block at {block.where()} failed against {url}: "
                f"{type(exc).__name__}: {exc}\n"
                f"(mark it `<!-- docs-test: skip REASON -->` only if it cannot run "
                f"standalone)\n{block.code}") from exc
        ran += 1
    if ran == 0:
        pytest.skip(f"every python block of {page.name} is marked skip")
    assert os.getcwd() == str(tmp_path)
    return namespace


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page: Path, stack: Stack, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    _run_page(page, f"{stack.url}/v1", MODEL, tmp_path, monkeypatch)
    assert not stack.cluster.events_of("wrong_kv")


# ----------------------------------------------------------------- on the real bundle


def _readme_second_turn_reuses(namespace: dict[str, Any]) -> None:
    from kvagent_server.bundle.render import BUILTIN_DEFAULT_MAX_TOKENS

    first, second = namespace["first"], namespace["second"]
    # An answer without max_tokens is bounded (the bundle's default for the built-in model),
    # not the rest of the 16k context, which left the second turn no room (HTTP 400).
    assert 0 < first.usage.completion_tokens <= BUILTIN_DEFAULT_MAX_TOKENS, first.usage
    assert first.path in ("pd_fresh", "d_fresh") and first.cache_token_received
    assert second.path in ("pd_reuse", "d_direct"), (second.path, second.router)
    assert second.reused_tokens and second.reused_tokens > 0
    assert second.usage.cached_tokens > 0 and second.time_to_first_token is not None


def _getting_started_agent_runs(namespace: dict[str, Any]) -> None:
    from kvagent_server.bundle.render import BUILTIN_DEFAULT_MAX_TOKENS

    run = namespace["run"]
    assert run.steps and run.stop_reason in ("final", "max_steps")
    assert all(step.usage is not None
               and step.usage.completion_tokens <= BUILTIN_DEFAULT_MAX_TOKENS
               for step in run.steps)
    assert all(step.path in ("pd_reuse", "d_direct") for step in run.steps[1:])


#: The pages a new user runs first, against `kvagent-server up`, and what each must show.
BUNDLE_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "README.md": _readme_second_turn_reuses,
    "docs/getting-started.md": _getting_started_agent_runs,
}
BUNDLE_PAGES = [ROOT / name for name in BUNDLE_CHECKS]


def test_bundle_pages_have_blocks_to_run() -> None:
    for page in BUNDLE_PAGES:
        assert any(b.skip is None for b in python_blocks(page)), page
