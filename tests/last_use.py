"""The suite's shared engines, each stopped right after the last test that needs it.

`e2e`, `vllm_node` and `kvagent_bundle` are session fixtures holding vLLM nodes (a P/D
bundle each, or one node). Kept to the end of the session, every later real-engine module
starts its own nodes beside all of them: on the 24 GiB machine, a P/D pair starting next
to the three ran out of memory and the kernel killed an engine mid-start. So:

- the collection counts each engine's users (a test that takes the fixture, directly or
  through another, or carries `@pytest.mark.shared_engine("name")` when it asks for the
  fixture by name at run time);
- the real-engine modules run grouped by the first engine they share, in `SHARED` order,
  so at most two engines overlap (`order_real_engine_items`);
- an engine is stopped after its last user's teardown (`finished`), not at session end.

Running a subset (`-k`, a node id) counts only the selected tests, so an engine still stops
after the last one that runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

#: The shared engines, in the order their users run.
SHARED = ("e2e", "vllm_node", "kvagent_bundle")


class _Item(Protocol):
    nodeid: str

    def iter_markers(self, name: str) -> Iterable[object]: ...


_left: Counter[str] = Counter()
_stops: dict[str, Callable[[], None]] = {}
_stopped: set[str] = set()


def engines_of(item: _Item) -> set[str]:
    """The shared engines a collected test needs."""
    names = set(getattr(item, "fixturenames", ()))
    for mark in item.iter_markers("shared_engine"):
        names.update(getattr(mark, "args", ()))
    return names & set(SHARED)


def count(items: Iterable[_Item]) -> None:
    """Counts each shared engine's users among the tests this run will execute."""
    _left.clear()
    _stopped.clear()
    for item in items:
        _left.update(engines_of(item))


def register(name: str, stop: Callable[[], None]) -> Callable[[], None]:
    """Records how to stop the engine `name`; returns a stop that runs once however often
    it is called (early, after the last user, and again when the session fixture ends)."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            _stops.pop(name, None)
            stop()

    _stops[name] = once
    return once


def finished(item: _Item, *, module_ends: bool) -> None:
    """After a test's teardown: counts it done, and where its module ends (the module's
    own fixtures, which may use an engine, are gone) stops every engine with no users
    left."""
    for name in engines_of(item):
        _left[name] -= 1
    if not module_ends:
        return
    for name in SHARED:
        if _left[name] <= 0 and name not in _stopped:
            _stopped.add(name)
            stop = _stops.get(name)
            if stop is not None:
                stop()


def check_live(name: str) -> None:
    """Fails clearly where a test asks at run time for an engine the count missed."""
    if name in _stopped:
        raise RuntimeError(f"the shared engine {name!r} was stopped after what the "
                           f"collection counted as its last test: mark the test "
                           f"@pytest.mark.shared_engine({name!r})")


def module_rank(engines: set[str]) -> int:
    """Where a real-engine module runs: with the users of the first engine it shares."""
    return min((SHARED.index(e) for e in engines), default=len(SHARED))


def order_real_engine_items(items: list[_Item], is_real: Callable[[str], bool]) -> None:
    """Reorders, in place, the real-engine modules' tests by `module_rank` (stable: modules
    keep their order within a rank, tests their order within a module). Other tests keep
    their places."""
    slots = [i for i, it in enumerate(items) if is_real(module_of(it))]
    engines: dict[str, set[str]] = {}
    for i in slots:
        engines.setdefault(module_of(items[i]), set()).update(engines_of(items[i]))
    ranked = sorted((items[i] for i in slots),
                    key=lambda it: module_rank(engines[module_of(it)]))
    for i, it in zip(slots, ranked, strict=True):
        items[i] = it


def module_of(item: _Item) -> str:
    return item.nodeid.split("::", 1)[0]
