"""External callbacks (SPEC §7): the four functions, their follow-ups, and the signed receiver.

Jobs that must be parked by a worker are parked by a real ``awa_worker``
process; the receiver's status codes are checked against rows made in any
state with ``make_job``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import io
import json
import re
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

import django_awa as awa
from django_awa.callbacks import (
    EARLY_KEY,
    MAX_BODY,
    RECEIPT_RETENTION,
    RESULT_KEY,
    complete_external_many,
    prune_receipts,
    sign,
)
from django_awa.execute import Attempt, AttemptResult, JobContext, from_value
from django_awa.finalize import finalize
from django_awa.followups import (
    WAITING_FOR_CALLBACK,
    FollowupError,
    FollowupSpec,
    Outcome,
    followup_registry,
)
from django_awa.maintenance import Maintenance
from django_awa.models import CallbackReceipt, Job, JobState
from tests.conftest import make_job, wait_for, wait_for_state
from tests.testapp.followups import FAIL
from tests.testapp.jobs import AtomicEarlyAnswer, Parked
from tests.testapp.models import Ledger

# Resolution commits (or not) on its own or with the caller: every test here commits.
pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "test-secret"
ACTIONS = ("complete", "fail", "retry", "heartbeat")


class Rollback(Exception):
    """Raised inside an outer atomic() to roll it back."""


# -- helpers --------------------------------------------------------------------------


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def close_to(value: dt.datetime | None, expected: dt.datetime, slack: float = 5.0) -> bool:
    return value is not None and abs((value - expected).total_seconds()) <= slack


def followups(job_id: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(outcome, kind, args) of each follow-up of ``job_id``, oldest first."""
    return [
        (f.metadata["awa_trigger"]["outcome"], f.kind, f.args)
        for f in Job.objects.followups_of(job_id).order_by("id")
    ]


def echo(job_id: int, note: str) -> dict[str, Any]:
    return {"n": job_id, "note": note, "tags": []}


def parked_row(**fields: Any) -> Job:
    """A ``parked`` job waiting on a fresh callback, as a worker leaves it (attempt 1 of 2)."""
    fields.setdefault("kind", "parked")
    fields.setdefault("args", {"timeout": 60.0, "hold": 0.0})
    fields.setdefault("state", JobState.WAITING_EXTERNAL)
    fields.setdefault("attempt", 1)
    fields.setdefault("max_attempts", 2)
    fields.setdefault("run_lease", 1)
    fields.setdefault("callback_id", uuid.uuid4())
    fields.setdefault("callback_timeout_at", db_now() + dt.timedelta(seconds=60))
    return make_job(**fields)


def snapshot(job_id: int) -> dict[str, Any]:
    row = Job.objects.get(id=job_id)
    return {f.attname: getattr(row, f.attname) for f in Job._meta.concrete_fields}


def call(action: str, callback_id: uuid.UUID | str) -> Job:
    if action == "complete":
        return awa.complete_external(callback_id, {"ok": True, "n": 7})
    if action == "fail":
        return awa.fail_external(callback_id, "declined by the bank")
    if action == "retry":
        return awa.retry_external(callback_id)
    return awa.heartbeat_callback(callback_id, 3600)


def park(start_worker: Callable[..., Any], count: int = 1, **args: Any) -> list[Job]:
    """Enqueue ``count`` Parked jobs, let a real worker park them, then stop it."""
    worker = start_worker("--queue", "default")
    ids = [awa.enqueue(Parked(**args)).id for _ in range(count)]
    jobs = [wait_for_state(job_id, JobState.WAITING_EXTERNAL) for job_id in ids]
    assert worker.stop() == 0, worker.output()
    for job in jobs:
        assert job.callback_id is not None and job.attempt == 1
    return jobs


@pytest.fixture
def spy() -> Iterator[list[tuple[Any, ...]]]:
    """Extra follow-ups of Parked that record exactly what they receive (and enqueue nothing)."""
    calls: list[tuple[Any, ...]] = []

    def completed(args, job):
        calls.append(("completed", args, job))

    def exhausted(args, job, error, attempt):
        calls.append(("exhausted", args, job, error, attempt))

    def retried(args, job, error, attempt, next_run_at):
        calls.append(("retried", args, job, error, attempt, next_run_at))

    specs = [
        FollowupSpec(outcome=Outcome.COMPLETED, trigger=Parked, function=completed),
        FollowupSpec(outcome=Outcome.EXHAUSTED, trigger=Parked, function=exhausted),
        FollowupSpec(outcome=Outcome.RETRIED, trigger=Parked, function=retried),
    ]
    for spec in specs:
        followup_registry.add(spec)
    yield calls
    for spec in specs:
        followup_registry._remove(spec)


# -- the four functions, on jobs a worker parked --------------------------------------


def test_a_parked_job_carries_its_callback_and_its_waiting_followup_sees_it(start_worker):
    (job,) = park(start_worker, timeout=90)
    assert job.state == JobState.WAITING_EXTERNAL
    assert close_to(job.callback_timeout_at, db_now() + dt.timedelta(seconds=90), slack=30)
    assert Ledger.objects.filter(job_id=job.id).values_list("note", flat=True)[0] == (
        f"callback:{job.callback_id}"
    )
    assert followups(job.id) == [
        ("waiting_for_callback", "echo", echo(job.id, f"waiting:{job.callback_id}"))
    ]


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_complete_external_completes_with_payload_and_completed_followups(start_worker, spy, outer):
    (job,) = park(start_worker)
    payload = {"ok": True, "items": [1, 2], "note": "ü"}
    with transaction.atomic() if outer else nullcontext():
        done = awa.complete_external(str(job.callback_id), payload)
        if outer:
            Ledger.objects.create(job_id=job.id, attempt=0, run_lease=0, note="business")
    assert (done.id, done.state) == (job.id, JobState.COMPLETED)
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.COMPLETED and row.finalized_at is not None
    assert row.metadata[RESULT_KEY] == payload and EARLY_KEY not in row.metadata
    assert row.callback_timeout_at is None and row.errors == [] and row.attempt == 1
    assert followups(job.id) == [
        ("waiting_for_callback", "echo", echo(job.id, f"waiting:{job.callback_id}")),
        ("completed", "echo", echo(job.id, "parked-completed")),
    ]
    [(outcome, args, seen)] = spy
    assert outcome == "completed" and args == Parked()
    assert seen.state == JobState.COMPLETED and seen.metadata[RESULT_KEY] == payload
    assert Ledger.objects.filter(note="business").count() == (1 if outer else 0)


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_fail_external_fails_whatever_attempts_remain_with_exhausted_followups(
    start_worker, spy, outer
):
    (job,) = park(start_worker)
    with transaction.atomic() if outer else nullcontext():
        done = awa.fail_external(job.callback_id, "declined by the bank")
    assert done.state == JobState.FAILED
    row = Job.objects.get(id=job.id)
    assert (row.state, row.attempt, row.max_attempts) == (JobState.FAILED, 1, 2)
    assert row.finalized_at is not None and row.callback_timeout_at is None
    [entry] = row.errors
    assert (entry["attempt"], entry["error"]) == (1, "declined by the bank")
    assert close_to(dt.datetime.fromisoformat(entry["at"]), db_now())
    assert followups(job.id)[1:] == [
        ("exhausted", "echo", echo(job.id, "parked-exhausted:declined by the bank"))
    ]
    [(outcome, args, seen, error, attempt)] = spy
    assert (outcome, args, error, attempt) == ("exhausted", Parked(), "declined by the bank", 1)
    assert seen.state == JobState.FAILED


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_retry_external_makes_the_job_available_now_with_attempts_reset(start_worker, spy, outer):
    (job,) = park(start_worker)
    with transaction.atomic() if outer else nullcontext():
        done = awa.retry_external(job.callback_id)
    now = db_now()
    assert done.state == JobState.AVAILABLE
    row = Job.objects.get(id=job.id)
    assert (row.state, row.attempt) == (JobState.AVAILABLE, 0)
    assert close_to(row.run_at, now) and row.run_at <= now
    assert row.callback_id is None and row.callback_timeout_at is None
    assert row.finalized_at is None
    assert followups(job.id)[1:] == [
        ("retried", "echo", echo(job.id, "parked-retried:retried externally:1"))
    ]
    [(outcome, args, seen, error, attempt, next_run_at)] = spy
    assert (outcome, args, error, attempt) == ("retried", Parked(), "retried externally", 1)
    assert next_run_at.tzinfo is not None and next_run_at == row.run_at
    assert seen.state == JobState.AVAILABLE and seen.attempt == 0
    # The old callback is gone; a worker runs the job again as attempt 1.
    with pytest.raises(awa.CallbackNotFound):
        awa.complete_external(job.callback_id)
    start_worker("--queue", "default")
    again = wait_for(
        lambda: Job.objects.filter(
            id=job.id, state=JobState.WAITING_EXTERNAL, callback_id__isnull=False
        ).first()
    )
    assert again.attempt == 1 and again.callback_id != job.callback_id
    assert Ledger.objects.filter(job_id=job.id).count() == 2


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_heartbeat_callback_extends_the_timeout(start_worker, outer):
    (job,) = park(start_worker, timeout=60)
    with transaction.atomic() if outer else nullcontext():
        beat = awa.heartbeat_callback(job.callback_id, dt.timedelta(hours=2))
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id == job.callback_id
    assert close_to(row.callback_timeout_at, db_now() + dt.timedelta(hours=2))
    assert beat.callback_timeout_at == row.callback_timeout_at > job.callback_timeout_at
    assert len(followups(job.id)) == 1  # only the waiting one
    awa.heartbeat_callback(job.callback_id, 30)
    row = Job.objects.get(id=job.id)
    assert close_to(row.callback_timeout_at, db_now() + dt.timedelta(seconds=30))


