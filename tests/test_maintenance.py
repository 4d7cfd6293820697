"""Maintenance duties, called directly: promotion, aging, pruning, periodic jobs."""

from __future__ import annotations

import datetime as dt
import re
import sys
import uuid
from dataclasses import dataclass

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

import django_awa as awa
from django_awa import sql
from django_awa.maintenance import LeadershipLost, Maintenance, MaintenanceService
from django_awa.models import Job, JobState, MaintenanceLease, PendingFollowup, PeriodicSchedule
from django_awa.producer import claim
from django_awa.schedules import fire_due, schedules
from django_awa.state import WorkerState
from tests.conftest import make_job, wait_for
from tests.testapp.jobs import Act, Echo

pytestmark = pytest.mark.django_db

ago = lambda **kw: timezone.now() - dt.timedelta(**kw)  # noqa: E731


def test_promote_makes_due_scheduled_and_retryable_jobs_available():
    due_scheduled = make_job(state=JobState.SCHEDULED, run_at=ago(seconds=1))
    due_retry = make_job(state=JobState.RETRYABLE, run_at=ago(seconds=1), attempt=1)
    future = make_job(state=JobState.SCHEDULED, run_at=ago(seconds=-3600))
    queues = Maintenance().promote()
    assert queues == {"default"}
    assert Job.objects.get(id=due_scheduled.id).state == JobState.AVAILABLE
    assert Job.objects.get(id=due_retry.id).state == JobState.AVAILABLE
    assert Job.objects.get(id=future.id).state == JobState.SCHEDULED


def test_claim_order_is_priority_then_run_at_then_id():
    low = make_job(priority=4, run_at=ago(seconds=30))
    high_late = make_job(priority=1, run_at=ago(seconds=1))
    high_early = make_job(priority=1, run_at=ago(seconds=5))
    mid = make_job(priority=2, run_at=ago(seconds=60))
    claimed = claim("default", 10, "default")
    assert [j.id for j in claimed] == [high_early.id, high_late.id, mid.id, low.id]
    assert all(j.state == JobState.RUNNING and j.attempt == 1 for j in claimed)
    assert all(j.run_lease == 1 for j in claimed)


def test_priority_aging_lets_a_starved_job_climb(settings):
    settings.AWA = {**settings.AWA, "PRIORITY_AGING_INTERVAL": 10}
    waited = ago(seconds=25)
    starved = make_job(priority=4, run_at=waited)  # 2.5 intervals: two levels up
    fresh = make_job(priority=4)
    maintenance = Maintenance()
    maintenance.age_priorities()
    aged = Job.objects.get(id=starved.id)
    assert aged.priority == 2 and aged.run_at == waited
    assert aged.metadata["awa_original_priority"] == 4
    assert Job.objects.get(id=fresh.id).priority == 4
    maintenance.age_priorities()  # nothing more to do until it waits longer
    assert Job.objects.get(id=starved.id).priority == 2
    Job.objects.filter(id=starved.id).update(run_at=ago(seconds=45))
    maintenance.age_priorities()
    assert Job.objects.get(id=starved.id).priority == 1
    # Behind a flood of priority-1 jobs that arrived later, it now comes first.
    for _ in range(5):
        make_job(priority=1)
    assert claim("default", 1, "default")[0].id == starved.id


def test_prune_deletes_finished_rows_past_retention_only(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60, "FAILED_RETENTION": 3600}
    old_done = make_job(state=JobState.COMPLETED, finalized_at=ago(seconds=120))
    new_done = make_job(state=JobState.COMPLETED, finalized_at=ago(seconds=10))
    old_failed = make_job(state=JobState.FAILED, finalized_at=ago(seconds=120))
    ancient_failed = make_job(state=JobState.CANCELLED, finalized_at=ago(days=1))
    running = make_job(state=JobState.RUNNING, heartbeat_at=timezone.now())
    assert Maintenance().prune() == 2
    left = set(Job.objects.values_list("id", flat=True))
    assert left == {new_done.id, old_failed.id, running.id}
    assert ancient_failed.id not in left and old_done.id not in left


def test_prune_goes_on_row_by_row_when_the_segments_duty_fails(settings, monkeypatch, caplog):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60}

    def broken(self):
        raise RuntimeError("segments broken")

    monkeypatch.setattr(Maintenance, "rotate_finished", broken)
    old_done = make_job(state=JobState.COMPLETED, finalized_at=ago(seconds=120))
    assert Maintenance().prune() == 1
    assert not Job.objects.filter(id=old_done.id).exists()
    assert "maintenance duty rotate_finished failed: segments broken" in caplog.text


def test_prune_works_in_batches(settings, monkeypatch):
    from django_awa import maintenance

    monkeypatch.setattr(maintenance, "BATCH", 7)
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 1}
    Job.objects.bulk_create(
        [
            Job(kind="echo", queue="q", state=JobState.COMPLETED, finalized_at=ago(hours=1))
            for _ in range(30)
        ]
    )
    assert Maintenance().prune() == 30
    assert not Job.objects.exists()


