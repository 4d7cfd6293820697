"""The completer in-process: ``Completer.run_once`` writes the results queued."""

from __future__ import annotations

import logging
import time

import psycopg
import pytest
from django.utils import timezone

from django_awa.completer import Completer
from django_awa.followups import followup_registry
from django_awa.handlers import HandlerPool
from django_awa.listener import listen_params
from django_awa.models import Job, JobState
from django_awa.producer import Producer
from django_awa.state import WorkerState
from tests.conftest import due_job


def _run(n: int, **fields: object) -> tuple[WorkerState, list[int]]:
    """Claim and run ``n`` jobs in this thread; their results wait for the completer."""
    ids = [due_job(**fields).id for _ in range(n)]
    state = WorkerState.create({"default": n})
    runner = state.queues["default"]
    Producer(state, runner).run_once()
    pool = HandlerPool(state)
    while pool.run_once(runner, timeout=0):
        pass
    return state, ids


def _claim_and_handle(state: WorkerState, queue: str) -> None:
    """Claim ``queue``'s due jobs and run their handlers, outcomes left queued for the
    completer; then clear every queue's wake-up, so a test sees only the completer's."""
    Producer(state, state.queues[queue]).run_once()
    pool = HandlerPool(state)
    while pool.run_once(state.queues[queue], timeout=0):
        pass
    for runner in state.queues.values():
        runner.wake.clear()


@pytest.mark.django_db
def test_run_once_writes_the_queued_results_and_forgets_their_attempts():
    state, ids = _run(3)

    assert Completer(state).run_once() == []

    assert set(Job.objects.filter(id__in=ids).values_list("state", flat=True)) == {
        JobState.COMPLETED
    }
    assert not state.running and state.processed == 3
    assert Completer(state).run_once() == []  # nothing queued: returns at once


@pytest.mark.django_db
def test_a_process_that_declares_no_follow_up_writes_its_outcomes_all_the_same(monkeypatch):
    # finalize asks no result for its follow-ups when none is declared at all (the
    # test app declares some): every outcome still goes to the statement.
    monkeypatch.setattr(followup_registry, "all", [])
    monkeypatch.setattr(followup_registry, "_specs", {})
    state, ids = _run(3)

    assert Completer(state).run_once() == []

    assert set(Job.objects.filter(id__in=ids).values_list("state", flat=True)) == {
        JobState.COMPLETED
    }
    assert not state.running and state.processed == 3


@pytest.mark.django_db
def test_a_batchs_attempted_at_is_when_each_of_its_handlers_began():
    # One array of started_ago for the batch (finalize._started_ago): each job's own.
    state, ids = _run(2)
    results = [state.results.get_nowait() for _ in ids]
    now = time.monotonic()
    results[0].started, results[1].started = now - 30.0, now - 60.0
    for result in results:
        state.results.put(result)

    assert Completer(state).run_once() == []

    began = {job.id: job.attempted_at for job in Job.objects.filter(id__in=ids)}
    ago = [(timezone.now() - began[r.job.id]).total_seconds() for r in results]
    assert 29 < ago[0] < 45 and 59 < ago[1] < 75


@pytest.mark.django_db(transaction=True)
def test_a_result_whose_row_is_locked_is_returned_still_tracked_and_written_later():
    state, ids = _run(2, args={"action": "ok", "tag": "none"})
    completer = Completer(state)
    with psycopg.connect(**listen_params("default")) as other:
        other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [ids[0]])
        [deferred] = completer.run_once()
        other.rollback()
    assert deferred.job.id == ids[0] and not deferred.locked
    assert Job.objects.get(id=ids[0]).state == JobState.RUNNING
    assert Job.objects.get(id=ids[1]).state == JobState.COMPLETED
    assert list(state.running) == [ids[0]]

    state.results.put(deferred)
    assert completer.run_once() == []
    assert Job.objects.get(id=ids[0]).state == JobState.COMPLETED and not state.running


