"""The address a worker advertises (worker.address), found with this host's real routes."""

from __future__ import annotations

import socket

from worker.address import advertise, interface_of, route_address


def test_the_default_is_the_address_that_reaches_the_broker_with_its_interface() -> None:
    found = advertise("redis://127.0.0.1:6379/1")
    assert (found.host, found.ifname) == ("127.0.0.1", interface_of("127.0.0.1"))
    assert found.ifname is not None and found.ifname in dict(socket.if_nameindex()).values()


def test_an_address_given_by_the_operator_wins_and_names_its_interface() -> None:
    assert advertise("redis://127.0.0.1:6379/1", "127.0.0.1").host == "127.0.0.1"
    given = advertise("redis://127.0.0.1:6379/1", "192.0.2.7")  # TEST-NET: not on this host
    assert (given.host, given.ifname) == ("192.0.2.7", None)


def test_the_route_address_is_a_local_address() -> None:
    addr = route_address("127.0.0.1", 6379)
    with socket.socket() as s:
        s.bind((addr, 0))  # only a local address can be bound
    assert interface_of("192.0.2.7") is None