def test_rescue_leaves_healthy_and_waiting_jobs_alone():
    healthy = make_job(state=JobState.RUNNING, heartbeat_at=timezone.now(), attempt=1)
    waiting = make_job(
        state=JobState.WAITING_EXTERNAL,
        callback_timeout_at=timezone.now() + dt.timedelta(minutes=5),
    )
    Maintenance().rescue()
    assert Job.objects.get(id=healthy.id).state == JobState.RUNNING
    assert Job.objects.get(id=waiting.id).state == JobState.WAITING_EXTERNAL


def test_rescued_job_retries_with_backoff():
    job = make_job(state=JobState.RUNNING, attempt=2, heartbeat_at=ago(minutes=1))
    Maintenance().rescue()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE
    delay = (row.run_at - dt.datetime.fromisoformat(row.errors[-1]["at"])).total_seconds()
    assert 3.9 <= delay <= 5.1  # 2**2 plus up to 25%


def retry_delay(row: Job) -> float:
    """Seconds from a retryable row's last errors entry to its run_at."""
    return (row.run_at - dt.datetime.fromisoformat(row.errors[-1]["at"])).total_seconds()


@pytest.mark.parametrize("attempt", [1, 3])
def test_a_handler_error_waits_the_backoff_the_database_draws(attempt):
    from django_awa.execute import Attempt, run_attempt
    from django_awa.finalize import finalize

    make_job(args={"action": "raise"}, attempt=attempt - 1)
    (claimed,) = claim("default", 1, "default")
    result = run_attempt(Attempt(job=claimed, alias="default"))
    assert result.state == JobState.RETRYABLE and result.delay is None
    finalize([result], "default")
    row = Job.objects.get(id=claimed.id)
    assert row.state == JobState.RETRYABLE and row.attempt == attempt
    assert 2**attempt - 0.1 <= retry_delay(row) <= 1.25 * 2**attempt + 0.1


def test_pending_followup_retries_back_off_from_the_injected_now():
    from tests.testapp.followups import FAIL

    FAIL["rescued_times"] = 5
    make_job(state=JobState.RUNNING, attempt=1, heartbeat_at=ago(minutes=5))
    maintenance = Maintenance()
    maintenance.rescue()  # its on_rescued follow-up fails: kept, retried later
    (pending,) = PendingFollowup.objects.all()
    assert pending.attempts == 1
    now = timezone.now() + dt.timedelta(days=3)
    assert maintenance.replay_pending(now) == 0  # due by the injected now; fails again
    pending.refresh_from_db()
    assert pending.attempts == 2 and "rescued follow-up exploded" in pending.last_error
    waited = (pending.next_attempt_at - now).total_seconds()
    assert 4 <= waited <= 5  # the backoff of try 2, from now
    assert maintenance.replay_pending() == 0  # not due by the database clock


def test_run_once_judges_periodic_fires_by_the_injected_now(periodic_schedule):
    periodic_schedule("hourly", "0 * * * *", Report(day="run-once"))
    start = timezone.now().replace(minute=30, second=0, microsecond=0)
    Maintenance().run_once(now=start)  # first sight: starts from now
    Maintenance().run_once(now=start + dt.timedelta(hours=1))
    (fired,) = Job.objects.filter(kind="report")
    assert fired.run_at == start.replace(minute=0) + dt.timedelta(hours=1)
    Maintenance().run_once()  # the database clock: an hour before that fire, nothing due
    assert Job.objects.filter(kind="report").count() == 1


def expire_lease() -> None:
    MaintenanceLease.objects.filter(name=sql.LEASE_NAME).update(
        lease_until=timezone.now() - dt.timedelta(seconds=1)
    )


@pytest.mark.django_db(transaction=True)
def test_the_maintenance_lease_is_held_by_one_worker_at_a_time():
    first, second = Maintenance(holder="host:1"), Maintenance(holder="host:2")
    assert first.try_lead()
    assert not second.try_lead()
    assert first.try_lead()  # the holder keeps it, in the same term
    term = first.term
    first.resign()
    assert second.try_lead()
    assert second.term == term + 1
    assert MaintenanceLease.objects.get(name=sql.LEASE_NAME).holder == "host:2"


@pytest.mark.django_db(transaction=True)
def test_a_leader_whose_lease_another_took_writes_nothing():
    stood_still, successor = Maintenance(holder="host:1"), Maintenance(holder="host:2")
    assert stood_still.try_lead()
    due = make_job(state=JobState.SCHEDULED, run_at=ago(seconds=1))
    expire_lease()  # it stopped renewing: frozen, or cut off
    assert successor.try_lead()

    with pytest.raises(LeadershipLost):
        stood_still.promote()
    with pytest.raises(LeadershipLost):
        stood_still.tick()
    assert Job.objects.get(id=due.id).state == JobState.SCHEDULED
    assert stood_still.term is None

    successor.tick()
    assert Job.objects.get(id=due.id).state == JobState.AVAILABLE
    # Back, it competes again, and waits for the lease to run out.
    assert not stood_still.try_lead()


@pytest.mark.django_db(transaction=True)
def test_a_leaders_writes_renew_its_lease():
    leader = Maintenance(holder="host:1")
    assert leader.try_lead()
    MaintenanceLease.objects.filter(name=sql.LEASE_NAME).update(lease_until=timezone.now())
    leader.promote()
    lease = MaintenanceLease.objects.get(name=sql.LEASE_NAME)
    assert lease.lease_until > timezone.now() + dt.timedelta(seconds=1)


