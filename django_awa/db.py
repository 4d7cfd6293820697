"""The hot path's statements, run with server-side binding and prepared plans.

Django's PostgreSQL cursors bind parameters on the client: every value is
quoted into the SQL text in Python and each statement is planned again. The
statements django-awa runs per job (claim, finalize, heartbeat, enqueue) go
instead through a plain psycopg cursor on the *same* connection, so they
join the caller's transaction exactly as the ORM does, but bind parameters
on the server, and those in ``sql.PREPARED`` reuse a prepared plan. An
enqueue that is its own transaction skips the cursor too (``fetch_one``).
Errors are wrapped into Django's database exceptions, as the ORM's are.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connections
from psycopg.adapt import Transformer
from psycopg.postgres import types as pg_types
from psycopg.pq import ConnStatus, DiagnosticField, ExecStatus, Format, TransactionStatus

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
    current = _kept(wrapper, connection, utc) or Cursor(_open(connection, utc), utc)
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


def _kept(wrapper: Any, connection: psycopg.Connection[Any], utc: bool) -> Cursor | None:
    """The connection's kept cursor, made anew if it no longer fits; None while it is in use."""
    held: Cursor | None = getattr(wrapper, _HELD, None)
    if held is not None and held._busy:
        return None
    if held is None or not held._fits(connection, utc):
        held = Cursor(_open(connection, utc), utc)
        setattr(wrapper, _HELD, held)
    return held


def _open(connection: psycopg.Connection[Any], utc: bool) -> psycopg.Cursor[Any]:
    raw = psycopg.Cursor(connection)
    if utc:
        raw.adapters.register_loader(_TIMESTAMPTZ_OID, _PSYCOPG_TIMESTAMPTZ)
    return raw


