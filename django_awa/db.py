"""The hot path's statements, run with server-side binding and prepared plans.

Django's PostgreSQL cursors bind parameters on the client: every value is
quoted into the SQL text in Python and each statement is planned again. The
statements django-awa runs per job (claim, finalize, heartbeat, enqueue) go
instead through a plain psycopg cursor on the *same* connection, so they
join the caller's transaction exactly as the ORM does, but bind parameters
on the server, and those in ``sql.PREPARED`` reuse a prepared plan. Errors
are wrapped into Django's database exceptions, as the ORM's are.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connections
from psycopg.postgres import types as pg_types
from psycopg.pq import Format

from . import sql

# Prepared statements are per connection; a transaction-mode pooler that does
# not track them (PgBouncer before 1.21) needs AWA["PREPARED_STATEMENTS"] off.
_prepare: dict[str, bool] = {}

# Django opens psycopg connections with prepare_threshold=None, and psycopg
# reads None as "prepare nothing", not even an execute(prepare=True). A
# threshold no statement reaches keeps Django's behaviour for its own queries
# (none is prepared behind its back) and lets ours be prepared when asked.
_NEVER_AUTOMATICALLY = sys.maxsize


# Aliases database_alias() has found to be PostgreSQL.
checked_aliases: set[str] = set()


def use_prepared(alias: str) -> bool:
    if alias not in _prepare:
        from .conf import awa_settings

        _prepare[alias] = awa_settings().prepared_statements
    return _prepare[alias]


def forget_settings() -> None:
    """Drop what was worked out from AWA and DATABASES (they changed)."""
    _prepare.clear()
    checked_aliases.clear()


# Django loads timestamptz through a Python subclass of psycopg's loader that
# re-labels each value with the connection's time zone: about 3 µs a value,
# five times psycopg's own. With Django's default (USE_TZ, the database in
# UTC) the label is the one psycopg's loader gives already.
_TIMESTAMPTZ_OID = pg_types["timestamptz"].oid
_PSYCOPG_TIMESTAMPTZ = psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)


def int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of ints, for a ``%(name)s::bigint[]`` parameter."""
    return "{" + ",".join(map(str, values)) + "}"


@contextmanager
def cursor(alias: str) -> Iterator[Cursor]:
    """A cursor on ``alias``'s Django connection, in its current transaction.

    One psycopg cursor is kept per connection and reused: opening one, with
    its own adapters and an empty dumper cache, was a fifth of an enqueue's
    Python time. A nested use (a follow-up function that enqueues while an
    outer statement's rows are read) gets a cursor of its own.
    """
    wrapper = connections[alias]
    wrapper.ensure_connection()
    connection = wrapper.connection
    prepare = use_prepared(alias)
    if prepare and connection.prepare_threshold is None:
        connection.prepare_threshold = _NEVER_AUTOMATICALLY
    utc = wrapper.timezone is dt.UTC
    held: Cursor | None = getattr(wrapper, _HELD, None)
    if held is not None and not held._busy and held._fits(connection, utc):
        current = held
    else:
        current = Cursor(_open(connection, utc), utc)
        if held is None or not held._busy:
            setattr(wrapper, _HELD, current)
    current._busy = True
    current._prepare = prepare
    try:
        with wrapper.wrap_database_errors:
            yield current
    finally:
        current._busy = False
        if current is not getattr(wrapper, _HELD, None):
            current._raw.close()


# The attribute of a Django DatabaseWrapper (one per thread and alias) that
# holds its reusable cursor.
_HELD = "_awa_cursor"


def _open(connection: psycopg.Connection[Any], utc: bool) -> psycopg.Cursor[Any]:
    raw = psycopg.Cursor(connection)
    if utc:
        raw.adapters.register_loader(_TIMESTAMPTZ_OID, _PSYCOPG_TIMESTAMPTZ)
    return raw


class Cursor:
    __slots__ = ("_busy", "_prepare", "_raw", "_utc")

    def __init__(self, raw: psycopg.Cursor[Any], utc: bool) -> None:
        self._raw = raw
        self._utc = utc
        self._prepare = False
        self._busy = False

    def _fits(self, connection: psycopg.Connection[Any], utc: bool) -> bool:
        """Whether this cursor may serve ``connection`` (after a reconnect it may not)."""
        raw = self._raw
        return raw.connection is connection and not raw.closed and self._utc == utc

    def execute(self, statement: str, params: Mapping[str, Any] | None = None) -> Cursor:
        prepare = self._prepare and statement in sql.PREPARED
        self._raw.execute(statement, params, prepare=prepare)  # type: ignore[arg-type]
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._raw.fetchone()

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._raw.fetchall()

    def copy_rows(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        """``COPY ... FROM STDIN`` of ``rows``, in the cursor's transaction."""
        with self._raw.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)

    @property
    def rowcount(self) -> int:
        return self._raw.rowcount
