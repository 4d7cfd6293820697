"""Jobs in a database other than ``AWA["DATABASE"]``: ``using="other"`` and
``awa_worker --database other`` (README, *Separate databases per queue group*).

The tests' ``AWA["DATABASE"]`` is ``default``; ``other`` is a second database on
the same server (tests/settings.py).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone

import django_awa as awa
from django_awa import bulk
from django_awa.backends import AwaTaskBackend, task_backends
from django_awa.db import listen_params
from django_awa.exceptions import ConfigurationError
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState, PeriodicSchedule
from django_awa.schedules import schedules
from django_awa.testing import assert_enqueued, enqueued, refute_enqueued
from tests.conftest import wait_for
from tests.test_commands import run
from tests.testapp import tasks
from tests.testapp.jobs import Act, Pay
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])


def other_env(**extra: str) -> dict[str, str]:
    """A worker subprocess's environment: ``other`` is this test's database too."""
    return {"AWA_TEST_OTHER_DB_NAME": connections["other"].settings_dict["NAME"], **extra}


def wait_for_other(job_id: int, state: str, timeout: float = 15) -> Job:
    def check() -> Job | None:
        job = Job.objects.using("other").filter(id=job_id).first()
        return job if job is not None and job.state == state else None

    return wait_for(check, timeout, lambda: f"job {job_id} in 'other' never became {state}")


def listening(worker: Any) -> bool:
    return "listening for new jobs and cancels" in worker.output()


def test_a_worker_on_another_database_is_woken_by_its_own_enqueues(start_worker):
    """Its listener LISTENs on its own database, where enqueues NOTIFY: not on
    AWA["DATABASE"]'s, which would leave every job waiting for the next poll."""
    worker = start_worker(
        "--database", "other", "--queue", "default", env=other_env(AWA_TEST_POLL_INTERVAL="30")
    )
    wait_for(lambda: listening(worker), 20, worker.output)
    assert "listening for new jobs and cancels (database 'other')" in worker.output()
    job = awa.enqueue(Act(action="ok"), using="other")
    # Far sooner than the 30 s poll.
    wait_for_other(job.id, JobState.COMPLETED, timeout=8)


def test_a_cancel_in_another_database_does_not_reach_a_job_with_the_same_id(start_worker):
    """A job id names a row of one database's table: cancelling job N of
    ``default`` must not tell the handler of job N of ``other`` it was cancelled."""
    worker = start_worker("--database", "other", "--queue", "default", env=other_env())
    wait_for(lambda: listening(worker), 20, worker.output)
    job = awa.enqueue(Act(action="sleep", seconds=3), using="other")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists(), 15, worker.output)
    # A running job of the same id in default, cancelled there: NOTIFY awa_cancel.
    Job.objects.using("default").create(
        id=job.id, kind="noop", queue="nowhere", args={}, state=JobState.RUNNING, attempt=1
    )
    awa.cancel(job.id)
    assert Job.objects.using("default").get(id=job.id).state == JobState.CANCELLED
    wait_for_other(job.id, JobState.COMPLETED)
    notes = list(Ledger.objects.filter(job_id=job.id).values_list("note", flat=True))
    assert notes == ["sleep"], worker.output()


@dataclass
class Tick(awa.JobArgs):
    n: int = 0


@pytest.fixture
def every_minute():
    schedule = awa.periodic("multidb-every-minute", "* * * * *", Tick())
    yield schedule
    schedules.pop(schedule.name, None)


def test_periodic_jobs_fire_once_in_awa_database_not_once_per_database(every_minute):
    """Each database's maintenance leader runs its duties; only AWA["DATABASE"]'s
    fires the project's schedules, so each fire is one job, not one per database."""
    start = timezone.now().replace(second=30, microsecond=0)
    later = start + dt.timedelta(minutes=1)
    for alias in ("default", "other"):
        maintenance = Maintenance(alias)
        maintenance.fire_periodic(start)  # first sight: starts from now
        maintenance.fire_periodic(later)
    assert Job.objects.using("default").filter(kind="tick").count() == 1
    assert not Job.objects.using("other").filter(kind="tick").exists()
    assert not PeriodicSchedule.objects.using("other").exists()


