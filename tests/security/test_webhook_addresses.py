"""Webhook address checks (`jobs.lib.safehttp.check_url`): a refusal does not say where a name
points, a listed host name does not admit private addresses behind it, and IPv6 forms that
carry an IPv4 address (NAT64, 6to4, IPv4-compatible) are refused unless their network is
listed."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from jobs.lib import safehttp

# Addresses whose embedded IPv4 address is loopback or private: a gateway may deliver
# them there, although `ipaddress` calls them global.
IPV4_CARRYING = {
    "64:ff9b::7f00:1": "64:ff9b::/96",  # NAT64 well-known prefix -> 127.0.0.1
    "64:ff9b:1::a00:1": "64:ff9b:1::/48",  # NAT64 local-use prefix -> 10.0.0.1
    "2002:7f00:1::1": "2002::/16",  # 6to4 -> 127.0.0.1
    "::a00:1": "::/96",  # IPv4-compatible -> 10.0.0.1
}


def allow(settings: Any, *, hosts: list[str] | None = None,
          networks: list[str] | None = None) -> None:
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_HOSTS": hosts or [],
                         "WEBHOOK_ALLOWED_NETWORKS": networks or []}


@pytest.fixture
def resolve_to(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make every name resolve to the given addresses (as a DNS answer would)."""
    def answer(*addresses: str) -> None:
        def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list:
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6,
                     "", (a, port)) for a in addresses]
        monkeypatch.setattr(safehttp.socket, "getaddrinfo", getaddrinfo)
    return answer


def test_a_refusal_does_not_reveal_the_resolved_address(settings, resolve_to):
    allow(settings, networks=["public"])
    resolve_to("10.20.30.40")
    with pytest.raises(safehttp.NotAllowed) as caught:
        safehttp.check_url("http://hooks.internal.example:8080/x")
    assert "hooks.internal.example" in caught.value.message
    assert "10.20.30.40" not in caught.value.message
    assert "not allowed" in caught.value.message

    # Nor when the name is listed but points somewhere private.
    allow(settings, hosts=["hooks.internal.example"])
    with pytest.raises(safehttp.NotAllowed) as caught:
        safehttp.check_url("http://hooks.internal.example:8080/x")
    assert "10.20.30.40" not in caught.value.message


def test_a_listed_host_name_does_not_admit_private_addresses(settings, resolve_to):
    allow(settings, hosts=["hooks.example.com", ".example.org"])
    for private in ("10.0.0.5", "127.0.0.1", "169.254.169.254", "192.168.1.1", "::1",
                    "fd00::1", "::ffff:10.0.0.5"):
        resolve_to(private)
        for url in ("https://hooks.example.com/x", "https://a.example.org/x"):
            with pytest.raises(safehttp.NotAllowed):
                safehttp.check_url(url)
    # One private address among public ones is enough to refuse.
    resolve_to("93.184.216.34", "10.0.0.5")
    with pytest.raises(safehttp.NotAllowed):
        safehttp.check_url("https://hooks.example.com/x")

    # Public addresses of a listed name are fine without "public".
    resolve_to("93.184.216.34", "2606:2800:220:1::1")
    target = safehttp.check_url("https://hooks.example.com/x")
    assert target.addresses == ["93.184.216.34", "2606:2800:220:1::1"]
    # A name that is not listed is not: the host list was the only permission.
    with pytest.raises(safehttp.NotAllowed):
        safehttp.check_url("https://other.example.net/x")

    # The operator lists the private network itself: now it is reachable.
    allow(settings, hosts=["hooks.example.com"], networks=["10.0.0.0/8"])
    resolve_to("10.0.0.5")
    assert safehttp.check_url("https://hooks.example.com/x").addresses == ["10.0.0.5"]


@pytest.mark.parametrize("address", sorted(IPV4_CARRYING))
def test_ipv6_carrying_ipv4_is_refused_unless_its_network_is_listed(settings, resolve_to,
                                                                     address):
    resolve_to(address)
    for hosts, networks in ((["hooks.example.com"], []), ([], ["public"]),
                            (["hooks.example.com"], ["public", "2606:2800::/32"])):
        allow(settings, hosts=hosts, networks=networks)
        with pytest.raises(safehttp.NotAllowed):
            safehttp.check_url("https://hooks.example.com/x")
        with pytest.raises(safehttp.NotAllowed):
            safehttp.check_url(f"https://[{address}]/x")
    allow(settings, networks=[IPV4_CARRYING[address]])
    assert safehttp.check_url("https://hooks.example.com/x").addresses == [address]


def test_public_still_admits_global_addresses(settings, resolve_to):
    allow(settings, networks=["public"])
    for address in ("93.184.216.34", "2606:2800:220:1::1", "::ffff:5db8:d822"):
        resolve_to(address)  # the last: 93.184.216.34, IPv4-mapped
        assert safehttp.check_url("https://hooks.example.com/x").addresses == [address]
