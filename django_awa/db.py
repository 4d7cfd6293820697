"""The database door: which connection, which cursor, and the one fast path.

Every public function taking ``using`` resolves it with ``database_alias()``,
which refuses an alias that is not PostgreSQL with ``postgresql_problem()``:
the one vendor check, also behind the system check awa.E101.
All of django-awa's statements (sql.py) then run on that alias's Django
connection, in its current transaction, by one of three routes:

* **Django's cursor** (``connections[alias].cursor()``): everything not run
  per job: operator controls (control.py), callbacks, maintenance, periodic
  schedules, the admin, the Django Tasks backend. Django instruments these
  itself.
* **``cursor(alias)``**, a psycopg cursor on the same connection: the
  statements run per job and per batch: CLAIM (claim.py); FINALIZE, COMPLETE
  (and their prepared forms for one outcome, FINALIZE_ONE and COMPLETE_ONE)
  and STILL_HELD (finalize.py); HEARTBEAT; SET_PROGRESS (execute.py); an
  enqueue inside a transaction (INSERT_ONE, INSERT_ONE_UNIQUE,
  FIND_UNIQUE_HOLDER); enqueue_many's RESERVE_IDS, COPY_AVAILABLE(_UNNUMBERED),
  INSERT_MANY and NOTIFY_QUEUES. Why: Django's PostgreSQL cursors bind on the
  client (every value quoted into the SQL text in Python, every statement
  parsed and planned again). This cursor binds on the server, and those in
  ``sql.PREPARED`` reuse a prepared plan.
* **``fetch_one()``**, straight through libpq's ``PQexecPrepared``
  (``Cursor.fetch_direct``): an enqueue that is its own transaction (the
  connection in autocommit, outside ``atomic()``): INSERT_ONE,
  INSERT_ONE_UNIQUE, FIND_UNIQUE_HOLDER. Why: a psycopg cursor's execute
  spends more Python per statement (query conversion, its statement cache,
  adaptation, its wait loop) than the rest of a one-job enqueue but its commit.

The last two are seen as Django's own statements are. When the connection
has ``execute_wrappers`` (``connection.execute_wrapper()``: APM agents,
sqlcommenter, blockers), each statement runs through them as Django's
``CursorWrapper`` runs its own: ``wrapper(execute, sql, params, many,
context)`` with ``context = {"connection": <DatabaseWrapper>, "cursor":
<Cursor>}``, database errors raised inside the chain as Django's; a wrapper
that raises blocks the statement. When ``queries_logged`` (``DEBUG``, or
``force_debug_cursor`` as ``assertNumQueries`` and ``CaptureQueriesContext``
set it), each is added to ``connection.queries`` with its time and logged
to ``django.db.backends``, as ``CursorDebugWrapper`` does. A COPY goes
through them as its statement with ``params=None``: its rows are data, not
parameters. A wrapper that rewrites the statement (a comment, as
sqlcommenter adds) gets it run as rewritten, unprepared: a text that changes
per request would otherwise prepare a new statement each time. With neither
set, a statement pays one test of the two and nothing else.

Outside Django's connections, and so outside its instrumentation: the
worker's listener (sql.LISTEN_JOBS, sql.LISTEN_CANCELS, sql.LISTENER_PING)
holds a psycopg connection of its own, to ``AWA["DIRECT_DATABASE"]`` when set,
because a LISTEN lasts as long as its session, which must stay open while the
worker runs and must not be a pooler's shared server connection; and
``contrib.embedded_postgres`` configures its development server before Django
is set up.

Errors are wrapped into Django's database exceptions, as the ORM's are.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import logging
import pkgutil
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from django.conf import settings
from django.core.signals import setting_changed
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connections,
)
from django.dispatch import receiver
from psycopg import abc as pg_abc
from psycopg.adapt import Transformer
from psycopg.postgres import types as pg_types
from psycopg.pq import ConnStatus, DiagnosticField, ExecStatus, Format, TransactionStatus

from . import sql
from .conf import awa_settings
from .exceptions import ConfigurationError

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


def database_alias(using: str | None) -> str:
    """The connection alias to use, checked to be PostgreSQL.

    Every public function taking ``using`` resolves it here. Only ``None``
    means ``AWA["DATABASE"]``: anything else must name an entry of
    ``DATABASES`` (``""`` is refused, not taken for the default). Raises
    ``ConfigurationError``.
    """
    alias = awa_settings().database if using is None else using
    if isinstance(alias, str) and alias in checked_aliases:
        return alias
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        raise ConfigurationError(f"django-awa: no database alias {alias!r} in DATABASES")
    problem = postgresql_problem(alias)
    if problem is not None:
        raise ConfigurationError(problem)
    checked_aliases.add(alias)
    return alias


def postgresql_problem(alias: str) -> str | None:
    """Why database ``alias`` (an entry of ``DATABASES``) cannot hold jobs; None if it can.

    The one vendor check, behind every ``using`` (``database_alias``) and
    the system check awa.E101. Reads the settings only, without connecting.
    """
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        return None
    return f"django-awa needs PostgreSQL, but database {alias!r} is {vendor!r}"


def use_prepared(alias: str) -> bool:
    if alias not in _prepare:
        _prepare[alias] = awa_settings().prepared_statements
    return _prepare[alias]


@receiver(setting_changed)
def forget_settings(*, setting: str = "", **kwargs: Any) -> None:
    """Drop what was worked out from AWA and DATABASES when they change (tests'
    ``override_settings``), or when called with no setting."""
    if setting in ("", "AWA", "DATABASES"):
        _prepare.clear()
        checked_aliases.clear()


# Django loads timestamptz through a Python subclass of psycopg's loader that
# re-labels each value with the connection's time zone, several times the
# cost of psycopg's own. With Django's default (USE_TZ, the database in UTC)
# the label is the one psycopg's loader gives already.
_TIMESTAMPTZ_OID = pg_types["timestamptz"].oid
_PSYCOPG_TIMESTAMPTZ = psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)


def as_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows of parameters (one dict per row, the same keys in each) as one list per
    key: the arrays a set-based statement unnests."""
    return {key: [row[key] for row in rows] for key in rows[0]}


