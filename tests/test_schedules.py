"""Steering periodic schedules (SPEC §8): pause, resume, trigger; removed ones never fire."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import pytest
from django.db import connection
from django.utils import timezone

import django_awa as awa
from django_awa.models import Job, PeriodicSchedule
from django_awa.schedules import fire_due, schedules
from tests.test_admin import browser, login, superuser  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Sweep(awa.JobArgs):
    floor: int = 1


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@pytest.fixture
def every_minute():
    schedule = awa.periodic("sweep", "* * * * *", Sweep(floor=3), queue="chores", priority=1)
    yield schedule
    schedules.pop("sweep", None)


def sweeps() -> list[Job]:
    return list(Job.objects.filter(kind="sweep").order_by("id"))


def test_a_paused_schedule_does_not_fire_and_resuming_skips_what_fell_due_meanwhile(every_minute):
    row = awa.pause_schedule("sweep")  # before it ever fired: its row is made paused
    assert row.paused and row.cron == "* * * * *" and row.kind == "sweep"
    start = db_now()
    assert fire_due("default", start + dt.timedelta(minutes=10)) == 0
    assert sweeps() == []

    row = awa.resume_schedule("sweep")
    assert not row.paused and row.last_fire_at >= start
    # The ten minutes it was paused are not caught up; the next minute fires
    # (the first minute boundary after the resume, whatever second it came at).
    next_minute = row.last_fire_at.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
    assert fire_due("default", next_minute - dt.timedelta(microseconds=1)) == 0
    assert fire_due("default", next_minute + dt.timedelta(seconds=1)) == 1
    assert len(sweeps()) == 1
    # Idempotent both ways.
    assert not awa.resume_schedule("sweep").paused
    assert awa.pause_schedule("sweep").paused and awa.pause_schedule("sweep").paused


def test_trigger_enqueues_one_fire_now_with_the_schedules_options_even_when_paused(every_minute):
    awa.pause_schedule("sweep")
    before = timezone.now()
    job = awa.trigger_schedule("sweep")
    assert (job.kind, job.queue, job.priority, job.args) == ("sweep", "chores", 1, {"floor": 3})
    assert job.state == "available" and job.run_at >= before - dt.timedelta(seconds=5)
    periodic = Job.objects.get(id=job.id).metadata["awa_periodic"]
    assert periodic["name"] == "sweep" and periodic["triggered"] is True
    assert dt.datetime.fromisoformat(periodic["fire_at"]) <= timezone.now()
    assert PeriodicSchedule.objects.get(name="sweep").paused  # trigger leaves the pause


def test_unknown_and_removed_schedules():
    with pytest.raises(awa.ScheduleNotFound, match="no periodic schedule named 'nope'"):
        awa.pause_schedule("nope")
    with pytest.raises(awa.ScheduleNotFound):
        awa.resume_schedule("nope")
    with pytest.raises(awa.ScheduleNotFound, match="no periodic schedule named 'nope'"):
        awa.trigger_schedule("nope")
    # A row left by a schedule no jobs.py declares any more: never fires, cannot be
    # triggered, may still be paused and resumed.
    PeriodicSchedule.objects.create(
        name="legacy", cron="* * * * *", kind="sweep",
        last_fire_at=timezone.now() - dt.timedelta(hours=2),
    )  # fmt: skip
    assert fire_due("default", db_now() + dt.timedelta(minutes=5)) == 0
    assert sweeps() == []
    with pytest.raises(awa.ScheduleNotFound, match="removed from code"):
        awa.trigger_schedule("legacy")
    assert awa.pause_schedule("legacy").paused
    assert not awa.resume_schedule("legacy").paused
    assert PeriodicSchedule.objects.get(name="legacy").next_fire_at is None


def test_the_admin_shows_removed_schedules_and_pauses_resumes_and_triggers(
    every_minute,
    login,  # noqa: F811
    superuser,  # noqa: F811
):
    import os

    from django.urls import reverse

    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    awa.pause_schedule("sweep")
    awa.resume_schedule("sweep")  # its row exists now
    PeriodicSchedule.objects.create(name="legacy", cron="0 * * * *", kind="old")
    page = login(superuser)
    page.goto(reverse("admin:django_awa_periodicschedule_changelist"))

    def status(name: str) -> str:
        row = page.locator("#result_list tbody tr", has_text=name)
        return row.locator("td.field-status").inner_text()

    assert status("legacy") == "removed from code: not firing"
    assert status("sweep") == "active"

    def act(action: str, name: str) -> None:
        page.locator("#result_list tbody tr", has_text=name).locator("input.action-select").check()
        page.select_option("select[name=action]", action)
        with page.expect_navigation():
            page.locator("button[name=index]").click()

    act("pause_schedules", "sweep")
    assert status("sweep") == "paused" and PeriodicSchedule.objects.get(name="sweep").paused
    act("trigger_schedules", "sweep")
    assert "Triggered: sweep." in page.locator("ul.messagelist").inner_text()
    assert [j.metadata["awa_periodic"]["triggered"] for j in sweeps()] == [True]
    act("trigger_schedules", "legacy")
    assert "removed from code" in page.locator("ul.messagelist li.error").inner_text()
    act("resume_schedules", "sweep")
    assert status("sweep") == "active"