def test_the_admin_shows_and_steers_schedules_of_awa_database(admin_client, settings):
    """With AWA["DATABASE"] another alias and no router, every admin page reads it:
    the periodic schedules' list, page and actions too."""
    settings.AWA = {**settings.AWA, "DATABASE": "other"}
    PeriodicSchedule.objects.using("other").create(
        name="multidb-nightly", cron="0 3 * * *", kind="tick"
    )
    listed = admin_client.get("/admin/django_awa/periodicschedule/")
    assert listed.status_code == 200 and b"multidb-nightly" in listed.content
    page = admin_client.get("/admin/django_awa/periodicschedule/multidb-nightly/change/")
    assert page.status_code == 200 and b"multidb-nightly" in page.content
    admin_client.post(
        "/admin/django_awa/periodicschedule/",
        {"action": "pause_schedules", "_selected_action": ["multidb-nightly"]},
    )
    assert PeriodicSchedule.objects.using("other").get(name="multidb-nightly").paused


def test_a_bulk_operation_commits_each_batch_under_atomic_requests_of_awa_database(
    admin_client, settings
):
    """The bulk view is not one transaction on AWA["DATABASE"] either: with
    ``ATOMIC_REQUESTS`` on that alias, a batch is committed (its row locks
    released) before the next one starts."""
    settings.AWA = {**settings.AWA, "DATABASE": "other"}
    settings.DATABASES["other"]["ATOMIC_REQUESTS"] = True
    connections["other"].settings_dict["ATOMIC_REQUESTS"] = True
    with connections["other"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args, state) "
            "SELECT 'tick', 'multidb', '{}', 'available' FROM generate_series(1, %s)",
            [bulk.BATCH_SIZE + 5],
        )
    up_to = Job.objects.using("other").order_by("-id").values_list("id", flat=True)[0]
    seen_committed: list[int] = []

    def observe(execute, sql, params, many, context):
        if "SET state = 'cancelled'" in sql:
            # What another session sees cancelled as this batch starts.
            with psycopg.connect(**listen_params("other"), autocommit=True) as other:
                (count,) = other.execute(
                    "SELECT count(*) FROM awa_job WHERE state = 'cancelled'"
                ).fetchone()
            seen_committed.append(count)
        return execute(sql, params, many, context)

    try:
        with connections["other"].execute_wrapper(observe):
            response = admin_client.post(
                "/admin/django_awa/job/bulk/cancel/?queue=multidb", {"up_to": str(up_to)}
            )
    finally:
        connections["other"].settings_dict["ATOMIC_REQUESTS"] = False
    assert response.status_code == 302
    assert seen_committed == [0, bulk.BATCH_SIZE]
    assert Job.objects.using("other").filter(state="cancelled").count() == bulk.BATCH_SIZE + 5


def test_the_operator_commands_take_database():
    """``awa_jobs`` and ``awa_queues`` reach jobs enqueued with ``using=`` another
    alias, as ``awa_worker --database`` runs them."""
    job = awa.enqueue(Tick(n=1), queue="multidb", using="other")
    out, code = run("awa_jobs", "list", "--database", "other", "--json")
    assert code == 0 and [row["id"] for row in json.loads(out)] == [job.id]
    out, code = run("awa_jobs", "cancel", str(job.id), "--database", "other")
    assert code == 0, out
    assert Job.objects.using("other").get(id=job.id).state == JobState.CANCELLED
    out, code = run("awa_queues", "pause", "multidb", "--database", "other")
    assert code == 0 and awa.queue_stats(using="other")["multidb"]["paused"]
    assert "multidb" not in awa.queue_stats()  # nothing written to AWA["DATABASE"]
    out, code = run("awa_jobs", "list", "--database", "nowhere")
    assert code == 2