def int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of ints, for a ``%(name)s::bigint[]`` parameter."""
    return "{" + ",".join(map(str, values)) + "}"


def float_array(values: Iterable[float | None]) -> str:
    """A PostgreSQL array literal of floats to the microsecond (``None`` as NULL), for
    ``%(name)s::float8[]``: durations in seconds, which need no more (formatted so, a
    third of the cost of ``repr``, once per job of a batch)."""
    return "{" + ",".join(["NULL" if v is None else f"{v:.6f}" for v in values]) + "}"


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
    current = _kept(wrapper, connection, utc) or Cursor(wrapper, _open(connection, utc), utc)
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
        held = Cursor(wrapper, _open(connection, utc), utc)
        setattr(wrapper, _HELD, held)
    return held


def _open(connection: psycopg.Connection[Any], utc: bool) -> psycopg.Cursor[Any]:
    raw = psycopg.Cursor(connection)
    if utc and _PSYCOPG_TIMESTAMPTZ is not None:
        raw.adapters.register_loader(_TIMESTAMPTZ_OID, _PSYCOPG_TIMESTAMPTZ)
    return raw


class Cursor:
    """A psycopg cursor on a Django connection, whose statements Django's instrumentation sees."""

    __slots__ = (
        "_busy", "_direct_names", "_encoding", "_prepare", "_raw", "_transformer", "_utc",
        "_wrapper",
    )  # fmt: skip

    def __init__(self, wrapper: Any, raw: psycopg.Cursor[Any], utc: bool) -> None:
        self._wrapper = wrapper  # the Django DatabaseWrapper whose connection raw is on
        self._raw = raw
        self._utc = utc
        self._prepare = False
        self._busy = False
        # For fetch_direct: the statements it has prepared, and its row loader.
        self._encoding = raw.connection.info.encoding
        self._direct_names: set[bytes] = set()
        # psycopg.adapt.Transformer is the class psycopg picked (C or Python);
        # what they share is the abc protocol.
        self._transformer: pg_abc.Transformer | None = None

    def _fits(self, connection: psycopg.Connection[Any], utc: bool) -> bool:
        """Whether this cursor may serve ``connection`` (after a reconnect it may not)."""
        raw = self._raw
        return raw.connection is connection and not raw.closed and self._utc == utc

    def execute(self, statement: str, params: Mapping[str, Any] | None = None) -> Cursor:
        wrapper = self._wrapper
        if wrapper.execute_wrappers or wrapper.queries_logged:
            _as_django_does(self, self._execute, statement, params)
        else:
            self._execute(statement, params)
        return self

    def _execute(self, statement: str, params: Mapping[str, Any] | None) -> Cursor:
        # A statement rewritten by an execute_wrapper is not in PREPARED.
        prepare = self._prepare and statement in sql.PREPARED
        self._raw.execute(statement, params, prepare=prepare)
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._raw.fetchone()

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._raw.fetchall()

    def copy_rows(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        """``COPY ... FROM STDIN`` of ``rows``, in the cursor's transaction."""
        wrapper = self._wrapper
        if wrapper.execute_wrappers or wrapper.queries_logged:
            _as_django_does(self, lambda text, _: self._copy(text, rows), statement, None)
        else:
            self._copy(statement, rows)

    def _copy(self, statement: str, rows: Iterable[Sequence[Any]]) -> Cursor:
        with self._raw.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
        return self

    @property
    def rowcount(self) -> int:
        return self._raw.rowcount

    def fetch_direct(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run a statement that is its own transaction with libpq's ``PQexecPrepared``.

        A psycopg cursor's execute spends much of a one-job enqueue's Python
        time (query conversion, its prepared-statement cache, adaptation, its
        wait loop). Here the parameters go as text, each statement is prepared
        under its own name once per connection (planning the INSERT afresh
        each time costs more than running it), and the row is read with this
        cursor's loaders. The
        server infers each parameter's type from the statement, so every
        parameter must be cast there or go straight into a column.

        Only outside a transaction: psycopg deallocates every prepared
        statement of the connection when it rolls back (or sees DEALLOCATE
        ALL), and a statement found missing would fail the caller's
        transaction. On its own it has failed nothing yet, and is prepared and
        run again.
        """
        wrapper = self._wrapper
        if wrapper.execute_wrappers or wrapper.queries_logged:
            run = functools.partial(self._direct_or_rewritten, statement)
            return _as_django_does(self, run, statement, params)  # type: ignore[no-any-return]
        return self._direct(statement, params)

    def _direct_or_rewritten(
        self, original: str, statement: str, params: Any
    ) -> tuple[Any, ...] | None:
        """``fetch_direct``'s executor: as sent, unless an execute_wrapper rewrote it."""
        if statement == original and isinstance(params, Mapping):
            return self._direct(statement, params)
        self._raw.execute(statement, params)
        return self._raw.fetchone()

    def _direct(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        plan = _plan(statement)
        connection = self._raw.connection
        encoding = self._encoding
        values = [_text(params[name], encoding) for name in plan.names]
        pgconn = connection.pgconn
        with connection.lock:
            if plan.name not in self._direct_names:
                self._prepare_direct(plan)
            # None is SQL NULL: libpq takes it, and psycopg's implementations
            # pass it on, but pq.abc declares the values as buffers only.
            result = pgconn.exec_prepared(plan.name, values)  # type: ignore[arg-type]
            if _sqlstate(result) == _MISSING_STATEMENT:
                self._direct_names.discard(plan.name)
                self._prepare_direct(plan)
                result = pgconn.exec_prepared(plan.name, values)  # type: ignore[arg-type]
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


def _as_django_does(
    cursor: Cursor, run: Callable[[str, Any], Any], statement: str, params: Any
) -> Any:
    """``run(statement, params)`` through the connection's execute_wrappers and query log.

    As Django's ``CursorWrapper._execute_with_wrappers`` and
    ``CursorDebugWrapper.debug_sql`` do for its own cursors; see the module
    docstring. Returns what ``run`` returned: taken from the innermost call,
    not from the chain, so a wrapper that forgets to return the result loses
    nothing. A wrapper that returns without running the statement at all is
    an error here (Django would leave the cursor without a result): taken
    for "no row", the enqueue would report a unique conflict.
    """
    wrapper = cursor._wrapper
    ran: list[Any] = []

    def execute(statement: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        with wrapper.wrap_database_errors:
            ran.append(run(statement, params))
        return ran[-1]

    executor: Callable[..., Any] = execute
    for outer in reversed(wrapper.execute_wrappers):
        executor = functools.partial(outer, executor)
    context = {"connection": wrapper, "cursor": cursor}
    if wrapper.queries_logged:
        start = time.monotonic()
        try:
            executor(statement, params, False, context)
        finally:
            _log_query(cursor, statement, params, time.monotonic() - start)
    else:
        executor(statement, params, False, context)
    if not ran:
        raise ProgrammingError(
            "django-awa: an execute_wrapper returned without running the statement "
            f"{statement.strip()[:60]!r}"
        )
    return ran[-1]


_query_logger = logging.getLogger("django.db.backends")


def _log_query(cursor: Cursor, statement: str, params: Any, duration: float) -> None:
    """Record a statement in ``connection.queries`` and Django's SQL log, as Django's do."""
    wrapper = cursor._wrapper
    text = _composed(cursor, statement, params)
    wrapper.queries_log.append({"sql": text, "time": f"{duration:.3f}"})
    _query_logger.debug(
        "(%.3f) %s; args=%s; alias=%s",
        duration,
        text,
        params,
        wrapper.alias,
        extra={"duration": duration, "sql": text, "params": params, "alias": wrapper.alias},
    )


def _composed(cursor: Cursor, statement: str, params: Any) -> str:
    """The statement with its parameters quoted in, as Django shows its own queries."""
    if params is None:
        return statement
    try:
        return psycopg.ClientCursor(cursor._raw.connection).mogrify(statement, params)
    except (psycopg.Error, TypeError, ValueError, KeyError):
        return statement  # as sent: the log must not fail where the statement did not


def transaction_failed(alias: str) -> bool:
    """Whether ``alias``'s open transaction is aborted (a statement in it failed)."""
    connection = connections[alias].connection
    return connection is not None and (
        connection.pgconn.transaction_status == TransactionStatus.INERROR
    )


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
_LOCK_NOT_AVAILABLE = "55P03"
_UNIQUE_VIOLATION = "23505"
_TRANSIENT_CODES = (_LOCK_NOT_AVAILABLE, "25006")  # and read_only_sql_transaction


def _psycopg_cause(exc: BaseException) -> psycopg.Error | None:
    """The psycopg error behind ``exc`` (Django's wraps it), if any."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, psycopg.Error):
        cause = cause.__cause__
    return cause


def connection_lost(alias: str) -> bool:
    """Whether this thread's connection of ``alias`` is gone: the server ended it (a
    restart, ``pg_terminate_backend``) or the network cut it. A statement's error then
    says nothing about what the statement sent, nor can its transaction go on."""
    raw = connections[alias].connection
    return raw is None or raw.closed or raw.broken


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether database error ``exc`` is a lock not had within ``lock_timeout``."""
    cause = _psycopg_cause(exc)
    return cause is not None and cause.sqlstate == _LOCK_NOT_AVAILABLE


def is_unique_key_held(exc: BaseException) -> bool:
    """Whether database error ``exc`` is a job's ``awa.Unique`` key held by another job:
    the statement moved a job into a state its key is held in (``awa_job_unique_idx``)."""
    cause = _psycopg_cause(exc)
    return (
        cause is not None
        and cause.sqlstate == _UNIQUE_VIOLATION
        and cause.diag.constraint_name == "awa_job_unique_idx"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether database error ``exc`` may go away when the same work is tried again.

    True for lost connections, shutdowns, deadlocks, serialization failures,
    lock timeouts and a server in recovery (a failover in progress); False for
    errors about what was sent (bad data, a constraint, a programming error),
    which fail the same way every time.
    """
    cause = _psycopg_cause(exc)
    if cause is None:
        return isinstance(exc, OperationalError | InterfaceError)
    state = cause.sqlstate
    if state is None:  # no server answer: the connection itself failed
        return isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(_TRANSIENT_CLASSES) or state in _TRANSIENT_CODES


# -- connections: a pool's, a worker's need, the server's room, a refusal -------

# Django's pool (DATABASES[alias]["OPTIONS"]["pool"]) is psycopg_pool's
# ConnectionPool, whose max_size defaults to its min_size, 4.
_POOL_MIN_SIZE = 4


def pool_max_size(alias: str) -> int | None:
    """The most connections Django's pool of ``alias`` opens; None when it has no pool."""
    options = connections[alias].settings_dict.get("OPTIONS", {}).get("pool")
    if not options:
        return None
    if not isinstance(options, Mapping):
        return _POOL_MIN_SIZE
    max_size = options.get("max_size")
    return int(max_size or options.get("min_size", _POOL_MIN_SIZE))


def is_pooled(wrapper: Any) -> bool:
    """Whether a Django connection's alias takes its connections from Django's pool."""
    return bool(wrapper.settings_dict.get("OPTIONS", {}).get("pool"))


def pool_wanted(wrapper: Any) -> bool:
    """Whether a thread waits for a connection of the pool behind a pooled Django connection."""
    return bool(wrapper.pool.get_stats().get("requests_waiting"))


def release(alias: str) -> None:
    """Give this thread's connection of ``alias`` back to its pool, outside a transaction.

    A no-op without a pool: there closing would mean connecting again for the
    next statement. With one, the connection goes back to the pool (Django's
    ``close()`` puts it back) and the next use takes one again, so a thread
    holds a pooled connection only while it works. Engine threads call it
    after each pass, handler threads after each job.
    """
    wrapper = connections[alias]
    if wrapper.connection is not None and not wrapper.in_atomic_block and is_pooled(wrapper):
        try:
            wrapper.close()
        except (DatabaseError, psycopg.Error):
            pass  # the pool discards a connection it cannot take back; close() forgot it


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionNeed:
    """The most connections one worker process holds at once, and of what."""

    alias: str
    handlers: int  # handler threads: the queues' concurrency
    queues: int  # a producer thread each
    listener: int  # 1: the LISTEN connection, psycopg's own, outside any pool
    pool_max: int | None  # Django's pool of the alias: it bounds the threads' connections

    @property
    def engine_threads(self) -> int:
        """A producer per queue, the completer, the heartbeat, maintenance."""
        return self.queues + 3

    @property
    def shared_by_producers(self) -> bool:
        """Whether the producers take turns on one connection: several, and no pool."""
        return self.queues > 1 and self.pool_max is None

    @property
    def most(self) -> int:
        if self.pool_max is not None:
            return min(self.pool_max, self.handlers + self.engine_threads) + self.listener
        return self.handlers + min(self.queues, 1) + 3 + self.listener

    def parts(self) -> str:
        """What ``most`` is made of, e.g. ``100 handler threads + 4 for the engine + 1 LISTEN``."""
        if self.pool_max is not None:
            threads = (
                f"Django's pool of at most {self.pool_max}, shared by {self.handlers} handler "
                f"threads and {self.engine_threads} engine threads"
            )
        else:
            shared = f" ({self.queues} producers share one)" if self.shared_by_producers else ""
            several = "s" if self.handlers != 1 else ""
            engine = min(self.queues, 1) + 3
            threads = f"{self.handlers} handler thread{several} + {engine} for the engine"
            threads += shared
        return threads + (" + 1 LISTEN" if self.listener else "")


def connection_need(queues: Mapping[str, int], alias: str, listener: bool) -> ConnectionNeed:
    """The connections a worker running ``queues`` (name: concurrency) on ``alias`` holds at most.

    Each thread has its own Django connection (handler threads from their
    first query on), but the producers of several queues share one when
    there is no pool. A handler thread abandoned in a stuck handler keeps its
    connection while its replacement opens another; not counted here.
    """
    return ConnectionNeed(
        alias=alias,
        handlers=sum(queues.values()),
        queues=len(queues),
        listener=1 if listener else 0,
        pool_max=pool_max_size(alias),
    )


# Past this share of what the server allows, a worker about to start is warned.
CONNECTIONS_WARN_SHARE = 0.85


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerRoom:
    """What the server allows this login, and what is in use now (``SERVER_CONNECTIONS``)."""

    max_connections: int
    reserved: int
    in_use: int
    role: str
    superuser: bool
    role_limit: int
    role_in_use: int
    database: str
    database_limit: int
    database_in_use: int
    server_port: int | None

    def limits(self) -> list[tuple[str, int, int]]:
        """Each limit that applies: (what it is, how many it allows, how many are in use)."""
        found = [
            (
                f"max_connections {self.max_connections} less {self.reserved} reserved",
                self.max_connections - self.reserved,
                self.in_use,
            )
        ]
        if self.role_limit >= 0 and not self.superuser:  # superusers are not held to it
            found.append(
                (f"role {self.role!r} CONNECTION LIMIT", self.role_limit, self.role_in_use)
            )
        if self.database_limit >= 0:
            found.append(
                (
                    f"database {self.database!r} CONNECTION LIMIT",
                    self.database_limit,
                    self.database_in_use,
                )
            )
        return found


def server_room(alias: str) -> ServerRoom:
    """``SERVER_CONNECTIONS`` read on this thread's connection of ``alias``; errors raise."""
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.SERVER_CONNECTIONS)
        row = cursor.fetchone()
    if row is None:  # no pg_roles row for session_user: not a login this check can judge
        raise ProgrammingError("django-awa: the server did not describe this login's limits")
    return ServerRoom(
        max_connections=row[0],
        reserved=row[1],
        in_use=row[2],
        role=row[3],
        superuser=row[4],
        role_limit=row[5],
        role_in_use=row[6],
        database=row[7],
        database_limit=row[8],
        database_in_use=row[9],
        server_port=row[10],
    )


def behind_pooler(alias: str, room: ServerRoom) -> bool:
    """Whether ``alias`` reaches the server through a pooler: the server was reached on
    another TCP port than the one ``alias`` connects to (PgBouncer's 6432, say), or
    through a Unix socket while ``alias`` connects over TCP (a pooler beside the server
    forwarding to its socket)."""
    settings_dict = connections[alias].settings_dict
    port = settings_dict.get("PORT")
    if not port:
        return False
    if room.server_port is None:
        host = str(settings_dict.get("HOST") or "")
        return bool(host) and not host.startswith("/")
    return int(port) != room.server_port


def connections_report(
    need: ConnectionNeed, room: ServerRoom, processes: int = 1
) -> tuple[str, str | None]:
    """A sentence on ``need`` against ``room``, and a warning when the worker would take
    the server past ``CONNECTIONS_WARN_SHARE`` of a limit (None when it would not)."""
    alias = need.alias
    per = f" each, {processes * need.most} in all" if processes > 1 else ""
    held = f"up to {need.most} connections ({need.parts()}){per}"
    if behind_pooler(alias, room):
        return (
            f"{held}, to a pooler in front of the server (port "
            f"{connections[alias].settings_dict.get('PORT')}; the server's is {room.server_port}): "
            "the pooler's pool size bounds the server connections",
            None,
        )
    limits = room.limits()
    summary = "; ".join(f"{what}: {allowed}, {used} in use now" for what, allowed, used in limits)
    report = f"{held}; the server allows {summary}"
    total = processes * need.most
    for what, allowed, used in limits:
        if used + total > CONNECTIONS_WARN_SHARE * allowed:
            warning = (
                f"a worker on database {alias!r} holds {held}: with the {used} connections in "
                f"use now that is {used + total} of the {allowed} the server allows ({what}), "
                f"past {CONNECTIONS_WARN_SHARE:.0%}; handlers will meet 'too many clients' "
                f"errors. Share connections: DATABASES[{alias!r}]['OPTIONS']['pool'] = "
                "{'max_size': ...} (Django's pool, psycopg[pool]) or PgBouncer; or run fewer "
                "handler threads (lower concurrency)"
            )
            return report, warning
    return report, None


# SQLSTATE too_many_connections: max_connections, a role's or a database's
# CONNECTION LIMIT, or the slots reserved for superusers, reached.
_TOO_MANY_CONNECTIONS = "53300"
_REFUSALS = (
    "too many clients already",
    "remaining connection slots are reserved",
    "too many connections for role",
    "too many connections for database",
)


def connection_refusal(exc: BaseException, need: ConnectionNeed | None = None) -> str | None:
    """What to tell of ``exc`` when it is PostgreSQL refusing a new connection, or Django's
    pool finding none free in time; None for any other error.

    Names the fix, and with ``need`` how many connections the worker holds.
    """
    cause: BaseException | None = exc
    for _ in range(16):  # a chain of causes may, in principle, loop
        if cause is None:
            return None
        if _is_pool_timeout(cause):
            held = (
                f"this worker's {need.handlers + need.engine_threads} threads"
                if need
                else "threads"
            )
            size = f" of at most {need.pool_max}" if need and need.pool_max else ""
            return (
                f"no connection came free in Django's pool{size} in time ({cause}): it is "
                f"shared by {held} and handlers hold one while they run; raise the pool's "
                "max_size (or its timeout), or lower concurrency"
            )
        if isinstance(cause, psycopg.Error):
            text = str(cause)
            if cause.sqlstate == _TOO_MANY_CONNECTIONS or any(r in text for r in _REFUSALS):
                # The server's own words: 'too many connections for role "app"'.
                reason = text.rsplit("FATAL:", 1)[-1].strip()
                held = (
                    f"this worker holds up to {need.most} connections ({need.parts()})"
                    if need
                    else "each thread of a worker holds a connection"
                )
                alias = need.alias if need else "..."
                return (
                    f"PostgreSQL refused a new connection ({reason}): {held}; use "
                    f"DATABASES[{alias!r}]['OPTIONS']['pool'] or PgBouncer, or lower concurrency"
                )
        cause = cause.__cause__ or cause.__context__
    return None


def _is_pool_timeout(exc: BaseException) -> bool:
    # psycopg_pool is optional (psycopg[pool], for Django's pool): known by its class.
    return any(
        c.__name__ == "PoolTimeout" and c.__module__.startswith("psycopg_pool")
        for c in type(exc).__mro__
    )


# -- the schema: django-awa's migrations applied to a database ---------------------

_UNDEFINED_TABLE = "42P01"


def database_address(alias: str) -> str:
    """Where database ``alias`` is, for messages: ``HOST:PORT/NAME``."""
    settings_dict = connections[alias].settings_dict
    host = settings_dict.get("HOST") or "local socket"
    return f"{host}:{settings_dict.get('PORT') or 5432}/{settings_dict.get('NAME')}"


def migrations_not_in_step(alias: str) -> tuple[list[str], list[str]]:
    """django-awa's migrations this code has that database ``alias`` has not applied, and
    those applied there that it does not have (a newer release's), each sorted.

    Cheap enough for every worker's start-up: one read of ``django_migrations`` (none
    there at all, on a database never migrated, is nothing applied), against the
    names of the modules of ``django_awa.migrations``, listed as Django's loader lists
    them but not imported. Django's ``MigrationLoader`` would import every app's
    migrations and build their graph, tens of milliseconds. It holds because
    django-awa squashes no migrations: a squashed one is recorded under its own name
    or under those it ``replaces``, and only the loader knows which stand for which.
    Other database errors raise.
    """
    from . import migrations

    known = {
        name
        for _, name, is_package in pkgutil.iter_modules(migrations.__path__)
        if not is_package and name[0] not in "_~"  # as MigrationLoader skips
    }
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.APPLIED_MIGRATIONS)
            applied = {name for (name,) in cursor.fetchall()}
    except ProgrammingError as exc:
        cause = _psycopg_cause(exc)
        if cause is None or cause.sqlstate != _UNDEFINED_TABLE:
            raise
        applied = set()
    return sorted(known - applied), sorted(applied - known)


def not_migrated(alias: str, missing: Sequence[str]) -> str:
    """What a worker or ``run_jobs`` says of database ``alias`` lacking django-awa's
    ``missing`` migrations (``migrations_not_in_step``): "django-awa's migrations are
    not applied to database 'default' (host:5432/name): 0016_x, 0017_y are missing",
    the first and last named when there are more than three."""
    named = (
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
        if len(missing) <= 3
        else f"{len(missing)} are missing, {missing[0]} to {missing[-1]}"
    )
    return (
        f"django-awa's migrations are not applied to database {alias!r} "
        f"({database_address(alias)}): {named}"
    )


# -- riding through outages ---------------------------------------------------------

_outage_logger = logging.getLogger("django_awa.outage")


class _Outage:
    """One outage of a database, as this process sees it: since when, who is still failing,
    and since when no one is."""

    __slots__ = ("failing", "recovered_at", "since")

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.failing: set[str] = set()
        self.recovered_at: float | None = None


_outages: dict[str, _Outage] = {}
_outages_lock = threading.Lock()
# Counts the outages this process has seen begin. A thread that does not
# reconnect through Reconnect (a handler thread) compares it before its next
# use, and closes connections opened before the outage: they are most likely
# dead, and finding out by running a job would cost that job an attempt.
outage_count = 0

# Reconnect delays: from the first, doubling up to the most, each drawn from
# its upper half so that a fleet of workers does not reconnect in step.
RECONNECT_FIRST = 0.1
RECONNECT_MOST = 5.0
# An outage is over once no thread has failed for this long. Threads find
# their connection dead only when they next use it (an idle completer may not
# for seconds), and each such find would otherwise be an outage of its own.
OUTAGE_SETTLES = 5.0


class Reconnect:
    """How a worker thread rides through a database outage: close, wait, try again.

    A service's loop calls ``failed(exc)`` when its database work raised a
    database error and ``succeeded()`` when a pass went through. ``failed``
    closes the thread's connections (the next use opens a new one, on
    whatever server is the primary by then: a connection to a server that
    went read-only, SQLSTATE 25006, is closed like a dropped one) and waits a
    backoff that doubles from ``RECONNECT_FIRST`` to ``most`` seconds
    (``RECONNECT_MOST`` unless given), or until ``stop`` is set.

    The process logs one WARNING when the first of its threads finds
    ``alias`` unavailable, and one INFO line once every thread that failed
    got through again and none failed for ``OUTAGE_SETTLES`` seconds, with
    how long the database was unavailable; each thread's retries are DEBUG.
    """

    def __init__(
        self,
        service: str,
        alias: str,
        stop: threading.Event | None = None,
        *,
        most: float = RECONNECT_MOST,
    ) -> None:
        self.service = service
        self.alias = alias
        self.stop = stop or threading.Event()
        self.most = most
        self.delay = RECONNECT_FIRST
        self.retries = 0  # failures since the last success

    @property
    def failing(self) -> bool:
        return self.retries > 0

    def failed(
        self, exc: BaseException, *, closing: contextlib.AbstractContextManager[Any] | None = None
    ) -> None:
        """Close this thread's connections, note the outage, wait the backoff.

        ``closing``: held while the connections close (the producers' shared
        connection's lock), not while the backoff waits.
        """
        global outage_count  # one per process, changed under _outages_lock
        with closing if closing is not None else contextlib.nullcontext():
            close_thread_connections()
        self.retries += 1
        with _outages_lock:
            outage = _outages.get(self.alias)
            first = outage is None
            if outage is None:
                outage = _outages[self.alias] = _Outage()
                outage_count += 1
            outage.failing.add(self.service)
            outage.recovered_at = None
        if first:
            _outage_logger.warning(
                "django-awa: database %r unavailable (%s: %s); every worker thread "
                "reconnects by itself, backing off up to %.0fs%s",
                self.alias, self.service, one_line(exc), RECONNECT_MOST, _cause_hint(exc),
            )  # fmt: skip
        else:
            _outage_logger.debug(
                "%s: database %r still unavailable (try %s): %s",
                self.service, self.alias, self.retries, one_line(exc),
            )  # fmt: skip
        delay = self.delay * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not a secret
        self.delay = min(self.delay * 2, self.most)
        self.stop.wait(delay)

    def succeeded(self) -> None:
        """This thread's database work went through: end its part of the outage.

        Costs a dict lookup while there is no outage: services call it after
        every pass.
        """
        if not self.retries and self.alias not in _outages:
            return
        self.retries = 0
        self.delay = RECONNECT_FIRST
        now = time.monotonic()
        with _outages_lock:
            outage = _outages.get(self.alias)
            if outage is None:
                return
            outage.failing.discard(self.service)
            if outage.failing:
                return
            if outage.recovered_at is None:
                outage.recovered_at = now
            if now - outage.recovered_at < OUTAGE_SETTLES:
                return
            del _outages[self.alias]
        _outage_logger.info(
            "django-awa: database %r available again after %.1fs; worker threads reconnected",
            self.alias,
            outage.recovered_at - outage.since,
        )


def hold_connection(reconnect: Reconnect) -> bool:
    """Open this engine thread's connection of ``reconnect.alias`` now; whether it did.

    A worker's heartbeat and completer call it as they start, before any
    handler thread runs a job: without a pool, each thread keeps its
    connection for good, and a thread that connected only at its first use
    found the server's last slots (a role's or a database's ``CONNECTION
    LIMIT``, ``max_connections``) taken by handlers. A heartbeat refused its
    connection lets the running jobs' heartbeats go stale, and maintenance
    rescues them while they still run here: they would run twice. Retries
    through ``reconnect`` (its backoff, its outage log) until the connection
    opens or ``reconnect.stop`` is set. With Django's pool, a no-op: engine
    threads take a pooled connection for each pass, and the handlers' gate
    leaves them theirs.
    """
    wrapper = connections[reconnect.alias]
    if is_pooled(wrapper):
        return True
    while not reconnect.stop.is_set():
        try:
            wrapper.ensure_connection()
        except (DatabaseError, InterfaceError, psycopg.Error) as exc:
            reconnect.failed(exc)
            continue
        reconnect.succeeded()
        return True
    return False


def close_thread_connections() -> None:
    """Close this thread's Django connections after a database error; the next use reconnects."""
    with contextlib.suppress(Exception):
        connections.close_all()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ServerNotWritable(OperationalError):
    """The server a connection reached takes no writes (a standby, or read-only)."""


def is_writable(wrapper: Any) -> bool:
    """Whether Django connection ``wrapper``'s server takes writes; database errors raise.

    False when its server is a hot standby (in recovery) or refuses writes
    (``default_transaction_read_only``, as a demoted or not yet promoted node
    does): after a failover a connection can land there, and every write on
    it fails with SQLSTATE 25006.
    """
    with wrapper.cursor() as cursor:
        cursor.execute(sql.WRITABLE_SERVER)
        row = cursor.fetchone()
    return bool(row and row[0])


def _cause_hint(exc: BaseException) -> str:
    """What to do, for the errors that read as an outage but are the setup's: they come
    back on every try, and only the first is logged above DEBUG."""
    text = str(exc)
    if 'prepared statement "' in text:
        return (
            ". A transaction-mode pooler that keeps no prepared statements (PgBouncer "
            "before 1.21) refuses them: set AWA['PREPARED_STATEMENTS'] = False"
        )
    if connection_refusal(exc) is not None:
        return (
            ". The server refuses new connections: a worker starts its handlers only once "
            "its heartbeat and completer are connected. Share connections (Django's pool, "
            "or PgBouncer) or lower concurrency"
        )
    if 'relation "awa_' in text and "does not exist" in text:
        return ". django-awa's tables are missing from this database: run manage.py migrate"
    return ""


def listen_params(alias: str) -> dict[str, Any]:
    """libpq parameters of Django connection ``alias``, for a dedicated psycopg connection
    (the listener's, or one that must commit apart from the thread's transaction)."""
    params = connections[alias].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "pool"):
        params.pop(key, None)
    return params