def test_an_engine_key_written_around_enqueue_does_not_stop_priority_aging(settings):
    settings.AWA = {**settings.AWA, "PRIORITY_AGING_INTERVAL": 60}
    odd = make_job(priority=4, run_at=ago(minutes=10), metadata={"awa_original_priority": "high"})
    huge = make_job(priority=4, run_at=ago(minutes=10), metadata={"awa_original_priority": 1e30})
    normal = make_job(priority=4, run_at=ago(minutes=10))
    Maintenance().age_priorities()
    assert Job.objects.get(id=normal.id).priority == 1
    # The odd originals count as absent: aged from the row's own priority.
    assert Job.objects.get(id=odd.id).priority == 1
    assert Job.objects.get(id=huge.id).priority == 1


def test_each_maintenance_duty_fails_alone(monkeypatch, caplog):
    stale = make_job(state=JobState.RUNNING, attempt=1, heartbeat_at=ago(minutes=5))

    def broken() -> None:
        raise RuntimeError("schedule store unreachable")

    maintenance = Maintenance()
    monkeypatch.setattr(maintenance, "promote", broken)
    monkeypatch.setattr(maintenance, "fire_periodic", broken)
    with caplog.at_level("ERROR", logger="django_awa.maintenance"):
        maintenance.tick()
    # The duties after the broken ones still ran: the stale job was rescued.
    assert Job.objects.get(id=stale.id).state == JobState.RETRYABLE
    messages = [r.getMessage() for r in caplog.records]
    assert "maintenance duty promote failed: schedule store unreachable" in messages
    assert "maintenance duty fire_periodic failed: schedule store unreachable" in messages


@dataclass
class Report(awa.JobArgs):
    day: str = "today"


@pytest.fixture
def periodic_schedule():
    created = []

    def declare(*args, **kwargs):
        schedule = awa.periodic(*args, **kwargs)
        created.append(schedule.name)
        return schedule

    yield declare
    for name in created:
        schedules.pop(name, None)


def test_periodic_fires_once_per_due_time_and_coalesces_missed_fires(periodic_schedule):
    periodic_schedule("every-minute", "* * * * *", Report())
    start = timezone.now().replace(second=30, microsecond=0)
    assert fire_due("default", now=start) == 0  # first sight: starts from now
    assert fire_due("default", now=start + dt.timedelta(seconds=20)) == 0
    assert fire_due("default", now=start + dt.timedelta(seconds=40)) == 1
    assert fire_due("default", now=start + dt.timedelta(seconds=45)) == 0  # not twice
    # Five minutes with no worker: coalesce enqueues only the last fire.
    assert fire_due("default", now=start + dt.timedelta(minutes=5, seconds=40)) == 1
    jobs = list(Job.objects.filter(kind="report").order_by("id"))
    assert len(jobs) == 2
    fire_at = dt.datetime.fromisoformat(jobs[-1].metadata["awa_periodic"]["fire_at"])
    assert jobs[-1].metadata["awa_periodic"]["name"] == "every-minute"
    assert jobs[-1].run_at == fire_at and fire_at.second == 0


def test_coalesce_enqueues_only_the_last_fire_after_more_missed_than_a_catch_up(
    periodic_schedule,
):
    periodic_schedule("every-second", "* * * * * *", Report(day="s"))
    start = timezone.now().replace(microsecond=0)
    fire_due("default", now=start)
    # 40 minutes down: 2,400 missed fires, more than MAX_CATCH_UP (1,000).
    later = start + dt.timedelta(minutes=40, microseconds=500_000)
    assert fire_due("default", now=later) == 1
    assert fire_due("default", now=later + dt.timedelta(milliseconds=100)) == 0
    [job] = Job.objects.filter(kind="report", args__day="s")
    assert job.run_at == later.replace(microsecond=0)


def test_coalesce_finds_the_latest_fire_without_walking_every_missed_one(
    periodic_schedule, monkeypatch
):
    # It walked every fire since the last (some 40 µs each: minutes after weeks of an
    # every-second schedule) and stopped at MAX_COALESCED, firing that one instead.
    monkeypatch.setattr("django_awa.schedules.MAX_COALESCED", 20_000)
    every_second = periodic_schedule("long-down", "* * * * * *", Report(day="l"))
    down = dt.datetime(2026, 3, 2, tzinfo=dt.UTC)
    up = down + dt.timedelta(days=1, microseconds=400_000)  # 86,400 fires missed
    assert every_second.last_fire_between(down, up) == up.replace(microsecond=0)