# -- the caller's transaction ---------------------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
def test_a_rolled_back_outer_transaction_changes_nothing(action):
    job = parked_row()
    before = snapshot(job.id)
    with pytest.raises(Rollback), transaction.atomic():
        Ledger.objects.create(job_id=job.id, attempt=0, run_lease=0, note="business")
        result = call(action, job.callback_id)
        assert result.id == job.id
        raise Rollback
    assert snapshot(job.id) == before
    assert followups(job.id) == [] and not Ledger.objects.exists()
    # The callback is still good.
    assert call(action, job.callback_id).id == job.id


def _seen_elsewhere(job_id: int) -> tuple[str, dt.datetime | None, uuid.UUID | None]:
    """The row as another (autocommit) connection sees it."""
    import psycopg

    params = {
        k: v
        for k, v in connection.get_connection_params().items()
        if k in ("dbname", "user", "password", "host", "port")
    }
    with psycopg.connect(**params, autocommit=True) as conn:
        return conn.execute(
            "SELECT state, callback_timeout_at, callback_id FROM awa_job WHERE id = %s", [job_id]
        ).fetchone()


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
@pytest.mark.parametrize("action", ACTIONS)
def test_each_function_commits_with_the_caller_or_at_once(action, outer):
    job = parked_row()
    before = _seen_elsewhere(job.id)
    with transaction.atomic() if outer else nullcontext():
        done = call(action, job.callback_id)
        seen = _seen_elsewhere(job.id)
        if outer:
            assert seen == before  # nothing visible before the caller commits
    after = _seen_elsewhere(job.id)
    assert after != before
    assert after == (done.state, done.callback_timeout_at, done.callback_id)
    if not outer:
        assert seen == after


# -- CallbackNotFound -----------------------------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
def test_unknown_callback_ids_raise_callback_not_found(action):
    parked_row()
    for unknown in (uuid.uuid4(), str(uuid.uuid4()), "not-a-uuid"):
        with pytest.raises(awa.CallbackNotFound):
            call(action, unknown)


@pytest.mark.parametrize("first", ["complete", "fail", "retry"])
@pytest.mark.parametrize("then", ACTIONS)
def test_an_already_resolved_callback_raises_callback_not_found(first, then):
    job = parked_row()
    call(first, job.callback_id)
    after = snapshot(job.id)
    count = len(followups(job.id))
    with transaction.atomic():
        with pytest.raises(awa.CallbackNotFound):
            call(then, job.callback_id)
        # The caller's transaction is still usable.
        Ledger.objects.create(job_id=job.id, attempt=0, run_lease=0, note="after")
    assert snapshot(job.id) == after and len(followups(job.id)) == count
    assert Ledger.objects.filter(note="after").exists()


def test_callback_not_found_is_an_awa_error():
    assert issubclass(awa.CallbackNotFound, awa.AwaError)


# -- a failing follow-up during resolution -------------------------------------------


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_a_failing_followup_reaches_the_caller_and_the_job_keeps_waiting(outer):
    job = parked_row()
    before = snapshot(job.id)
    with transaction.atomic() if outer else nullcontext():
        with pytest.raises(FollowupError, match="parked completion follow-up exploded") as info:
            awa.complete_external(job.callback_id, {"explode": True})
        if outer:
            # Only the resolution's savepoint rolled back.
            Ledger.objects.create(job_id=job.id, attempt=0, run_lease=0, note="still usable")
    assert isinstance(info.value, awa.AwaError)
    assert isinstance(info.value.__cause__, RuntimeError)
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id == job.callback_id
    assert snapshot(job.id) == before and followups(job.id) == []
    assert Ledger.objects.filter(note="still usable").count() == (1 if outer else 0)
    # The sender tries again with a payload the follow-up accepts.
    assert awa.complete_external(job.callback_id, {"explode": False}).state == JobState.COMPLETED
    assert followups(job.id) == [("completed", "echo", echo(job.id, "parked-completed"))]


# -- many callbacks at once (complete_external_many) -------------------------------


def test_complete_external_many_completes_each_with_its_payload_and_followups(spy):
    jobs = [parked_row() for _ in range(5)]
    resolved = parked_row(state=JobState.COMPLETED)
    unknown = uuid.uuid4()
    given = [(str(job.callback_id), {"tracking": f"T{job.id}"}) for job in jobs]
    done = complete_external_many([*given, (resolved.callback_id, None), (unknown, None)])
    assert list(done) == [job.callback_id for job in jobs] + [resolved.callback_id, unknown]
    assert done[resolved.callback_id] is None and done[unknown] is None
    for job in jobs:
        assert (done[job.callback_id].id, done[job.callback_id].state) == (  # type: ignore[union-attr]
            job.id,
            JobState.COMPLETED,
        )
        row = Job.objects.get(id=job.id)
        assert row.state == JobState.COMPLETED and row.finalized_at is not None
        assert row.metadata[RESULT_KEY] == {"tracking": f"T{job.id}"}
        assert row.callback_timeout_at is None and row.errors == [] and row.attempt == 1
        assert followups(job.id) == [("completed", "echo", echo(job.id, "parked-completed"))]
    assert sorted(seen.id for outcome, _, seen in spy if outcome == "completed") == sorted(
        job.id for job in jobs
    )
    assert Job.objects.get(id=resolved.id).metadata.get(RESULT_KEY) is None


def test_complete_external_many_takes_as_many_statements_for_fifty_as_for_two():
    from django.test.utils import CaptureQueriesContext

    counts = []
    for size in (2, 50):
        jobs = [parked_row() for _ in range(size)]
        with CaptureQueriesContext(connection) as queries:
            complete_external_many([(job.callback_id, {"n": job.id}) for job in jobs])
        assert Job.objects.filter(id__in=[j.id for j in jobs], state="completed").count() == size
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1], counts


def test_complete_external_many_applies_a_callback_whose_handler_still_runs_when_it_parks():
    running = parked_row(state=JobState.RUNNING)
    waiting = parked_row()
    done = complete_external_many([(running.callback_id, {"a": 1}), (waiting.callback_id, None)])
    assert done[running.callback_id].state == JobState.RUNNING  # type: ignore[union-attr]
    row = Job.objects.get(id=running.id)
    assert row.state == JobState.RUNNING
    assert row.metadata[EARLY_KEY]["callback_id"] == str(running.callback_id)
    assert row.metadata[EARLY_KEY]["payload"] == {"a": 1}
    assert Job.objects.get(id=waiting.id).state == JobState.COMPLETED
    # A second answer while it still runs is refused, as complete_external refuses it.
    again = complete_external_many([(running.callback_id, {"a": 2})])
    assert again == {running.callback_id: None}
    assert Job.objects.get(id=running.id).metadata[EARLY_KEY]["payload"] == {"a": 1}


