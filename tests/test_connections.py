"""Connections: handlers' ORM use through Django's pool, what a worker holds, a refusal.

Real worker processes log in as a role with a CONNECTION LIMIT (created and
dropped here, named after the test database so parallel runs do not meet),
settings from ``tests/conn_settings.py``.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

import django_awa as awa
from django_awa.checks import check_connections
from django_awa.db import connection_need
from django_awa.execute import from_exception
from django_awa.models import Job, JobState
from tests.conftest import ROOT, connect_to, wait_for, wait_for_state
from tests.testapp.jobs import Act, Echo, Nap, Noop, Touch
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = {"DJANGO_SETTINGS_MODULE": "tests.conn_settings"}


def _sql(statement: str, params: list | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def limited_role(transactional_db) -> Iterator[Callable[[int], str]]:
    """``make(limit)``: a login role allowed ``limit`` connections, with rights on every table."""
    made: list[str] = []

    def make(limit: int) -> str:
        name = f"awa_limited_{len(made)}_{connection.settings_dict['NAME']}"[:63]
        _drop(name)
        _sql(f'CREATE ROLE "{name}" LOGIN CONNECTION LIMIT {int(limit)}')
        _sql(f'GRANT USAGE ON SCHEMA public TO "{name}"')
        _sql(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{name}"')
        _sql(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{name}"')
        made.append(name)
        return name

    yield make
    for name in made:
        _drop(name)


def _drop(name: str) -> None:
    if not _sql("SELECT 1 FROM pg_roles WHERE rolname = %s", [name]):
        return
    _sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [name])
    wait_for(lambda: not _sql("SELECT 1 FROM pg_stat_activity WHERE usename = %s", [name]))
    _sql(f'DROP OWNED BY "{name}"')
    _sql(f'DROP ROLE "{name}"')


def _backends(role: str) -> int:
    return _sql("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role])[0][0]


def _touch_jobs(n: int, hold: float, using: str = "default") -> list[int]:
    Order.objects.bulk_create([Order(reference=f"o{i}") for i in range(n)])
    return awa.enqueue_many([Touch(reference=f"o{i}", hold=hold, using=using) for i in range(n)])


def _drain_watching(ids: list[int], role: str, timeout: float) -> int:
    """Wait for every job of ``ids`` to finish; the most backends ``role`` had meanwhile."""
    most = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        most = max(most, _backends(role))
        if not Job.objects.filter(id__in=ids).exclude(state__in=JobState.FINAL).exists():
            return most
        time.sleep(0.02)
    states = list(Job.objects.filter(id__in=ids).values_list("state", "attempt", "errors")[:5])
    raise AssertionError(f"jobs did not finish in {timeout}s: {states}")


def _pooled_drain(start_worker, role: str, jobs: int, hold: float, concurrency: int, pool: str):
    """Run ``jobs`` Touch jobs on a worker logged in as ``role`` with the pool ``pool``.

    Every job must finish at its first attempt with no error; returns the
    worker and the most backends ``role`` had meanwhile.
    """
    ids = _touch_jobs(jobs, hold=hold)
    worker = start_worker(
        "--queue",
        f"orm={concurrency}",
        env={**SETTINGS, "AWA_TEST_DB_USER": role, "AWA_TEST_POOL": pool},
    )
    most = _drain_watching(ids, role, timeout=90)
    found = list(Job.objects.filter(id__in=ids).values_list("state", "attempt", "errors"))
    assert [j for j in found if j != (JobState.COMPLETED, 1, [])][:3] == []
    assert Order.objects.filter(paid=True).count() == jobs
    return worker, most


def test_pooled_handlers_outnumber_the_connections_the_role_may_open(limited_role, start_worker):
    # 30 handler threads and 4 engine threads, but the role may open 15
    # connections: they share Django's pool of 10 (and the LISTEN connection).
    worker, most = _pooled_drain(start_worker, limited_role(15), 150, 0.05, 30, "default:10")
    assert most <= 11, most  # the pool's 10 and the LISTEN connection
    assert (
        "up to 11 connections (Django's pool of at most 10, shared by 30 handler threads and "
        "4 engine threads + 1 LISTEN)" in worker.output()
    )


def test_the_engine_threads_give_their_pooled_connections_back(limited_role, start_worker):
    # A pool of 2 for 4 engine threads and 4 handler threads: it serves them
    # only if every thread gives its connection back after each pass.
    role = limited_role(3)
    ids = _touch_jobs(40, hold=0.02)
    start_worker(
        "--queue", "orm=4", env={**SETTINGS, "AWA_TEST_DB_USER": role, "AWA_TEST_POOL": "default:2"}
    )
    most = _drain_watching(ids, role, timeout=90)
    jobs = list(Job.objects.filter(id__in=ids).values_list("state", "attempt"))
    assert set(jobs) == {(JobState.COMPLETED, 1)}
    assert most <= 3, most


@pytest.mark.slow
def test_sixty_handler_threads_on_a_pool_of_five_wait_their_turn_without_a_job(
    limited_role, start_worker
):
    # 60 handler threads, Django's pool of 5 with a 1 s timeout, jobs holding
    # their connection 0.2 s: were every thread to take a job and then queue for
    # a connection, most would wait past the timeout and fail an attempt. The
    # gate lets 3 threads (5 less the engine's 2) take jobs at once; the role
    # may open 6 connections (the pool's 5 and LISTEN), so any more is refused.
    worker, most = _pooled_drain(start_worker, limited_role(6), 60, 0.2, 60, "default:5:1")
    assert most <= 6, most
    assert "(max_size 5) serves 3 handler threads at once" in worker.output()
    assert "PoolTimeout" not in worker.output()


def test_a_pooled_connection_left_in_a_transaction_goes_back_to_the_pool(start_worker):
    # Four handlers in turn leave a transaction open on a pool of three: each
    # connection must go back (rolled back), or the pool would run dry.
    leaky = [awa.enqueue(Act(action="leave_atomic")) for _ in range(4)]
    fine = [awa.enqueue(Act(action="ok")) for _ in range(3)]
    start_worker("--queue", "default=1", env={**SETTINGS, "AWA_TEST_POOL": "default:3"})
    for job in fine:
        wait_for_state(job.id, JobState.COMPLETED, timeout=30)
    for job in leaky:
        row = Job.objects.get(id=job.id)
        assert "left a transaction open" in row.errors[0]["error"]


@pytest.mark.slow
def test_handlers_that_use_no_database_are_not_held_to_the_pools_size(start_worker):
    # 20 handler threads on a pool of 3: once a job has shown that the queue's
    # handlers take no connection, its threads run side by side, not 1 at a time.
    ids = awa.enqueue_many([Nap(seconds=1.5) for _ in range(20)])
    start_worker("--queue", "nap=20", env={**SETTINGS, "AWA_TEST_POOL": "default:3"})
    wait_for(
        lambda: not Job.objects.filter(id__in=ids).exclude(state=JobState.COMPLETED).exists(),
        timeout=60,
    )
    started = sorted(Job.objects.filter(id__in=ids).values_list("attempted_at", flat=True))
    # All but the first start when it ends; were the threads let through one at a
    # time as their own jobs show it, the last would start about 12 s after the first.
    assert (started[-1] - started[0]).total_seconds() < 4, [s.isoformat() for s in started]


def test_a_refused_connection_is_named_in_the_jobs_error_and_the_log(limited_role, start_worker):
    # Handlers use an alias of their own, as a role that may open one
    # connection: the first handler thread to connect keeps it (no pool), the
    # others are refused by the server.
    role = limited_role(1)
    ids = _touch_jobs(3, hold=1.0, using="handlers")
    worker = start_worker("--queue", "orm=3", env={**SETTINGS, "AWA_TEST_HANDLER_USER": role})

    def refused() -> Job | None:
        return next(
            (j for j in Job.objects.filter(id__in=ids) if j.errors and j.attempt == 1), None
        )

    job = wait_for(refused, timeout=30)
    error = job.errors[0]["error"]
    expected = (
        f'PostgreSQL refused a new connection (too many connections for role "{role}"): this '
        "worker holds up to 8 connections (3 handler threads + 4 for the engine + 1 LISTEN); "
        "use DATABASES['default']['OPTIONS']['pool'] or PgBouncer, or lower concurrency. "
        "OperationalError: "
    )
    assert error.startswith(expected), error
    # Retried as any error is.
    assert Job.objects.get(id=job.id).state != JobState.FAILED
    wait_for(lambda: "failed, retrying" in worker.output() and expected in worker.output())
    assert re.search(
        r"up to 8 connections \(3 handler threads \+ 4 for the engine \+ 1 LISTEN\); the server "
        r"allows max_connections \d+ less \d+ reserved: \d+, \d+ in use now",
        worker.output(),
    ), worker.output()


@pytest.mark.slow
def test_handlers_past_the_limit_leave_the_heartbeat_its_connection(limited_role, start_worker):
    # No pool; the role may open 8 connections and the worker would hold 13
    # (8 handler threads, 4 engine threads, LISTEN). Jobs run 4 s, twice
    # STALE_AFTER. The heartbeat and the completer connect before any handler
    # runs, so the handlers refused are the ones past the limit: their attempts
    # fail (retried) without running. Were the heartbeat refused instead, its
    # jobs' heartbeats would go stale and maintenance would rescue them while
    # they run, to run again.
    role = limited_role(8)
    ids = _touch_jobs(8, hold=4.0)
    worker = start_worker(
        "--queue",
        "orm=8",
        env={**SETTINGS, "AWA_TEST_DB_USER": role, "AWA_TEST_STALE_AFTER": "2"},
    )
    wait_for(lambda: Ledger.objects.filter(job_id__in=ids).count() >= 3, timeout=30)
    time.sleep(1.5)  # three maintenance passes: a stale heartbeat would be rescued by now
    assert "rescued" not in worker.output(), worker.output()
    ran = list(Ledger.objects.filter(job_id__in=ids).values_list("job_id", flat=True))
    assert len(ran) == len(set(ran)), sorted(ran)  # no job ran twice
    errors = [e["error"] for job in Job.objects.filter(id__in=ids) for e in job.errors]
    assert not [e for e in errors if "stale heartbeat" in e], errors
    assert any("PostgreSQL refused a new connection" in e for e in errors), errors


def test_a_worker_near_the_limit_warns_at_start_up(limited_role, start_worker):
    role = limited_role(10)
    worker = start_worker("--queue", "orm=4", env={**SETTINGS, "AWA_TEST_DB_USER": role})
    text = wait_for(lambda: "(awa.W101)" in worker.output() and worker.output(), timeout=20)
    assert re.search(
        r"WARNING .*a worker on database 'default' holds up to 9 connections \(4 handler threads "
        rf"\+ 4 for the engine \+ 1 LISTEN\): with the \d+ connections in use now that is \d+ of "
        rf"the 10 the server allows \(role '{role}' CONNECTION LIMIT\), past 85%",
        text,
    ), text
    assert "['OPTIONS']['pool']" in text and "PgBouncer" in text


def _server_allows() -> tuple[int, int]:
    (row,) = _sql(
        "SELECT current_setting('max_connections')::int, "
        "current_setting('superuser_reserved_connections')::int"
    )
    return row


def test_the_check_warns_when_a_worker_would_take_the_server_near_its_limit():
    max_connections, reserved = _server_allows()
    concurrency = max_connections  # a worker alone past the limit, whatever else runs
    with override_settings(AWA={"QUEUES": {"big": {"concurrency": concurrency}}}):
        (warning,) = check_connections(databases=["default"])
        assert check_connections(databases=None) == []  # only under check --database
    assert warning.id == "awa.W101"
    assert re.search(
        rf"holds up to {concurrency + 5} connections \({concurrency} handler threads \+ 4 for "
        rf"the engine \+ 1 LISTEN\): with the \d+ connections in use now that is \d+ of the "
        rf"{max_connections - reserved} the server allows \(max_connections {max_connections} "
        rf"less {reserved} reserved\), past 85%.*lower concurrency\) \(queues big={concurrency}\)",
        warning.msg,
    ), warning.msg
    with override_settings(AWA={"QUEUES": {"small": {"concurrency": 2}}}):
        assert check_connections(databases=["default"]) == []


def test_the_check_says_nothing_when_the_database_cannot_be_reached():
    env = {
        **SETTINGS,
        "AWA_TEST_DB_NAME": connection.settings_dict["NAME"],
        "AWA_TEST_DB_PORT": "1",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "django", "check", "--database", "default"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


def test_a_pool_with_no_free_connection_is_named_in_the_error():
    psycopg_pool = pytest.importorskip("psycopg_pool")
    settings_dict = connection.settings_dict
    conninfo = (
        f"host={settings_dict['HOST'] or 'localhost'} port={settings_dict['PORT'] or 5432} "
        f"user={settings_dict['USER'] or 'postgres'} dbname={settings_dict['NAME']}"
    )
    with (
        psycopg_pool.ConnectionPool(conninfo, min_size=1, max_size=1, timeout=0.2) as pool,
        pool.connection(),
        pytest.raises(psycopg_pool.PoolTimeout) as raised,
    ):
        pool.getconn()
    job = Job.objects.create(kind="touch", queue="orm", args={"reference": "x"})
    need = connection_need({"orm": 30}, "default", listener=True)
    result = from_exception(job, raised.value, need=need)
    assert result.state == JobState.RETRYABLE
    assert result.error.startswith(
        "no connection came free in Django's pool in time (couldn't get a connection after "
    ), result.error
    assert (
        "it is shared by this worker's 34 threads and handlers hold one while they run; "
        "raise the pool's max_size (or its timeout), or lower concurrency. PoolTimeout: "
    ) in result.error


def test_the_producers_of_several_queues_share_one_connection(limited_role, start_worker):
    # Three queues, no pool: their producers take turns on one connection.
    role = limited_role(20)
    worker = start_worker(
        "--queue", "default=1", "--queue", "echo=1", "--queue", "bulk=1",
        env={**SETTINGS, "AWA_TEST_DB_USER": role},
    )  # fmt: skip
    wait_for(
        lambda: (
            "listening for new jobs" in worker.output()
            and "is now the maintenance leader" in worker.output()
        ),
        timeout=20,
    )
    # Idle: the producers' one (polling every 0.2 s), maintenance, the listener,
    # the heartbeat and the completer (both connect before any handler runs);
    # the main thread holds none.
    most = 0
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        most = max(most, _backends(role))
        time.sleep(0.02)
    assert most == 5, most
    assert (
        "up to 8 connections (3 handler threads + 4 for the engine (3 producers share one) "
        "+ 1 LISTEN)" in worker.output()
    )
    jobs = [awa.enqueue(Act(action="ok")), awa.enqueue(Echo(n=1)), awa.enqueue(Noop(n=1))]
    for job in jobs:
        wait_for_state(job.id, JobState.COMPLETED)


def _take_the_heartbeats_slot(role: str) -> psycopg.Connection:
    """Terminate the worker's heartbeat backend and take its slot under ``role``'s limit.

    The heartbeat's connection is the one whose last statement registered the
    worker (``fleet.beat``, each ``HEARTBEAT_INTERVAL``); the main thread's, at
    start-up, is closed. Should the heartbeat reconnect before this connects,
    it goes again.
    """
    for _ in range(20):
        pids = wait_for(
            lambda: _sql(
                "SELECT pid FROM pg_stat_activity WHERE usename = %s "
                "AND query LIKE '%%INSERT INTO awa_worker %%'",
                [role],
            )
        )
        assert len(pids) == 1, pids
        [(pid,)] = pids
        _sql("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda pid=pid: not _sql("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]))
        try:
            return connect_to(connection.settings_dict["NAME"], user=role)
        except psycopg.OperationalError as exc:
            assert "too many connections" in str(exc), exc
    raise AssertionError("the heartbeat took its slot back every time")


PAUSED = "the heartbeat has not reached the database for"
RESUMED = "the heartbeat reached the database again after"


def _heartbeat_tries(log: str) -> list[float]:
    """When the heartbeat tried the database and failed, from ``-v 3``'s lines, seconds."""
    return [
        datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for line in log.splitlines()
        if "unavailable (heartbeat:" in line or "heartbeat: database 'default' still" in line
    ]


