"""A worker rides through a database that goes away or turns read-only, and says so once.

The read-only case is what a failover looks like from a worker: for a while
its new connections land on a server that refuses writes (SQLSTATE 25006, as
a standby or a not yet promoted node does). Made here with the test
database's ``default_transaction_read_only``, set for new sessions only, and
every worker session terminated so that they reconnect into it.
"""

from __future__ import annotations

import time

import pytest
from django.db import connection

import django_awa as awa
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
    new_holder, new_term = _lease()
    assert new_holder == holder  # the same worker leads again, on a writable server
    assert new_term >= term
    assert worker.stop() == 0


AWA_LEADS = "is now the maintenance leader"


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
