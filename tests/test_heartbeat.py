"""Heartbeats in-process: ``Heartbeat.run_once`` stores progress and heartbeats once."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from django_awa.execute import Attempt
from django_awa.heartbeat import Heartbeat
from django_awa.models import Job, JobState
from django_awa.state import WorkerState
from tests.conftest import make_job

pytestmark = pytest.mark.django_db

LONG_AGO = dt.timedelta(minutes=5)


def _running(state: WorkerState, **fields: object) -> Attempt:
    job = make_job(
        state=JobState.RUNNING,
        attempt=1,
        run_lease=7,
        heartbeat_at=timezone.now() - LONG_AGO,
        **fields,
    )
    attempt = state.running[job.id] = Attempt(job=job, alias="default")
    return attempt


def test_run_once_renews_the_heartbeats_and_tells_lost_attempts():
    state = WorkerState.create({"default": 2})
    alive = _running(state)
    lost = _running(state)
    Job.objects.filter(id=lost.job.id).update(run_lease=8)  # rescued, claimed again elsewhere

    Heartbeat(state).run_once()

    rows = {j.id: j for j in Job.objects.filter(id__in=[alive.job.id, lost.job.id])}
    assert rows[alive.job.id].heartbeat_at > timezone.now() - LONG_AGO / 2
    assert rows[lost.job.id].heartbeat_at < timezone.now() - LONG_AGO / 2
    assert not alive.cancelled.is_set() and lost.cancelled.is_set()


def test_progress_is_stored_every_pass_and_heartbeats_only_when_due():
    state = WorkerState.create({"default": 1})
    attempt = _running(state)
    attempt.progress = {"percent": 50, "message": "half", "metadata": {}}
    attempt.progress_dirty = True
    heartbeat = Heartbeat(state)  # it just started: the next heartbeat is not due

    heartbeat.run_once(due_only=True)

    row = Job.objects.get(id=attempt.job.id)
    assert row.progress == {"percent": 50, "message": "half", "metadata": {}}
    assert not attempt.progress_dirty
    assert row.heartbeat_at < timezone.now() - LONG_AGO / 2
    heartbeat.last_beat -= state.conf.heartbeat_interval
    heartbeat.run_once(due_only=True)
    assert Job.objects.get(id=attempt.job.id).heartbeat_at > timezone.now() - LONG_AGO / 2