@pytest.mark.django_db
def test_of_two_results_of_one_attempt_in_a_batch_the_first_is_written():
    # A timed-out attempt: the handler pool's result first, the handler's own just after.
    from django_awa.execute import completed, timed_out

    state, [job_id] = _run(1)
    handlers_own = state.results.get_nowait()
    state.results.put(timed_out(handlers_own.job, 1.0, 1.2))
    state.results.put(completed(handlers_own.job))
    assert Completer(state).run_once() == []
    row = Job.objects.get(id=job_id)
    assert row.state == JobState.RETRYABLE and row.errors[-1]["error"].startswith("timed out")
    # Its follow-ups are the retry's, not the completion's.
    notes = list(Job.objects.filter(kind="echo").values_list("args__note", flat=True))
    assert len(notes) == 1 and notes[0].startswith("retried:1:timed out"), notes
    assert not state.running


@pytest.mark.django_db(transaction=True)
def test_an_outcome_left_out_for_a_brief_lock_is_written_again_soon(caplog):
    # The usual holder of a fresh attempt's row is a claim that met it and holds
    # it until its statement ends: the first retry comes LOCKED_RETRY_SOON later,
    # not LOCKED_RETRY; an outcome left out again waits LOCKED_RETRY.
    import threading
    import time

    from django_awa.completer import LOCKED_RETRY, LOCKED_RETRY_SOON

    caplog.set_level(logging.INFO, logger="django_awa.completer")
    state, [brief_id, held_id] = _run(2, args={"action": "ok", "tag": "none"})
    results = {}
    while not state.results.empty():
        result = state.results.get_nowait()
        results[result.job.id] = result
    completer = threading.Thread(target=Completer(state).run)

    def left_out(job_id: int) -> int:
        return sum(
            "wait for a row lock" in r.getMessage() and f"(jobs {job_id})" in r.getMessage()
            for r in caplog.records
        )

    def written(job_id: int) -> bool:
        return Job.objects.get(id=job_id).state == JobState.COMPLETED

    try:
        with psycopg.connect(**listen_params("default")) as other:
            other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [brief_id])
            state.results.put(results[brief_id])
            completer.start()
            deadline = time.monotonic() + 5
            while not left_out(brief_id) and time.monotonic() < deadline:
                time.sleep(0.001)
            other.rollback()  # a claim's brief hold ends
            released = time.monotonic()
            while not written(brief_id) and time.monotonic() < deadline:
                time.sleep(0.002)
            assert written(brief_id)
            assert time.monotonic() - released < LOCKED_RETRY / 2

            # Held through the soon retry too: then LOCKED_RETRY.
            other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [held_id])
            state.results.put(results[held_id])
            deadline = time.monotonic() + 5
            while left_out(held_id) < 2 and time.monotonic() < deadline:
                time.sleep(LOCKED_RETRY_SOON / 4)
            assert left_out(held_id) >= 2  # the soon retry met the lock too
            other.rollback()
            released = time.monotonic()
            time.sleep(LOCKED_RETRY / 4)
            assert not written(held_id)
            deadline = time.monotonic() + 5
            while not written(held_id) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert written(held_id)
    finally:
        state.results.put(None)
        completer.join(10)


@pytest.mark.django_db(transaction=True)
def test_an_outcome_left_out_for_a_lock_is_written_again_while_results_keep_coming():
    # A steady stream of other results must not postpone, batch after batch, the
    # outcome that waits for a row lock: it is written LOCKED_RETRY after the lock
    # made it wait, once the lock is gone.
    import threading
    import time

    from django_awa.completer import LOCKED_RETRY

    state, [locked_id, *others] = _run(40, args={"action": "ok", "tag": "none"})
    results = []
    while not state.results.empty():
        results.append(state.results.get_nowait())
    first = next(r for r in results if r.job.id == locked_id)
    stream = [r for r in results if r.job.id != locked_id]
    completer = threading.Thread(target=Completer(state).run)
    with psycopg.connect(**listen_params("default")) as other:
        other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [locked_id])
        state.results.put(first)
        completer.start()
        time.sleep(0.1)  # written once, left out for the lock
        other.rollback()
    released = time.monotonic()
    try:
        written_at = None
        for result in stream:  # one result every 50 ms, for about two seconds
            state.results.put(result)
            time.sleep(0.05)
            if written_at is None and Job.objects.get(id=locked_id).state == JobState.COMPLETED:
                written_at = time.monotonic()
    finally:
        state.results.put(None)
        completer.join(10)
    assert written_at is not None, "the locked outcome waited for the stream to stop"
    assert written_at - released < LOCKED_RETRY + 1.0, written_at - released
    assert set(Job.objects.filter(id__in=others).values_list("state", flat=True)) == {
        JobState.COMPLETED
    }