@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "outer-atomic"])
def test_complete_external_many_writes_nothing_when_a_followup_fails(outer):
    jobs = [parked_row() for _ in range(3)]
    before = [snapshot(job.id) for job in jobs]
    payloads = [{"explode": False}, {"explode": True}, None]
    with transaction.atomic() if outer else nullcontext():
        with pytest.raises(FollowupError, match="parked completion follow-up exploded"):
            complete_external_many(
                [(job.callback_id, p) for job, p in zip(jobs, payloads, strict=True)]
            )
        if outer:  # only the batch's savepoint rolled back
            Ledger.objects.create(job_id=0, attempt=0, run_lease=0, note="still usable")
    assert [snapshot(job.id) for job in jobs] == before
    assert all(followups(job.id) == [] for job in jobs)
    assert Ledger.objects.filter(note="still usable").count() == (1 if outer else 0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("not-a-uuid", "is not a UUID"),
        ("twice", "given twice"),
        ("payload", "cannot be stored"),
    ],
)
def test_complete_external_many_refuses_bad_input_before_writing(bad, message):
    jobs = [parked_row() for _ in range(2)]
    before = [snapshot(job.id) for job in jobs]
    given: list[tuple[Any, Any]] = [(job.callback_id, None) for job in jobs]
    if bad == "not-a-uuid":
        given.append(("nope", None))
    elif bad == "twice":
        given.append((str(jobs[0].callback_id), None))
    else:
        given.append((uuid.uuid4(), {"nul": "\x00"}))
    with pytest.raises(awa.ValidationError, match=message):
        complete_external_many(given)
    assert [snapshot(job.id) for job in jobs] == before


# -- a callback that arrives while the handler still runs ---------------------------


def _registered_while_running(job_id: int) -> Job:
    return wait_for(
        lambda: Job.objects.filter(
            id=job_id, state=JobState.RUNNING, callback_id__isnull=False
        ).first(),
        message=lambda: f"job {job_id} never registered its callback",
    )


def test_early_complete_is_applied_once_the_job_parks(start_worker):
    start_worker("--queue", "default")
    job = awa.enqueue(Parked(timeout=60, hold=3.0))
    running = _registered_while_running(job.id)
    early = awa.complete_external(running.callback_id, {"early": True})
    assert (early.id, early.state) == (job.id, JobState.RUNNING)
    # A second early callback for the same id is refused: one is already recorded.
    with pytest.raises(awa.CallbackNotFound):
        awa.fail_external(running.callback_id, "too late")
    row = wait_for_state(job.id, JobState.COMPLETED, timeout=20)
    assert row.metadata[RESULT_KEY] == {"early": True} and EARLY_KEY not in row.metadata
    assert row.finalized_at is not None and row.callback_timeout_at is None
    assert followups(job.id) == [
        ("waiting_for_callback", "echo", echo(job.id, f"waiting:{running.callback_id}")),
        ("completed", "echo", echo(job.id, "parked-completed")),
    ]
    assert Ledger.objects.filter(job_id=job.id).count() == 1
    with pytest.raises(awa.CallbackNotFound):
        awa.complete_external(running.callback_id)


def test_an_atomic_handlers_callback_can_be_answered_before_it_returns(start_worker):
    # The id is stored apart from the handler's transaction, so the outside system's
    # answer, sent while that transaction is open, finds the job and is kept for it.
    start_worker("--queue", "default")
    job = awa.enqueue(AtomicEarlyAnswer(payload="quick"))
    row = wait_for_state(job.id, JobState.COMPLETED, timeout=20)
    assert Ledger.objects.get(job_id=job.id).note == "answer:['accepted']"
    assert row.metadata[RESULT_KEY] == {"answer": "quick"} and EARLY_KEY not in row.metadata


def test_an_atomic_handler_holding_its_own_row_still_registers_its_callback(start_worker):
    # Stored apart, the id would wait for the row the handler's transaction holds:
    # after a short wait it is stored in that transaction instead.
    start_worker("--queue", "default")
    job = awa.enqueue(AtomicEarlyAnswer(touch_row=True))
    row = wait_for_state(job.id, JobState.WAITING_EXTERNAL, timeout=20)
    assert row.callback_id is not None and row.tags == ["touched"]
    assert awa.complete_external(row.callback_id, {"late": 1}).state == JobState.COMPLETED


def test_early_fail_over_http_is_applied_once_the_job_parks(start_worker):
    start_worker("--queue", "default")
    job = awa.enqueue(Parked(timeout=60, hold=3.0))
    running = _registered_while_running(job.id)
    response = post(running.callback_id, "fail", {"error": "rejected upstream"})
    assert response.status_code == 200, response.content
    assert response.json() == {"id": job.id, "state": "running"}
    row = wait_for_state(job.id, JobState.FAILED, timeout=20)
    assert [e["error"] for e in row.errors] == ["rejected upstream"]
    assert EARLY_KEY not in row.metadata
    assert followups(job.id) == [
        ("waiting_for_callback", "echo", echo(job.id, f"waiting:{running.callback_id}")),
        ("exhausted", "echo", echo(job.id, "parked-exhausted:rejected upstream")),
    ]


def test_early_heartbeat_extends_the_timeout_the_parked_job_keeps(start_worker):
    start_worker("--queue", "default")
    job = awa.enqueue(Parked(timeout=60, hold=3.0))
    running = _registered_while_running(job.id)
    awa.heartbeat_callback(running.callback_id, 7200)
    row = wait_for_state(job.id, JobState.WAITING_EXTERNAL, timeout=20)
    assert row.callback_id == running.callback_id
    assert close_to(row.callback_timeout_at, db_now() + dt.timedelta(seconds=7200), slack=30)


def _park_in_process(job_id: int) -> Job:
    """Finalize the running attempt of ``job_id`` as ``WaitForCallback``, as a worker would."""
    running = Job.objects.get(id=job_id)
    result = AttemptResult(
        job=running, state=JobState.WAITING_EXTERNAL, context=WAITING_FOR_CALLBACK
    )
    assert finalize([result], "default") == [result]
    return Job.objects.get(id=job_id)


def _left_by_attempt_1() -> dict[str, Any]:
    """What attempt 1 left: its callback was answered early, then its handler raised."""
    return {
        EARLY_KEY: {
            "callback_id": str(uuid.uuid4()),
            "action": "complete",
            "payload": {"stale": True},
            "error": None,
        }
    }