def test_a_fixed_hour_fires_once_when_the_clocks_go_back(periodic_schedule):
    # Paris, 2026-10-25: 03:00 CEST becomes 02:00 CET, and 02:30 comes twice.
    nightly = periodic_schedule(
        "nightly-dst", "30 2 * * *", Report(day="n"), timezone="Europe/Paris"
    )
    quarterly = periodic_schedule(
        "quarter-dst", "*/30 * * * *", Report(day="q"), timezone="Europe/Paris"
    )
    before = dt.datetime(2026, 10, 24, 12, 0, tzinfo=dt.UTC)
    nights = nightly.fires_between(before, before + dt.timedelta(days=2))
    assert [f.isoformat() for f in nights] == [
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST
        "2026-10-26T01:30:00+00:00",  # 02:30 CET the next night
    ]
    # A wildcard hour fires at each coming of the repeated hour, as cron does.
    first_pass = dt.datetime(2026, 10, 25, 0, 0, tzinfo=dt.UTC)  # 02:00 CEST
    halves = quarterly.fires_between(first_pass, first_pass + dt.timedelta(hours=2))
    assert len(halves) == 4  # 02:30 CEST, 02:00 and 02:30 CET, 03:00 CET
    # The fire after the first 02:30 is the next night's, not the second 02:30.
    assert nightly.next_after(nights[0]) == nights[1]


@pytest.mark.parametrize("missed", ["coalesce", "catch_up"])
def test_a_cron_or_timezone_edited_in_code_fires_from_now_not_from_the_old_last_fire(
    periodic_schedule, missed
):
    periodic_schedule("edited", "0 3 * * *", Report(day="e"), missed=missed)
    start = dt.datetime(2026, 3, 2, 2, 0, 30, tzinfo=dt.UTC)
    fire_due("default", now=start)
    assert fire_due("default", now=start + dt.timedelta(hours=1)) == 1  # 03:00
    # At 10:00 a deploy makes it every minute (workers ran all along): the minutes
    # since 03:00 were never its fire times, and nothing is enqueued for them.
    schedules.pop("edited")
    periodic_schedule("edited", "* * * * *", Report(day="e"), missed=missed)
    edited_at = start + dt.timedelta(hours=8)
    assert fire_due("default", now=edited_at) == 0
    row = PeriodicSchedule.objects.get(name="edited")
    assert (row.cron, row.last_fire_at) == ("* * * * *", edited_at)
    assert row.next_fire_at == dt.datetime(2026, 3, 2, 10, 1, tzinfo=dt.UTC)
    assert fire_due("default", now=edited_at + dt.timedelta(minutes=1)) == 1  # 10:01
    # A timezone edited: the same, from now.
    schedules.pop("edited")
    periodic_schedule(
        "edited", "0 * * * *", Report(day="e"), missed=missed, timezone="Asia/Kolkata"
    )
    assert fire_due("default", now=edited_at + dt.timedelta(hours=3)) == 0
    fire_times = [j.run_at.strftime("%H:%M") for j in Job.objects.filter(kind="report")]
    assert sorted(fire_times) == ["03:00", "10:01"]


def test_a_schedule_back_in_code_after_its_removal_fires_from_then(periodic_schedule):
    periodic_schedule("away", "* * * * *", Report(day="a"), missed="catch_up")
    start = dt.datetime(2026, 3, 2, 2, 0, 30, tzinfo=dt.UTC)
    fire_due("default", now=start)
    assert fire_due("default", now=start + dt.timedelta(minutes=1)) == 1  # 02:01
    schedules.pop("away")  # removed from jobs.py: it never fires
    assert fire_due("default", now=start + dt.timedelta(minutes=2)) == 0
    assert PeriodicSchedule.objects.get(name="away").next_fire_at is None
    # A day later it is declared again: the day's minutes, when it was not in the
    # code while workers ran, are not caught up.
    periodic_schedule("away", "* * * * *", Report(day="a"), missed="catch_up")
    back = start + dt.timedelta(days=1)
    assert fire_due("default", now=back) == 0
    assert fire_due("default", now=back + dt.timedelta(minutes=1)) == 1
    fire_times = sorted(j.run_at for j in Job.objects.filter(kind="report"))
    assert [f.strftime("%d %H:%M") for f in fire_times] == ["02 02:01", "03 02:01"]


def test_periodic_catch_up_enqueues_every_missed_fire(periodic_schedule):
    periodic_schedule("catch", "*/10 * * * * *", Report(day="x"), missed="catch_up")
    start = timezone.now().replace(microsecond=0)
    fire_due("default", now=start)
    assert fire_due("default", now=start + dt.timedelta(seconds=60)) == 6
    assert PeriodicSchedule.objects.get(name="catch").last_fire_at is not None


@pytest.mark.parametrize(
    ("cron", "kwargs", "message"),
    [
        ("not a cron", {}, "cron must have five fields"),
        ("61 * * * *", {}, "invalid cron expression"),
        ("* * * * *", {"timezone": "Mars/Olympus"}, "unknown timezone"),
        ("* * * * *", {"missed": "sometimes"}, "missed must be one of"),
        ("* * * * *", {"priority": 9}, "priority"),
        ("* * * * *", {"queue": "bad queue"}, "^periodic 'bad': .*invalid queue name 'bad queue'"),
        # What croniter takes but cron does not mean: refused, by field.
        ("R * * * *", {}, r"R \(random\) in the minute field 'R' is not supported"),
        ("0 H(0-5) * * *", {}, r"H \(hashed\) in the hour field 'H\(0-5\)' is not supported"),
        ("0 22-2 * * *", {}, "range 22-2 in the hour field '22-2' runs backwards: write 22-23,0-2"),
        ("0 23-1/2 * * *", {}, "range 23-1 in the hour field '23-1/2' runs backwards"),
        ("0 0 * * FRI-MON", {}, "range FRI-MON in the day-of-week field .* write FRI-6,0-MON"),
        ("55-5 * * * * *", {}, "range 55-5 in the second field '55-5' runs backwards"),
        (
            "0 3-3 * * *",
            {},
            r"range 3-3 in the hour field '3-3' names one value: write it alone \(3\)",
        ),
    ],
)
def test_periodic_declarations_are_validated(cron, kwargs, message):
    with pytest.raises(awa.ValidationError, match=message):
        awa.periodic("bad", cron, Report(), **kwargs)
    assert "bad" not in schedules