class Cursor:
    __slots__ = (
        "_busy", "_direct_names", "_encoding", "_prepare", "_raw", "_transformer", "_utc",
    )  # fmt: skip

    def __init__(self, raw: psycopg.Cursor[Any], utc: bool) -> None:
        self._raw = raw
        self._utc = utc
        self._prepare = False
        self._busy = False
        # For fetch_direct: the statements it has prepared, and its row loader.
        self._encoding = raw.connection.info.encoding
        self._direct_names: set[bytes] = set()
        self._transformer: Transformer | None = None

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

    def fetch_direct(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run a statement that is its own transaction with libpq's ``PQexecPrepared``.

        A psycopg cursor's execute spends about 40 µs of Python per statement
        (query conversion, its prepared-statement cache, adaptation, its wait
        loop), an eighth of a one-job enqueue with its commit's disk flush.
        Here the parameters go as text, each statement is prepared under its
        own name once per connection (planned afresh, the enqueue INSERT cost
        100 µs more), and the row is read with this cursor's loaders. The
        server infers each parameter's type from the statement, so every
        parameter must be cast there or go straight into a column.

        Only outside a transaction: psycopg deallocates every prepared
        statement of the connection when it rolls back (or sees DEALLOCATE
        ALL), and a statement found missing would fail the caller's
        transaction. On its own it has failed nothing yet, and is prepared and
        run again.
        """
        plan = _plan(statement)
        connection = self._raw.connection
        encoding = self._encoding
        values = [_text(params[name], encoding) for name in plan.names]
        pgconn = connection.pgconn
        with connection.lock:
            if plan.name not in self._direct_names:
                self._prepare_direct(plan)
            result = pgconn.exec_prepared(plan.name, values)
            if _sqlstate(result) == _MISSING_STATEMENT:
                self._direct_names.discard(plan.name)
                self._prepare_direct(plan)
                result = pgconn.exec_prepared(plan.name, values)
        if result.status != ExecStatus.TUPLES_OK:
            raise self._error(result)
        if not result.ntuples:
            return None
        if self._transformer is None:
            self._transformer = Transformer(self._raw)
        self._transformer.set_pgresult(result)
        return self._transformer.load_row(0, tuple)

    def _prepare_direct(self, plan: _Plan) -> None:
        result = self._raw.connection.pgconn.prepare(plan.name, plan.text)
        # Already there: prepared by an earlier kept cursor of this
        # connection, under a name that is the statement's own.
        if result.status != ExecStatus.COMMAND_OK and _sqlstate(result) != _DUPLICATE_STATEMENT:
            raise self._error(result)
        self._direct_names.add(plan.name)

    def _error(self, result: psycopg.pq.abc.PGresult) -> psycopg.Error:
        """The error psycopg raises for ``result``; OperationalError if the connection is lost."""
        if self._raw.connection.pgconn.status == ConnStatus.BAD:
            message = result.error_message.decode(self._encoding, "replace").strip()
            return psycopg.OperationalError(message or "the connection is lost")
        return psycopg.errors.error_from_result(result, encoding=self._encoding)


def fetch_one(alias: str, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """Run ``statement`` on ``alias``'s connection, in its transaction; its one row or None.

    A statement that is its own transaction (the connection in autocommit
    mode, outside ``atomic()``) goes straight through libpq, with prepared
    statements on (``Cursor.fetch_direct``); any other through ``cursor()``.
    Parameters must be str, int, aware datetime or None.
    """
    wrapper = connections[alias]
    wrapper.ensure_connection()
    connection = wrapper.connection
    if (
        connection.autocommit
        and connection.pgconn.transaction_status == TransactionStatus.IDLE
        and use_prepared(alias)
        and (kept := _kept(wrapper, connection, wrapper.timezone is dt.UTC)) is not None
    ):
        with wrapper.wrap_database_errors:
            return kept.fetch_direct(statement, params)
    with cursor(alias) as current:
        current.execute(statement, params)
        return current.fetchone()


class _Plan:
    """A ``%(name)s`` statement as libpq takes it: ``$n`` placeholders, and a name."""

    __slots__ = ("name", "names", "text")

    def __init__(self, statement: str) -> None:
        names: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        text = _PLACEHOLDER.sub(placeholder, statement)
        if "%" in text:
            raise ValueError(f"django-awa: a directly sent statement has a stray %: {statement}")
        self.text = text.encode()
        # Named by its text: the same name means the same statement.
        self.name = b"_awa_" + hashlib.sha256(self.text).hexdigest()[:24].encode()
        self.names = tuple(names)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_plans: dict[str, _Plan] = {}


def _plan(statement: str) -> _Plan:
    plan = _plans.get(statement)
    if plan is None:
        plan = _plans[statement] = _Plan(statement)
    return plan


def _text(value: Any, encoding: str) -> bytes | None:
    """A parameter in PostgreSQL's text format."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode(encoding)
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d" % value
    if isinstance(value, dt.datetime) and value.utcoffset() is not None:
        return value.isoformat().encode()
    raise TypeError(f"django-awa: cannot send {value!r} as a directly sent statement's parameter")


_MISSING_STATEMENT = b"26000"  # invalid_sql_statement_name
_DUPLICATE_STATEMENT = b"42P05"  # duplicate_prepared_statement


def _sqlstate(result: psycopg.pq.abc.PGresult) -> bytes | None:
    return result.error_field(DiagnosticField.SQLSTATE)


# SQLSTATE classes and codes of errors that say nothing about the statement's
# data: the connection or server failed, or the statement lost a race. Writing
# the same thing again later may succeed.
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")  # connection, rollback, resources, operator
_TRANSIENT_CODES = ("55P03", "25006")  # lock_not_available, read_only_sql_transaction


def is_transient(exc: BaseException) -> bool:
    """Whether database error ``exc`` may go away when the same work is tried again.

    True for lost connections, shutdowns, deadlocks, serialization failures,
    lock timeouts and a server in recovery (a failover in progress); False for
    errors about what was sent (bad data, a constraint, a programming error),
    which fail the same way every time.
    """
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, psycopg.Error):
        cause = cause.__cause__
    if cause is None:
        from django.db import InterfaceError, OperationalError

        return isinstance(exc, OperationalError | InterfaceError)
    state = cause.sqlstate
    if state is None:  # no server answer: the connection itself failed
        return isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(_TRANSIENT_CLASSES) or state in _TRANSIENT_CODES
