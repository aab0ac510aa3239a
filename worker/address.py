"""The address a worker advertises to the other nodes of a gang, and its network interface.

Node 0 of a multi-node attempt hosts torchrun's rendezvous store, and the other nodes reach
it at the address it advertises (``MASTER_ADDR``). The host name is a poor default: on many
distributions it resolves to 127.0.1.1, which no other host can reach. The default here is
the address of the interface this host uses to reach the broker: the one a kernel route
picks for it, found by "connecting" a UDP socket (no packet is sent). An operator may name
the address instead (``TRAINQ_ADVERTISE_HOST``, ``trainq worker --advertise-host``).

The interface that holds that address is handed to gloo and NCCL too
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``), so the collectives use the same network
as the rendezvous rather than the first interface the library finds.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Advertised", "advertise", "interface_of", "route_address"]

_SIOCGIFADDR = 0x8915  # linux/sockios.h


@dataclass(frozen=True)
class Advertised:
    host: str  # what other nodes connect to (MASTER_ADDR of node 0)
    ifname: str | None  # the interface that holds it; None: not an address of this host


def route_address(host: str, port: int) -> str:
    """This host's source address for packets to ``host:port`` (the kernel's route choice)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))  # UDP: sets the route, sends nothing
        return str(s.getsockname()[0])


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # no IPv4 address on it, or it is down
            return None
    return socket.inet_ntoa(raw[20:24])


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address``; None if there is none."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def advertise(broker_url: str, override: str | None = None) -> Advertised:
    """The address to advertise: ``override`` if given, else the address that reaches the
    broker's host; with the interface holding it, when it is one of this host's."""
    host = override
    if not host:
        parts = urlsplit(broker_url)
        target = parts.hostname or "127.0.0.1"
        try:
            target = socket.gethostbyname(target)
            host = route_address(target, parts.port or 6379)
        except OSError:  # no route, or a name that does not resolve: the host name
            host = socket.gethostname()
    try:
        ifname = interface_of(socket.gethostbyname(host))
    except OSError:
        ifname = None
    return Advertised(host, ifname)