@pytest.mark.slow
def test_no_job_is_claimed_while_the_heartbeat_cannot_reconnect(limited_role, start_worker):
    # The role may open as many connections as the idle worker holds (its
    # producer, completer, heartbeat, maintenance and LISTEN). The heartbeat's
    # backend is terminated and its slot taken: the server refuses it another,
    # while the producer's connection still works. A job claimed then would get
    # no heartbeat, be rescued after STALE_AFTER (3 s) and run twice: none is
    # claimed until the heartbeat reaches the database again.
    role = limited_role(5)
    worker = start_worker(
        "--queue", "bulk=2", "-v", "3", env={**SETTINGS, "AWA_TEST_DB_USER": role}
    )  # fmt: skip
    wait_for(lambda: "listening for new jobs" in worker.output(), timeout=30)
    wait_for(lambda: _backends(role) == 5, message=lambda: f"{_backends(role)} backends")
    holder = _take_the_heartbeats_slot(role)
    try:
        wait_for(lambda: "unavailable (heartbeat:" in worker.output(), message=worker.output)
        time.sleep(1.5)  # the heartbeat has failed past ClaimPause.after (0.75 s here)
        ids = awa.enqueue_many([Noop(n=i) for i in range(4)])
        # The producer, woken by the NOTIFY, would have claimed them at once. Long
        # enough, too, for the heartbeat's seventh try: with the other threads'
        # backoff (up to 5 s), its wait before it would be 1.6 s at least.
        time.sleep(5)
        states = set(Job.objects.filter(id__in=ids).values_list("state", "attempt"))
        assert states == {(JobState.AVAILABLE, 0)}, states
    finally:
        holder.close()
    # Claims wait for the heartbeat: it tries again at most a second apart (and a
    # pass), so they resume soon after the database takes it back.
    tries = _heartbeat_tries(worker.output())
    assert len(tries) >= 7, worker.output()
    gaps = [later - earlier for earlier, later in itertools.pairwise(tries)]
    assert max(gaps) < 1.6, gaps
    wait_for(
        lambda: not Job.objects.filter(id__in=ids).exclude(state=JobState.COMPLETED).exists(),
        timeout=30,
        message=worker.output,
    )
    assert set(Job.objects.filter(id__in=ids).values_list("attempt", flat=True)) == {1}
    log = worker.output()
    [paused] = [line for line in log.splitlines() if PAUSED in line]
    assert "WARNING" in paused and "too many connections for role" in paused, paused
    assert "claims no jobs until it does" in paused and "run a second time" in paused, paused
    assert log.count(RESUMED) == 1, log
    assert "rescued job" not in log, log


def test_one_handler_thread_is_said_in_the_singular() -> None:
    need = connection_need({"default": 1}, "default", listener=True)
    assert need.parts() == "1 handler thread + 4 for the engine + 1 LISTEN"
