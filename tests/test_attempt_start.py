"""A claimed job that waits in the worker's inbox is not yet running its handler.

The claim makes the row ``running`` (so no other worker takes it, and
heartbeats protect it) with ``attempted_at`` NULL; ``attempted_at`` is when the
handler began, stored with the outcome (quick handlers) or by the heartbeat
thread's MARK_STARTED (handlers still running after ``MARK_STARTED_AFTER``),
on the database clock. These run the services in-process, each statement its
own transaction, so ``now()`` moves as in a worker.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections, transaction

import django_awa as awa
from django_awa.completer import Completer
from django_awa.handlers import HandlerPool
from django_awa.heartbeat import MARK_STARTED_AFTER, Heartbeat
from django_awa.models import Job, JobState
from django_awa.process import Worker
from django_awa.producer import RATED_START_WITHIN, Producer
from django_awa.state import WorkerState
from tests.conftest import due_job
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 0.4  # seconds the claimed jobs wait in the inbox before a handler takes them


def _claim(*args: dict) -> tuple[WorkerState, list[Job]]:
    ids = [due_job(args=a).id for a in args]
    state = WorkerState.create({"default": len(args)})
    Producer(state, state.queues["default"]).run_once()
    assert sorted(state.running) == sorted(ids)
    return state, list(Job.objects.filter(id__in=ids).order_by("id"))


def test_a_claimed_job_is_protected_but_not_started_until_its_handler_takes_it():
    state, [claimed] = _claim({"action": "ok"})

    # Running as far as other workers and maintenance can tell: held by its
    # run_lease, heartbeated, with a deadline; but no handler has begun.
    assert claimed.state == JobState.RUNNING and claimed.attempt == 1
    assert claimed.attempted_at is None
    assert claimed.heartbeat_at is not None and claimed.deadline_at is not None
    Heartbeat(state).run_once()
    beaten = Job.objects.get(id=claimed.id)
    assert beaten.attempted_at is None and beaten.heartbeat_at >= claimed.heartbeat_at

    time.sleep(WAIT)
    assert HandlerPool(state).run_once(state.queues["default"], timeout=1)
    Completer(state).run_once()

    done = Job.objects.get(id=claimed.id)
    assert done.state == JobState.COMPLETED
    # attempted_at is when the handler began, after the wait, not the claim.
    waited = (done.attempted_at - claimed.heartbeat_at).total_seconds()
    assert waited >= WAIT - 0.05, waited
    assert done.finalized_at >= done.attempted_at


def test_attempted_at_is_when_the_handler_began_not_when_its_outcome_was_written():
    state, [claimed] = _claim({"action": "sleep", "seconds": 0.3})
    assert HandlerPool(state).run_once(state.queues["default"], timeout=1)
    time.sleep(WAIT)  # the outcome waits for the completer meanwhile
    Completer(state).run_once()

    done = Job.objects.get(id=claimed.id)
    assert done.state == JobState.COMPLETED
    # From the handler's start to the outcome's write: its 0.3 s, then the wait.
    took = (done.finalized_at - done.attempted_at).total_seconds()
    assert took >= 0.3 + WAIT - 0.05, took


def test_an_outcome_with_a_result_other_than_completed_stores_its_start_too():
    state, [claimed] = _claim({"action": "raise"})
    time.sleep(WAIT)
    assert HandlerPool(state).run_once(state.queues["default"], timeout=1)
    Completer(state).run_once()

    retried = Job.objects.get(id=claimed.id)
    assert retried.state == JobState.RETRYABLE  # written by FINALIZE, not COMPLETE
    assert (retried.attempted_at - claimed.heartbeat_at).total_seconds() >= WAIT - 0.05


def test_a_long_handler_gets_its_start_stored_while_it_runs_and_its_deadline_moved():
    ids = [due_job(args={"action": "sleep", "seconds": 1.5}).id]
    state = WorkerState.create({"default": 1})
    Producer(state, state.queues["default"]).run_once()
    claimed = Job.objects.get(id=ids[0])
    assert claimed.attempted_at is None
    time.sleep(WAIT)

    pool, runner = HandlerPool(state), state.queues["default"]
    handler = threading.Thread(target=pool.run_once, args=(runner, 1))
    handler.start()
    try:
        heartbeat = Heartbeat(state)
        deadline = time.monotonic() + 5
        row = claimed
        while row.attempted_at is None and time.monotonic() < deadline:
            time.sleep(MARK_STARTED_AFTER)
            heartbeat.run_once(due_only=True)
            row = Job.objects.get(id=claimed.id)
        assert row.state == JobState.RUNNING and row.attempted_at is not None
        # Still running: the start is stored once, and the deadline counts
        # from it rather than from the claim.
        waited = (row.attempted_at - claimed.heartbeat_at).total_seconds()
        assert waited >= WAIT - 0.05, waited
        moved = (row.deadline_at - claimed.deadline_at).total_seconds()
        assert abs(moved - waited) < 0.1, (moved, waited)
        started = row.attempted_at
        heartbeat.run_once(due_only=True)
        assert Job.objects.get(id=claimed.id).attempted_at == started
    finally:
        handler.join(10)
    Completer(state).run_once()
    done = Job.objects.get(id=claimed.id)
    assert done.state == JobState.COMPLETED and done.attempted_at == started
    assert (done.finalized_at - done.attempted_at).total_seconds() >= 1.5 - 0.05


def test_a_job_given_back_before_it_started_has_no_start():
    job = due_job(args={"action": "ok"})
    worker = Worker({"default": 1}, install_signal_handlers=False)
    Producer(worker.state, worker.state.queues["default"]).run_once()
    assert Job.objects.get(id=job.id).state == JobState.RUNNING

    worker._give_back(worker.state.withdraw_waiting(), started=False)  # as at shutdown

    back = Job.objects.get(id=job.id)
    assert back.state == JobState.AVAILABLE and back.attempted_at is None
    assert back.attempt == 1 and back.snoozed  # its next run keeps this attempt's number


def test_an_atomic_attempt_whose_row_is_locked_a_moment_is_written_not_dropped():
    # The heartbeat thread (HEARTBEAT, MARK_STARTED) locks attempts' rows for one
    # statement; an atomic handler finishing at that moment must still commit,
    # its writes with its outcome, not be taken for a stale attempt.
    job = due_job(kind="pay", args={"reference": "locked-a-moment"})
    state = WorkerState.create({"default": 1})
    Producer(state, state.queues["default"]).run_once()
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(id=job.id)
                locked.set()
                release.wait(5)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    assert locked.wait(5)
    threading.Timer(0.15, release.set).start()
    try:
        assert HandlerPool(state).run_once(state.queues["default"], timeout=1)
    finally:
        release.set()
        holder.join(5)

    done = Job.objects.get(id=job.id)
    assert done.state == JobState.COMPLETED, done.state
    assert Order.objects.filter(reference="locked-a-moment", paid=True).count() == 1
    assert done.attempted_at is not None


def test_a_rated_job_not_started_within_its_bound_is_given_back_unstarted():
    """Under a rate, a claimed job whose handler cannot begin within
    ``RATED_START_WITHIN`` of its claim is not run (started late, it could be one
    start too many in a window the claim counted it in): it is available again,
    its attempt unused, and the next claim runs it once."""
    awa.set_queue_limits("default", rate_limit="100/s")
    state, [claimed] = _claim({"action": "ok"})
    # A rated claim leaves attempted_at to the handler, as every claim does.
    assert claimed.state == JobState.RUNNING and claimed.attempted_at is None
    time.sleep(RATED_START_WITHIN + 0.05)
    pool, runner = HandlerPool(state), state.queues["default"]
    assert pool.run_once(runner, timeout=1)
    Completer(state).run_once()

    back = Job.objects.get(id=claimed.id)
    # Its attempt unused: the next claim runs it under the same number.
    assert (back.state, back.attempt, back.snoozed) == (JobState.AVAILABLE, 1, True)
    assert back.attempted_at is None
    assert not Ledger.objects.filter(job_id=claimed.id).exists()  # its handler never ran
    assert claimed.id not in state.running and runner.held == 0

    # Claimed again and taken at once, it runs: once, under attempt 1.
    Producer(state, runner).run_once()
    assert pool.run_once(runner, timeout=1)
    Completer(state).run_once()
    done = Job.objects.get(id=claimed.id)
    assert (done.state, done.attempt) == (JobState.COMPLETED, 1)
    assert done.attempted_at is not None
    assert list(Ledger.objects.filter(job_id=claimed.id).values_list("attempt", flat=True)) == [1]
