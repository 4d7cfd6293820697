"""The admin dashboard (issue 21, item 5): the per-minute rollup and the live page.

Outcomes are counted by real workers (``awa_worker`` subprocesses), flushed with
their heartbeats and rolled up by their maintenance leader; the page is driven
in Chromium.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.sessions.models import Session
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.test.utils import CaptureQueriesContext

import django_awa as awa
from django_awa import dashboard, sql
from django_awa.maintenance import Maintenance
from django_awa.models import JobCount, JobState, StatDelta, StatMinute
from tests.conftest import make_job, wait_for, wait_for_state
from tests.test_admin import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    browser,
    login,
    superuser,
    viewer,
)
from tests.testapp.jobs import Act, Pay

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
pytestmark = pytest.mark.django_db(transaction=True)

DASHBOARD_URL = "/admin/django_awa/dashboard/"
DATA_URL = "/admin/django_awa/dashboard/data/"


def _rolled_up() -> dict[str, int]:
    sums = StatMinute.objects.aggregate(
        completed=Sum("completed"), failed=Sum("failed"), retried=Sum("retried")
    )
    return {key: value or 0 for key, value in sums.items()}


def _waits_counted() -> int:
    return sum(sum(row.wait) for row in StatMinute.objects.all())


def test_a_tally_flushed_by_two_workers_adds_up_in_one_rollup_row_per_queue_and_minute():
    first, second = dashboard.Tally(), dashboard.Tally()
    for _ in range(3):
        first.count("default", JobState.COMPLETED, wait=0.004)
    first.count("default", JobState.FAILED, wait=2.0)
    first.count("echo", JobState.RETRYABLE)
    second.count("default", JobState.COMPLETED, wait=40.0)
    second.count("default", JobState.AVAILABLE)  # a snoozed or given-back attempt: no outcome
    assert first.flush("default", "w1") == 2
    assert second.flush("default", "w2") == 1
    assert first.flush("default", "w1") == 0  # nothing new: no row
    assert StatDelta.objects.count() == 3

    taken = Maintenance().roll_up_stats()
    assert taken == 3
    assert StatDelta.objects.count() == 0  # taken by the leader
    rows = {row.queue: row for row in StatMinute.objects.all()}
    assert set(rows) == {"default", "echo"}
    default = rows["default"]
    assert (default.completed, default.failed, default.retried) == (4, 1, 0)
    assert (rows["echo"].completed, rows["echo"].retried) == (0, 1)
    assert sum(default.wait) == 5  # every attempt that started, one bucket each

    # A later flush in the same minute adds to the row rather than replacing it.
    first.count("default", JobState.COMPLETED)
    first.flush("default", "w1")
    Maintenance().roll_up_stats()
    assert StatMinute.objects.get(queue="default").completed == 5

    data = dashboard.snapshot("default", "hour")
    overall = data["series"]["*"]
    assert overall["totals"] == {"completed": 5, "failed": 1, "retried": 1}
    assert data["series"]["default"]["totals"]["completed"] == 5
    assert len(overall["completed"]) == 60  # a point per minute of the hour
    assert sum(overall["completed"]) == 5  # per minute, one point per minute
    p50 = overall["wait_p50"][-1]
    p95 = overall["wait_p95"][-1]
    assert p50 is not None and p50 <= 0.005  # three of five waited 4 ms
    assert p95 is not None and 30.0 <= p95 <= 60.0  # the slowest waited 40 s
    day = dashboard.snapshot("default", "day")
    assert len(day["series"]["*"]["completed"]) == 96  # a point per 15 minutes
    assert day["series"]["*"]["totals"]["completed"] == 5


def test_the_leader_folds_deltas_in_bounded_batches(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dashboard, "FOLD_BATCH", 2)
    monkeypatch.setattr(dashboard, "FOLD_ROUNDS", 2)
    for n in range(5):
        tally = dashboard.Tally()
        tally.count("default", JobState.COMPLETED)
        tally.flush("default", f"w{n}")
    assert Maintenance().roll_up_stats() == 4  # two rounds of two
    assert StatDelta.objects.count() == 1  # the next pass takes it
    assert Maintenance().roll_up_stats() == 1
    assert StatMinute.objects.get(queue="default").completed == 5


def test_maintenance_prunes_minutes_older_than_a_day_and_records_the_oldest_due_job():
    old = StatMinute.objects.create(
        queue="default", minute=dt.datetime(2020, 1, 1, tzinfo=dt.UTC), completed=7
    )
    make_job(run_at=awa_now() - dt.timedelta(seconds=90))
    maintenance = Maintenance()
    maintenance.count_jobs()
    maintenance.roll_up_stats()
    assert not StatMinute.objects.filter(id=old.id).exists()
    row = StatMinute.objects.get(queue="default")
    assert row.oldest_due is not None and 85 <= row.oldest_due <= 120
    data = dashboard.snapshot("default", "hour")
    assert 85 <= data["current"]["oldest_due"]["default"] <= 120
    assert data["series"]["default"]["oldest_due"][-1] == pytest.approx(row.oldest_due, abs=0.1)


def awa_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute(sql.DATABASE_NOW)
        now: dt.datetime = cursor.fetchone()[0]
    return now


def test_worker_outcomes_reach_the_rollup_completed_failed_and_retried(start_worker: Any):
    done = [awa.enqueue(Act(action="ok")) for _ in range(5)]
    failed = awa.enqueue(Act(action="terminal"))
    retried = awa.enqueue(Act(fail_until=1))
    worker = start_worker()
    for job in done:
        wait_for_state(job.id, JobState.COMPLETED)
    wait_for_state(failed.id, JobState.FAILED)
    wait_for(
        lambda: (
            _rolled_up()["completed"] >= 5
            and _rolled_up()["failed"] == 1
            and _rolled_up()["retried"] >= 1
        ),
        timeout=20,
        message=lambda: f"rollup {_rolled_up()}\n{worker.output()[-3000:]}",
    )
    sums = _rolled_up()
    assert sums["failed"] == 1
    assert sums["retried"] == 1  # the one job that failed its first attempt, once
    # Every attempt that started has a wait: 5 + 1 + the retried job's attempts.
    wait_for(lambda: _waits_counted() >= 7, timeout=20, message=lambda: str(_rolled_up()))
    assert wait_for_state(retried.id, JobState.COMPLETED, timeout=30)
    wait_for(lambda: _rolled_up()["completed"] == 6, timeout=20, message=lambda: str(_rolled_up()))
    assert worker.stop() == 0


def test_an_atomic_attempt_whose_followup_failed_counts_as_its_retry_not_a_completion(
    start_worker: Any,
):
    # Pay is atomic=True with max_attempts=2; its on_completed follow-up raises for
    # this reference, so each attempt is recorded as an error: retried, then failed.
    job = awa.enqueue(Pay(reference="bad-followup-dashboard"))
    worker = start_worker()
    wait_for_state(job.id, JobState.FAILED, timeout=30)
    wait_for(
        lambda: _rolled_up()["failed"] == 1 and _rolled_up()["retried"] == 1,
        timeout=20,
        message=lambda: f"rollup {_rolled_up()}\n{worker.output()[-3000:]}",
    )
    assert _rolled_up() == {"completed": 0, "failed": 1, "retried": 1}
    assert worker.stop() == 0


def test_the_data_endpoint_is_for_staff_with_job_permissions_only(superuser: Any):  # noqa: F811
    anonymous = Client()
    response = anonymous.get(DATA_URL)
    assert response.status_code == 302 and "/login/" in response["Location"]

    staff = User.objects.create_user("plain", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(DATA_URL).status_code == 403
    assert client.get(DASHBOARD_URL).status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(User.objects.get(id=staff.id))
    response = client.get(DATA_URL)
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]

    client.force_login(superuser)
    bad = client.get(DATA_URL, {"window": "week"})
    assert bad.status_code == 400 and "window" in json.loads(bad.content)["error"]
    assert client.get(DASHBOARD_URL, {"refresh": "0"}).status_code == 400
    # The page reads the rollup and the leader's counts, never awa_job.
    with CaptureQueriesContext(connection) as queries:
        assert client.get(DATA_URL, {"window": "day"}).status_code == 200
    assert not [q["sql"] for q in queries if 'awa_job"' in q["sql"] or "awa_job " in q["sql"]]
    index = client.get("/admin/").content.decode()
    assert DASHBOARD_URL in index and "/admin/django_awa/deadletter/" in index


@pytest.mark.slow
def test_the_dashboard_draws_real_outcomes_and_redraws_without_a_reload(
    start_worker: Any,
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    for _ in range(3):
        awa.enqueue(Act(action="ok"))
    awa.enqueue(Act(action="terminal"))
    worker = start_worker()
    wait_for(
        lambda: _rolled_up()["completed"] == 3 and _rolled_up()["failed"] == 1,
        timeout=20,
        message=lambda: f"rollup {_rolled_up()}\n{worker.output()[-3000:]}",
    )
    page = login(superuser)
    page.goto(f"{DASHBOARD_URL}?refresh=1")
    assert page.locator("#awa-total-completed").inner_text() == "3"
    assert page.locator("#awa-total-failed").inner_text() == "1"
    outcomes = page.locator("#awa-chart-outcomes")
    assert int(outcomes.get_attribute("data-completed-points") or 0) >= 1
    assert outcomes.locator("polyline[data-series=completed]").count() >= 1
    # The waits are drawn: a line, or a dot when only one minute has any.
    assert page.locator("#awa-chart-wait [data-series=p95]").count() >= 1
    row = page.locator('#awa-dashboard-queues tr[data-queue="default"]')
    assert row.locator("td.completed").inner_text() == "3"
    page.evaluate("window.awaSamePage = true")

    later = awa.enqueue(Act(action="ok"))
    wait_for_state(later.id, JobState.COMPLETED)
    page.wait_for_function(
        "document.getElementById('awa-total-completed').textContent === '4'", timeout=20_000
    )
    assert page.evaluate("window.awaSamePage") is True  # redrawn, not reloaded
    assert row.locator("td.completed").inner_text() == "4"
    page.screenshot(path=str(SCREENSHOTS / "awa-admin-dashboard.png"), full_page=True)
    page.select_option("#awa-scope", "default")
    assert page.locator("#awa-total-completed").inner_text() == "4"
    assert worker.stop() == 0
    assert JobCount.objects.exists()


def test_the_charts_axes_read_as_round_figures_in_their_units(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    """The y axis tops out at a round figure above the highest point, and says counts
    as counts and waits as durations: "30,000" jobs a minute, "5.0 s", not "32831"
    (the highest point plus a tenth) or "4.8"."""
    minute = awa_now().replace(second=0, microsecond=0) - dt.timedelta(minutes=2)
    StatMinute.objects.create(queue="default", minute=minute, completed=29_846, oldest_due=4.4)
    page = login(superuser)
    page.goto(DASHBOARD_URL)

    def axis(chart: str) -> list[str]:
        labels: list[str] = page.locator(f"#awa-chart-{chart} text.awa-axis-y").all_text_contents()
        return labels

    assert axis("outcomes") == ["0", "15,000", "30,000"]
    assert axis("oldest") == ["0", "2.5 s", "5.0 s"]
    assert axis("wait") == ["0", "500 ms", "1.0 s"]  # no waits: the axis of 0 to 1 s


def test_a_dashboard_whose_session_ended_says_so_and_stops_polling(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    """Signed out in another tab (or the session expired): the data endpoint redirects
    to the login page. The page said "could not refresh (Unexpected token '<' ...)" and
    fetched the login page every second for as long as it stayed open."""
    page = login(superuser)
    page.goto(f"{DASHBOARD_URL}?refresh=1")
    page.wait_for_function(
        "document.getElementById('awa-dashboard-status').textContent.startsWith('as of')"
    )
    Session.objects.all().delete()
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url))
    status = page.locator("#awa-dashboard-status")
    page.wait_for_function(
        "!document.getElementById('awa-dashboard-status').textContent.startsWith('as of')",
        timeout=10_000,
    )
    assert status.inner_text() == "signed out: sign in again and reload this page to refresh"
    seen = len(fetched)
    page.wait_for_timeout(3_000)
    assert len(fetched) == seen, fetched[seen:]


def test_a_dashboard_whose_user_lost_view_job_says_so_and_stops_polling(
    login: Any,  # noqa: F811
    viewer: Any,  # noqa: F811
):
    page = login(viewer)
    page.goto(f"{DASHBOARD_URL}?refresh=1")
    page.wait_for_function(
        "document.getElementById('awa-dashboard-status').textContent.startsWith('as of')"
    )
    viewer.user_permissions.clear()
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url))
    page.wait_for_function(
        "!document.getElementById('awa-dashboard-status').textContent.startsWith('as of')",
        timeout=10_000,
    )
    assert page.locator("#awa-dashboard-status").inner_text() == (
        "no longer allowed to view jobs: the figures shown are not refreshed"
    )
    seen = len(fetched)
    page.wait_for_timeout(3_000)
    assert len(fetched) == seen, fetched[seen:]
