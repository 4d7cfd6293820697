"""Unique keys met on the paths that change a job's state after it was enqueued.

A kind whose ``awa.Unique(states=...)`` leaves out a state (``running``,
``scheduled``, ``retryable``...) lets a twin be enqueued while a job is in it; the
job's next transition into a state its key is held in then meets the twin's key.
"""

from __future__ import annotations

import datetime as dt
import signal

import pytest
from django.utils import timezone

import django_awa as awa
from django_awa.models import Job, JobState
from django_awa.testing import run_jobs
from tests.conftest import wait_for, wait_for_state
from tests.testapp.jobs import Act, TimedAsync
from tests.testapp.models import Ledger

pytestmark = pytest.mark.django_db(transaction=True)

NOT_RUNNING = awa.Unique(states=("available", "scheduled", "retryable"))


@pytest.mark.slow
def test_a_timed_out_attempt_whose_retry_meets_a_twins_key_is_failed_not_left_running(
    start_worker,
):
    """The attempt's retry would take the key a twin (enqueued while it ran, running
    holding no key here) holds: the outcome's write and its fallback both broke the
    unique index, and the job stayed running until rescue took it."""
    job = awa.enqueue(TimedAsync(seconds=60), unique=NOT_RUNNING)
    start_worker("--queue", "default")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id, note="timed-async:start").exists())
    # Its twin, on a queue no worker takes: it holds the key, available.
    twin = awa.enqueue(TimedAsync(seconds=60), queue="elsewhere", unique=NOT_RUNNING)
    failed = wait_for_state(job.id, JobState.FAILED, timeout=10)
    error = failed.errors[-1]["error"]
    assert failed.attempt == 1 and len(failed.errors) == 1
    assert error.startswith("timed out"), error
    assert "not retried: another job holds its unique key" in error, error
    assert Job.objects.get(id=twin.id).state == JobState.AVAILABLE


AVAILABLE_ONLY = awa.Unique(states=("available",))


@pytest.mark.slow
def test_a_due_job_whose_key_a_twin_holds_waits_and_promotion_goes_on_for_the_others(
    start_worker,
):
    """A scheduled (or retryable) job does not hold a key held only while available;
    its twin, enqueued meanwhile, does. Promoting it broke the unique index: the
    whole promotion failed every tick, and no due job was made available any more."""
    soon = timezone.now() + dt.timedelta(seconds=1)
    waiting = awa.enqueue(Act(tag="1"), run_at=soon, unique=AVAILABLE_ONLY)
    twin = awa.enqueue(Act(tag="1"), queue="elsewhere", unique=AVAILABLE_ONLY)
    other = awa.enqueue(Act(tag="2"), run_at=soon)
    # Twins due together: the first is promoted, the second waits for it.
    first = awa.enqueue(Act(tag="3"), run_at=soon, unique=AVAILABLE_ONLY)
    second = awa.enqueue(Act(tag="3"), queue="elsewhere", run_at=soon, unique=AVAILABLE_ONLY)
    worker = start_worker("--queue", "default")
    wait_for_state(other.id, JobState.COMPLETED, timeout=10)
    wait_for_state(first.id, JobState.COMPLETED, timeout=10)
    wait_for(lambda: Job.objects.get(id=second.id).state == JobState.AVAILABLE, timeout=10)
    assert Job.objects.get(id=waiting.id).state == JobState.SCHEDULED
    # Once the twin lets the key go, the waiting job is made available and runs.
    awa.cancel(twin.id)
    wait_for_state(waiting.id, JobState.COMPLETED, timeout=10)
    assert "maintenance duty promote failed" not in worker.output()


@pytest.mark.slow
def test_a_job_whose_failure_would_take_a_key_a_twin_holds_is_rescued_and_rescue_goes_on(
    start_worker,
):
    """``Unique(states=...)`` with ``failed`` but not ``running``: the last attempt's
    failure would take the key a twin (enqueued while it ran) holds. Neither the
    worker's outcome nor rescue could write it: the whole rescue statement failed,
    every tick, and no job was rescued any more, anyone's."""
    held_when_failed = awa.Unique(states=("available", "failed"))
    job = awa.enqueue(
        awa.EnqueueRequest(TimedAsync(seconds=60), max_attempts=1, unique=held_when_failed)
    )
    worker = start_worker("--queue", "default")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id, note="timed-async:start").exists())
    twin = awa.enqueue(TimedAsync(seconds=60), queue="elsewhere", unique=held_when_failed)
    failed = wait_for_state(job.id, JobState.FAILED, timeout=15)
    # It failed without holding the key, which the twin holds.
    assert failed.unique_states == ["available", "blocked"]
    assert failed.unique_key == Job.objects.get(id=twin.id).unique_key
    assert Job.objects.get(id=twin.id).state == JobState.AVAILABLE
    assert "maintenance duty rescue failed" not in worker.output()


def test_run_jobs_leaves_a_job_whose_key_a_twin_holds_and_runs_twins_one_after_the_other():
    """``testing.run_jobs`` promotes as maintenance does: it raised the unique index's
    ``IntegrityError`` for a scheduled job whose twin held the key, or for twins
    scheduled together."""
    later = timezone.now() + dt.timedelta(hours=1)
    waiting = awa.enqueue(Act(tag="1"), run_at=later, unique=AVAILABLE_ONLY)
    twin = awa.enqueue(Act(tag="1"), queue="elsewhere", unique=AVAILABLE_ONLY)
    first = awa.enqueue(Act(tag="2"), run_at=later, unique=AVAILABLE_ONLY)
    second = awa.enqueue(Act(tag="2"), run_at=later, unique=AVAILABLE_ONLY)
    run_jobs(queue="default", include_scheduled=True)
    states = dict(Job.objects.values_list("id", "state"))
    assert states[waiting.id] == JobState.SCHEDULED
    assert states[twin.id] == JobState.AVAILABLE
    assert states[first.id] == states[second.id] == JobState.COMPLETED


@pytest.mark.slow
def test_a_job_given_back_at_shutdown_whose_key_a_twin_holds_says_so(start_worker):
    """Given back at shutdown, a job would be available, holding a key a twin (enqueued
    while it ran) holds. Its error read ``follow-up insert failed: IntegrityError``,
    naming a follow-up that had not failed."""
    job = awa.enqueue(Act(action="sleep", seconds=30, tag="given"), unique=AVAILABLE_ONLY)
    worker = start_worker("--queue", "default", "--shutdown-timeout", "0.5")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    twin = awa.enqueue(
        Act(action="sleep", seconds=30, tag="given"), queue="elsewhere", unique=AVAILABLE_ONLY
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    back = Job.objects.get(id=job.id)
    assert back.state == JobState.RETRYABLE
    error = back.errors[-1]["error"]
    assert error.startswith(
        "the attempt's outcome (available) was not stored: another job holds its unique key"
    ), error
    assert "follow-up" not in error and "interrupted" in error
    assert Job.objects.get(id=twin.id).state == JobState.AVAILABLE
