"""Where trainq may send a request of its own: the address policy for outbound URLs.

Webhook deliveries (service.api.webhooks) and tracker URIs (trainer.tracking) name hosts that
a user chose; the service's host can reach what the user cannot (loopback, the private
network, the cloud metadata service), so a URL a user gives is checked before anything is
sent: ``check_url`` when it is given (scheme, host, a literal address), ``pinned_addresses``
when it is used (the name resolved once; the request then goes to those addresses, so a
second lookup cannot answer differently, as DNS rebinding would).

Refused always: link-local (169.254.0.0/16, which holds the metadata service 169.254.169.254,
and fe80::/10), the AWS IPv6 metadata address fd00:ec2::254, multicast, unspecified,
reserved and broadcast addresses, and the IPv4-mapped/compatible/6to4/Teredo/NAT64 forms of any
refused IPv4 address. Refused unless ``allow_private`` (an admin's setting, e.g.
``TRAINQ_WEBHOOK_ALLOW_LOOPBACK=1``): loopback, private (RFC 1918, fc00::/7, 100.64.0.0/10).

Standard library only: imported by the trainer as well as the service.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

__all__ = ["OutboundRefused", "Unresolved", "address_refusal", "check_url", "pinned_addresses"]

_METADATA = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack
        ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
    }
)
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class OutboundRefused(ValueError):
    """A URL or an address trainq will not send to; the message says why."""


class Unresolved(OutboundRefused):
    """A host name that does not resolve (now: it may later)."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, compatible, 6to4, Teredo), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    packed = ip.packed
    if packed[:12] == bytes(12) and packed[12:] != bytes(4) and int(ip) > 1:
        return ipaddress.IPv4Address(packed[12:])  # IPv4-compatible ::a.b.c.d
    if ip in _NAT64:  # 64:ff9b::a.b.c.d: a NAT64 gateway forwards it to a.b.c.d
        return ipaddress.IPv4Address(packed[12:])
    return None


def address_refusal(ip: IPAddress, *, allow_private: bool = False) -> str | None:
    """Why ``ip`` may not be sent to, or None if it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            why = address_refusal(inner, allow_private=allow_private)
            return f"{why} (as {ip})" if why else None
        if ip.scope_id:
            return f"{ip} is a scoped (link-local) address"
    if ip in _METADATA:
        return f"{ip} is a cloud metadata address"
    if ip.is_link_local:
        return f"{ip} is a link-local address"
    if ip.is_multicast:
        return f"{ip} is a multicast address"
    if ip.is_unspecified:
        return f"{ip} is the unspecified address"
    if ip.is_loopback:
        return None if allow_private else f"{ip} is a loopback address"
    if ip.is_private or ip in _CGNAT:
        # is_private also covers documentation and other special-purpose ranges
        return None if allow_private else f"{ip} is a private address"
    if ip.is_reserved or not ip.is_global:
        return f"{ip} is a reserved address"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    # Forms inet_aton still accepts and some resolvers too: 2130706433, 0x7f.1, 0177.0.0.1.
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def check_url(url: str, *, allow_private: bool = False) -> urllib.parse.SplitResult:
    """``url`` split, if it is http(s) with a host that is not a refused literal address;
    OutboundRefused otherwise. A host name is checked where it is resolved
    (``pinned_addresses``), as its addresses may change."""
    if not isinstance(url, str) or len(url) > 2048:
        raise OutboundRefused("must be an http or https URL of at most 2048 characters")
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise OutboundRefused("must not contain spaces or control characters")
    if not url.isascii():  # what is sent is what was checked: no encoding on the way
        raise OutboundRefused(
            "must be ASCII: write a host name in its punycode form (xn--...) and"
            " percent-encode the rest"
        )
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise OutboundRefused(f"is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise OutboundRefused("must be an http or https URL")
    host = parts.hostname
    if not host:
        raise OutboundRefused("must name a host")
    if parts.username is not None or parts.password is not None:
        raise OutboundRefused("must not carry credentials")
    if port == 0:
        raise OutboundRefused("must not name port 0")
    if "%" in host:
        raise OutboundRefused(f"{host} is a scoped (link-local) address")
    ip = _literal(host)
    if ip is not None:
        why = address_refusal(ip, allow_private=allow_private)
        if why:
            raise OutboundRefused(why)
    elif host.rstrip(".").lower() in ("localhost", "localhost.localdomain") and not allow_private:
        raise OutboundRefused(f"{host} is a loopback address")
    return parts


# Names are resolved on these threads, each lookup waited for at most RESOLVE_TIMEOUT_S: a
# tenant's slow name server holds one of them, never a request's thread for longer, and
# with all of them held a lookup ends at once as not resolving (its caller checks again).
_RESOLVERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="trainq-resolve")
RESOLVE_TIMEOUT_S = 5.0


def pinned_addresses(
    host: str, port: int, *, allow_private: bool = False, timeout_s: float = RESOLVE_TIMEOUT_S
) -> list[str]:
    """The addresses ``host`` resolves to, once (connect to these, not to the name);
    OutboundRefused if it does not resolve (within ``timeout_s``) or if ANY of them is
    refused (a name that answers with one public and one private address is refused
    whole)."""
    lookup = _RESOLVERS.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=timeout_s)
    except TimeoutError:
        lookup.cancel()
        raise Unresolved(f"{host} does not resolve within {timeout_s:g} s") from None
    except (OSError, UnicodeError) as exc:
        raise Unresolved(f"{host} does not resolve: {exc}") from None
    found: list[str] = []
    for info in infos:
        text = str(info[4][0])
        ip = ipaddress.ip_address(text.split("%", 1)[0])
        why = (
            f"{text} is a scoped (link-local) address"
            if "%" in text
            else address_refusal(ip, allow_private=allow_private)
        )
        if why:
            raise OutboundRefused(f"{host} resolves to a refused address: {why}")
        if text not in found:
            found.append(text)
    if not found:
        raise Unresolved(f"{host} does not resolve")
    return found
