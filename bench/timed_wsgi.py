"""The service's WSGI application with what each request cost, for the benchmarks only.

`gunicorn bench.timed_wsgi:application` serves exactly `batchweb.wsgi.application` and adds
one header to every answer:

    Server-Timing: app;dur=WALL, cpu;dur=CPU, db;dur=DB;desc="QUERIES", memo;desc="M"

WALL is the time in Django (ms), CPU the CPU time its thread spent meanwhile (ms), DB the time
spent waiting on database queries (ms) and QUERIES their number; M is 1 when the answer was
a remembered poll (jobs.http.polls), else 0. The difference WALL - CPU - DB
is time the thread was ready but not running (the GIL held by another thread of the process,
or the core taken by another process) or waiting on Redis. What gunicorn spends around the
call (reading and parsing the request, writing the answer, its event loop) is not in these
figures: the benchmark gets it from the processes' CPU time less the sum of the CPU figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import django
from django.db import connection

# Django is set up before the service's modules are imported: the poll memo's module reads
# models (the sessions') as it is imported.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")
django.setup(set_prefix=False)

from batchweb.wsgi import application as _service  # noqa: E402
from jobs.http.polls import REMEMBERED  # noqa: E402


class _Queries:
    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool,
                 context: dict[str, Any]) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - started


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    queries = _Queries()
    wall, cpu = time.perf_counter(), time.thread_time()
    held: list[Any] = []

    def hold(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        held[:] = [status, headers, exc_info]
        return lambda data: None  # the service never uses write()

    # Django's answer is complete once it returns (the polled views do not stream), so the
    # header can still be added before the answer starts.
    with connection.execute_wrapper(queries):
        body = _service(environ, hold)
        chunks = list(body)
        if hasattr(body, "close"):
            body.close()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    status, headers, exc_info = held
    timing = (f"app;dur={wall * 1000:.3f}, cpu;dur={cpu * 1000:.3f}, "
              f'db;dur={queries.seconds * 1000:.3f};desc="{queries.count}", '
              f'memo;desc="{int(bool(environ.get(REMEMBERED)))}"')
    headers.append(("Server-Timing", timing))
    start_response(status, headers, exc_info)
    return chunks
