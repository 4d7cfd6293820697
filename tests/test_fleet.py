"""The worker registry (fleet.py): real worker processes appear, heartbeat, and disappear."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.urls import reverse

import django_awa as awa
from django_awa import fleet
from django_awa.maintenance import Maintenance
from django_awa.models import Worker
from tests.conftest import wait_for, wait_for_state
from tests.test_admin import browser, login, superuser  # noqa: F401 (fixtures)
from tests.testapp.jobs import Act

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

STALE_AFTER = 3.0  # tests/settings.py


def row_of(pid: int) -> Worker | None:
    return Worker.objects.filter(pid=pid).first()


def live_pids() -> set[int]:
    return set(fleet.live("default", STALE_AFTER).values_list("pid", flat=True))


def test_a_worker_registers_heartbeats_its_running_jobs_and_deregisters_on_sigterm(start_worker):
    worker = start_worker("--queue", "default=3", "--queue", "echo=2")
    row = wait_for(lambda: row_of(worker.pid), message=worker.output)
    assert row.host == socket.gethostname()
    assert row.name == f"{row.host}:{worker.pid}"
    assert row.queues == {"default": 3, "echo": 2} and row.concurrency == 5
    assert row.version == awa.__version__ and row.started_at <= row.last_seen_at
    first_seen = row.last_seen_at

    job = awa.enqueue(Act(action="sleep", seconds=30))
    wait_for_state(job.id, "running")
    row = wait_for(
        lambda: (r := row_of(worker.pid)) is not None and r.running_ids == [job.id] and r,
        message=worker.output,
    )
    assert row.running == 1 and row.last_seen_at > first_seen
    assert fleet.running_job("default", STALE_AFTER, job.id) == row

    awa.cancel(job.id, "enough")
    wait_for(lambda: (r := row_of(worker.pid)) is not None and r.running == 0 and r)
    assert worker.stop() == 0
    assert row_of(worker.pid) is None


def test_a_job_whose_handler_returned_is_not_counted_while_its_outcome_waits(start_worker):
    # Its outcome waits for the completer (here: for a row lock another session holds;
    # in a busy worker, for the next batch). Counted, a busy worker said it ran more
    # jobs than its concurrency.
    worker = start_worker("--queue", "default=2")
    job = awa.enqueue(Act(action="sleep", seconds=2))
    wait_for_state(job.id, "running")
    wait_for(lambda: (r := row_of(worker.pid)) is not None and r.running_ids == [job.id])
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params) as other:
        other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [job.id])
        wait_for(lambda: "wait for a row lock" in worker.output(), message=worker.output)
        row = wait_for(lambda: (r := row_of(worker.pid)) is not None and r.running == 0 and r)
        assert row.running_ids == []
    wait_for_state(job.id, "completed")
    assert worker.stop() == 0


@pytest.mark.slow
def test_a_sigkilled_worker_leaves_the_live_list_after_stale_after_and_the_leader_prunes_it(
    start_worker,
):
    doomed = start_worker()
    survivor = start_worker()
    wait_for(lambda: {doomed.pid, survivor.pid} <= live_pids())
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    # Unrenewed, it drops out of the live list once STALE_AFTER passed...
    wait_for(lambda: doomed.pid not in live_pids(), timeout=STALE_AFTER + 10)
    assert survivor.pid in live_pids()
    # ...and the maintenance leader (the survivor, now) deletes its row.
    wait_for(lambda: row_of(doomed.pid) is None, timeout=STALE_AFTER + 15)
    assert row_of(survivor.pid) is not None


@pytest.mark.django_db(transaction=True)
def test_maintenance_prunes_only_rows_unseen_for_stale_after():
    import datetime as dt
    import uuid

    from django.utils import timezone

    now = timezone.now()
    fresh = Worker.objects.create(id=uuid.uuid4(), name="a:1", host="a", pid=1)
    stale = Worker.objects.create(
        id=uuid.uuid4(), name="b:2", host="b", pid=2, last_seen_at=now - dt.timedelta(seconds=60)
    )
    assert Maintenance().prune_workers() == 1
    assert list(Worker.objects.values_list("id", flat=True)) == [fresh.id]
    assert stale.id not in set(fleet.live("default", STALE_AFTER).values_list("id", flat=True))


def test_the_admin_lists_live_workers_and_links_a_running_job_to_its_worker(
    start_worker,
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    worker = start_worker("--queue", "default=2")
    job = awa.enqueue(Act(action="sleep", seconds=30))
    wait_for_state(job.id, "running")
    wait_for(lambda: (r := row_of(worker.pid)) is not None and r.running_ids == [job.id])
    page = login(superuser)

    page.goto(reverse("admin:django_awa_worker_changelist"))
    row = page.locator("#result_list tbody tr")
    assert row.count() == 1
    assert row.locator("th.field-name").inner_text() == f"{socket.gethostname()}:{worker.pid}"
    assert row.locator("td.field-queue_list").inner_text() == "default=2"
    assert row.locator("td.field-running").inner_text() == "1"
    # The only worker leads maintenance.
    wait_for(lambda: fleet.live("default", STALE_AFTER).filter(maintained_at__isnull=False))
    page.reload()
    assert page.locator("td.field-leader img[alt=True]").count() == 1

    page.goto(reverse("admin:django_awa_job_change", args=[job.id]))
    link = page.locator(".field-running_worker a")
    assert link.inner_text() == f"{socket.gethostname()}:{worker.pid}"
    link.click()
    page.wait_for_url("**/worker/**")
    assert page.locator(".field-running_jobs a").inner_text() == f"act #{job.id}"

    worker.signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: worker.pid not in live_pids(), timeout=STALE_AFTER + 10)
    page.goto(reverse("admin:django_awa_worker_changelist"))
    assert page.locator("#result_list tbody tr").count() == 0
    page.goto(reverse("admin:django_awa_job_change", args=[job.id]))
    assert "no live worker" in page.locator(".field-running_worker").inner_text()
