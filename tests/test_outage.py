"""A worker rides through a database that goes away or turns read-only, and says so once.

The read-only case is what a failover looks like from a worker: for a while
its new connections land on a server that refuses writes (SQLSTATE 25006, as
a standby or a not yet promoted node does). Made here with the test
database's ``default_transaction_read_only``, set for new sessions only, and
every worker session terminated so that they reconnect into it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import psycopg
import pytest
from django.db import DatabaseError, connection
from django.db import OperationalError as DjangoOperationalError

import django_awa as awa
from django_awa import db
from django_awa.models import Job
from tests.conftest import wait_for
from tests.testapp.jobs import Act

pytestmark = pytest.mark.django_db(transaction=True)

UNAVAILABLE = "unavailable"
AVAILABLE_AGAIN = "available again after"


def _terminate_others() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def _set_read_only(on: bool) -> None:
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        if on:
            cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        else:
            cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def _lease() -> tuple[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT holder, term FROM awa_lease WHERE name = 'maintenance'")
        holder, term = cursor.fetchone()
    return holder or "", int(term)


def _completed(ids: list[int]) -> int:
    return Job.objects.filter(id__in=ids, state="completed").count()


@pytest.fixture
def read_only_afterwards():
    yield
    _set_read_only(False)


def test_a_worker_that_never_reached_its_database_stops_at_once_on_sigterm(start_worker):
    with socket.socket() as closed:  # a port nothing listens on once this closes
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    worker = start_worker(
        env={
            "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/awa",
            "AWA_TEST_SHUTDOWN_TIMEOUT": "60",
        }
    )
    wait_for(lambda: UNAVAILABLE in worker.output(), message=worker.output)
    started = time.monotonic()
    # It claimed and ran nothing: there is nothing to finish for SHUTDOWN_TIMEOUT.
    assert worker.stop(timeout=10) == 0
    assert time.monotonic() - started < 5, worker.output()
    assert "stopped after 0 jobs" in worker.output()


@pytest.mark.slow
def test_a_read_only_server_is_waited_out_and_the_worker_says_so_once(
    start_worker, read_only_afterwards
):
    worker = start_worker("--queue", "default=4")
    wait_for(lambda: AWA_LEADS in worker.output(), timeout=30, message=worker.output)
    before = [awa.enqueue(Act(action="ok")).id for _ in range(5)]
    wait_for(lambda: _completed(before) == 5, timeout=30, message=worker.output)
    holder, term = _lease()

    # The "failover": every worker session is cut, and new ones are read-only.
    _set_read_only(True)
    assert _terminate_others() >= 3
    during = [awa.enqueue(Act(action="ok")).id for _ in range(5)]  # the test's old session writes
    wait_for(lambda: UNAVAILABLE in worker.output(), timeout=30, message=worker.output)
    # It keeps trying (a session from each thread comes and goes), runs nothing
    # and does not lead: a read-only server cannot hold the lease.
    time.sleep(3)
    assert _completed(during) == 0
    assert worker.proc.poll() is None, worker.output()

    # The "new primary" takes writes: everything flows again, nothing is lost,
    # the NOTIFYs sent during the gap are made up for by the reconnect's wake.
    _set_read_only(False)
    _terminate_others()
    wait_for(lambda: _completed(during) == 5, timeout=60, message=worker.output)
    after = [awa.enqueue(Act(action="ok")).id for _ in range(5)]
    wait_for(lambda: _completed(after) == 5, timeout=30, message=worker.output)
    wait_for(lambda: AVAILABLE_AGAIN in worker.output(), timeout=30, message=worker.output)

    log = worker.output()
    assert log.count(UNAVAILABLE) == 1, log
    assert log.count(AVAILABLE_AGAIN) == 1, log
    # Its heartbeat could not write either: claims paused, and resumed once it could.
    assert log.count("the heartbeat has not reached the database") == 1, log
    assert log.count("the heartbeat reached the database again") == 1, log
    new_holder, new_term = _lease()
    assert new_holder == holder  # the same worker leads again, on a writable server
    assert new_term >= term
    assert worker.stop() == 0


AWA_LEADS = "is now the maintenance leader"


@pytest.mark.slow
def test_prepared_statements_are_prepared_again_on_a_new_session(start_worker):
    """After its sessions are cut, a worker's prepared claims and finalizes work on new ones."""
    worker = start_worker("--queue", "default=4")
    for round_ in range(3):
        ids = [awa.enqueue(Act(action="ok")).id for _ in range(10)]
        wait_for(lambda ids=ids: _completed(ids) == 10, timeout=60, message=worker.output)
        assert _terminate_others() >= 1, round_
    with connection.cursor() as cursor:
        # The test's own session re-prepares its direct enqueue statement too.
        _terminate_others()
        cursor.execute("SELECT 1")
    ids = [awa.enqueue(Act(action="ok")).id for _ in range(10)]
    wait_for(lambda: _completed(ids) == 10, timeout=60, message=worker.output)
    log = worker.output()
    assert "prepared statement" not in log, log
    assert worker.stop() == 0


# -- which errors are an outage ---------------------------------------------------------


def _psycopg_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "pool"):
        params.pop(key, None)
    return psycopg.connect(**params, autocommit=True)


