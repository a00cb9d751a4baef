"""The shared engines' lifetimes (`last_use`): grouped users, a stop after the last one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import last_use
import pytest


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ()
    marks: list[SimpleNamespace] = field(default_factory=list)

    def iter_markers(self, name: str) -> Iterator[SimpleNamespace]:
        return iter(self.marks if name == "shared_engine" else [])


def real(module: str) -> bool:
    return module.endswith("_vllm.py")


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    """The module keeps the running session's counts: save and restore them."""
    saved = (last_use._left.copy(), dict(last_use._stops), set(last_use._stopped))
    yield
    last_use._left.clear()
    last_use._left.update(saved[0])
    last_use._stops.clear()
    last_use._stops.update(saved[1])
    last_use._stopped.clear()
    last_use._stopped.update(saved[2])


def test_real_engine_modules_group_by_shared_engine_and_others_keep_their_places() -> None:
    items = [
        Item("a_vllm.py::t1", ("kvagent_bundle",)),
        Item("b.py::t"),
        Item("a_vllm.py::t2"),
        Item("c_vllm.py::t", ("tmp_path",)),
        Item("d_vllm.py::t", ("e2e", "tmp_path")),
        Item("e_vllm.py::t", marks=[SimpleNamespace(args=("vllm_node",))]),
        Item("f.py::t"),
    ]
    last_use.order_real_engine_items(items, real)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "d_vllm.py::t", "b.py::t", "e_vllm.py::t", "a_vllm.py::t1", "a_vllm.py::t2",
        "c_vllm.py::t", "f.py::t"]


def test_an_engine_stops_once_when_the_module_of_its_last_user_ends() -> None:
    items = [Item("m1_vllm.py::a", ("e2e",)), Item("m1_vllm.py::b"),
             Item("m2_vllm.py::a", ("e2e",)), Item("m2_vllm.py::b"),
             Item("m3_vllm.py::a")]
    last_use.count(items)  # type: ignore[arg-type]
    stops: list[str] = []
    stop = last_use.register("e2e", lambda: stops.append("e2e"))

    def run(i: int) -> None:
        nxt = items[i + 1] if i + 1 < len(items) else None
        ends = nxt is None or last_use.module_of(nxt) != last_use.module_of(items[i])
        last_use.finished(items[i], module_ends=ends)  # type: ignore[arg-type]

    run(0)
    run(1)
    assert stops == []  # a later module still uses it
    run(2)
    assert stops == []  # its module's own fixtures may still hold it
    run(3)
    assert stops == ["e2e"]
    run(4)
    stop()  # the session fixture's own teardown
    assert stops == ["e2e"]


def test_asking_for_an_engine_after_its_counted_last_use_fails_clearly() -> None:
    items = [Item("m_vllm.py::a", ("kvagent_bundle",))]
    last_use.count(items)  # type: ignore[arg-type]
    last_use.check_live("kvagent_bundle")
    last_use.finished(items[0], module_ends=True)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="shared_engine\\('kvagent_bundle'\\)"):
        last_use.check_live("kvagent_bundle")
