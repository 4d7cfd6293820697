"""Follow-ups: declared in followups.py, committed with the state change they follow."""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.core import checks
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connection, transaction
from django.db.models import Count
from django.utils import timezone

import django_awa as awa
from django_awa import signals
from django_awa.execute import Attempt, AttemptResult, completed, run_attempt
from django_awa.finalize import finalize
from django_awa.followups import (
    CONTEXT_PARAMETERS,
    Cancelled,
    Completed,
    Exhausted,
    FollowupSpec,
    Outcome,
    Rescued,
    Retried,
    WaitingForCallback,
    followup_registry,
    on_completed,
    on_retried,
)
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState, PendingFollowup
from django_awa.pending import context_from_json, context_json
from django_awa.producer import claim
from stress import audit
from tests.conftest import make_job, wait_for, wait_for_state
from tests.testapp.followups import CALLS, FAIL
from tests.testapp.jobs import Act, Echo, Pay, Stamp
from tests.testapp.models import Ledger, Order

db = pytest.mark.django_db


def run_next(queue: str = "default") -> list[AttemptResult]:
    """Claim one job and run and finalize it in this process."""
    (job,) = claim(queue, 1, "default")
    return finalize([run_attempt(Attempt(job=job, alias="default"))], "default")


def followups_of(job_id: int) -> list[Job]:
    return list(Job.objects.followups_of(job_id).order_by("id"))


def notes(job_id: int) -> list[str]:
    return [j.args["note"] for j in followups_of(job_id)]


@db
def test_completed_followups_run_in_declaration_order_with_trigger_lineage():
    job = awa.enqueue(Act(action="ok"))
    run_next()
    trigger = Job.objects.get(id=job.id)
    assert trigger.state == JobState.COMPLETED
    children = followups_of(job.id)
    assert [c.args for c in children] == [
        {"n": job.id, "note": "completed-1", "tags": []},
        {"n": job.id, "note": "completed-2", "tags": []},
    ]
    for child in children:
        assert child.kind == "echo" and child.state == JobState.AVAILABLE
        assert child.metadata["awa_trigger"] == {
            "job_id": job.id,
            "kind": "act",
            "outcome": "completed",
        }
        assert child.trigger() == trigger
    assert list(trigger.followups()) == children


@db
def test_retried_followup_gets_error_attempt_and_next_run_at():
    job = awa.enqueue(Act(action="raise"))
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE
    (child,) = followups_of(job.id)
    assert child.args["note"].startswith("retried:1:ValueError: boom on attempt 1")
    assert child.metadata["awa_trigger"]["outcome"] == "retried"


@db
def test_retried_followup_arguments_exactly():
    seen = {}

    @on_retried(Act)
    def capture(args, job, error, attempt, next_run_at):
        seen.update(args=args, job=job, error=error, attempt=attempt, next_run_at=next_run_at)

    try:
        job = awa.enqueue(Act(action="raise", tag="x"))
        run_next()
    finally:
        _unregister(capture)
    row = Job.objects.get(id=job.id)
    assert seen["args"] == Act(action="raise", tag="x")
    assert seen["job"].id == job.id and seen["job"].state == JobState.RETRYABLE
    assert seen["error"] == "ValueError: boom on attempt 1"
    assert seen["attempt"] == 1
    assert seen["next_run_at"] == row.run_at and timezone.is_aware(seen["next_run_at"])


@db
def test_exhausted_followup_on_the_last_attempt_and_on_terminal_error():
    last = awa.enqueue(Act(action="raise"), max_attempts=1)
    run_next()
    assert Job.objects.get(id=last.id).state == JobState.FAILED
    assert notes(last.id) == ["exhausted:1"]
    terminal = awa.enqueue(Act(action="terminal"))
    run_next()
    assert notes(terminal.id) == ["exhausted:1"]


@db
def test_cancelled_followup_gets_the_reason():
    job = awa.enqueue(Act(action="cancel"))
    run_next()
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED
    assert notes(job.id) == ["cancelled:not needed any more"]


@db
def test_a_cancel_without_a_reason_records_none_rather_than_the_text_none():
    job = awa.enqueue(Act(action="cancel_none"))
    run_next()
    cancelled = Job.objects.get(id=job.id)
    assert cancelled.state == JobState.CANCELLED
    assert [e["error"] for e in cancelled.errors] == ["cancelled"]
    assert notes(job.id) == ["cancelled:"]
    # awa.cancel takes None the same way.
    other = awa.enqueue(Act(action="ok"))
    awa.cancel(other.id, None)  # type: ignore[arg-type]
    assert [e["error"] for e in Job.objects.get(id=other.id).errors] == ["cancelled"]
    assert notes(other.id) == ["cancelled:"]


