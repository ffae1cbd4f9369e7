"""Login throttling with django-axes: two limits, and the address a login came from.

axes keeps a failure count for each group of AXES_LOCKOUT_PARAMETERS and compares the
largest with one limit (AXES_FAILURE_LIMIT). The IP's count includes the pair's, so it is
always the largest: answering LOGIN_FAILURES_PER_IP locks an address after that many
failures across all accounts, and answering LOGIN_FAILURES_PER_USER once the pair itself has
reached it locks the address out of that one account sooner.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.http import HttpRequest


def login_failure_limit(request: HttpRequest, credentials: dict[str, Any] | None) -> int:
    """AXES_FAILURE_LIMIT for this login attempt (axes' database handler)."""
    from axes.attempts import get_cool_off_threshold
    from axes.helpers import get_client_username
    from axes.models import AccessAttempt

    # The same window axes counts in: failures older than the cool-off are forgotten.
    pair_failures = AccessAttempt.objects.filter(
        username=get_client_username(request, credentials),
        ip_address=request.axes_ip_address,  # type: ignore[attr-defined]  # set by axes
        attempt_time__gte=get_cool_off_threshold(request),
    ).aggregate(total=Sum("failures_since_start"))["total"] or 0
    if pair_failures >= settings.LOGIN_FAILURES_PER_USER:
        return int(settings.LOGIN_FAILURES_PER_USER)
    return int(settings.LOGIN_FAILURES_PER_IP)


def client_ip(request: HttpRequest) -> str:
    """AXES_CLIENT_IP_CALLABLE: the address a login came from.

    Without proxies it is the peer's address. Behind BATCHWEB_PROXY_COUNT reverse proxies
    each one appends the address it was reached from to X-Forwarded-For, so the client's is
    that many entries from the right; whatever stands left of it the client wrote itself, and
    trusting it would let one attacker pose as any number of addresses (or as its victim's).
    """
    peer = str(request.META.get("REMOTE_ADDR", ""))
    count = int(settings.BATCHWEB_PROXY_COUNT)
    if count <= 0:
        return peer
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
            if hop.strip()]
    # Fewer entries than proxies: the request did not come through them all.
    return hops[-count] if len(hops) >= count else peer
