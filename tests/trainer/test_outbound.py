"""trainer.outbound: the addresses trainq refuses to connect to on a tenant's behalf."""

from __future__ import annotations

import socket
import threading

import pytest

from trainer.outbound import OutboundRefused, Unresolved, check_url, pinned_addresses

REFUSED = [
    "http://127.0.0.1:5000",
    "http://localhost:5000",
    "http://[::1]/",
    "http://10.1.2.3/",
    "http://192.168.0.10/",
    "http://172.16.5.4/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/",
    "http://[::ffff:127.0.0.1]/",  # IPv4-mapped loopback
    "http://[::ffff:169.254.169.254]/",
    "http://0.0.0.0/",
    "http://224.0.0.1/",
    "http://100.64.0.1/",  # shared address space (carrier NAT)
    "http://[fe80::1]/",
    "http://[64:ff9b::7f00:1]/",  # NAT64 to 127.0.0.1
    "http://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "http://[::127.0.0.1]/",  # IPv4-compatible
]


@pytest.mark.parametrize("url", REFUSED)
def test_private_and_metadata_addresses_are_refused(url: str) -> None:
    with pytest.raises(OutboundRefused):
        check_url(url)


def test_the_admin_setting_allows_private_but_never_metadata() -> None:
    assert check_url("http://127.0.0.1:5000", allow_private=True).port == 5000
    assert check_url("http://localhost:5000", allow_private=True).hostname == "localhost"
    for url in ("http://169.254.169.254/", "http://[fd00:ec2::254]/", "http://[::ffff:a9fe:a9fe]/"):
        with pytest.raises(OutboundRefused, match="metadata"):
            check_url(url, allow_private=True)


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/", "file:///etc/passwd", "http://user:pw@example.com/", "http:///x",
     "http://example.com:99999/", "http://exa mple.com/"],
)  # fmt: skip
def test_malformed_or_credentialed_urls_are_refused(url: str) -> None:
    with pytest.raises(OutboundRefused):
        check_url(url, allow_private=True)


def test_public_addresses_and_names_pass_the_url_check() -> None:
    assert check_url("https://93.184.216.34/x").hostname == "93.184.216.34"
    assert check_url("https://mlflow.example.com:8443/").port == 8443


def test_pinned_addresses_resolve_and_check_every_address() -> None:
    assert pinned_addresses("127.0.0.1", 80, allow_private=True) == ["127.0.0.1"]
    with pytest.raises(OutboundRefused, match="loopback"):
        pinned_addresses("localhost", 80)
    with pytest.raises(OutboundRefused, match="does not resolve"):
        pinned_addresses("no-such-host.invalid", 80)
    assert pinned_addresses("93.184.216.34", 443) == ["93.184.216.34"]


def test_a_name_whose_server_does_not_answer_is_unresolved_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tenant's name server that never answers holds a resolver thread, not its caller.
    (The name server is the outside edge: getaddrinfo is replaced by one that blocks.)"""
    release = threading.Event()

    def never(*_: object, **__: object) -> list[object]:
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", never)
    try:
        with pytest.raises(Unresolved, match=r"does not resolve within 0\.2 s"):
            pinned_addresses("slow.example", 443, timeout_s=0.2)
    finally:
        release.set()
