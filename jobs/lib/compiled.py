"""Queries that polls run on every request, their SQL built once per process.

Building the SQL is most of what a small query costs in Django: on the 2-core machines of
`bench/RESULTS.md`, reading one batch row through the ORM took ~0.7 ms of CPU, of which the
database's own answer ~0.05 ms. A poll of a running batch does little else, so the queries it
runs are built once, from the same queryset the ORM would run, and afterwards only executed
with new values: the rows, the models built from them and the queries counted by Django's
debug tools are exactly the ORM's.
"""

from __future__ import annotations

import itertools
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

from django.db import connections
from django.db.models import QuerySet
from django.db.models.query import ModelIterable

# Stand-ins for the values while the SQL is built, told apart from each other (and from
# anything else in the query) in its parameters; as numbers they fit integer (of 32 bits:
# PostgreSQL's ORM drops a comparison with a number out of a column's range) and text
# columns alike.
_PROBE = 1_919_000_001
# The names of the statements prepared on each PostgreSQL connection (a new connection has
# none), and a source of names for them.
_PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()
_PREPARED_LOCK = threading.Lock()
_NAMES = itertools.count(1)


class Compiled:
    """`build(**values)`'s queryset, compiled on first use: `rows(**values)` runs it with
    those values. `build` must be a plain queryset (filters, order, slice, annotations;
    no select_related or prefetch) whose values each appear as parameters of its SQL."""

    def __init__(self, build: Callable[..., QuerySet[Any, Any]], *names: str) -> None:
        self.build = build
        self.names = names
        self._plan: tuple[Any, ...] | None = None
        self._statement = f"batchweb_compiled_{next(_NAMES)}".encode()

    def _compile(self) -> tuple[Any, ...]:
        probes = {name: _PROBE + i for i, name in enumerate(self.names)}
        queryset = self.build(**probes)
        compiler = queryset.query.get_compiler(using=queryset.db)
        sql, params = compiler.as_sql()
        # Each parameter: the name of a value, or a constant of the query itself.
        order: list[tuple[str | None, Any]] = []
        for param in params:
            named = [name for name, probe in probes.items() if str(probe) == str(param)]
            order.append((named[0], None) if named else (None, param))
        if {name for name, _ in order} - {None} != set(self.names):
            raise ValueError(f"{self.build}: not every one of {self.names} is a parameter")
        columns = [column for column, _, _ in compiler.select]
        converters = compiler.get_converters(columns)
        model_part = None
        if queryset._iterable_class is ModelIterable:  # rows are models, not values
            fields = compiler.klass_info["select_fields"]
            model_part = (queryset.model, fields[0], fields[-1] + 1,
                          [columns[i].target.attname for i in fields],
                          list(compiler.annotation_col_map.items()))
        # The SQL in the driver's own parameter style (see raw_rows): sqlite3 takes "?", as
        # Django's SQLite cursor rewrites it on each call; psycopg takes "%s".
        driver_sql = sql
        vendor = connections[queryset.db].vendor
        if vendor == "sqlite":
            driver_sql = re.sub(r"(?<!%)%s", "?", sql).replace("%%", "%")
        elif vendor == "postgresql":  # libpq's numbered parameters (see _pg_rows)
            numbers = itertools.count(1)
            driver_sql = re.sub(r"(?<!%)%s", lambda _: f"${next(numbers)}", sql).replace("%%", "%")
            driver_sql = f"SELECT CAST(q AS text) FROM ({driver_sql}) AS q"
        return queryset.db, sql, order, list(converters.items()), model_part, driver_sql

    def raw_rows(self, **values: Any) -> list[Any]:
        """The rows as the database driver gives them, before the ORM's conversions: what
        a caller that only compares rows needs (jobs.http.polls, on every poll of a batch).

        The query runs on the driver's own cursor with its SQL made ready once: Django's
        cursor rewrites the placeholders of every query on SQLite (a regular expression
        over the whole SQL: ~60 us of a ~250 us poll here) and wraps each call. Django's
        debug tools therefore do not count this query.

        On PostgreSQL each row comes as one value, the row's text form (a distinct text for
        distinct values; NULL and "" differ), as bytes: psycopg turning a batch row's 35
        columns into Python values cost the web process more than the query itself (~0.13
        ms a poll, against ~0.08 ms for the one text value). See _pg_rows for the rest."""
        plan = self._plan
        if plan is None:
            plan = self._plan = self._compile()
        db, _, order, _, _, driver_sql = plan
        wrapper = connections[db]  # this thread's
        wrapper.ensure_connection()
        params = [constant if name is None else values[name] for name, constant in order]
        if wrapper.vendor == "postgresql":
            return self._pg_rows(wrapper, driver_sql, params)
        cursor = wrapper.connection.cursor()
        try:
            cursor.execute(driver_sql, params)
            return cursor.fetchall()
        finally:
            cursor.close()

    def _pg_rows(self, wrapper: Any, sql: str, params: list[Any]) -> list[Any]:
        # Through libpq itself, skipping psycopg's cursor (its parameter and result
        # machinery cost ~0.13 ms of CPU a query on the Zen 3 of bench/RESULTS.md, libpq
        # ~0.03-0.05 ms), and as a statement prepared once per connection: PostgreSQL
        # parsing and planning the ~2 kB query took ~0.35 ms of the 2 cores on every poll.
        # Behind a pooler in transaction mode a connection's statements may be another
        # session's, so there each query is parsed again.
        from psycopg import errors, pq

        connection = wrapper.connection
        pgconn = connection.pgconn
        values = [None if v is None else (b"t" if v else b"f") if isinstance(v, bool)
                  else str(v).encode() for v in params]
        if wrapper.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
            result = pgconn.exec_params(sql.encode(), values)
        else:
            with _PREPARED_LOCK:
                prepared = _PREPARED.setdefault(connection, set())
            if self._statement not in prepared:
                made = pgconn.prepare(self._statement, sql.encode())
                if made.status != pq.ExecStatus.COMMAND_OK:
                    raise errors.error_from_result(made, encoding=connection.info.encoding)
                prepared.add(self._statement)
            result = pgconn.exec_prepared(self._statement, values)
        if result.status != pq.ExecStatus.TUPLES_OK:
            # The statement may be gone with the session (a DISCARD ALL): made again next.
            with _PREPARED_LOCK:
                _PREPARED.pop(connection, None)
            raise errors.error_from_result(result, encoding=connection.info.encoding)
        return [(result.get_value(row, 0),) for row in range(result.ntuples)]

    def rows(self, **values: Any) -> list[Any]:
        """The queryset's results for these values: models, or tuples for values_list."""
        plan = self._plan
        if plan is None:
            plan = self._plan = self._compile()
        db, sql, order, converters, model_part, _ = plan
        connection = connections[db]  # this thread's
        with connection.cursor() as cursor:
            cursor.execute(sql, [constant if name is None else values[name]
                                 for name, constant in order])
            rows: list[Any] = cursor.fetchall()
        if converters:  # as the ORM's compiler.apply_converters does
            rows = [list(row) for row in rows]
            for row in rows:
                for position, (functions, expression) in converters:
                    value = row[position]
                    for function in functions:
                        value = function(value, expression, connection)
                    row[position] = value
        if model_part is None:
            return [tuple(row) for row in rows]
        model, start, end, attnames, annotations = model_part
        objects = []
        for row in rows:
            obj = model.from_db(db, attnames, row[start:end])
            for name, position in annotations:
                setattr(obj, name, row[position])
            objects.append(obj)
        return objects