@pytest.mark.django_db(transaction=True)
def test_a_later_result_of_an_attempt_whose_first_waits_for_its_row_is_not_written():
    # The timed-out result is left out for a row lock (the heartbeat's, say); the
    # handler's own late result of the same attempt comes next and must not win.
    import threading
    import time

    from django.db import connections

    from django_awa.execute import completed, timed_out

    state, [job_id] = _run(1)
    handlers_own = state.results.get_nowait()

    def run_completer() -> None:
        try:
            Completer(state).run()
        finally:
            connections.close_all()  # this thread's own, before the test database goes

    completer = threading.Thread(target=run_completer)
    with psycopg.connect(**listen_params("default")) as other:
        other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [job_id])
        state.results.put(timed_out(handlers_own.job, 1.0, 1.2))
        completer.start()
        time.sleep(0.2)  # written once, left out for the lock
        other.rollback()
    state.results.put(completed(handlers_own.job))
    try:
        deadline = time.monotonic() + 10
        while Job.objects.get(id=job_id).state == JobState.RUNNING:
            assert time.monotonic() < deadline, "the outcome was never written"
            time.sleep(0.05)
    finally:
        state.results.put(None)
        completer.join(10)
    row = Job.objects.get(id=job_id)
    assert row.state == JobState.RETRYABLE and row.errors[-1]["error"].startswith("timed out")


@pytest.mark.django_db(transaction=True)  # woken by the commit, which TestCase never makes
def test_a_batch_that_promotes_dependents_wakes_their_queue_in_this_worker_as_it_commits():
    import django_awa as awa
    from tests.testapp.jobs import Echo

    first = awa.enqueue(Echo(n=1))
    second = awa.enqueue(Echo(n=2), after=[first], queue="other")
    state = WorkerState.create({"echo": 1, "other": 1})
    _claim_and_handle(state, "echo")

    assert Completer(state).run_once() == []

    assert Job.objects.get(id=second.id).state == JobState.AVAILABLE
    # The queue the dependent went to is woken now, not when its NOTIFY comes back.
    assert state.queues["other"].wake.is_set()
    assert not state.queues["echo"].wake.is_set()


@pytest.mark.django_db(transaction=True)
def test_a_batchs_follow_ups_are_announced_after_its_commit_from_the_listeners_connection():
    import django_awa as awa
    from django_awa.listener import Listener
    from tests.testapp.jobs import Act

    awa.enqueue(Act(action="ok"))  # completed, it enqueues two Echo jobs on queue "echo"
    state = WorkerState.create({"default": 1, "echo": 1})
    listener = Listener(state)
    listener.run_once(0)  # connects: from now on the listener sends the outbox
    _claim_and_handle(state, "default")
    try:
        with psycopg.connect(**listen_params("default"), autocommit=True) as other:
            other.execute("LISTEN awa_job")

            assert Completer(state).run_once() == []

            assert Job.objects.filter(kind="echo", state=JobState.AVAILABLE).count() == 2
            # This worker's producer of the follow-ups' queue is woken as the batch commits,
            assert state.queues["echo"].wake.is_set()
            assert not state.queues["default"].wake.is_set()
            # but the batch's transaction NOTIFYed nothing (its commit did not wait for
            # PostgreSQL's notification lock): the other workers hear from the listener.
            assert list(other.notifies(timeout=0.3, stop_after=1)) == []
            assert listener.conn is not None
            sender = listener.conn.info.backend_pid
            state.queues["echo"].wake.clear()

            assert listener.run_once(0) == 0  # sends what the outbox holds

            heard = list(other.notifies(timeout=5, stop_after=1))
            assert [(n.channel, n.payload, n.pid) for n in heard] == [("awa_job", "echo", sender)]
            # Its own NOTIFY, coming back to the listener, neither counts nor wakes again.
            assert listener.run_once(0.3) == 0
            assert not state.queues["echo"].wake.is_set()
    finally:
        listener.close()
