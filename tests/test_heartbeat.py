"""Heartbeats in-process: ``Heartbeat.run_once`` stores progress and heartbeats once."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time

import pytest
from django.db import OperationalError
from django.utils import timezone

from django_awa.conf import awa_settings
from django_awa.execute import Attempt
from django_awa.heartbeat import Heartbeat, fresh_for
from django_awa.models import Job, JobState
from django_awa.state import ClaimPause, WorkerState
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


def test_claims_pause_while_the_heartbeat_fails_past_its_bound_and_resume_when_it_goes_through(
    caplog,
):
    # The subprocess test: test_connections.py's
    # test_no_job_is_claimed_while_the_heartbeat_cannot_reconnect.
    pause = WorkerState.create({"default": 1}).claim_pause
    refused = OperationalError('FATAL: too many connections for role "app"')
    with caplog.at_level(logging.INFO, logger="django_awa.state"):
        pause.went_through()  # nothing failed: nothing said
        assert not pause.holds()
        # A pass failed just now, then the next went through (a dropped connection
        # opened again): no pause, nothing said.
        pause.failed(time.monotonic(), refused)
        assert not pause.holds()
        pause.went_through()
        assert not caplog.records
        # Failing in a row past the bound: every producer finds claims paused, and
        # the first says so, once.
        pause.failed(time.monotonic() - pause.after - 0.1, refused)
        pause.failed(time.monotonic(), refused)  # the same outage: its start stays
        assert pause.holds() and pause.holds()
        pause.went_through()
        assert not pause.holds()
        pause.went_through()
    [warning, info] = caplog.records
    assert warning.levelno == logging.WARNING
    assert "the heartbeat has not reached the database for " in warning.getMessage()
    assert 'too many connections for role "app"' in warning.getMessage()
    assert "claims no jobs until it does" in warning.getMessage()
    assert "rescued after STALE_AFTER (3s) to run a second time" in warning.getMessage()
    assert info.levelno == logging.INFO
    assert "the heartbeat reached the database again after" in info.getMessage()


def test_claims_pause_after_a_heartbeat_interval_of_failures_well_before_stale_after():
    for interval, stale, after in ((5.0, 30.0, 5.0), (0.5, 30.0, 1.0), (25.0, 30.0, 7.5)):
        conf = dataclasses.replace(awa_settings(), heartbeat_interval=interval, stale_after=stale)
        assert ClaimPause(conf).after == after