def test_an_atomic_handler_wraps_the_jobs_database_only(start_worker):
    """``atomic=True`` is a transaction on the job's database (README): the
    handler's write to ``default``, another database here, stays when it raises."""
    worker = start_worker("--database", "other", "--queue", "default", env=other_env())
    job = awa.enqueue(Pay(reference="multidb-pay", fail=True), using="other")
    wait_for_other(job.id, JobState.RETRYABLE)
    assert Order.objects.filter(reference="multidb-pay").count() == 1, worker.output()


def test_the_tasks_backend_database_option_is_checked_and_used():
    """``TASKS[...]["OPTIONS"]["DATABASE"]`` puts the tasks' jobs in that alias; a
    name that is no PostgreSQL entry of DATABASES is a system check error, not a
    ConfigurationError at the first enqueue in production."""
    bad = AwaTaskBackend("bulk", {"OPTIONS": {"DATABASE": "nowhere"}})
    (error,) = bad.check()
    assert error.id == "awa.E102"
    assert "TASKS['bulk']['OPTIONS']['DATABASE'] names no entry of DATABASES" in error.msg
    assert AwaTaskBackend("bulk", {"OPTIONS": {"DATABASE": "other"}}).check() == []
    # A misspelt key left the jobs in AWA["DATABASE"], with no word.
    (error,) = AwaTaskBackend("bulk", {"OPTIONS": {"DATABSE": "other"}}).check()
    assert error.id == "awa.E103"
    assert error.msg == (
        "TASKS['bulk']['OPTIONS'] has unknown key(s) 'DATABSE'; AwaTaskBackend takes only "
        "'DATABASE'"
    )
    backend = AwaTaskBackend("default", {"OPTIONS": {"DATABASE": "other"}})
    result = backend.enqueue(tasks.add, [2, 3], {})
    assert Job.objects.using("other").filter(id=int(result.id), kind__startswith="task:").exists()
    assert backend.get_result(result.id).id == result.id


def test_the_testing_helpers_take_using():
    """``assert_enqueued``, ``refute_enqueued`` and ``enqueued`` read jobs enqueued with
    ``using=`` another alias, as ``run_jobs(using=...)`` runs them; without it they
    read ``AWA["DATABASE"]``, which holds none."""
    job = awa.enqueue(Tick(n=3), queue="multidb", using="other")
    assert [j.id for j in assert_enqueued(Tick, n=3, count=1, using="other")] == [job.id]
    assert [j.id for j in enqueued(Tick, using="other")] == [job.id]
    refute_enqueued(Tick, n=4, using="other")
    with pytest.raises(AssertionError, match=r"(?s)to be enqueued, found 1: .*kind='tick'"):
        refute_enqueued(Tick, using="other")
    refute_enqueued(Tick)  # AWA["DATABASE"]: nothing there
    with pytest.raises(AssertionError, match="no job is enqueued at all"):
        assert_enqueued(Tick, n=3)
    with pytest.raises(ConfigurationError, match="no database alias 'nowhere'"):
        assert_enqueued(Tick, using="nowhere")


def test_a_task_enqueued_through_another_awa_backend_is_read_and_run_as_that_backends():
    """``task.using(backend=...)`` puts the call in that backend's database. A result read
    back through it (``get_result``), and the one the worker gives the task (its
    context, ``task_started``/``task_finished``), named the task's declared backend:
    their ``refresh()`` asked the other database, which holds no such job (or
    another job with the same id)."""
    from django_awa.testing import run_jobs

    awa_backend = {"BACKEND": "django_awa.backends.AwaTaskBackend"}
    bulk = {**awa_backend, "OPTIONS": {"DATABASE": "other"}}
    with override_settings(TASKS={"default": awa_backend, "bulk": bulk}):
        enqueued = tasks.backend_seen.using(backend="bulk").enqueue()
        assert Job.objects.using("other").filter(id=int(enqueued.id)).exists()
        read = task_backends["bulk"].get_result(enqueued.id)
        assert (read.backend, read.task.backend) == ("bulk", "bulk")
        read.refresh()  # TaskResultDoesNotExist: asked AWA["DATABASE"]
        assert read.status == "READY"
        assert run_jobs(using="other").counts["completed"] == 1
        read.refresh()
        assert read.status == "SUCCESSFUL"
        assert read.return_value == ["bulk", "bulk"]
