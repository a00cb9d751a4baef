"""Node choice: least loaded, stable ties, decode affinity yielding to health and load."""

from __future__ import annotations

import itertools

import pytest
from kvagent_server.router.reuse.placement import NodeState, pick_decode, pick_prefill


def node(node_id: str, role: str = "decode", *, healthy: bool = True, in_flight: int = 0,
         max_in_flight: int = 8) -> NodeState:
    return NodeState(node_id=node_id, url=f"http://127.0.0.1:80{node_id[-1]}", role=role,
                     healthy=healthy, in_flight=in_flight, epoch="e", max_in_flight=max_in_flight)


def test_pick_prefill_least_loaded_healthy_prefill_node() -> None:
    nodes = [node("p1", "prefill", in_flight=3), node("p2", "prefill", in_flight=1),
             node("p3", "prefill", in_flight=0, healthy=False), node("d1", in_flight=0)]
    assert pick_prefill(nodes).node_id == "p2"  # type: ignore[union-attr]


def test_pick_prefill_uses_relative_load() -> None:
    nodes = [node("p1", "prefill", in_flight=4, max_in_flight=32),
             node("p2", "prefill", in_flight=2, max_in_flight=4)]
    assert pick_prefill(nodes).node_id == "p1"  # type: ignore[union-attr]


def test_pick_prefill_none_without_healthy_prefill_nodes() -> None:
    assert pick_prefill([]) is None
    assert pick_prefill([node("p1", "prefill", healthy=False), node("d1")]) is None


def test_ties_break_stably_whatever_the_order() -> None:
    nodes = [node("p2", "prefill"), node("p1", "prefill"), node("p3", "prefill")]
    for order in itertools.permutations(nodes):
        assert pick_prefill(order).node_id == "p1"  # type: ignore[union-attr]
        assert pick_decode([n.model_copy(update={"role": "decode"}) for n in order],
                           affinity=None)[0].node_id == "p1"  # type: ignore[union-attr]


def test_saturated_nodes_are_still_chosen_when_all_are_saturated() -> None:
    nodes = [node("p1", "prefill", in_flight=9), node("p2", "prefill", in_flight=8)]
    assert pick_prefill(nodes).node_id == "p2"  # type: ignore[union-attr]


def test_decode_without_affinity_is_least_loaded() -> None:
    chosen, why = pick_decode([node("d1", in_flight=2), node("d2", in_flight=1)], affinity=None)
    assert (chosen.node_id, why) == ("d2", "least_loaded")  # type: ignore[union-attr]


def test_decode_keeps_affinity_under_moderate_load() -> None:
    nodes = [node("d1", in_flight=3), node("d2", in_flight=0)]
    chosen, why = pick_decode(nodes, affinity="d1")
    assert (chosen.node_id, why) == ("d1", "affinity")  # type: ignore[union-attr]
    # by URL as well as by id
    chosen, why = pick_decode(nodes, affinity="http://127.0.0.1:801")
    assert (chosen.node_id, why) == ("d1", "affinity")  # type: ignore[union-attr]


def test_decode_affinity_already_least_loaded() -> None:
    chosen, why = pick_decode([node("d1"), node("d2", in_flight=1)], affinity="d1")
    assert (chosen.node_id, why) == ("d1", "affinity")  # type: ignore[union-attr]


@pytest.mark.parametrize(("aff_load", "best_load", "factor", "kept"), [
    (3, 0, 4.0, True),    # (3+1) <= 4 * (0+1)
    (4, 0, 4.0, False),   # (4+1) >  4 * 1
    (7, 1, 4.0, True),    # 8 <= 8
    (7, 0, 8.0, True),
    (1, 0, 1.0, False),   # factor 1: any extra load moves the session
    (0, 0, 1.0, True),
])
def test_decode_affinity_yields_to_overload(aff_load: int, best_load: int, factor: float,
                                            kept: bool) -> None:
    nodes = [node("d1", in_flight=aff_load, max_in_flight=100),
             node("d2", in_flight=best_load, max_in_flight=100)]
    chosen, why = pick_decode(nodes, affinity="d1", overload_factor=factor)
    if kept:
        assert (chosen.node_id, why) == ("d1", "affinity")  # type: ignore[union-attr]
    else:
        assert (chosen.node_id, why) == ("d2", "affinity_overloaded")  # type: ignore[union-attr]


def test_decode_affinity_yields_when_saturated_and_another_is_not() -> None:
    nodes = [node("d1", in_flight=8, max_in_flight=8), node("d2", in_flight=6)]
    chosen, why = pick_decode(nodes, affinity="d1")
    assert (chosen.node_id, why) == ("d2", "affinity_overloaded")  # type: ignore[union-attr]


def test_decode_affinity_unhealthy_or_unknown() -> None:
    nodes = [node("d1", healthy=False), node("d2", in_flight=5)]
    assert pick_decode(nodes, affinity="d1")[1] == "affinity_unhealthy"
    assert pick_decode(nodes, affinity="d1")[0].node_id == "d2"  # type: ignore[union-attr]
    assert pick_decode(nodes, affinity="gone")[1] == "affinity_unknown"
    # a prefill node's id is not a decode affinity
    assert pick_decode([node("p1", "prefill"), *nodes], affinity="p1")[1] == "affinity_unknown"


def test_decode_with_no_healthy_node() -> None:
    assert pick_decode([node("d1", healthy=False)], affinity="d1") == (None, "no_healthy_node")
    assert pick_decode([], affinity=None) == (None, "no_healthy_node")


def test_bad_overload_factor() -> None:
    with pytest.raises(ValueError):
        pick_decode([node("d1")], affinity=None, overload_factor=0.5)