@db
def test_awa_cancel_dispatches_cancelled_followups_in_the_same_transaction():
    job = awa.enqueue(Act(action="ok"))
    awa.cancel(job.id, "by hand")
    assert notes(job.id) == ["cancelled:by hand"]


@db
def test_waiting_for_callback_followup_sees_the_callback_id():
    from tests.testapp.jobs import Parked

    job = awa.enqueue(Parked(timeout=60))
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.WAITING_EXTERNAL and row.callback_id
    assert notes(job.id) == [f"waiting:{row.callback_id}"]


@db
def test_a_function_returning_none_enqueues_nothing():
    job = awa.enqueue(Act(action="ok", tag="none"))
    run_next()
    assert followups_of(job.id) == []
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED


@db
def test_enqueue_request_overrides_the_followups_options():
    job = awa.enqueue(Act(action="ok", tag="override"))
    run_next()
    (child,) = followups_of(job.id)
    assert (child.queue, child.priority, child.max_attempts) == ("other", 1, 7)


def _the_followup_of_one_echo(function: Callable[..., Any]) -> tuple[Job, Job]:
    """Run one Echo job with ``function`` as its ``on_completed``: the job and its follow-up."""
    on_completed(Echo)(function)
    try:
        job = awa.enqueue(Echo(n=1))
        run_next("echo")
    finally:
        _unregister(function)
    (child,) = followups_of(job.id)
    return job, child


@db
def test_followup_run_at_and_unique_from_an_enqueue_request():
    later = timezone.now() + dt.timedelta(hours=2)

    def delayed(args, job):
        return awa.EnqueueRequest(Echo(n=-job.id), run_at=later, unique=awa.Unique())

    _, child = _the_followup_of_one_echo(delayed)
    assert child.state == JobState.SCHEDULED and child.run_at == later
    assert child.unique_key is not None


@db
def test_an_enqueue_request_keeps_its_metadata_beside_the_trigger():
    def tagged(args, job):
        return awa.EnqueueRequest(Echo(n=-job.id), metadata={"source": "followup"})

    job, child = _the_followup_of_one_echo(tagged)
    trigger = {"job_id": job.id, "kind": "echo", "outcome": "completed"}
    assert child.metadata == {"source": "followup", "awa_trigger": trigger}


@db
def test_engine_metadata_keys_from_a_followup_function_are_a_followup_failure():
    # What a follow-up function returns is the user's: it may not forge a trigger.
    @on_completed(Echo)
    def forged(args, job):
        return awa.EnqueueRequest(Echo(n=-job.id), metadata={"awa_trigger": {"job_id": 1}})

    try:
        job = awa.enqueue(Echo(n=1))
        run_next("echo")
    finally:
        _unregister(forged)
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE
    assert "forged" in row.errors[-1]["error"]
    assert "metadata key 'awa_trigger'" in row.errors[-1]["error"]
    assert followups_of(job.id) == []


@db
def test_a_raising_followup_rolls_the_outcome_back_and_records_a_retry():
    job = awa.enqueue(Act(action="ok", tag="fail-completed"))
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE and row.attempt == 1
    error = row.errors[-1]["error"]
    assert "tests.testapp.followups.act_completed" in error
    assert "RuntimeError: completed follow-up exploded" in error
    # No follow-up of the outcome that did not commit; the retry's own ones did.
    assert [c.metadata["awa_trigger"]["outcome"] for c in followups_of(job.id)] == ["retried"]


@db
def test_a_raising_followup_on_the_last_attempt_fails_the_job():
    job = awa.enqueue(Act(action="ok", tag="fail-completed"), max_attempts=1)
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.FAILED and row.finalized_at is not None
    assert [c.metadata["awa_trigger"]["outcome"] for c in followups_of(job.id)] == ["exhausted"]


@db
def test_a_unique_conflict_from_a_followup_is_a_followup_failure():
    awa.enqueue(Echo(n=0), unique=awa.Unique(by_args=False))  # holds the Echo kind's key
    job = awa.enqueue(Act(action="ok", tag="unique-clash"))
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE
    assert "UniqueConflict" in row.errors[-1]["error"]
    assert "act_completed" in row.errors[-1]["error"]


