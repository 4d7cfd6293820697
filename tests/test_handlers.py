"""Handler threads in-process: ``HandlerPool.run_once`` runs one attempt of the inbox."""

from __future__ import annotations

import threading

import pytest

import django_awa as awa
from django_awa.execute import Attempt
from django_awa.handlers import HandlerPool
from django_awa.models import JOB_ATTNAMES, ClaimedJob, Job, JobState
from django_awa.producer import Producer
from django_awa.state import RunGate, WorkerState
from tests.conftest import due_job
from tests.testapp.jobs import ROWS_SEEN, RowProbe
from tests.testapp.models import Ledger

pytestmark = pytest.mark.django_db


def _claimed(*args: dict) -> tuple[WorkerState, HandlerPool, list[Attempt]]:
    for a in args:
        due_job(args=a)
    state = WorkerState.create({"default": len(args)})
    runner = state.queues["default"]
    Producer(state, runner).run_once()
    return state, HandlerPool(state), [state.running[i] for i in sorted(state.running)]


def test_run_once_runs_an_attempt_and_hands_its_result_to_the_completer():
    state, pool, [attempt] = _claimed({"action": "ok"})
    runner = state.queues["default"]

    assert pool.run_once(runner, timeout=1)

    result = state.results.get_nowait()
    assert result.job is attempt.job and result.state == JobState.COMPLETED
    assert Ledger.objects.filter(job_id=attempt.job.id).count() == 1
    # It started and finished: no longer waiting, its place free, its run time seen.
    assert not state.waiting and runner.held == 0 and runner.run_time is not None
    assert state.running == {attempt.job.id: attempt}  # until the completer writes it
    assert not pool.run_once(runner, timeout=0.01)  # nothing else in the inbox


def test_an_attempt_lost_or_given_back_before_it_started_does_not_run():
    state, pool, [lost, given_back] = _claimed({"action": "ok"}, {"action": "ok"})
    runner = state.queues["default"]
    lost.cancelled.set()  # cancelled or rescued while it waited
    state.waiting.discard(given_back.job.id)  # given back at shutdown

    assert pool.run_once(runner, timeout=1) and pool.run_once(runner, timeout=1)

    assert state.results.empty()
    assert not Ledger.objects.filter(job_id__in=[lost.job.id, given_back.job.id]).exists()
    assert lost.job.id not in state.running and state.processed == 1
    assert runner.held == 0


def test_attempts_waiting_at_a_full_run_gate_do_not_run_and_stop_waiting_once_given_up():
    state, pool, [lost, given_back] = _claimed({"action": "ok"}, {"action": "ok"})
    runner = state.queues["default"]
    runner.gate.set_limit(0)  # no usable slot (global_concurrency): no handler may begin
    returned: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda: returned.append(pool.run_once(runner, timeout=1)), daemon=True
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    threads[0].join(0.3)
    assert not returned and state.waiting == {lost.job.id, given_back.job.id}  # they wait
    lost.cancelled.set()  # cancelled or rescued while it waited
    with state.running_lock:  # given back unstarted (shutdown, or its slots went)
        del state.running[given_back.job.id]
        state.waiting.discard(given_back.job.id)
    for thread in threads:
        thread.join(2)
    assert returned == [True, True], "a thread kept waiting for an attempt given up"
    assert state.results.empty()
    assert not Ledger.objects.filter(job_id__in=[lost.job.id, given_back.job.id]).exists()
    assert runner.held == 0 and runner.gate.active == 0


def test_a_limit_set_while_handlers_run_counts_them_and_holds_the_next_back() -> None:
    # An unlimited queue's handlers enter without the gate's lock; a limit set at
    # runtime (global_concurrency's slots) must still see them all.
    gate = RunGate()
    assert gate.enter_unlimited() and gate.enter_unlimited()
    assert gate.lower(1) == 2, "the handlers already running were not counted"
    entered = threading.Event()
    released: list[int] = []  # the waiting thread gives its pooled connections back once
    third = threading.Thread(
        target=lambda: gate.enter(lambda: False, lambda: released.append(1)) and entered.set(),
        daemon=True,
    )
    third.start()
    assert not entered.wait(0.2), "a handler began beyond the limit"
    gate.leave()
    assert not entered.wait(0.2), "a handler began beyond the limit"
    gate.leave()
    assert entered.wait(2), "a freed place did not let the waiting handler begin"
    assert gate.active == 1 and released == [1]
    third.join(2)
    gate.set_limit(2)  # room at once: nothing to give back
    assert gate.enter(lambda: False, lambda: released.append(1)) and released == [1]


def test_a_handlers_row_is_its_claimed_job_as_a_job_instance_the_same_each_time():
    ROWS_SEEN.clear()
    job = awa.enqueue(RowProbe(n=3), queue="probe", tags=["t"], metadata={"m": 1}, priority=1)
    state = WorkerState.create({"probe": 1})
    runner = state.queues["probe"]
    Producer(state, runner).run_once()
    claimed = Job.objects.get(id=job.id)  # as the claim left it: running, a new lease

    assert HandlerPool(state).run_once(runner, timeout=0)

    [(row, again)] = ROWS_SEEN
    assert isinstance(row, Job)
    assert row is again
    assert row._state.db == "default"
    assert not row._state.adding
    fields = [f.attname for f in Job._meta.concrete_fields]
    assert {f: getattr(row, f) for f in fields} == {f: getattr(claimed, f) for f in fields}
    assert (row.state, row.args, row.tags, row.metadata) == ("running", {"n": 3}, ["t"], {"m": 1})


def test_a_claimed_row_holds_every_job_field_in_column_order():
    # The claim's rows are read by position: a field added to Job must be added here too.
    assert ClaimedJob._fields == tuple(JOB_ATTNAMES)