def test_args_that_cannot_be_stored_are_refused_naming_the_schedule():
    with pytest.raises(awa.ValidationError, match=r"^periodic 'nul-args': args of kind 'report'"):
        awa.periodic("nul-args", "0 3 * * *", Report(day="nul\x00"))
    assert "nul-args" not in schedules


def test_a_schedule_name_declared_twice_is_refused_naming_both_places(periodic_schedule):
    first = periodic_schedule("nightly-twice", "0 3 * * *", Report(day="first"))
    with pytest.raises(ImproperlyConfigured) as refused:
        line = sys._getframe().f_lineno + 1
        awa.periodic("nightly-twice", "*/5 * * * *", Report(day="second"))
    # Both places are this file's lines: the fixture's call and this test's.
    assert re.fullmatch(
        rf"periodic schedule 'nightly-twice' is declared twice: "
        rf"at {re.escape(__file__)}:\d+ and at {re.escape(__file__)}:{line}",
        str(refused.value),
    )
    assert schedules["nightly-twice"] is first  # nothing replaced: the first still fires
    start = dt.datetime(2026, 3, 2, 2, 0, 30, tzinfo=dt.UTC)
    fire_due("default", now=start)
    assert fire_due("default", now=start + dt.timedelta(hours=1)) == 1
    [job] = Job.objects.filter(kind="report")
    assert job.args == {"day": "first"} and job.run_at.hour == 3


def test_the_same_declaration_again_replaces_it(periodic_schedule):
    # A module re-imported (autoreload, tests) runs its awa.periodic(...) again.
    for day in ("before", "after"):
        periodic_schedule("reimported", "0 3 * * *", Report(day=day))
    assert schedules["reimported"].args == Report(day="after")


def test_ranges_fire_as_cron_means_them(periodic_schedule):
    # Friday to Sunday (7 is Sunday too); a wrap written as two ranges; L ends a range.
    weekend = periodic_schedule("weekend", "0 9 * * 5-7", Report(day="w"))
    night = periodic_schedule("night", "0 22-23,0-1 * * *", Report(day="n"))
    month_end = periodic_schedule("month-end", "0 0 30-L * *", Report(day="m"))
    monday = dt.datetime(2026, 3, 2, tzinfo=dt.UTC)
    week = monday + dt.timedelta(days=7)
    assert [f.strftime("%a") for f in weekend.fires_between(monday, week)] == ["Fri", "Sat", "Sun"]
    hours = [f.hour for f in night.fires_between(monday, monday + dt.timedelta(days=1))]
    assert hours == [1, 22, 23, 0]  # (after, until]: the next midnight too
    days = [f.strftime("%m-%d") for f in month_end.fires_between(monday, monday.replace(month=5))]
    assert days == ["03-30", "03-31", "04-30"]


def test_queue_controls_pause_resume_and_stats():
    awa.enqueue(Act(action="ok"))
    awa.enqueue(Echo(n=1))
    awa.pause_queue("default")
    assert claim("default", 5, "default") == []
    stats = awa.queue_stats()
    assert stats["default"]["paused"] is True and stats["default"]["available"] == 1
    assert stats["echo"]["available"] == 1 and stats["echo"]["failed"] == 0
    awa.resume_queue("default")
    assert len(claim("default", 5, "default")) == 1
    assert awa.queue_stats()["default"]["running"] == 1


