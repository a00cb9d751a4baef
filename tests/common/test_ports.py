"""The port helper draws outside the kernel's ephemeral range, where no outgoing
connection can take a port between the pick and the late bind."""

from __future__ import annotations

import socket

from kvagent_server.common import ports


def test_draw_ranges_leave_out_the_ephemeral_range_and_small_slivers() -> None:
    assert ports.draw_ranges((32768, 60999)) == [range(10000, 32768), range(61000, 65536)]
    assert ports.draw_ranges((1024, 65000)) == []  # 535 ports above: too few to draw from
    assert ports.draw_ranges(None) == []


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    picked = ports.free_ports(20)
    assert len(set(picked)) == 20
    eph = ports.ephemeral_range()
    if eph is not None and ports.draw_ranges(eph):
        assert not any(eph[0] <= p <= eph[1] for p in picked), (picked, eph)
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_bound_port_is_not_free_and_is_not_picked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert not ports.port_free(port)
        monkeypatch.setattr(ports, "draw_ranges", lambda _e: [range(port, port + 1)])
        got = ports.free_ports(2)  # the one drawable port is taken: the kernel supplies both
        assert port not in got and len(set(got)) == 2
