"""Heartbeats in-process: ``Heartbeat.run_once`` stores progress and heartbeats once."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from django.utils import timezone

from django_awa.conf import awa_settings
from django_awa.execute import Attempt
from django_awa.heartbeat import Heartbeat, fresh_for
from django_awa.models import Job, JobState
from django_awa.state import WorkerState
from tests.conftest import make_job

pytestmark = pytest.mark.django_db

LONG_AGO = dt.timedelta(minutes=5)


def _running(state: WorkerState, **fields: object) -> Attempt:
    fields.setdefault("heartbeat_at", timezone.now() - LONG_AGO)
    job = make_job(state=JobState.RUNNING, attempt=1, run_lease=7, **fields)
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


def test_a_heartbeat_leaves_rows_claimed_or_beaten_recently_alone_and_still_holds_them():
    # Under a burst nearly every attempt a worker holds was claimed moments ago:
    # rewriting (and locking) those rows would contend with the completer about
    # to finalize them, for nothing. Only heartbeats older than fresh_for move.
    state = WorkerState.create({"default": 2})
    old = _running(state)
    recent = timezone.now() - dt.timedelta(seconds=fresh_for(state.conf) / 4)
    fresh = _running(state, heartbeat_at=recent)

    Heartbeat(state).run_once()

    rows = {j.id: j for j in Job.objects.filter(id__in=[old.job.id, fresh.job.id])}
    assert rows[old.job.id].heartbeat_at > timezone.now() - LONG_AGO / 2
    assert rows[fresh.job.id].heartbeat_at == recent
    assert not old.cancelled.is_set() and not fresh.cancelled.is_set()


def test_a_row_left_alone_is_beaten_before_it_could_look_stale():
    # Skipped at one pass, written at the next: at most fresh_for + HEARTBEAT_INTERVAL
    # old, under STALE_AFTER whatever the two settings are (STALE_AFTER > interval).
    for interval, stale in ((5.0, 30.0), (5.0, 6.0), (1.0, 1.5), (10.0, 100.0)):
        conf = dataclasses.replace(awa_settings(), heartbeat_interval=interval, stale_after=stale)
        assert 0 < fresh_for(conf) <= interval
        assert fresh_for(conf) + interval < stale