def test_retry_makes_a_failed_job_available_with_attempts_reset():
    job = make_job(state=JobState.FAILED, attempt=3, max_attempts=3, finalized_at=timezone.now())
    retried = awa.retry(job.id)
    assert retried.state == JobState.AVAILABLE and retried.attempt == 0
    assert retried.finalized_at is None
    running = make_job(state=JobState.RUNNING, heartbeat_at=timezone.now())
    assert awa.retry(running.id).state == JobState.RUNNING  # left alone
    with pytest.raises(awa.JobNotFound):
        awa.retry(10**12)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (1.5, "a job id is an int, got float 1.5"),
        (True, "a job id is an int, got bool True"),
        ("abc", "a job id is an int, got str 'abc'"),
        ("job", r"a job id is an int, got the Job row .* \(pass job.id\)"),
    ],
)
@pytest.mark.parametrize("operation", ["cancel", "retry"])
def test_cancel_and_retry_refuse_what_is_no_job_id_and_touch_no_job(
    operation: str, given: object, message: str
) -> None:
    """A float went to PostgreSQL as it was and was rounded to another job's id:
    ``cancel(1.5)`` cancelled job 2. A Job row, a bool or text that is no number
    failed with a database error naming neither the value nor the call."""
    first = make_job(state=JobState.FAILED, finalized_at=timezone.now())
    second = make_job(state=JobState.AVAILABLE)
    other = make_job(state=JobState.FAILED, finalized_at=timezone.now())
    if given == "job":
        given = first
    elif isinstance(given, float):
        given = first.id + 0.5  # PostgreSQL rounds it half to even: one of the two
        message = rf"a job id is an int, got float {given}"
    with transaction.atomic():
        with pytest.raises(awa.ValidationError, match=rf"^{operation}: {message}"):
            getattr(awa, operation)(given)
        assert Job.objects.count() >= 3  # the caller's transaction is still usable
    states = {j.id: j.state for j in Job.objects.filter(id__in=[first.id, second.id, other.id])}
    assert states == {
        first.id: JobState.FAILED,
        second.id: JobState.AVAILABLE,
        other.id: JobState.FAILED,
    }
    assert getattr(awa, operation)(str(second.id)).id == second.id  # text of an id: as before
    with pytest.raises(awa.JobNotFound, match=f"no job with id {10**30}"):
        getattr(awa, operation)(10**30)


def test_cancel_a_finished_job_changes_nothing():
    job = make_job(state=JobState.COMPLETED, finalized_at=timezone.now())
    assert awa.cancel(job.id, "late").state == JobState.COMPLETED
    assert Job.objects.get(id=job.id).errors == []
    with pytest.raises(awa.JobNotFound):
        awa.cancel(10**12, "nope")


def add_finished_rows(n: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args, state, finalized_at) "
            "SELECT 'echo', 'default', '{}', 'completed', now() FROM generate_series(1, %s)",
            [n],
        )
        cursor.execute("ANALYZE awa_job")


def test_claim_is_an_index_scan_with_many_finished_rows():
    # 50,000 finished rows and a handful available: the claim reads the partial index.
    # (Like sql.CLAIM, it reads ONLY awa_job: finished rows in awa_job_done are never live.)
    add_finished_rows(50_000)
    for _ in range(5):
        make_job()
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN SELECT id FROM ONLY awa_job WHERE state = 'available' AND queue = 'default' "
            "AND run_at <= now() ORDER BY priority, run_at, id LIMIT 10 FOR UPDATE SKIP LOCKED"
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Index Scan using awa_job_claim_idx" in plan, plan
    assert "Seq Scan" not in plan


def test_prepared_claim_keeps_its_index_plan_when_planned_generically():
    # Prepared statements may switch to a plan made for any parameters; the
    # claim's must still walk awa_job_claim_idx, whatever the queue's size.
    add_finished_rows(20_000)
    for _ in range(3):
        awa.enqueue(Act(action="ok"))
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            assert len(claim("default", 2, "default")) == 2
            cursor.execute(
                "SELECT name FROM pg_prepared_statements WHERE statement LIKE %s",
                ["%WITH picked AS%"],
            )
            (name,) = cursor.fetchone()
            cursor.execute(f"EXPLAIN EXECUTE {name}('default', 10, '{{}}', 900)")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET plan_cache_mode")
    assert "Index Scan using awa_job_claim_idx" in plan, plan
    assert "Seq Scan on awa_job" not in plan, plan


def test_statements_joining_arrays_are_not_prepared():
    # A generic plan for the batched finalize cannot know how many ids it
    # gets; on a quiet table's statistics it scanned every running row per
    # batch. It is planned on each run instead.
    for _ in range(8):
        awa.enqueue(Act(action="ok"))
    from django_awa.execute import Attempt, run_attempt
    from django_awa.finalize import finalize

    claimed = claim("default", 8, "default")
    assert len(claimed) == 8
    for job in claimed:
        assert finalize([run_attempt(Attempt(job=job, alias="default"))], "default")
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    assert [s for s in prepared if "WITH picked AS" in s]  # the claim
    assert not [s for s in prepared if "d.run_lease" in s], prepared


def test_a_batch_of_completions_is_written_like_any_other_outcome():
    # Completions without progress take a narrower statement than other
    # outcomes; the rows must come out the same, and stale attempts untouched.
    from django_awa.execute import completed
    from django_awa.finalize import finalize

    for n in range(4):
        awa.enqueue(Echo(n=n))
    jobs = claim("echo", 4, "default")
    assert len(jobs) == 4
    stale = jobs[3]
    awa.cancel(stale.id, "meanwhile")
    written = finalize([completed(job) for job in jobs], "default")
    assert sorted(r.job.id for r in written) == sorted(j.id for j in jobs[:3])
    for row in Job.objects.filter(id__in=[j.id for j in jobs[:3]]):
        assert row.state == JobState.COMPLETED and row.finalized_at is not None
        assert (row.heartbeat_at, row.deadline_at, row.callback_id) == (None, None, None)
        assert row.attempt == 1 and row.errors == [] and not row.snoozed
    assert Job.objects.get(id=stale.id).state == JobState.CANCELLED


