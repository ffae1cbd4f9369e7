"""HTTP POST to a URL a user gave, without letting it reach what the operator did not
allow (SSRF): the host is resolved, every address checked against the allow-list
(settings WEBHOOK_ALLOWED_HOSTS / _NETWORKS), and the connection made to a checked address,
so a DNS answer that changes between check and connect cannot redirect the request.
Redirects are not followed. Webhook delivery (`jobs.services.webhooks`) is its user.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from jobs.services.errors import ServiceError
from jobs.wire import host_listed

log = logging.getLogger(__name__)

USER_AGENT = "batchweb-webhooks/1"
# How much of a response body is kept (WebhookDelivery.response_excerpt).
EXCERPT = 500


class NotAllowed(ServiceError):
    """The URL is malformed or its address is not allowed by the operator (a 400)."""


def _host_allowed(host: str) -> bool:
    return host_listed(host, settings.BATCHWEB["WEBHOOK_ALLOWED_HOSTS"])


def _address_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    for entry in settings.BATCHWEB["WEBHOOK_ALLOWED_NETWORKS"]:
        if entry == "public":
            if address.is_global:
                return True
            continue
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            log.warning("ignoring bad WEBHOOK_ALLOWED_NETWORKS entry %r", entry)
            continue
        if address.version == network.version and address in network:
            return True
    return False


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
    if not _host_allowed(host) and not all(_address_allowed(a) for a in addresses):
        raise NotAllowed(f"The webhook address {host} ({addresses[0]}) is not allowed by this "
                         "service's operator (BATCHWEB_WEBHOOK_ALLOWED_HOSTS / "
                         "_NETWORKS).", param="webhook_url")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    unique = list(dict.fromkeys(str(a) for a in addresses))
    return Target(parts.scheme, host, port, path, unique)


def _connect(addresses: list[str], port: int, timeout: float | None) -> socket.socket:
    """A connection to the first of the checked addresses that answers (as
    socket.create_connection does for a name, without resolving it again)."""
    error: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout)
        except OSError as exc:
            error = exc
    raise error or OSError("no address to connect to")


class _PinnedHTTP(http.client.HTTPConnection):
    """HTTP to a fixed, already checked address (the Host header keeps the name)."""

    def __init__(self, target: Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._addresses = target.addresses

    def connect(self) -> None:
        self.sock = _connect(self._addresses, self.port, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a fixed, already checked address, verifying the certificate for the name."""

    def __init__(self, target: Target, timeout: float) -> None:
        context = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout, context=context)
        self._addresses = target.addresses
        self._ssl_context = context

    def connect(self) -> None:
        sock = _connect(self._addresses, self.port, self.timeout)
        self.sock = self._ssl_context.wrap_socket(sock, server_hostname=self.host)


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
    timeout = settings.BATCHWEB["WEBHOOK_TIMEOUT_SECONDS"]
    connection_class = _PinnedHTTPS if target.scheme == "https" else _PinnedHTTP
    conn = connection_class(target, timeout)
    try:
        conn.request("POST", target.path, body=body, headers={
            **headers, "Content-Type": "application/json", "User-Agent": USER_AGENT})
        response = conn.getresponse()
        excerpt = response.read(EXCERPT).decode("utf-8", "replace")
        ok = 200 <= response.status < 300
        return Outcome(ok=ok, status_code=response.status, excerpt=excerpt,
                       error="" if ok else f"HTTP {response.status}")
    except (OSError, http.client.HTTPException) as exc:
        return Outcome(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        conn.close()
