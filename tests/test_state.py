"""What a worker's services share: queue runners and the attempts tracked."""

from __future__ import annotations

import threading

import pytest

from django_awa.execute import Attempt
from django_awa.models import Job
from django_awa.state import QueueRunner, WorkerState


def test_quick_handlers_are_kept_two_claims_ahead_and_slow_ones_none():
    # While one claim of CLAIM_BATCH_SIZE is under way, the handlers still
    # have the one before it to work through; slow handlers get no prefetch.
    runner = QueueRunner(name="q", concurrency=10)
    assert runner.prefetch(0.05, 100) == 0  # nothing measured yet
    runner.observe(0.000_02)
    assert runner.prefetch(0.05, 100) == 200
    assert runner.prefetch(None, 100) == 0
    for _ in range(30):
        runner.observe(2.0)
    assert runner.prefetch(0.05, 100) == 0


def test_the_producer_waiting_for_room_wakes_once_enough_jobs_finished():
    # The producer waits for room for a batch, not for each place: a finished job
    # wakes it only once the queue holds no more than it waits for.
    runner = QueueRunner(name="q", concurrency=10)
    runner.held = 10
    woken = threading.Event()
    got: list[bool] = []

    def producer() -> None:
        with runner.room:
            got.append(runner.wait_for_room(7, timeout=30))
        woken.set()

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        for _ in range(2):
            runner.finished()
        assert not woken.wait(0.2)  # 8 held: still short of the room it waits for
        with runner.room:
            assert runner.wake_at_held == 7
        runner.finished()
        assert woken.wait(10)  # woken at once, long before its 30 s timeout
    finally:
        with runner.room:
            runner.held = 0
            runner.room.notify_all()
        thread.join(10)
    assert got == [True]
    assert runner.wake_at_held is None


def test_waiting_for_room_gives_up_after_its_timeout():
    runner = QueueRunner(name="q", concurrency=1)
    runner.held = 1
    with runner.room:
        assert runner.wait_for_room(0, timeout=0.01) is False
    assert runner.wake_at_held is None


def test_finishing_an_attempt_leaves_a_newer_attempt_of_the_same_job_tracked():
    # Once an outcome such as Snooze(0) is written, the job may be claimed again
    # before the completer stops tracking the old attempt: the new one must stay
    # tracked (heartbeated, given back at shutdown), not be dropped by the old one.
    state = WorkerState.create({"default": 1})
    old = Job(id=41, kind="act", queue="default", run_lease=1)
    new = Job(id=41, kind="act", queue="default", run_lease=2)
    state.running[41] = Attempt(job=new, alias="default")
    state.forget(old)
    assert state.running[41].job.run_lease == 2
    state.forget(new)
    assert 41 not in state.running
    assert state.processed == 2


def test_wake_sets_the_named_queues_or_all():
    state = WorkerState.create({"a": 1, "b": 2, "c": 3})
    state.wake({"b", "unknown"})
    assert [name for name, r in state.queues.items() if r.wake.is_set()] == ["b"]
    state.wake()
    assert all(r.wake.is_set() for r in state.queues.values())
    assert state.backlog_limit == 1000
    assert WorkerState.create({"big": 800}).backlog_limit == 1600


def test_a_prefetch_is_held_to_what_the_handlers_start_once_claimed_jobs_wait():
    # 1 ms handlers on ten threads promise 10,000 starts a second: 500 prefetched
    # for a 50 ms window. A process that starts 1,000 a second (short of CPU)
    # leaves them waiting: the prefetch comes down to what it starts in 50 ms.
    runner = QueueRunner(name="q", concurrency=10)
    runner.observe(0.001)
    assert runner.prefetch(0.05, 500) == 500
    # The first start after an idle spell measures no rate (one start in ten
    # seconds says nothing of the pace): the prefetch stays as it was.
    now = runner.starts_since + 10
    runner.observe_start(0.2, now)
    assert runner.start_rate is None
    assert runner.prefetch(0.05, 500) == 500
    for i in range(1, 501):  # 1,000 starts a second, each waiting 200 ms in the inbox
        runner.observe_start(0.2, now + i / 1000)
    assert runner.start_rate == pytest.approx(1000, rel=0.01)
    assert runner.prefetch(0.05, 500) == 50
    # Never below the concurrency, whatever the rate measured.
    runner.start_rate = 10.0
    assert runner.prefetch(0.05, 500) == 10
    # Jobs that start at once (a quick process) lift the bound.
    for i in range(30):
        runner.observe_start(0.0, now + 1 + i / 1000)
    assert runner.prefetch(0.05, 500) == 500


def test_a_start_rate_measured_while_the_inbox_ran_dry_does_not_bound_the_prefetch():
    # Claims slower than the window (a loaded server) leave the handlers waiting
    # for jobs: the rate they start at is the claims', and holding the prefetch
    # to it would starve them further (each claim smaller, the rate lower).
    runner = QueueRunner(name="q", concurrency=10)
    runner.observe(0.001)
    now = runner.starts_since
    for i in range(1, 251):  # a pace the handlers keep, jobs always waiting
        runner.observe_start(0.2, now + i / 1000)
    assert runner.prefetch(0.05, 500) == 50
    for i in range(1, 51):  # 200 a second, and the inbox runs dry between claims
        runner.observe_start(0.2, now + 0.25 + i / 200, drained=i % 10 == 0)
    assert runner.start_rate is None
    assert runner.prefetch(0.05, 500) == 500
