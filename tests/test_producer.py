"""The producer in-process: ``Producer.run_once`` claims one batch and hands it out."""

from __future__ import annotations

import dataclasses

import pytest
from django.db import OperationalError

from django_awa import producer as producer_module
from django_awa.conf import awa_settings
from django_awa.models import Job, JobState
from django_awa.producer import Producer
from django_awa.state import WorkerState
from tests.conftest import due_job

pytestmark = pytest.mark.django_db


def _producer(concurrency: int, **conf: object) -> tuple[WorkerState, Producer]:
    state = WorkerState.create(
        {"default": concurrency}, conf=dataclasses.replace(awa_settings(), **conf)
    )
    return state, Producer(state, state.queues["default"])


def test_run_once_claims_what_the_queue_has_room_for_and_puts_it_in_the_inbox():
    ids = [due_job(priority=p).id for p in (3, 1, 2)]
    due_job(queue="other")
    state, producer = _producer(2)
    runner = producer.runner
    runner.wake.set()

    jobs = producer.run_once()

    assert [j.id for j in jobs] == [ids[1], ids[2]]  # by priority
    assert all(j.state == JobState.RUNNING and j.run_lease for j in jobs)
    assert producer.busy  # it took all it asked for
    assert not runner.wake.is_set()
    assert runner.held == 2
    attempts = [runner.inbox.get_nowait(), runner.inbox.get_nowait()]
    assert [a.job.id for a in attempts] == [ids[1], ids[2]]
    assert state.running == {a.job.id: a for a in attempts}
    assert state.waiting == {ids[1], ids[2]}
    assert Job.objects.get(id=ids[0]).state == JobState.AVAILABLE


def test_run_once_waits_for_room_and_then_claims_the_rest():
    ids = [due_job().id for _ in range(3)]
    _, producer = _producer(2)
    runner = producer.runner
    assert len(producer.run_once()) == 2
    assert producer.run_once() is None  # full: no claim within half a second
    runner.finished()
    rest = producer.run_once()
    assert [j.id for j in rest] == [ids[2]]
    assert runner.held == 2
    assert producer.run_once() is None


def test_quick_handlers_get_a_prefetch_beyond_the_concurrency():
    for _ in range(12):
        due_job()
    state, producer = _producer(2, prefetch_window=0.05, claim_batch_size=5)
    producer.runner.observe(0.001)  # 2 threads * 0.05 s / 1 ms: 100, capped at 2 claims
    assert len(producer.run_once()) == 5  # one claim's worth at most
    assert len(producer.run_once()) == 5
    assert producer.runner.held == 10
    assert len(state.waiting) == 10


def test_a_failed_claim_gives_its_room_back(monkeypatch):
    due_job()
    state, producer = _producer(3)

    def fail(*args: object) -> list[Job]:
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(producer_module, "claim", fail)
    with pytest.raises(OperationalError):
        producer.run_once()
    assert producer.runner.held == 0 and not state.running


@pytest.mark.django_db
def test_a_claimed_rows_json_columns_hold_what_the_row_holds():
    # Parsed from the claim's text (models._json_parsed), empty or not, as the ORM reads them.
    empty = due_job()
    full = due_job(errors=[{"attempt": 1}], metadata={"k": [1, {}]}, tags=["t"], result=[])
    claimed = {job.id: job for job in producer_module.claim("default", 10, "default")}
    for job in (empty, full):
        row = Job.objects.get(id=job.id)
        columns = ("args", "errors", "metadata", "tags", "progress", "unique_states", "result")
        got = [getattr(claimed[job.id], name) for name in columns]
        want = [getattr(row, name) for name in columns]
        assert got == want and [type(v) for v in got] == [type(v) for v in want]