def test_a_read_only_server_an_admin_shutdown_and_a_connect_timeout_are_transient():
    with _psycopg_connection() as conn:
        conn.execute("SET default_transaction_read_only = on")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as read_only:
            conn.execute("CREATE TABLE outage_probe (x int)")
    assert db.is_transient(read_only.value)

    with _psycopg_connection() as conn:
        pid = conn.info.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        with pytest.raises(psycopg.OperationalError) as shutdown:
            conn.execute("SELECT 1")
    assert db.is_transient(shutdown.value)

    # A server that accepts the TCP connection and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        with pytest.raises(psycopg.OperationalError) as timeout:
            psycopg.connect(host="127.0.0.1", port=port, connect_timeout=1, user="x", dbname="x")
    assert db.is_transient(timeout.value)

    # Wrapped by Django, as the ORM raises them (25006 as an InternalError).
    with pytest.raises(DatabaseError) as wrapped, connection.wrap_database_errors:
        raise read_only.value
    assert db.is_transient(wrapped.value)


def test_errors_about_what_was_sent_are_not_transient():
    with _psycopg_connection() as conn:
        conn.execute("CREATE TEMP TABLE t (x int PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(psycopg.errors.UniqueViolation) as duplicate:
            conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(psycopg.errors.SyntaxError) as syntax:
            conn.execute("SELEC 1")
    assert not db.is_transient(duplicate.value)
    assert not db.is_transient(syntax.value)


# -- one line per outage, one per recovery --------------------------------------------


def test_one_warning_per_outage_and_one_info_line_once_every_thread_is_back(caplog, monkeypatch):
    monkeypatch.setattr(db, "OUTAGE_SETTLES", 0.2)
    monkeypatch.setattr(db, "RECONNECT_FIRST", 0.001)
    error = DjangoOperationalError("server closed the connection unexpectedly")
    producer = db.Reconnect("producer", "outage-test")
    completer = db.Reconnect("completer", "outage-test")
    before = db.outage_count
    with caplog.at_level(logging.DEBUG, logger="django_awa.outage"):
        for _ in range(3):
            producer.failed(error)
        completer.failed(error)
        producer.succeeded()  # the completer still fails: not over
        completer.failed(error)
        completer.succeeded()  # every thread is back, not yet for OUTAGE_SETTLES
        assert not [r for r in caplog.records if r.levelno == logging.INFO]
        time.sleep(0.25)
        producer.succeeded()  # settled: the recovery line
        producer.succeeded()  # no outage: nothing
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "unavailable (producer" in warnings[0].getMessage()
    assert len(infos) == 1 and "available again after" in infos[0].getMessage()
    assert db.outage_count == before + 1

    # A new failure after the recovery is a new outage.
    with caplog.at_level(logging.DEBUG, logger="django_awa.outage"):
        completer.failed(error)
    assert db.outage_count == before + 2
    completer.succeeded()
    time.sleep(0.25)
    completer.succeeded()
    assert "outage-test" not in db._outages


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        ('prepared statement "_pg3_0" already exists', "AWA['PREPARED_STATEMENTS'] = False"),
        ('relation "awa_lease" does not exist', "run manage.py migrate"),
        ("server closed the connection unexpectedly", None),
    ],
)
def test_a_setup_error_that_reads_as_an_outage_says_what_to_do(caplog, monkeypatch, error, hint):
    monkeypatch.setattr(db, "RECONNECT_FIRST", 0.001)
    reconnect = db.Reconnect("producer", f"hint-test-{hint}")
    with caplog.at_level(logging.WARNING, logger="django_awa.outage"):
        reconnect.failed(DjangoOperationalError(error))
    [warning] = caplog.records
    assert error in warning.getMessage()
    if hint is None:
        assert warning.getMessage().endswith("backing off up to 5s")
    else:
        assert hint in warning.getMessage()
    db._outages.pop(f"hint-test-{hint}", None)


def test_the_backoff_doubles_to_its_bound():
    stop = threading.Event()
    stop.set()  # waits return at once
    reconnect = db.Reconnect("test", "backoff-test", stop)
    delays = []
    for _ in range(10):
        delays.append(reconnect.delay)
        reconnect.failed(DjangoOperationalError("gone"))
    assert delays[:3] == [db.RECONNECT_FIRST, db.RECONNECT_FIRST * 2, db.RECONNECT_FIRST * 4]
    assert max(delays) == db.RECONNECT_MOST
    reconnect.succeeded()
    assert reconnect.delay == db.RECONNECT_FIRST
    reconnect.stop = threading.Event()


# -- an ambiguous commit ----------------------------------------------------------------


def test_an_ambiguous_commit_retried_with_its_unique_key_is_neither_lost_nor_doubled():
    """The enqueue commits, then the connection dies before the answer arrives; the caller
    cannot tell, so it enqueues again with the same ``awa.Unique`` key (README: *Highly
    available PostgreSQL*)."""
    lost_answers = []

    def answer_lost(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if "INSERT INTO awa_job" in sql and not lost_answers:
            lost_answers.append(sql)
            context["connection"].connection.close()  # committed; the answer never comes
            raise DjangoOperationalError("server closed the connection unexpectedly")
        return result

    args = Act(action="ok", tag="order-1234")
    tries = []
    with connection.execute_wrapper(answer_lost):
        for _ in range(5):
            try:
                job = awa.enqueue(args, unique=awa.Unique())
            except awa.UniqueConflict as exc:
                tries.append(("conflict", exc.conflicting_id))
                break
            except DjangoOperationalError as exc:
                assert db.is_transient(exc)
                tries.append(("error", None))
                connection.close()  # reconnect, and try again
            else:
                tries.append(("enqueued", job.id))
                break
    rows = list(Job.objects.filter(kind="act", args__tag="order-1234").values_list("id", flat=True))
    assert len(rows) == 1  # the first try committed; the retry added nothing
    assert tries == [("error", None), ("conflict", rows[0])]