def test_rows_without_a_callback_take_no_callback_index_entries():
    # Callback ids are unique where set, through a partial index: the many rows
    # without one add nothing to it on each write, and a lookup by id (a
    # prepared statement's generic plan included) still reads it.
    for _ in range(3):
        make_job()
    parked = make_job(state="waiting_external", callback_id=uuid.uuid4())
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM awa_job WHERE callback_id IS NOT NULL")
        assert cursor.fetchone()[0] == 1
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'awa_job_callback_id_uniq'"
        )
        assert "WHERE (callback_id IS NOT NULL)" in cursor.fetchone()[0]
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(
                "PREPARE awa_by_callback(uuid) AS "
                + sql.LOCK_BY_CALLBACK.replace("%(callback_id)s", "$1")
            )
            cursor.execute("EXPLAIN EXECUTE awa_by_callback(%s)", [parked.callback_id])
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE awa_by_callback")
            cursor.execute("RESET plan_cache_mode")
    assert "awa_job_callback_id_uniq" in plan, plan
    with pytest.raises(IntegrityError), transaction.atomic():
        make_job(state="waiting_external", callback_id=parked.callback_id)


@pytest.mark.django_db(transaction=True)
def test_the_maintenance_service_leads_ticks_and_wakes_the_queues_it_made_due(caplog):
    state = WorkerState.create({"default": 1, "other": 1})
    service = MaintenanceService(state)
    other = MaintenanceService(WorkerState.create({"default": 1}))
    other.maintenance.holder = "elsewhere:1"
    due = make_job(state=JobState.SCHEDULED, run_at=ago(seconds=1))

    with caplog.at_level("INFO", logger="django_awa.maintenance"):
        service.run_once()
        other.run_once()

    assert service.is_leader and not other.is_leader
    assert f"worker {state.name} is now the maintenance leader" in caplog.text
    assert Job.objects.get(id=due.id).state == JobState.AVAILABLE
    assert state.queues["default"].wake.is_set() and not state.queues["other"].wake.is_set()

    expire_lease()  # it stood still
    assert other.maintenance.try_lead()
    service.run_once()
    assert not service.is_leader
    assert "is no longer the maintenance leader" in caplog.text


def job_table_stats() -> tuple[int, int, int]:
    """awa_job's dead rows, VACUUMs and autovacuums, as the statistics system counts them."""
    with connection.cursor() as cursor:
        if connection.pg_version >= 150000:
            cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT n_dead_tup, vacuum_count, autovacuum_count FROM pg_stat_user_tables "
            "WHERE relname = 'awa_job'"
        )
        dead, vacuums, autovacuums = cursor.fetchone()
    return dead, vacuums, autovacuums


def dead_job_rows(count: int) -> None:
    """Leave ``count`` dead row versions in awa_job (rows inserted, then deleted) and
    wait until the statistics system counts them, or autovacuum has cleared them."""
    autovacuumed = job_table_stats()[2]
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args) SELECT 'act', 'default', '{}' "
            "FROM generate_series(1, %s)",
            [count],
        )
        cursor.execute("DELETE FROM ONLY awa_job WHERE kind = 'act'")

    def counted() -> bool:
        dead, _, autovacuums = job_table_stats()
        return dead >= count or autovacuums > autovacuumed

    wait_for(counted, timeout=20, message="awa_job's dead rows uncounted")


def vacuums_of_awa_job() -> int:
    return job_table_stats()[1]


@pytest.mark.django_db(transaction=True)  # VACUUM cannot run in a transaction
def test_the_leader_vacuums_awa_job_when_autovacuum_will_not(settings, caplog):
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE awa_job SET (autovacuum_enabled = false)")
        # No dead rows left by earlier tests, and none counted: this connection's
        # statistics of a test rolled back before (its inserts, dead rows) are
        # flushed first, or they would land after the VACUUM's count.
        job_table_stats()
        cursor.execute("VACUUM awa_job")
    try:
        # Below autovacuum's threshold for it (migration 0001: 1,000 rows and 1%): none.
        dead_job_rows(500)
        assert Maintenance().vacuum() is False

        dead_job_rows(2000)
        vacuumed = vacuums_of_awa_job()
        settings.AWA = {**settings.AWA, "VACUUM_WITHOUT_AUTOVACUUM": False}
        off = MaintenanceService(WorkerState.create({"default": 1}))
        with caplog.at_level("WARNING", logger="django_awa.maintenance"):
            off.run_once()  # a new leader's first tick runs every duty
        assert off.is_leader
        assert "autovacuum is off" in caplog.text and "nothing reclaims" in caplog.text
        off.maintenance.resign()

        settings.AWA = {**settings.AWA, "VACUUM_WITHOUT_AUTOVACUUM": True}
        on = MaintenanceService(WorkerState.create({"default": 1}))
        on.run_once()
        assert on.is_leader
        # The statistics system saw one VACUUM (this one), and the dead rows are gone.
        assert wait_for(lambda: vacuums_of_awa_job() - vacuumed) == 1
        assert job_table_stats()[0] < 500
        assert Maintenance().vacuum() is False
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE awa_job RESET (autovacuum_enabled)")