def test_an_early_callback_left_by_an_earlier_attempt_is_not_applied():
    job = parked_row(state=JobState.RUNNING, attempt=2, run_lease=2, metadata=_left_by_attempt_1())
    row = _park_in_process(job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id == job.callback_id
    assert awa.complete_external(job.callback_id, {"late": True}).state == JobState.COMPLETED
    assert Job.objects.get(id=job.id).metadata == {RESULT_KEY: {"late": True}}


def test_an_earlier_attempts_early_callback_does_not_block_this_ones():
    job = parked_row(state=JobState.RUNNING, attempt=2, run_lease=2, metadata=_left_by_attempt_1())
    early = awa.complete_external(job.callback_id, {"current": True})
    assert early.state == JobState.RUNNING
    assert early.metadata[EARLY_KEY]["callback_id"] == str(job.callback_id)
    row = _park_in_process(job.id)
    assert row.state == JobState.COMPLETED
    assert row.metadata == {RESULT_KEY: {"current": True}}
    assert [f[2]["note"] for f in followups(job.id)] == [
        f"waiting:{job.callback_id}",
        "parked-completed",
    ]


def test_an_early_callback_is_applied_at_the_park_of_a_kind_without_follow_ups():
    # No follow-up asks for the parked row: finalize reads it all the same, for the answer.
    job = parked_row(kind="echo", args={"n": 1}, state=JobState.RUNNING, run_lease=1)
    assert awa.complete_external(job.callback_id, {"early": True}).state == JobState.RUNNING
    row = _park_in_process(job.id)
    assert row.state == JobState.COMPLETED and row.metadata == {RESULT_KEY: {"early": True}}


def test_an_early_callback_whose_followup_fails_leaves_the_job_parked():
    job = parked_row(state=JobState.RUNNING, run_lease=1)
    awa.complete_external(job.callback_id, {"explode": True})
    row = _park_in_process(job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id == job.callback_id
    assert [f[2]["note"] for f in followups(job.id)] == [f"waiting:{job.callback_id}"]
    # The sender (or an operator) can still resolve it.
    assert awa.complete_external(job.callback_id, {"ok": 1}).state == JobState.COMPLETED


def test_maintenance_applies_an_early_answer_whose_followups_failed_at_the_park():
    # The sender was told 200 and will not send it again: maintenance tries it again.
    job = parked_row(state=JobState.RUNNING, run_lease=1)
    awa.complete_external(job.callback_id, {"late": "but accepted"})
    FAIL["parked_completed"] = True
    assert _park_in_process(job.id).state == JobState.WAITING_EXTERNAL
    Maintenance().run_once()  # the follow-up still fails: the answer is kept
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.WAITING_EXTERNAL and EARLY_KEY in row.metadata
    FAIL["parked_completed"] = False
    assert Maintenance().apply_early_callbacks() == 1
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.COMPLETED and row.metadata == {
        RESULT_KEY: {"late": "but accepted"}
    }
    assert [f[2]["note"] for f in followups(job.id)] == [
        f"waiting:{job.callback_id}",
        "parked-completed",
    ]


# -- callback timeout -----------------------------------------------------------------


@pytest.mark.slow
def test_a_timed_out_callback_whose_unique_key_a_twin_holds_fails_without_wedging_rescue(
    start_worker,
):
    """A parked job does not hold its unique key (``waiting_external`` is not among the
    default states), so a twin may be enqueued meanwhile. Its rescue to ``retryable``
    (a held state) broke the unique index: the rescue statement failed whole, every
    tick, and no job was rescued any more, a dead worker's neither. Now it fails, and
    of twins timing out together the first is retried."""
    worker = start_worker("--queue", "default")
    unique = awa.Unique(by_args=True)
    first = awa.enqueue(Parked(timeout=61.0), unique=unique).id
    wait_for_state(first, JobState.WAITING_EXTERNAL)
    twin = awa.enqueue(Parked(timeout=61.0), unique=unique)
    twin = wait_for_state(twin.id, JobState.WAITING_EXTERNAL)
    pair = [awa.enqueue(Parked(timeout=62.0), unique=unique).id]
    wait_for_state(pair[0], JobState.WAITING_EXTERNAL)
    pair.append(awa.enqueue(Parked(timeout=62.0), unique=unique).id)
    plain = awa.enqueue(Parked()).id
    for job_id in (*pair, plain):
        wait_for_state(job_id, JobState.WAITING_EXTERNAL)
    assert worker.stop() == 0, worker.output()
    # The twin completes and holds the key; then every other callback times out.
    assert awa.complete_external(twin.callback_id).state == JobState.COMPLETED
    Job.objects.filter(state=JobState.WAITING_EXTERNAL).update(
        callback_timeout_at=db_now() - dt.timedelta(seconds=1)
    )
    Maintenance().rescue()  # raised IntegrityError, and rescued none
    rows = Job.objects.filter(id__in=[first, *pair, plain])
    states = {row.id: (row.state, row.errors[-1]["error"]) for row in rows}
    held = "rescued: callback timeout, not retried: another job holds its unique key"
    assert states[first] == (JobState.FAILED, held)
    assert states[pair[0]] == (JobState.RETRYABLE, "rescued: callback timeout")
    assert states[pair[1]] == (JobState.FAILED, held)
    assert states[plain] == (JobState.RETRYABLE, "rescued: callback timeout")


def test_a_timed_out_callback_is_rescued_by_maintenance(start_worker):
    (job,) = park(start_worker)
    Job.objects.filter(id=job.id).update(callback_timeout_at=db_now() - dt.timedelta(seconds=1))
    Maintenance().run_once()
    row = Job.objects.get(id=job.id)
    assert (row.state, row.attempt) == (JobState.RETRYABLE, 1)
    assert row.callback_id is None and row.callback_timeout_at is None
    assert row.errors[-1]["error"] == "rescued: callback timeout"
    assert row.errors[-1]["attempt"] == 1
    assert followups(job.id)[1:] == [
        ("rescued", "echo", echo(job.id, f"parked-rescued:{awa.RescueReason.CALLBACK_TIMEOUT}"))
    ]
    with pytest.raises(awa.CallbackNotFound):
        awa.complete_external(job.callback_id)


def test_a_timed_out_callback_on_the_last_attempt_fails():
    job = parked_row(attempt=2, callback_timeout_at=db_now() - dt.timedelta(seconds=1))
    Maintenance().run_once()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.FAILED and row.finalized_at is not None
    assert [f[2]["note"] for f in followups(job.id)] == ["parked-rescued:callback_timeout"]


def test_a_heartbeat_keeps_the_callback_from_timing_out():
    job = parked_row(callback_timeout_at=db_now() + dt.timedelta(seconds=1))
    awa.heartbeat_callback(job.callback_id, 600)
    Job.objects.filter(id=job.id).update(callback_timeout_at=db_now() - dt.timedelta(seconds=1))
    awa.heartbeat_callback(job.callback_id, 600)  # just in time
    Maintenance().run_once()
    assert Job.objects.get(id=job.id).state == JobState.WAITING_EXTERNAL


BAD_TIMEOUTS = [
    0,
    -5,
    "60",
    None,
    True,
    float("nan"),
    1e-300,
    0.5,
    dt.timedelta(microseconds=1),
    366 * 86400,
    dt.timedelta.max,
    10**400,
]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_heartbeat_refuses_a_bad_timeout(timeout):
    job = parked_row()
    before = snapshot(job.id)
    with pytest.raises(awa.ValidationError, match="timeout"):
        awa.heartbeat_callback(job.callback_id, timeout)
    assert snapshot(job.id) == before


@pytest.mark.parametrize("timeout", [1, 1.0, dt.timedelta(seconds=1), 365 * 86400])
def test_heartbeat_takes_a_timeout_from_one_second_to_a_year(timeout):
    job = parked_row()
    row = awa.heartbeat_callback(job.callback_id, timeout)
    seconds = timeout.total_seconds() if isinstance(timeout, dt.timedelta) else timeout
    assert close_to(row.callback_timeout_at, db_now() + dt.timedelta(seconds=seconds))


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_register_callback_refuses_a_bad_timeout(timeout):
    """A handler asking for a callback that times out before any answer can arrive
    gets a ValidationError, and the row gets no callback."""
    job = make_job(kind="parked", state=JobState.RUNNING, attempt=1, run_lease=1)
    context = JobContext(Attempt(job=job, alias="default"), Parked())
    with pytest.raises(awa.ValidationError, match="register_callback: timeout"):
        context.register_callback(timeout)
    row = Job.objects.get(id=job.id)
    assert (row.callback_id, row.callback_timeout_at) == (None, None)


def test_a_second_register_callback_in_one_attempt_is_refused_naming_the_first():
    """The first id, which the outside system may already hold, stays the job's:
    a second call neither replaces it nor leaves the handler a token that fails."""
    job = parked_row(state=JobState.RUNNING, callback_id=None, callback_timeout_at=None)
    attempt = Attempt(job=job, alias="default")
    context = JobContext(attempt, Parked())
    first = context.register_callback(60)
    message = (
        f"register_callback: job {job.id} already registered callback {first.id} "
        "in this attempt (attempt 1)"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        context.register_callback(120)
    assert Job.objects.get(id=job.id).callback_id == first.id
    # The handler can still park on the first: the outside system's answer finds it.
    (result,) = finalize([from_value(attempt, awa.WaitForCallback(first))], "default")
    assert result.state == JobState.WAITING_EXTERNAL
    assert awa.complete_external(first.id, {"ok": 1}).state == JobState.COMPLETED


@pytest.mark.parametrize(
    ("function", "bad"),
    [
        (awa.complete_external, {"when": dt.datetime(2024, 1, 1)}),
        (awa.complete_external, {"x": float("inf")}),
        (awa.complete_external, {"nul": "a\x00b"}),
        (awa.fail_external, 42),
        (awa.fail_external, "nul \x00 inside"),
        (awa.fail_external, ""),  # no reason: refused, as over HTTP
    ],
)
def test_values_postgres_cannot_store_are_refused_before_any_write(function, bad):
    job = parked_row()
    before = snapshot(job.id)
    with transaction.atomic():
        with pytest.raises(awa.ValidationError):
            function(job.callback_id, bad)
        Ledger.objects.create(job_id=job.id, attempt=0, run_lease=0, note="usable")
    assert snapshot(job.id) == before and Ledger.objects.count() == 1


# -- the HTTP receiver ----------------------------------------------------------------


def url(callback_id: uuid.UUID | str, action: str) -> str:
    return reverse("django_awa:callback", args=[callback_id, action])


def post(
    callback_id: uuid.UUID | str,
    action: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
    client: Client | None = None,
):
    """POST ``body`` to the receiver, signed for ``callback_id`` and ``action`` unless
    ``headers`` are given."""
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    client = client or Client(enforce_csrf_checks=True)
    if headers is None:
        headers = sign(raw, SECRET, callback_id=callback_id, action=action)
    return client.post(
        url(callback_id, action), data=raw, content_type="application/json", headers=headers
    )


def spec_signature(secret: str, stamp: int, signed: str, body: bytes) -> str:
    """The HMAC-SHA256 hex of SPEC §7, written out here rather than taken from the code."""
    return hmac.new(
        secret.encode(), f"{stamp}.{signed}".encode() + body, hashlib.sha256
    ).hexdigest()


def test_sign_is_the_hmac_of_timestamp_callback_id_action_and_body():
    body = b'{"payload":{"ok":true}}'
    cid = uuid.UUID("0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0")
    headers = sign(body, SECRET, callback_id=cid, action="complete", timestamp=1_700_000_000)
    expected = spec_signature(
        SECRET, 1_700_000_000, "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0.complete.", body
    )
    assert headers == {"X-Awa-Timestamp": "1700000000", "X-Awa-Signature": expected}
    # The id as text in any case, the body as str: the same signature.
    for same_id in (str(cid), str(cid).upper(), cid.hex):
        again = sign(
            body.decode(), SECRET, callback_id=same_id, action="complete", timestamp=1_700_000_000
        )
        assert again == headers
    stamp = sign(body, SECRET, callback_id=cid, action="complete")["X-Awa-Timestamp"]
    assert abs(int(stamp) - time.time()) < 5
    # Another action, another signature.
    assert sign(body, SECRET, callback_id=cid, action="retry", timestamp=1_700_000_000) != headers


def test_sign_needs_the_callback_id_and_action_by_keyword():
    with pytest.raises(TypeError):
        sign(b"{}", SECRET)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        sign(b"{}", SECRET, uuid.uuid4(), "complete")  # type: ignore[misc]
    with pytest.raises(ValueError, match="action"):
        sign(b"{}", SECRET, callback_id=uuid.uuid4(), action="explode")
    with pytest.raises(ValueError):
        sign(b"{}", SECRET, callback_id="not-a-uuid", action="complete")


README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.skipif(
    not (shutil.which("openssl") and shutil.which("curl")), reason="needs openssl and curl"
)
def test_the_readme_shell_recipe_completes_a_callback(live_server):
    """The README's openssl and curl lines, run as they are written (with this test's
    secret, callback id and server), make a request the receiver accepts."""
    recipe = re.search(r"```sh\n(SECRET=.*?)```", README.read_text(), re.DOTALL)
    assert recipe is not None, "README.md lost its shell recipe for signed callbacks"
    job = parked_row()
    script = recipe[1]
    for name, value in (("SECRET", SECRET), ("CALLBACK_ID", str(job.callback_id))):
        script, found = re.subn(
            rf"^{name}=.*$", f"{name}={shlex.quote(value)}", script, flags=re.MULTILINE
        )
        assert found == 1, name
    assert script.count("http://127.0.0.1:8000") == 1
    script = script.replace("http://127.0.0.1:8000", live_server.url)
    done = subprocess.run(
        ["bash", "-eu", "-o", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"id": job.id, "state": "completed"}, done.stdout
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.COMPLETED and row.metadata[RESULT_KEY] == {"ok": True}


def test_the_receiver_is_mounted_under_the_prefix():
    cid = uuid.uuid4()
    assert url(cid, "complete") == f"/awa/callbacks/{cid}/complete"


@pytest.mark.parametrize(
    ("action", "body", "state"),
    [
        ("complete", {"payload": {"ok": True}}, "completed"),
        ("complete", {}, "completed"),
        ("fail", {"error": "card declined"}, "failed"),
        ("retry", {}, "available"),
        ("heartbeat", {"timeout": 120}, "waiting_external"),
        ("heartbeat", {"timeout": 90.5}, "waiting_external"),
    ],
)
def test_each_action_answers_200_with_id_and_state(action, body, state):
    job = parked_row()
    response = post(job.callback_id, action, body)
    assert response.status_code == 200, response.content
    assert response.json() == {"id": job.id, "state": state}
    row = Job.objects.get(id=job.id)
    assert row.state == state
    if action == "complete":
        assert row.metadata[RESULT_KEY] == body.get("payload")
        assert followups(job.id) == [("completed", "echo", echo(job.id, "parked-completed"))]
    elif action == "fail":
        assert row.errors[-1]["error"] == "card declined"
        assert followups(job.id) == [
            ("exhausted", "echo", echo(job.id, "parked-exhausted:card declined"))
        ]
    elif action == "retry":
        assert row.attempt == 0
        assert followups(job.id) == [
            ("retried", "echo", echo(job.id, "parked-retried:retried externally:1"))
        ]
    else:
        seconds = body["timeout"]
        assert close_to(row.callback_timeout_at, db_now() + dt.timedelta(seconds=seconds))
        assert followups(job.id) == []


def test_a_callback_id_written_in_uppercase_reaches_its_job():
    # Some platforms print a UUID in uppercase; Django's uuid converter took only
    # lowercase, and such a sender's every callback got a 404.
    job = parked_row()
    upper = str(job.callback_id).upper()
    raw = json.dumps({"payload": {"ok": True}})
    response = Client().post(
        f"/awa/callbacks/{upper}/complete",
        data=raw,
        content_type="application/json",
        headers=sign(raw, SECRET, callback_id=upper, action="complete"),
    )
    assert response.status_code == 200, response.content
    assert Job.objects.get(id=job.id).state == "completed"
    assert url(upper, "complete") == f"/awa/callbacks/{job.callback_id}/complete"


def test_no_csrf_token_is_needed_even_with_a_session():
    job = parked_row()
    client = Client(enforce_csrf_checks=True)
    client.cookies["csrftoken"] = "x" * 32  # a browser-like client; still no token sent
    response = post(job.callback_id, "complete", {"payload": 1}, client=client)
    assert response.status_code == 200, response.content


def _unchanged(job: Job, before: dict[str, Any]) -> None:
    assert snapshot(job.id) == before
    assert followups(job.id) == []


def good(raw: str, cid: uuid.UUID, action: str, **kwargs: Any) -> dict[str, str]:
    """Headers signed for ``cid`` and ``action``, for the tests that spoil them."""
    return sign(raw, kwargs.pop("secret", SECRET), callback_id=cid, action=action, **kwargs)


OTHER_ACTION = {"complete": "retry", "fail": "complete", "retry": "complete", "heartbeat": "retry"}


@pytest.mark.parametrize(
    "make_headers",
    [
        pytest.param(lambda raw, cid, action: {}, id="no-headers"),
        pytest.param(
            lambda raw, cid, action: {"X-Awa-Timestamp": str(int(time.time()))},
            id="no-signature",
        ),
        pytest.param(
            lambda raw, cid, action: {"X-Awa-Signature": good(raw, cid, action)["X-Awa-Signature"]},
            id="no-timestamp",
        ),
        pytest.param(
            lambda raw, cid, action: good(raw, cid, action, secret="not-the-secret"),
            id="wrong-secret",
        ),
        pytest.param(lambda raw, cid, action: good(raw + " ", cid, action), id="other-body"),
        pytest.param(lambda raw, cid, action: good(raw, uuid.uuid4(), action), id="other-callback"),
        pytest.param(
            lambda raw, cid, action: good(raw, cid, OTHER_ACTION[action]), id="other-action"
        ),
        pytest.param(
            lambda raw, cid, action: {
                "X-Awa-Timestamp": str(int(time.time())),
                "X-Awa-Signature": spec_signature(SECRET, int(time.time()), "", raw.encode()),
            },
            id="old-form-timestamp-and-body-only",
        ),
        pytest.param(
            lambda raw, cid, action: {**good(raw, cid, action), "X-Awa-Signature": "0" * 64},
            id="forged-hex",
        ),
        pytest.param(
            lambda raw, cid, action: {
                "X-Awa-Timestamp": str(int(time.time()) + 1),
                "X-Awa-Signature": good(raw, cid, action)["X-Awa-Signature"],
            },
            id="timestamp-not-signed",
        ),
        pytest.param(
            lambda raw, cid, action: good(raw, cid, action, timestamp=int(time.time()) - 301),
            id="stale",
        ),
        pytest.param(
            lambda raw, cid, action: good(raw, cid, action, timestamp=int(time.time()) + 400),
            id="future",
        ),
        pytest.param(
            lambda raw, cid, action: {
                "X-Awa-Timestamp": "yesterday",
                "X-Awa-Signature": "ab" * 32,
            },
            id="timestamp-not-a-number",
        ),
    ],
)
@pytest.mark.parametrize("action", ACTIONS)
def test_a_missing_forged_or_stale_signature_is_refused_with_403(action, make_headers):
    job = parked_row()
    before = snapshot(job.id)
    raw = json.dumps(
        {
            "complete": {"payload": {"ok": True}},
            "fail": {"error": "x"},
            "retry": {},
            "heartbeat": {"timeout": 999},
        }[action]
    )
    headers = make_headers(raw, job.callback_id, action)
    response = post(job.callback_id, action, raw, headers=headers)
    assert response.status_code == 403, response.content
    assert "error" in response.json()
    _unchanged(job, before)
    assert not CallbackReceipt.objects.exists()


def test_a_timestamp_within_300_seconds_is_accepted():
    job = parked_row()
    raw = json.dumps({"timeout": 100})
    headers = good(raw, job.callback_id, "heartbeat", timestamp=int(time.time()) - 250)
    response = post(job.callback_id, "heartbeat", raw, headers=headers)
    assert response.status_code == 200, response.content


def test_a_replayed_request_is_refused_with_403():
    job = parked_row()
    raw = json.dumps({"timeout": 120})
    headers = good(raw, job.callback_id, "heartbeat")
    assert post(job.callback_id, "heartbeat", raw, headers=headers).status_code == 200
    after = snapshot(job.id)
    # The same timestamp, body and signature again to the same callback and action.
    response = post(job.callback_id, "heartbeat", raw, headers=headers)
    assert response.status_code == 403 and "replay" in response.json()["error"]
    assert snapshot(job.id) == after
    # The same body to another callback in the same second, signed for it: a request
    # of its own, not a replay.
    other = parked_row()
    assert post(other.callback_id, "heartbeat", raw).status_code == 200
    # Another timestamp makes another request.
    stamp = int(headers["X-Awa-Timestamp"]) - 1
    response = post(
        job.callback_id,
        "heartbeat",
        raw,
        headers=good(raw, job.callback_id, "heartbeat", timestamp=stamp),
    )
    assert response.status_code == 200


def test_a_signature_for_one_callback_replayed_to_another_is_403_and_changes_nothing():
    """A sender's signed ``complete`` for callback A, seen by someone else and sent
    within 300 s to callback B: B is left as it was, whatever the action."""
    a, b = parked_row(), parked_row()
    before = snapshot(b.id)
    for action, body in [("complete", {"payload": {"ok": True}}), ("retry", {})]:
        raw = json.dumps(body)
        headers = good(raw, a.callback_id, action)
        response = post(b.callback_id, action, raw, headers=headers)
        assert response.status_code == 403, response.content
        assert "signature" in response.json()["error"]
    _unchanged(b, before)
    assert not CallbackReceipt.objects.exists()
    # The same headers still resolve A, the callback they were made for.
    raw = json.dumps({"payload": {"ok": True}})
    headers = good(raw, a.callback_id, "complete")
    assert post(a.callback_id, "complete", raw, headers=headers).status_code == 200
    assert post(b.callback_id, "complete", raw, headers=headers).status_code == 403
    _unchanged(b, before)


@pytest.mark.parametrize(
    ("signed", "sent"),
    [("complete", "retry"), ("complete", "fail"), ("fail", "complete"), ("heartbeat", "retry")],
)
def test_a_signature_for_one_action_used_for_another_is_403_and_changes_nothing(signed, sent):
    job = parked_row()
    before = snapshot(job.id)
    # A body the sent action takes: only the action differs from what was signed.
    raw = json.dumps({"complete": {}, "fail": {"error": "x"}, "retry": {}}[sent])
    response = post(job.callback_id, sent, raw, headers=good(raw, job.callback_id, signed))
    assert response.status_code == 403, response.content
    _unchanged(job, before)
    assert not CallbackReceipt.objects.exists()


def test_the_old_signature_of_timestamp_and_body_alone_is_403():
    """Before 0.2 the signature covered ``"{timestamp}."`` and the body only."""
    job = parked_row()
    before = snapshot(job.id)
    raw = json.dumps({"payload": {"ok": True}})
    stamp = int(time.time())
    old = {
        "X-Awa-Timestamp": str(stamp),
        "X-Awa-Signature": spec_signature(SECRET, stamp, "", raw.encode()),
    }
    response = post(job.callback_id, "complete", raw, headers=old)
    assert response.status_code == 403, response.content
    assert response.json()["error"] == "bad signature"
    _unchanged(job, before)


def test_a_replayed_completion_is_refused_with_403_not_404():
    job = parked_row()
    raw = json.dumps({"payload": {"n": 1}})
    headers = good(raw, job.callback_id, "complete")
    assert post(job.callback_id, "complete", raw, headers=headers).status_code == 200
    assert post(job.callback_id, "complete", raw, headers=headers).status_code == 403
    assert len(followups(job.id)) == 1


@pytest.mark.parametrize("action", ACTIONS)
def test_an_unknown_callback_is_404(action):
    parked_row()
    body = {"complete": {}, "fail": {"error": "x"}, "retry": {}, "heartbeat": {"timeout": 5}}
    response = post(uuid.uuid4(), action, body[action])
    assert response.status_code == 404, response.content
    assert "error" in response.json()
    assert not CallbackReceipt.objects.exists()


@pytest.mark.parametrize("first", ["complete", "fail", "retry"])
def test_a_resolved_callback_is_404(first):
    job = parked_row()
    body = {"complete": {}, "fail": {"error": "x"}, "retry": {}}
    assert post(job.callback_id, first, body[first]).status_code == 200
    after = snapshot(job.id)
    # (Bodies differ from the first request's, which would otherwise be a replay: 403.)
    for action, again in [
        ("complete", {"payload": "again"}),
        ("fail", {"error": "y"}),
        ("retry", {}),
        ("heartbeat", {"timeout": 9}),
    ]:
        headers = good(json.dumps(again), job.callback_id, action, timestamp=int(time.time()) - 10)
        assert post(job.callback_id, action, again, headers=headers).status_code == 404
    assert snapshot(job.id) == after


def test_unknown_actions_and_malformed_ids_are_404():
    job = parked_row()
    raw = "{}"
    client = Client(enforce_csrf_checks=True)
    for path in (
        f"/awa/callbacks/{job.callback_id}/explode",
        "/awa/callbacks/not-a-uuid/complete",
    ):
        headers = good(raw, job.callback_id, "complete")
        response = client.post(path, data=raw, content_type="application/json", headers=headers)
        assert response.status_code == 404
    assert Job.objects.get(id=job.id).state == JobState.WAITING_EXTERNAL


@pytest.mark.parametrize(
    ("action", "raw"),
    [
        ("complete", "not json"),
        ("complete", "{'payload': 1}"),
        ("complete", "[1, 2]"),
        ("complete", '"a string"'),
        ("complete", b"\xff\xfe{}"),
        ("complete", '{"payload": 1, "extra": 2}'),
        ("complete", '{"error": "wrong field for complete"}'),
        ("complete", '{"payload": NaN}'),
        ("complete", '{"payload": "nul \\u0000 inside"}'),
        ("complete", "[" * 100_000 + "]" * 100_000),
        ("fail", "{}"),
        ("fail", '{"error": 42}'),
        ("fail", '{"error": ""}'),
        ("fail", '{"error": ["a"]}'),
        ("fail", '{"error": "x", "payload": 1}'),
        ("fail", '{"error": "nul \\u0000"}'),
        ("retry", '{"payload": 1}'),
        ("retry", "[]"),
        ("heartbeat", "{}"),
        ("heartbeat", '{"timeout": "60"}'),
        ("heartbeat", '{"timeout": true}'),
        ("heartbeat", '{"timeout": 0}'),
        ("heartbeat", '{"timeout": -5}'),
        ("heartbeat", '{"timeout": null}'),
        ("heartbeat", '{"timeout": 1e400}'),
        ("heartbeat", '{"timeout": NaN}'),
        ("heartbeat", '{"timeout": 999999999999}'),
        ("heartbeat", '{"timeout": 1e-300}'),
        ("heartbeat", '{"timeout": 0.5}'),
        ("heartbeat", '{"timeout": 60, "extra": 1}'),
    ],
)
def test_a_bad_body_is_400_and_changes_nothing(action, raw):
    job = parked_row()
    before = snapshot(job.id)
    response = post(job.callback_id, action, raw)
    assert response.status_code == 400, response.content
    assert "error" in response.json()
    _unchanged(job, before)
    assert not CallbackReceipt.objects.exists()


@pytest.mark.parametrize("method", ["get", "put", "delete", "patch"])
def test_other_methods_are_405(method):
    job = parked_row()
    client = Client(enforce_csrf_checks=True)
    response = getattr(client, method)(url(job.callback_id, "complete"))
    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert Job.objects.get(id=job.id).state == JobState.WAITING_EXTERNAL


def post_claiming_length(job: Job, length: str) -> Any:
    """A signed ``complete`` whose Content-Length header says ``length``."""
    raw = json.dumps({"payload": 1})
    return Client().post(
        url(job.callback_id, "complete"),
        data=raw,
        content_type="application/json",
        headers=good(raw, job.callback_id, "complete"),
        CONTENT_LENGTH=length,
    )


@pytest.mark.parametrize("length", ["-1", "+5", "²", "1e3", "0x10", " ", "-" + "9" * 5000])
def test_a_bad_content_length_header_is_400(length):
    job = parked_row()
    before = snapshot(job.id)
    response = post_claiming_length(job, length)
    assert response.status_code == 400, response.content
    assert "Content-Length" in response.json()["error"]
    _unchanged(job, before)


@pytest.mark.parametrize(
    "length", [str(MAX_BODY + 1), "9" * 30, "9" * 5000, "0" * 40 + str(MAX_BODY + 1)]
)
def test_a_content_length_over_the_limit_is_413(length):
    job = parked_row()
    response = post_claiming_length(job, length)
    assert response.status_code == 413, response.content
    assert Job.objects.get(id=job.id).state == JobState.WAITING_EXTERNAL


def test_an_integer_too_long_to_read_is_400_saying_so():
    job = parked_row()
    before = snapshot(job.id)
    response = post(job.callback_id, "complete", '{"payload": ' + "7" * 5001 + "}")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert "integer" in error and "5001 digits" in error
    assert "JSON object" not in error
    _unchanged(job, before)


def test_an_oversize_body_is_413():
    job = parked_row()
    before = snapshot(job.id)
    raw = json.dumps({"payload": "x" * MAX_BODY})
    assert len(raw) > MAX_BODY
    response = post(job.callback_id, "complete", raw)
    assert response.status_code == 413
    _unchanged(job, before)


def test_a_body_at_the_limit_is_accepted():
    job = parked_row()
    filler = MAX_BODY - len(json.dumps({"payload": ""}))
    raw = json.dumps({"payload": "x" * filler})
    assert len(raw) == MAX_BODY
    assert post(job.callback_id, "complete", raw).status_code == 200


def test_a_failing_followup_is_503_and_the_same_request_succeeds_once_fixed():
    job = make_job(
        kind="act",
        args={"action": "callback"},
        state=JobState.WAITING_EXTERNAL,
        attempt=1,
        max_attempts=3,
        run_lease=1,
        callback_id=uuid.uuid4(),
        callback_timeout_at=db_now() + dt.timedelta(minutes=5),
    )
    before = snapshot(job.id)
    raw = json.dumps({"payload": {"order": 5}})
    headers = good(raw, job.callback_id, "complete")
    FAIL["completed"] = True
    response = post(job.callback_id, "complete", raw, headers=headers)
    assert response.status_code == 503, response.content
    assert "error" in response.json()
    _unchanged(job, before)
    assert not CallbackReceipt.objects.exists()
    FAIL["completed"] = False  # fixed
    response = post(job.callback_id, "complete", raw, headers=headers)
    assert response.status_code == 200, response.content
    assert response.json() == {"id": job.id, "state": "completed"}
    assert Job.objects.get(id=job.id).metadata[RESULT_KEY] == {"order": 5}
    assert [f[2]["note"] for f in followups(job.id)] == ["completed-1", "completed-2"]


def test_a_payload_that_makes_the_followup_fail_is_503():
    job = parked_row()
    before = snapshot(job.id)
    response = post(job.callback_id, "complete", {"payload": {"explode": True}})
    assert response.status_code == 503
    _unchanged(job, before)
    assert post(job.callback_id, "complete", {"payload": {"ok": True}}).status_code == 200


def test_without_a_callback_secret_every_request_is_refused(settings):
    settings.AWA = {**settings.AWA, "CALLBACK_SECRET": None}
    job = parked_row()
    before = snapshot(job.id)
    response = post(job.callback_id, "complete", {"payload": 1})
    assert response.status_code == 403
    _unchanged(job, before)


def test_a_body_over_data_upload_max_memory_size_is_413(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    job = parked_row()
    before = snapshot(job.id)
    response = post(job.callback_id, "complete", {"payload": "x" * 200})
    assert response.status_code == 413
    _unchanged(job, before)


def post_chunked(path: str, raw: str, headers: dict[str, str], terminated: bool = True) -> Any:
    """A POST as gunicorn hands a chunked one to Django: no Content-Length, the body
    de-chunked in wsgi.input, ``wsgi.input_terminated`` set (when ``terminated``)."""
    extra: dict[str, Any] = {"CONTENT_LENGTH": "", "HTTP_TRANSFER_ENCODING": "chunked"}
    # A stream that ends with the body, as gunicorn's (the test client's asserts
    # on a read past the length it was given).
    extra["wsgi.input"] = io.BytesIO(raw.encode())
    if terminated:
        extra["wsgi.input_terminated"] = True
    return Client().post(path, data=raw, content_type="application/json", headers=headers, **extra)


def test_a_chunked_callback_without_content_length_is_read_and_applied():
    """Django's WSGI request reads no body without a Content-Length: a sender that
    streamed its body (chunked) got "bad signature", and the batch "body must be
    {"callbacks": [...]}", though both were right."""
    job = parked_row()
    raw = json.dumps({"payload": {"ok": 1}})
    response = post_chunked(
        url(job.callback_id, "complete"), raw, good(raw, job.callback_id, "complete")
    )
    assert response.status_code == 200, response.content
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED
    other = parked_row()
    body = json.dumps({"callbacks": [entry(other.callback_id, {"ok": 2})]})
    response = post_chunked(reverse("django_awa:callback_batch"), body, {})
    assert response.status_code == 200, response.content
    assert response.json()["results"][0]["status"] == 200
    assert Job.objects.get(id=other.id).state == JobState.COMPLETED


def test_a_chunked_callback_over_the_limit_is_413(settings):
    job = parked_row()
    before = snapshot(job.id)
    raw = json.dumps({"payload": "x" * MAX_BODY})
    response = post_chunked(
        url(job.callback_id, "complete"), raw, good(raw, job.callback_id, "complete")
    )
    assert response.status_code == 413, response.content
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    raw = json.dumps({"payload": "x" * 200})
    response = post_chunked(
        url(job.callback_id, "complete"), raw, good(raw, job.callback_id, "complete")
    )
    assert response.status_code == 413, response.content
    _unchanged(job, before)


def test_a_chunked_callback_the_server_cannot_read_to_its_end_is_411():
    job = parked_row()
    before = snapshot(job.id)
    raw = json.dumps({"payload": 1})
    headers = good(raw, job.callback_id, "complete")
    response = post_chunked(url(job.callback_id, "complete"), raw, headers, terminated=False)
    assert response.status_code == 411, response.content
    assert "Content-Length" in response.json()["error"]
    _unchanged(job, before)


def test_receipts_too_old_to_replay_are_pruned():
    job = parked_row()
    assert post(job.callback_id, "heartbeat", {"timeout": 60}).status_code == 200
    assert prune_receipts() == 0
    CallbackReceipt.objects.update(received_at=db_now() - dt.timedelta(seconds=RECEIPT_RETENTION))
    assert prune_receipts() == 1 and not CallbackReceipt.objects.exists()


def test_an_early_callback_that_cannot_be_applied_does_not_block_the_park(monkeypatch):
    from django.db import DatabaseError

    def broken(*args: Any) -> list[int]:
        raise DatabaseError("insert failed")

    job = parked_row(state=JobState.RUNNING)
    awa.complete_external(job.callback_id, {"ok": True})
    monkeypatch.setattr("django_awa.callbacks.dispatch", broken)
    row = _park_in_process(job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id == job.callback_id
    monkeypatch.undo()
    assert awa.complete_external(job.callback_id, {"ok": 2}).state == JobState.COMPLETED


# -- the batch receiver (<prefix>/callbacks/complete) ------------------------------------


def entry(
    callback_id: uuid.UUID | str, payload: Any = None, *, raw: str | None = None, **spoil: str
) -> dict[str, str]:
    """A batch entry: the body (``raw``, or one with ``payload``) and headers of
    ``callback_id``'s own ``complete`` POST; ``spoil`` overrides fields after signing."""
    body = json.dumps({"payload": payload}) if raw is None else raw
    headers = sign(body, SECRET, callback_id=callback_id, action="complete")
    made = {
        "id": str(callback_id),
        "timestamp": headers["X-Awa-Timestamp"],
        "signature": headers["X-Awa-Signature"],
        "body": body,
    }
    return {**made, **spoil}


def post_batch(entries: Any, client: Client | None = None):
    client = client or Client(enforce_csrf_checks=True)
    raw = entries if isinstance(entries, (str, bytes)) else json.dumps({"callbacks": entries})
    return client.post(
        reverse("django_awa:callback_batch"), data=raw, content_type="application/json"
    )


def parked_twins() -> list[Job]:
    """Two jobs of one ``awa.Unique`` key, both parked as a worker leaves them: the first
    parked before the second was enqueued (``waiting_external`` holds no key)."""
    twins = []
    for _ in range(2):
        job = awa.enqueue(Parked(timeout=63.0), unique=awa.Unique(by_args=True))
        Job.objects.filter(id=job.id).update(
            state=JobState.WAITING_EXTERNAL,
            attempt=1,
            run_lease=1,
            callback_id=uuid.uuid4(),
            callback_timeout_at=db_now() + dt.timedelta(seconds=60),
        )
        twins.append(Job.objects.get(id=job.id))
    return twins


def test_an_answer_that_would_take_a_unique_key_another_job_holds_is_refused_clearly():
    """Once one twin's callback completed it (``completed`` holds the key), completing or
    retrying the other broke the unique index: a bare ``IntegrityError`` in Python and a
    500 over HTTP. It is ``awa.UniqueConflict`` (409), and the job still waits."""
    done, other = parked_twins()
    assert awa.complete_external(done.callback_id, {"n": 1}).state == JobState.COMPLETED
    before = snapshot(other.id)
    for action in ("complete", "retry"):
        with transaction.atomic():
            with pytest.raises(awa.UniqueConflict, match="another job holds its unique key"):
                call(action, other.callback_id)
            Ledger.objects.create(job_id=other.id, attempt=0, run_lease=0, note="usable")
        response = post(other.callback_id, action, {"payload": 1} if action == "complete" else {})
        assert response.status_code == 409, response.content
        assert "another job holds its unique key" in response.json()["error"]
    response = post_batch([entry(other.callback_id, 2)])
    assert response.status_code == 409 and "no job changed" in response.json()["error"]
    with pytest.raises(awa.UniqueConflict):
        complete_external_many([(other.callback_id, 3)])
    assert snapshot(other.id) == before and Ledger.objects.count() == 2
    assert awa.fail_external(other.callback_id, "a twin did it").state == JobState.FAILED


def test_the_batch_receiver_judges_each_entry_as_its_own_request_would_be():
    ok = [parked_row() for _ in range(3)]
    forged, stale, failed = parked_row(), parked_row(), parked_row(state=JobState.FAILED)
    nul = parked_row()
    before = {job.id: snapshot(job.id) for job in (forged, stale, failed, nul)}
    unknown = uuid.uuid4()
    first = entry(ok[0].callback_id, {"n": 0})
    sent = [
        first,
        entry(ok[1].callback_id, {"n": 1}),
        entry(forged.callback_id, {"n": 9}, signature="0" * 64),
        entry(stale.callback_id, timestamp=str(int(time.time()) - 301)),
        entry(unknown),
        entry(failed.callback_id),
        first,  # the same signed request twice: a replay
        entry(ok[2].callback_id, raw='{"payload": 2, "extra": 1}'),  # signed, but a bad body
        entry(ok[1].callback_id, {"n": 5}),  # resolved by an entry before it
        entry(nul.callback_id, raw='{"payload": "a\\u0000b"}'),  # a payload jsonb refuses
    ]
    response = post_batch(sent)
    assert response.status_code == 200, response.content
    results = response.json()["results"]
    assert [r["id"] for r in results] == [e["id"] for e in sent]
    assert [r["status"] for r in results] == [200, 200, 403, 403, 404, 404, 403, 400, 404, 400]
    assert results[0]["state"] == "completed" and results[0]["job"] == ok[0].id
    for job, n in ((ok[0], 0), (ok[1], 1)):
        row = Job.objects.get(id=job.id)
        assert row.state == JobState.COMPLETED and row.metadata[RESULT_KEY] == {"n": n}
        assert followups(job.id) == [("completed", "echo", echo(job.id, "parked-completed"))]
    for job in (forged, stale, failed, nul):
        _unchanged(job, before[job.id])
    assert Job.objects.get(id=ok[2].id).state == JobState.WAITING_EXTERNAL
    # Receipts of the two accepted requests only: a 404 keeps none, as one POST's.
    assert CallbackReceipt.objects.count() == 2
    again = post_batch([entry(unknown), first])
    assert [r["status"] for r in again.json()["results"]] == [404, 403]


def test_a_failing_followup_in_a_batch_is_503_and_changes_nothing():
    jobs = [parked_row() for _ in range(3)]
    before = [snapshot(job.id) for job in jobs]
    sent = [entry(jobs[0].callback_id), entry(jobs[1].callback_id, {"explode": True})]
    response = post_batch([*sent, entry(jobs[2].callback_id)])
    assert response.status_code == 503, response.content
    assert [snapshot(job.id) for job in jobs] == before
    assert not CallbackReceipt.objects.exists()
    # The sender tries again without the bad one: the same signed entries pass.
    response = post_batch([sent[0], entry(jobs[2].callback_id)])
    assert [r["status"] for r in response.json()["results"]] == [200, 200]
    assert Job.objects.get(id=jobs[1].id).state == JobState.WAITING_EXTERNAL


@pytest.mark.parametrize(
    "body",
    [
        "[]",
        "not json",
        '{"callbacks": {}}',
        '{"callbacks": [], "more": 1}',
        '{"callbacks": [{"id": "x"}]}',
        '{"callbacks": [{"id": 1, "timestamp": "1", "signature": "s", "body": "{}"}]}',
        json.dumps({"callbacks": [entry(uuid.UUID(int=0))] * 501}),
    ],
    ids=["list", "text", "object", "extra", "fields", "types", "too-many"],
)
def test_a_malformed_batch_is_400_and_changes_nothing(body):
    job = parked_row()
    before = snapshot(job.id)
    response = post_batch(body)
    assert response.status_code == 400, response.content
    _unchanged(job, before)
    assert not CallbackReceipt.objects.exists()


def test_the_batch_receiver_takes_only_post():
    response = Client().get(reverse("django_awa:callback_batch"))
    assert response.status_code == 405 and response["Allow"] == "POST"
