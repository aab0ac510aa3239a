"""Where trainq may connect on a user's behalf: the outbound-URL policy (stdlib only, no torch).

A URL from a spec (a webhook endpoint, a tracking server) is an outbound request the service's
or a worker's network makes for a tenant: it must not reach loopback, link-local, private,
multicast, reserved or unspecified addresses, nor the cloud metadata endpoint
(169.254.169.254, fd00:ec2::254), nor those in IPv4-mapped or -compatible IPv6 spellings,
unless an admin setting allows private ones. ``check_url`` looks at the URL as written (its
host may be a name); ``pinned_addresses`` resolves the name once, refuses it if any of its
addresses is refused, and returns them for the caller to connect to.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

__all__ = ["OutboundRefused", "check_url", "pinned_addresses"]

_METADATA = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class OutboundRefused(ValueError):
    """A URL or address trainq will not connect to; the message says why."""


def _refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_private: bool) -> str | None:
    """Why ``ip`` is refused, or None. The metadata endpoint is refused always."""
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is None and ip.packed[:12] == bytes(12) and int(ip) > 1:
            mapped = ipaddress.IPv4Address(ip.packed[12:])  # IPv4-compatible ::a.b.c.d
        if mapped is None and ip in _NAT64:
            mapped = ipaddress.IPv4Address(ip.packed[12:])  # 64:ff9b::a.b.c.d reaches a.b.c.d
        if mapped is not None:
            return _refusal(mapped, allow_private)
    if ip in _METADATA:
        return "a cloud metadata address"
    if allow_private:
        return None
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return f"a {kind.replace('_', '-')} address"
    if not ip.is_global:  # shared address space (100.64/10) and the like
        return "not a public address"
    return None


def check_url(url: str, *, allow_private: bool = False) -> urllib.parse.SplitResult:
    """The URL split, if it is an http(s) URL with a host, no credentials, and (when its host
    is an address, not a name) an address allowed; OutboundRefused otherwise."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # a malformed port raises here
    except ValueError as exc:
        raise OutboundRefused(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise OutboundRefused("must be an http:// or https:// URL")
    if not parts.hostname:
        raise OutboundRefused("must name a host")
    if parts.username is not None or parts.password is not None:
        raise OutboundRefused("must not carry credentials (user:password@)")
    if any(c in url for c in "\x00\r\n\t "):
        raise OutboundRefused("must not contain whitespace or control characters")
    host = parts.hostname.rstrip(".").lower()
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        if not allow_private:
            raise OutboundRefused(f"host {host} is a loopback name")
        return parts
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return parts  # a name: pinned_addresses checks what it resolves to
    why = _refusal(ip, allow_private)
    if why is not None:
        raise OutboundRefused(f"host {host} is {why}")
    return parts


def pinned_addresses(host: str, port: int, *, allow_private: bool = False) -> list[str]:
    """Every address ``host`` resolves to (resolved once, here), each allowed; else
    OutboundRefused naming the first refused one, or saying the name does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise OutboundRefused(f"host {host} does not resolve: {exc}") from None
    found: list[str] = []
    for *_, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]
        why = _refusal(ipaddress.ip_address(address), allow_private)
        if why is not None:
            raise OutboundRefused(f"host {host} resolves to {address}, {why}")
        if address not in found:
            found.append(address)
    if not found:
        raise OutboundRefused(f"host {host} does not resolve")
    return found