def job_indexes() -> dict[str, tuple[str, bool, int]]:
    """awa_job's indexes: name -> (definition, valid, size in bytes)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_indexdef(c.oid), i.indisvalid, pg_relation_size(c.oid) "
            "FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'awa_job'::regclass"
        )
        return {name: (definition, valid, size) for name, definition, valid, size in cursor}


def backlog(rows: int, *, drained: bool) -> None:
    """``rows`` available jobs in awa_job; with ``drained``, deleted again and the table
    vacuumed, as a backlog leaves it once worked off: its indexes as large as they grew."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args) SELECT 'act', 'default', '{}' "
            "FROM generate_series(1, %s)",
            [rows],
        )
        if drained:
            cursor.execute("DELETE FROM ONLY awa_job WHERE kind = 'act'")
        cursor.execute("VACUUM ANALYZE awa_job")


@pytest.fixture
def small_reindex_threshold(monkeypatch):
    """An index counts as large from 256 kB (32 MB in production), so a backlog of
    tens of thousands of jobs stands for one of millions."""
    monkeypatch.setattr("django_awa.maintenance.REINDEX_MIN_BYTES", 256 * 1024)


@pytest.mark.django_db(transaction=True)  # REINDEX CONCURRENTLY cannot run in a transaction
def test_the_leader_rebuilds_the_indexes_a_drained_backlog_left_large(small_reindex_threshold):
    backlog(30_000, drained=True)
    before = job_indexes()
    large = {name for name, (_, _, size) in before.items() if size > 256 * 1024}
    assert {"awa_job_pkey", "awa_job_claim_idx"} <= large
    job = make_job()  # a live job goes on being found through them

    assert sorted(Maintenance().reindex()) == sorted(large)

    after = job_indexes()
    # The same indexes, each valid and as defined, rebuilt small.
    assert {name: (d, v) for name, (d, v, _) in after.items()} == {
        name: (d, True) for name, (d, _, _) in before.items()
    }
    assert all(after[name][2] < 64 * 1024 for name in large), after
    assert Job.objects.get(id=job.id).state == JobState.AVAILABLE
    assert [j.id for j in claim("default", 5, "default")] == [job.id]
    assert Maintenance().reindex() == []


@pytest.mark.django_db(transaction=True)
def test_indexes_as_large_as_their_live_rows_need_are_left_alone(small_reindex_threshold):
    backlog(30_000, drained=False)  # a backlog still waiting: its indexes are its size
    assert job_indexes()["awa_job_claim_idx"][2] > 256 * 1024
    assert Maintenance().reindex() == []


@pytest.mark.django_db(transaction=True)
def test_reindex_drops_the_invalid_index_an_interrupted_rebuild_left(small_reindex_threshold):
    """A REINDEX CONCURRENTLY stopped midway leaves <name>_ccnew behind, invalid, and
    every insert goes on writing into it. Made here as a failed build leaves one."""
    make_job(kind="act")
    make_job(kind="act")
    with connection.cursor() as cursor:
        for name in ("awa_job_claim_idx_ccnew", "someone_elses_idx", "someone_elses_ccnew"):
            with pytest.raises(IntegrityError):
                cursor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON awa_job (kind)")
    assert job_indexes()["awa_job_claim_idx_ccnew"][1] is False

    assert Maintenance().reindex() == ["awa_job_claim_idx_ccnew"]

    left = job_indexes()
    assert "awa_job_claim_idx_ccnew" not in left
    # Not the engine's to drop: no rebuild of one of its indexes left them.
    assert left["someone_elses_idx"][1] is False
    assert left["someone_elses_ccnew"][1] is False
    with connection.cursor() as cursor:
        cursor.execute("DROP INDEX someone_elses_idx, someone_elses_ccnew")


@pytest.mark.django_db(transaction=True)
def test_the_leaders_tick_rebuilds_in_a_thread_of_its_own_every_ten_minutes(
    small_reindex_threshold, settings
):
    backlog(30_000, drained=True)
    settings.AWA = {**settings.AWA, "REINDEX_BLOATED": False}
    off = Maintenance()
    off.tick()
    assert off._reindexing is None
    assert job_indexes()["awa_job_pkey"][2] > 256 * 1024

    settings.AWA = {**settings.AWA, "REINDEX_BLOATED": True}
    leader = Maintenance()
    leader.tick()
    rebuilding = leader._reindexing
    assert rebuilding is not None and rebuilding.name == "awa-reindex"
    rebuilding.join(timeout=60)
    assert not rebuilding.is_alive()
    assert job_indexes()["awa_job_pkey"][2] < 64 * 1024

    backlog(30_000, drained=True)
    leader._last_full = 0.0  # the tick's other duties are due again; the check is not
    leader.tick()
    assert leader._reindexing is rebuilding
    assert job_indexes()["awa_job_pkey"][2] > 256 * 1024


@pytest.mark.django_db(transaction=True)
def test_the_leader_leaves_awa_job_to_autovacuum_when_it_is_on():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('autovacuum')::boolean")
        if not cursor.fetchone()[0]:
            pytest.skip("autovacuum is off on this server")
    vacuumed = vacuums_of_awa_job()
    dead_job_rows(3000)  # past its threshold: autovacuum's to clear
    assert Maintenance().vacuum() is False
    assert vacuums_of_awa_job() == vacuumed