@db
def test_a_followup_after_a_job_that_no_longer_exists_is_a_followup_failure():
    """The refusal (a ValidationError from the insert) escaped finalize: run_jobs raised
    it, and a worker recorded the batch's outcomes as unstorable. It is that trigger's
    follow-up failure, as a unique conflict is."""
    gone = make_job(kind="echo", args={"n": 0})
    Job.objects.filter(id=gone.id).delete()

    def after_gone(args, job):
        if args.tag == "after-gone":
            return awa.EnqueueRequest(Echo(n=job.id, note="after-gone"), after=[gone.id])
        return None

    spec = FollowupSpec(outcome=Outcome.COMPLETED, trigger=Act, function=after_gone)
    followup_registry.add(spec)
    try:
        ok = awa.enqueue(Act(action="ok"))
        bad = awa.enqueue(Act(action="ok", tag="after-gone"))
        claimed = claim("default", 10, "default")
        finalize([run_attempt(Attempt(job=j, alias="default")) for j in claimed], "default")
    finally:
        followup_registry._remove(spec)
    assert Job.objects.get(id=ok.id).state == JobState.COMPLETED
    assert notes(ok.id) == ["completed-1", "completed-2"]
    row = Job.objects.get(id=bad.id)
    assert row.state == JobState.RETRYABLE
    assert f"after names job id {gone.id}, which does not exist" in row.errors[-1]["error"]
    assert [note.partition(":")[0] for note in notes(bad.id)] == ["retried"]


@db
def test_when_the_fallbacks_followups_fail_too_they_are_kept_and_replayed():
    FAIL["completed"] = True
    FAIL["retried"] = True
    job = awa.enqueue(Act(action="ok"))
    run_next()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE  # the fallback transition committed
    (pending,) = PendingFollowup.objects.filter(job_id=job.id)
    assert pending.outcome == "retried" and "retried follow-up exploded" in pending.last_error
    assert followups_of(job.id) == []
    FAIL["retried"] = False
    assert Maintenance().replay_pending() == 1
    assert not PendingFollowup.objects.exists()
    (child,) = followups_of(job.id)
    assert child.args["note"].startswith(
        "retried:1:follow-up tests.testapp.followups.act_completed"
    )


