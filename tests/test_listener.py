"""The listener in-process: ``Listener.run_once`` acts on the notifications of one wait."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from django.db import transaction

import django_awa as awa
from django_awa.execute import Attempt
from django_awa.listener import Listener
from django_awa.models import JobState
from django_awa.state import WorkerState
from tests.conftest import make_job
from tests.testapp.jobs import Act

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def listening(caplog: pytest.LogCaptureFixture) -> Iterator[tuple[WorkerState, Listener]]:
    state = WorkerState.create({"default": 1, "other": 1})
    listener = Listener(state)
    with caplog.at_level(logging.INFO, logger="django_awa.listener"):
        assert listener.run_once(0) == 0  # connects
    assert "listening for new jobs and cancels" in caplog.text
    # What was enqueued before it listened: every queue looks once.
    assert all(runner.wake.is_set() for runner in state.queues.values())
    for runner in state.queues.values():
        runner.wake.clear()
    yield state, listener
    listener.close()


def test_an_enqueue_wakes_its_queue_only_and_only_once_committed(listening):
    state, listener = listening
    with transaction.atomic():
        awa.enqueue(Act(action="ok"), queue="other")
        assert listener.run_once(0.2) == 0  # Postgres delivers NOTIFY at commit
    awa.enqueue(Act(action="ok"), queue="not-run-here")

    assert listener.run_once(5) >= 1

    assert state.queues["other"].wake.is_set()
    assert not state.queues["default"].wake.is_set()


def test_a_cancel_sets_the_running_attempts_flag(listening):
    state, listener = listening
    job = make_job(state=JobState.RUNNING, attempt=1, run_lease=3)
    attempt = state.running[job.id] = Attempt(job=job, alias="default")

    awa.cancel(job.id, "not needed")
    listener.run_once(5)

    assert attempt.cancelled.is_set()


def test_a_quiet_wait_checks_the_connection_and_returns_nothing(listening):
    state, listener = listening
    assert listener.run_once(0.05) == 0
    assert not any(runner.wake.is_set() for runner in state.queues.values())
