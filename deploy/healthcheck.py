"""The web container's health check: the login page answers 200 through Granian and Django.

    python deploy/healthcheck.py [URL]      (default http://127.0.0.1:8000/accounts/login/)

It asks as the proxy would: with a Host that ALLOWED_HOSTS accepts (else Django answers 400)
and X-Forwarded-Proto https (else, with BATCHWEB_HTTPS on, a redirect to https). A
redirect is a failure, never followed: it would leave the container. The page needs no
database, so a database outage does not mark the web container unhealthy: that shows on
/metrics and the admin's queue-health page instead.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/accounts/login/"


def host_header(allowed_hosts: str) -> str:
    """A Host the first ALLOWED_HOSTS entry accepts ('.example.com' accepts example.com)."""
    first = allowed_hosts.split(",")[0].strip().lstrip(".")
    return "localhost" if first in ("", "*") else first


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def check(url: str, *, allowed_hosts: str, timeout: float = 4.0) -> str:
    """'' when healthy, else what failed."""
    request = urllib.request.Request(url, headers={
        "Host": host_header(allowed_hosts), "X-Forwarded-Proto": "https"})
    try:
        with urllib.request.build_opener(_NoRedirect).open(request, timeout=timeout) as resp:
            return "" if resp.status == 200 else f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except OSError as exc:
        return f"{url}: {exc}"


if __name__ == "__main__":
    problem = check(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_URL,
                    allowed_hosts=os.environ.get("ALLOWED_HOSTS", "localhost"))
    if problem:
        sys.exit(f"unhealthy: {problem}")
