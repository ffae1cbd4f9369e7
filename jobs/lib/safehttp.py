"""HTTP POST to a URL a user gave, without letting it reach what the operator did not
allow (SSRF): the host is resolved, every address checked against the allow-list
(settings WEBHOOK_ALLOWED_HOSTS / _NETWORKS), and the connection made to a checked address,
so a DNS answer that changes between check and connect cannot redirect the request.
Redirects are not followed. Webhook delivery (`jobs.services.webhooks`) is its user.

A listed host name vouches for the name, not for where it points: its addresses must still
be globally routable, or lie in a network the operator listed. IPv6 ranges that carry an
IPv4 address a gateway forwards to (NAT64, 6to4, IPv4-compatible) count as global to
`ipaddress` but may lead to 127.0.0.1 or 10.x, so only a listed network admits them.
Refusals never say which address a name resolved to (that would map the operator's
network for whoever sets a webhook URL). An attempt, connect, send and read together, ends
at WEBHOOK_TIMEOUT_SECONDS, so a receiver that answers a byte at a time cannot hold a
worker longer than that.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from engine.endpoints.media import host_listed
from jobs.lib.errors import ServiceError

log = logging.getLogger(__name__)

USER_AGENT = "batchweb-webhooks/1"
# How much of a response body is kept (WebhookDelivery.response_excerpt).
EXCERPT = 500


class NotAllowed(ServiceError):
    """The URL is malformed or its address is not allowed by the operator (a 400)."""


def _host_allowed(host: str) -> bool:
    return host_listed(host, settings.BATCHWEB["WEBHOOK_ALLOWED_HOSTS"])


# IPv6 ranges with an IPv4 address inside (NAT64 well-known and local-use prefixes, 6to4,
# IPv4-compatible): `ipaddress` calls most of them global, yet a gateway on the way may
# deliver them to the embedded IPv4 address, private or loopback included.
IPV4_CARRYING = tuple(ipaddress.ip_network(n) for n in (
    "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96"))


def _listed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for entry in settings.BATCHWEB["WEBHOOK_ALLOWED_NETWORKS"]:
        if entry == "public":
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            log.warning("ignoring bad WEBHOOK_ALLOWED_NETWORKS entry %r", entry)
    return networks


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return address.is_global and not any(
        address.version == n.version and address in n for n in IPV4_CARRYING)


def _address_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address, *,
                     host_listed: bool) -> bool:
    """An address in a network the operator listed; else a public one, if the host name
    or "public" is listed."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if any(address.version == n.version and address in n for n in _listed_networks()):
        return True
    if not _is_public(address):
        return False
    return host_listed or "public" in settings.BATCHWEB["WEBHOOK_ALLOWED_NETWORKS"]


@dataclass
class Target:
    scheme: str
    host: str
    port: int
    path: str
    addresses: list[str]  # the checked IPs the connection may be made to, in order


def check_url(url: str) -> Target:
    """Parse, resolve and check a webhook URL. Raises NotAllowed (400)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise NotAllowed("The webhook URL is not a valid URL.", param="webhook_url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NotAllowed("The webhook URL must be an http:// or https:// URL.",
                         param="webhook_url")
    if parts.username or parts.password:
        raise NotAllowed("The webhook URL must not contain credentials.", param="webhook_url")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise NotAllowed(f"The webhook host {host} could not be resolved ({exc}).",
                         param="webhook_url") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise NotAllowed(f"The webhook host {host} has no address.", param="webhook_url")
    host_listed = _host_allowed(host)
    if not all(_address_allowed(a, host_listed=host_listed) for a in addresses):
        raise NotAllowed(f"The webhook host {host} is not allowed by this service's "
                         "operator (BATCHWEB_WEBHOOK_ALLOWED_HOSTS / _NETWORKS).",
                         param="webhook_url")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    unique = list(dict.fromkeys(str(a) for a in addresses))
    return Target(parts.scheme, host, port, path, unique)


class _Deadline:
    """The end of one attempt. A socket timeout bounds each wait, not their sum (a receiver
    sending a byte a second never trips it), so a timer shuts the connection down when the
    attempt's time is up, whatever it is waiting for."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.passed = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        left = self._at - time.monotonic()
        if left <= 0 or self.passed:
            raise TimeoutError("timed out")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.passed:
                self._shutdown()

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is None:
            return
        # The plain socket's shutdown, also for TLS: it wakes a read or write blocked in
        # the worker's thread, without touching the TLS state that thread is using. It
        # fails only on a socket no longer connected, which has nothing left to cut.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _connect(addresses: list[str], port: int, deadline: _Deadline) -> socket.socket:
    """A connection to the first of the checked addresses that answers (as
    socket.create_connection does for a name, without resolving it again)."""
    error: OSError | None = None
    for address in addresses:
        try:
            sock = socket.create_connection((address, port), deadline.remaining())
        except OSError as exc:
            error = exc
            continue
        deadline.watch(sock)
        return sock
    raise error or OSError("no address to connect to")


class _PinnedHTTP(http.client.HTTPConnection):
    """HTTP to a fixed, already checked address (the Host header keeps the name)."""

    def __init__(self, target: Target, deadline: _Deadline) -> None:
        super().__init__(target.host, target.port, timeout=deadline.seconds)
        self._addresses = target.addresses
        self._deadline = deadline

    def connect(self) -> None:
        self.sock = _connect(self._addresses, self.port, self._deadline)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a fixed, already checked address, verifying the certificate for the name."""

    def __init__(self, target: Target, deadline: _Deadline) -> None:
        context = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=deadline.seconds, context=context)
        self._addresses = target.addresses
        self._deadline = deadline
        self._ssl_context = context

    def connect(self) -> None:
        sock = _connect(self._addresses, self.port, self._deadline)
        tls = self._ssl_context.wrap_socket(sock, server_hostname=self.host,
                                            do_handshake_on_connect=False)
        # Wrapping took the file descriptor over: the deadline now watches the TLS socket,
        # before the handshake (a receiver may drip that too).
        self._deadline.watch(tls)
        self.sock = tls
        tls.do_handshake()


@dataclass
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str = ""
    excerpt: str = ""
    permanent: bool = False  # retrying cannot help (address not allowed)


def post(url: str, *, body: bytes, headers: dict[str, str]) -> Outcome:
    """POST `body` as JSON to `url` if its address is allowed; never raises for network
    failures, which come back as an Outcome that is not ok."""
    try:
        target = check_url(url)
    except NotAllowed as exc:
        return Outcome(ok=False, error=exc.message, permanent=True)
    deadline = _Deadline(settings.BATCHWEB["WEBHOOK_TIMEOUT_SECONDS"])
    connection_class = _PinnedHTTPS if target.scheme == "https" else _PinnedHTTP
    conn = connection_class(target, deadline)
    try:
        conn.request("POST", target.path, body=body, headers={
            **headers, "Content-Type": "application/json", "User-Agent": USER_AGENT})
        response = conn.getresponse()
        # The status is in: a body cut short by the deadline only shortens the excerpt.
        excerpt = response.read(EXCERPT).decode("utf-8", "replace")
        ok = 200 <= response.status < 300
        return Outcome(ok=ok, status_code=response.status, excerpt=excerpt,
                       error="" if ok else f"HTTP {response.status}")
    except (OSError, http.client.HTTPException) as exc:
        if deadline.passed:
            return Outcome(ok=False, error=f"TimeoutError: timed out: no answer within "
                                           f"{deadline.seconds:g} s")
        return Outcome(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        deadline.cancel()
        conn.close()