@db
@pytest.mark.parametrize(
    ("outcome", "context", "expected"),
    [
        (
            Outcome.RETRIED,
            {"error": "boom", "attempt": 2, "next_run_at": "2031-05-06T07:08:09.123Z"},
            ("boom", 2, dt.datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=dt.UTC)),
        ),
        (Outcome.EXHAUSTED, {"error": "boom", "attempt": 3}, ("boom", 3)),
        (Outcome.RESCUED, {"reason": "deadline_exceeded"}, (awa.RescueReason.DEADLINE_EXCEEDED,)),
    ],
)
def test_a_pending_row_kept_by_0_1_0_still_replays(outcome, context, expected):
    # 0.1.0 kept the context as a dict and the row through DjangoJSONEncoder
    # (datetimes to the millisecond, "Z" for UTC).
    job = make_job(state=JobState.FAILED, attempt=3, finalized_at=timezone.now())
    fields = {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}
    snapshot = json.loads(json.dumps(fields, cls=DjangoJSONEncoder))
    PendingFollowup.objects.create(
        job_id=job.id, kind=job.kind, outcome=outcome.value, context=context, snapshot=snapshot
    )
    seen = []

    def capture(args, job, *extra):
        seen.append((job.id, job.state, job.finalized_at, *extra))
        return Echo(n=job.id, note="replayed")

    spec = FollowupSpec(outcome=outcome, trigger=Act, function=capture)
    followup_registry.add(spec)
    try:
        assert Maintenance().replay_pending() == 1
    finally:
        followup_registry._remove(spec)
    kept_at = job.finalized_at.replace(microsecond=job.finalized_at.microsecond // 1000 * 1000)
    assert seen == [(job.id, job.state, kept_at, *expected)]
    assert "replayed" in notes(job.id) and not PendingFollowup.objects.exists()


@pytest.mark.parametrize(
    "context",
    [
        Completed(),
        Retried(error="e", attempt=2, next_run_at=dt.datetime(2030, 1, 2, 3, 4, 5, 6, dt.UTC)),
        Exhausted(error="e", attempt=2),
        Cancelled(reason="r"),
        WaitingForCallback(),
        Rescued(reason=awa.RescueReason.CALLBACK_TIMEOUT),
    ],
)
def test_an_outcome_context_is_kept_as_json_and_restored_as_it_was(context):
    kept = json.loads(json.dumps(context_json(context)))
    assert context_from_json(context.outcome, kept) == context
    assert context.values() == tuple(context.as_dict().values())
    assert tuple(context.as_dict()) == CONTEXT_PARAMETERS[context.outcome]


def test_the_context_parameters_are_the_spec_ones():
    assert CONTEXT_PARAMETERS == {
        Outcome.COMPLETED: (),
        Outcome.RETRIED: ("error", "attempt", "next_run_at"),
        Outcome.EXHAUSTED: ("error", "attempt"),
        Outcome.CANCELLED: ("reason",),
        Outcome.WAITING_FOR_CALLBACK: (),
        Outcome.RESCUED: ("reason",),
    }


@db
def test_a_stale_attempt_writes_nothing_and_inserts_no_followups():
    job = awa.enqueue(Act(action="ok"))
    (claimed,) = claim("default", 1, "default")
    result = run_attempt(Attempt(job=claimed, alias="default"))
    awa.cancel(job.id, "meanwhile")  # the attempt is no longer the running one
    assert finalize([result], "default") == []
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED
    assert notes(job.id) == ["cancelled:meanwhile"]


@db
def test_one_bad_followup_does_not_roll_back_the_rest_of_the_batch():
    good = [awa.enqueue(Act(action="ok")) for _ in range(3)]
    bad = awa.enqueue(Act(action="ok", tag="fail-completed"))
    claimed = claim("default", 10, "default")
    results = [run_attempt(Attempt(job=j, alias="default")) for j in claimed]
    finalize(results, "default")
    for job in good:
        assert Job.objects.get(id=job.id).state == JobState.COMPLETED
        assert notes(job.id) == ["completed-1", "completed-2"]
    assert Job.objects.get(id=bad.id).state == JobState.RETRYABLE


@db
@pytest.mark.parametrize(
    ("tag", "error"),
    [("db-error", "DataError: division by zero"), ("db-error-caught", "ValueError: no order")],
)
def test_a_followup_whose_query_fails_does_not_fail_the_others_of_the_batch(tag, error):
    """A follow-up function's failed query aborts the finalize transaction (whether
    the function lets the error out or raises another): the functions of the
    batch's other jobs, if they read the database, must not be called in it, or
    each would fail too and lose its job's outcome."""
    before = [awa.enqueue(Act(action="ok", tag="reads-db")) for _ in range(2)]
    bad = awa.enqueue(Act(action="ok", tag=tag))
    after = [awa.enqueue(Act(action="ok", tag="reads-db")) for _ in range(2)]
    claimed = claim("default", 10, "default")
    results = [run_attempt(Attempt(job=j, alias="default")) for j in claimed]
    finalize(results, "default")
    for job in [*before, *after]:
        row = Job.objects.get(id=job.id)
        assert row.state == JobState.COMPLETED, (job.id, row.state, row.errors)
        assert notes(job.id) == ["completed-1", "completed-2"]
    row = Job.objects.get(id=bad.id)
    assert row.state == JobState.RETRYABLE
    assert f"act_completed failed: {error}" in row.errors[-1]["error"]
    assert [note.partition(":")[0] for note in notes(bad.id)] == ["retried"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["SystemExit", "CancelledError", "KeyboardInterrupt"])
def test_a_followup_raising_a_base_exception_is_a_followup_failure_in_a_worker(start_worker, name):
    """What a follow-up function raises is recorded as a handler's is, BaseException
    subclasses included: one let out ended the completer's thread, and every job of
    the worker stayed running for good (its heartbeat kept maintenance away)."""
    bad = awa.enqueue(Act(action="ok", tag=f"base:{name}"), max_attempts=1)
    good = awa.enqueue(Act(action="ok"))
    worker = start_worker("--queue", "default=2", "--queue", "echo=1")
    wait_for_state(bad.id, JobState.FAILED, timeout=10)
    wait_for_state(good.id, JobState.COMPLETED, timeout=10)
    error = Job.objects.get(id=bad.id).errors[-1]["error"]
    assert error.startswith(f"follow-up tests.testapp.followups.act_completed failed: {name}")
    assert notes(good.id) == ["completed-1", "completed-2"]
    later = awa.enqueue(Act(action="ok"))  # the worker still writes outcomes
    wait_for_state(later.id, JobState.COMPLETED, timeout=10)
    assert worker.proc.poll() is None


@db
def test_a_refused_unique_followup_in_a_batch_fails_only_its_own_trigger():
    # Plain follow-ups take their ids from the column default and a unique one
    # draws its own: the refusal must still be pinned on the right trigger.
    awa.enqueue(Echo(n=0), unique=awa.Unique(by_args=False))  # holds the Echo kind's key
    before = [awa.enqueue(Act(action="ok")) for _ in range(2)]
    clash = awa.enqueue(Act(action="ok", tag="unique-clash"))
    after = [awa.enqueue(Act(action="ok")) for _ in range(2)]
    claimed = claim("default", 10, "default")
    results = [run_attempt(Attempt(job=j, alias="default")) for j in claimed]
    finalize(results, "default")
    for job in [*before, *after]:
        assert Job.objects.get(id=job.id).state == JobState.COMPLETED
        assert notes(job.id) == ["completed-1", "completed-2"]
    row = Job.objects.get(id=clash.id)
    assert row.state == JobState.RETRYABLE
    assert "UniqueConflict" in row.errors[-1]["error"]
    # Only the fallback's own follow-up: the refused outcome inserted nothing.
    assert [note.partition(":")[0] for note in notes(clash.id)] == ["retried"]


@db
def test_pending_followups_of_a_deleted_job_are_dropped_once_they_fail_again(caplog):
    """A follow-up that hangs on its trigger (``after=[job]``) cannot be inserted once the
    job is deleted. Its refusal escaped replay: each maintenance interval logged it and
    stopped there, the row never counted a try, and the rows due after it never ran."""

    def after_trigger(args, job, reason):
        return awa.EnqueueRequest(Echo(n=job.id, note="after-trigger"), after=[job.id])

    spec = FollowupSpec(outcome=Outcome.RESCUED, trigger=Act, function=after_trigger)
    followup_registry.add(spec)
    try:
        FAIL["rescued_times"] = 2
        old = timezone.now() - dt.timedelta(minutes=5)
        gone, kept = (
            make_job(state=JobState.RUNNING, attempt=1, heartbeat_at=old, attempted_at=old)
            for _ in range(2)
        )
        maintenance = Maintenance()
        maintenance.rescue()  # act_rescued fails for both: kept
        pending = PendingFollowup.objects.get(job_id=gone.id)
        Job.objects.filter(id=gone.id).delete()  # an operator discards one job
        PendingFollowup.objects.update(next_attempt_at=old)  # both due
        maintenance.run_once()
    finally:
        followup_registry._remove(spec)
    assert not PendingFollowup.objects.exists()
    assert followups_of(gone.id) == []
    assert sorted(notes(kept.id)) == ["after-trigger", "rescued:stale_heartbeat"]
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert f"pending follow-ups {pending.id} (rescued of job {gone.id} kind=act) dropped" in line
    assert f"job {gone.id} no longer exists (deleted)" in line
    assert f"after names job id {gone.id}, which does not exist" in line


@db
def test_pending_followups_of_a_deleted_job_are_still_inserted_when_they_can_be():
    FAIL["rescued_times"] = 1
    old = timezone.now() - dt.timedelta(minutes=5)
    job = make_job(state=JobState.RUNNING, attempt=1, heartbeat_at=old, attempted_at=old)
    maintenance = Maintenance()
    maintenance.rescue()
    Job.objects.filter(id=job.id).delete()
    PendingFollowup.objects.update(next_attempt_at=old)
    assert maintenance.replay_pending() == 1  # owed by an outcome that committed
    assert notes(job.id) == ["rescued:stale_heartbeat"]
    assert not PendingFollowup.objects.exists()


@db
def test_rescue_followups_fail_twice_then_are_inserted_exactly_once():
    FAIL["rescued_times"] = 2
    old = timezone.now() - dt.timedelta(minutes=5)
    job = make_job(state=JobState.RUNNING, attempt=1, heartbeat_at=old, attempted_at=old)
    maintenance = Maintenance()
    maintenance.rescue()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE  # the rescue stands
    assert "rescued: stale heartbeat" in row.errors[-1]["error"]
    (pending,) = PendingFollowup.objects.filter(job_id=job.id)
    assert pending.attempts == 1 and pending.next_attempt_at > timezone.now()
    assert maintenance.replay_pending() == 0  # not due yet: backoff
    PendingFollowup.objects.update(next_attempt_at=timezone.now())
    assert maintenance.replay_pending() == 0  # fails the second time
    assert PendingFollowup.objects.get().attempts == 2
    PendingFollowup.objects.update(next_attempt_at=timezone.now())
    assert maintenance.replay_pending() == 1
    assert maintenance.replay_pending() == 0
    assert not PendingFollowup.objects.exists()
    assert notes(job.id) == ["rescued:stale_heartbeat"]
    assert CALLS["rescued"] == 3


@db
def test_rescue_reasons_reach_the_followup():
    past = timezone.now() - dt.timedelta(seconds=1)
    overdue = make_job(
        state=JobState.RUNNING, attempt=1, heartbeat_at=timezone.now(), deadline_at=past
    )
    Maintenance().rescue()
    assert notes(overdue.id) == ["rescued:deadline_exceeded"]


@db
def test_rescue_on_the_last_attempt_fails_the_job():
    old = timezone.now() - dt.timedelta(minutes=5)
    job = make_job(state=JobState.RUNNING, attempt=3, max_attempts=3, heartbeat_at=old)
    Maintenance().rescue()
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.FAILED and row.finalized_at is not None


@pytest.mark.django_db(transaction=True)
def test_atomic_handler_commits_its_writes_completion_and_followups_together():
    job = awa.enqueue(Pay(reference="A-1"))
    (claimed,) = claim("default", 1, "default")
    from django_awa.execute import resolve_handler
    from django_awa.finalize import run_atomic_attempt

    spec, args = resolve_handler(claimed)
    run_atomic_attempt(Attempt(job=claimed, alias="default"), spec, args)
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED
    assert Order.objects.filter(reference="A-1", paid=True).count() == 1
    assert notes(job.id) == ["receipt:A-1"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("reference,fail", [("B-1", True), ("bad-followup-1", False)])
def test_atomic_handler_writes_roll_back_when_it_or_its_followup_fails(reference, fail):
    from django_awa.execute import resolve_handler
    from django_awa.finalize import run_atomic_attempt

    job = awa.enqueue(Pay(reference=reference, fail=fail))
    (claimed,) = claim("default", 1, "default")
    spec, args = resolve_handler(claimed)
    written = run_atomic_attempt(Attempt(job=claimed, alias="default"), spec, args)
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE
    # What it returns is what was written (the worker counts it), not the
    # completion whose follow-up was refused.
    assert written is not None and written.state == JobState.RETRYABLE
    assert not Order.objects.filter(reference=reference).exists()
    assert not Ledger.objects.filter(job_id=job.id).exists()
    assert notes(job.id) == []


@pytest.mark.django_db(transaction=True)
def test_atomic_handler_that_raised_and_whose_retry_followup_failed_keeps_nothing_of_it():
    # Three transactions: the handler's (rolled back), its retry's (rolled back:
    # the follow-up raised), and the fallback's, whose own follow-up (the same
    # one) is kept for maintenance to retry.
    from django_awa.execute import resolve_handler
    from django_awa.finalize import run_atomic_attempt

    job = awa.enqueue(Pay(reference="bad-retry-1", fail=True))
    (claimed,) = claim("default", 1, "default")
    spec, args = resolve_handler(claimed)
    written = run_atomic_attempt(Attempt(job=claimed, alias="default"), spec, args)
    assert written is not None and written.state == JobState.RETRYABLE
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE and row.attempt == 1
    assert "retry follow-up exploded" in row.errors[-1]["error"]
    # The handler's own error stays on record beside its follow-up's.
    assert "the attempt's own error: RuntimeError: card declined" in row.errors[-1]["error"]
    assert "Then its follow-up failed" in row.errors[-1]["traceback"]
    assert len(row.errors) == 1
    assert not Order.objects.filter(reference="bad-retry-1").exists()
    assert not Ledger.objects.filter(job_id=job.id).exists()
    (kept,) = PendingFollowup.objects.filter(job_id=job.id)
    assert kept.outcome == "retried" and "retry follow-up exploded" in kept.last_error


@pytest.mark.django_db(transaction=True)
def test_atomic_handler_writes_in_its_transaction_itself_not_a_subtransaction():
    # A savepoint around the handler would give its writes a subtransaction's id
    # (a second XID a job, pg_subtrans lookups for every reader of its rows).
    from django_awa.execute import resolve_handler
    from django_awa.finalize import run_atomic_attempt

    job = awa.enqueue(Stamp(n=1))
    (claimed,) = claim("default", 1, "default")
    spec, args = resolve_handler(claimed)
    run_atomic_attempt(Attempt(job=claimed, alias="default"), spec, args)
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED
    with connection.cursor() as cursor:
        cursor.execute("SELECT note, xmin::text FROM testapp_ledger WHERE job_id = %s", [job.id])
        ((note, xmin),) = cursor.fetchall()
    top_level = int(note.removeprefix("xid:")) % 2**32  # xid8 to the row's 32-bit xid
    assert int(xmin) == top_level


@pytest.mark.django_db(transaction=True)
def test_atomic_handler_of_a_stale_attempt_rolls_its_writes_back():
    from django_awa.execute import resolve_handler
    from django_awa.finalize import run_atomic_attempt

    job = awa.enqueue(Pay(reference="C-1"))
    (claimed,) = claim("default", 1, "default")
    Job.objects.filter(id=job.id).update(run_lease=claimed.run_lease + 1)  # lost the lease
    spec, args = resolve_handler(claimed)
    assert run_atomic_attempt(Attempt(job=claimed, alias="default"), spec, args) is None
    assert not Order.objects.filter(reference="C-1").exists()


@pytest.mark.django_db(transaction=True)
def test_a_signal_is_sent_for_a_kind_without_follow_ups():
    # No follow-up asks for the written rows: the receiver does (finalize._wants_rows).
    received = []

    def receiver(sender, job, **kwargs):
        received.append((job.id, job.state))

    signals.job_completed.connect(receiver)
    try:
        job = awa.enqueue(Echo(n=1))
        (claimed,) = claim("echo", 1, "default")
        finalize([completed(claimed)], "default")
        assert received == [(job.id, JobState.COMPLETED)]
    finally:
        signals.job_completed.disconnect(receiver)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["SystemExit", "CancelledError"])
def test_a_receiver_raising_a_base_exception_is_logged_and_the_worker_goes_on(start_worker, name):
    """A signal receiver is the user's code: whatever it raises is logged, never
    raised. One that let SystemExit out ended the completer's thread after the
    outcome committed, and every job the worker ran next stayed running for good."""
    worker = start_worker(
        "--queue", "default=2", "--queue", "echo=1", env={"AWA_TEST_RAISING_RECEIVER": name}
    )
    jobs = [awa.enqueue(Act(action="ok")) for _ in range(3)]
    for job in jobs:
        wait_for_state(job.id, JobState.COMPLETED, timeout=10)
        assert notes(job.id) == ["completed-1", "completed-2"]
    later = awa.enqueue(Act(action="ok"))  # enqueued after the receiver raised
    wait_for_state(later.id, JobState.COMPLETED, timeout=10)
    wait_for(lambda: "raising_receiver" in worker.output(), timeout=5)
    assert worker.proc.poll() is None


@pytest.mark.django_db(transaction=True)
def test_signals_are_sent_after_commit_only():
    received = []

    def receiver(sender, job, **kwargs):
        received.append((job.id, job.state, connection.in_atomic_block))

    signals.job_completed.connect(receiver)
    try:
        job = awa.enqueue(Act(action="ok"))
        with transaction.atomic():
            (claimed,) = claim("default", 1, "default")
            finalize([completed(claimed)], "default")
            assert received == []
        assert received == [(job.id, JobState.COMPLETED, False)]
    finally:
        signals.job_completed.disconnect(receiver)


@db
def test_checks_report_followups_for_non_jobargs_and_misfit_signatures():
    @dataclass
    class NotArgs:
        x: int = 0

    def wrong_arity(args):
        return None

    bad_class = FollowupSpec(outcome=Outcome.COMPLETED, trigger=NotArgs, function=wrong_arity)
    followup_registry.add(bad_class)
    try:
        errors = checks.run_checks()
    finally:
        _unregister(wrong_arity)
    ids = {e.id: e for e in errors if e.id and e.id.startswith("awa.")}
    assert "awa.E201" in ids and "awa.E202" in ids
    assert "test_followups" in ids["awa.E201"].msg and "wrong_arity" in ids["awa.E202"].msg
    assert "args, job" in ids["awa.E202"].msg


def test_one_function_declared_for_two_kinds_follows_both_and_a_redeclaration_replaces():
    def audit(args, job):
        return None

    try:
        on_completed(Act)(on_completed(Echo)(audit))  # stacked decorators
        assert [s.function for s in followup_registry.get(Outcome.COMPLETED, "act")][-1:] == [audit]
        assert [s.function for s in followup_registry.get(Outcome.COMPLETED, "echo")] == [audit]
        # followups.py imported again (autoreload): the same declarations, not twice.
        on_completed(Act)(on_completed(Echo)(audit))
        assert sum(s.function is audit for s in followup_registry.all) == 2
    finally:
        _unregister(audit)


def _unregister(function) -> None:
    for spec in list(followup_registry.all):
        if spec.function is function:
            followup_registry._remove(spec)


# -- with real worker processes ------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sigkill_between_handler_return_and_commit_runs_again_with_one_set_of_followups(
    start_worker, tmp_path
):
    marker = tmp_path / "in-commit"
    job = awa.enqueue(Act(action="ok", tag=f"slow-followup:{marker}"))
    victim = start_worker("--queue", "default")
    # The follow-up function runs inside the finalize transaction and stalls there.
    wait_for(marker.exists, timeout=15)
    victim.signal(signal.SIGKILL)
    victim.wait()
    assert Job.objects.get(id=job.id).state == JobState.RUNNING  # nothing committed
    assert followups_of(job.id) == []
    start_worker("--queue", "default")
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=30)
    assert done.attempt == 2
    assert Ledger.objects.filter(job_id=job.id).count() == 2  # the handler ran twice
    # One set of follow-ups per committed outcome: the rescue's, then the completion's.
    assert notes(job.id) == ["rescued:stale_heartbeat", "completed-1", "completed-2"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_every_committed_outcome_has_exactly_its_followups_over_5000_jobs(start_worker):
    rng = random.Random(20261130)
    items = []
    for _ in range(5000):
        roll = rng.random()
        if roll < 0.05:
            items.append(Act(action="raise"))  # retried twice, then exhausted
        elif roll < 0.25:
            items.append(Act(action="ok", fail_until=rng.choice([1, 2])))
        else:
            items.append(Act(action="ok"))
    ids = awa.enqueue_many(items)
    start_worker("--queue", "default=10")
    start_worker("--queue", "default=10")
    wait_for(
        lambda: Job.objects.filter(id__in=ids, state__in=["completed", "failed"]).count() == 5000,
        timeout=120,
        message=lambda: str(Job.objects.filter(id__in=ids).values("state").annotate(n=Count("id"))),
    )
    with connection.cursor() as cursor:
        # Per trigger: the outcomes its rows committed (errors, final state) against
        # the follow-up rows that name it, counted in SQL; and each handler side
        # effect once per attempt (the Ledger).
        mismatches = audit.outcome_mismatches(cursor, ids)
        duplicates = audit.ledger_duplicates(cursor, ids)
        by_state = audit.by_state(cursor, ids)
    assert mismatches == []
    assert duplicates == []
    assert by_state["failed"] > 100 and by_state["completed"] > 4000


@pytest.mark.django_db(transaction=True)
def test_a_connection_lost_while_follow_ups_are_inserted_is_no_follow_up_failure(
    start_worker, caplog
):
    # The follow-up function has the server end the finalizing connection; the
    # follow-ups' INSERT then fails. The connection, not the follow-ups, failed.
    caplog.set_level(logging.INFO, logger="django_awa")
    job = awa.enqueue(Act(action="ok", tag="drop-connection"))
    (row,) = claim("default", 1, "default")
    with pytest.raises(DatabaseError, match="terminating connection"):
        finalize([run_attempt(Attempt(job=row, alias="default"))], "default")
    connection.close()
    assert "follow-up" not in caplog.text, caplog.text
    assert Job.objects.get(id=job.id).errors == []  # still running: written again, or rescued

    # An atomic handler's transaction is lost whole: its attempt is recorded as not
    # finalized, as when the connection drops at its commit, while a follow-up that
    # raises still reads as one.
    dropped = awa.enqueue(Pay(reference="drop-connection"))
    broken = awa.enqueue(Pay(reference="bad-followup"))
    worker = start_worker("--queue", "default=1")
    entry = wait_for(lambda: Job.objects.get(id=dropped.id).errors, timeout=15)[0]
    assert entry["error"].startswith("could not be finalized: OperationalError: terminating"), entry
    assert "follow-up" not in entry["error"]
    entry = wait_for(lambda: Job.objects.get(id=broken.id).errors, timeout=15)[0]
    assert "receipt follow-up exploded" in entry["error"], entry
    wait_for(lambda: "could not be finalized" in worker.output())
    assert f"follow-up failed for job {dropped.id}" not in worker.output(), worker.output()


@pytest.mark.django_db(transaction=True)
def test_without_a_tracing_sdk_no_job_records_an_empty_trace_link(start_worker):
    # The OpenTelemetry API is installed, no SDK configured: every span is a no-op
    # one, with no trace to link to.
    pytest.importorskip("opentelemetry")
    awa.enqueue(Act(action="ok"))
    flow = awa.Workflow("untraced")
    first = flow.add(Act(tag="none"))
    flow.add(Act(tag="none"), after=[first])
    steps = flow.enqueue()
    start_worker("--queue", "default")
    wait_for_state(steps[1].id, JobState.COMPLETED)
    followups = wait_for(lambda: list(Job.objects.filter(kind="echo")), timeout=15)
    for job in [*followups, Job.objects.get(id=steps[1].id)]:
        assert "links" not in job.metadata.get("awa_trace", {}), job.metadata
