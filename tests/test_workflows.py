"""Results, dependencies and workflows (SPEC §11), in-process on the real database.

Jobs are claimed, run and finalized here through the worker's own functions
(claim, run_attempt, finalize); tests/test_workflow_workers.py runs them in
real worker processes.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

import django_awa as awa
from django_awa import bulk
from django_awa.execute import Attempt, AttemptResult, completed, run_attempt, unstarted
from django_awa.finalize import finalize
from django_awa.followups import FollowupSpec, Outcome, followup_registry
from django_awa.maintenance import Maintenance
from django_awa.models import Dependency, Job, JobState
from django_awa.producer import claim
from tests.testapp.jobs import Act, Node
from tests.testapp.models import Ledger

db = pytest.mark.django_db


def run_next(queue: str = "flow") -> list[AttemptResult]:
    """Claim one job of ``queue`` and run and finalize it in this process."""
    claimed = claim(queue, 1, "default")
    if not claimed:
        return []
    return finalize([run_attempt(Attempt(job=claimed[0], alias="default"))], "default")


def run_all(queue: str = "flow", limit: int = 500) -> list[int]:
    """Run jobs of ``queue`` one at a time until none is runnable; the ids in run order."""
    ran = []
    for _ in range(limit):
        done = run_next(queue)
        if not done:
            return ran
        ran.append(done[0].job.id)
    raise AssertionError(f"more than {limit} jobs ran")


def state(job: Job | int) -> str:
    return Job.objects.get(id=job if isinstance(job, int) else job.id).state


def runs(job: Job) -> int:
    return Ledger.objects.filter(job_id=job.id).count()


def make_due(job: Job) -> None:
    """A retryable job, made available now (in a test's transaction now() is its start)."""
    Job.objects.filter(id=job.id, state=JobState.RETRYABLE).update(
        state=JobState.AVAILABLE, run_at=timezone.now() - dt.timedelta(seconds=1)
    )


# -- results -------------------------------------------------------------------


@db
def test_a_return_value_is_stored_as_the_result_with_text_postgres_cannot_hold_escaped():
    job = awa.enqueue(Act(action="result", tag="order-7"))
    seen: dict[str, Any] = {}

    def capture(args: Act, trigger: Job) -> None:
        seen["result"] = trigger.result

    spec = FollowupSpec(outcome=Outcome.COMPLETED, trigger=Act, function=capture)
    followup_registry.add(spec)
    try:
        run_next("default")
    finally:
        followup_registry._remove(spec)
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.COMPLETED
    assert row.result == {"order": "order-7", "total": 1999, "text": "nul \\x00 kept"}
    # on_completed follow-ups see it as job.result, in the completing transaction.
    assert seen["result"] == row.result


@db
def test_a_result_that_is_not_json_fails_the_attempt_naming_its_type():
    job = awa.enqueue(Act(action="bad_return"))
    run_next("default")
    row = Job.objects.get(id=job.id)
    assert row.state == JobState.RETRYABLE and row.result is None
    assert "handler returned a dict" in row.errors[-1]["error"]
    assert "Job.result" in row.errors[-1]["error"]


# -- graphs --------------------------------------------------------------------


@db
def test_a_diamond_runs_each_step_once_after_its_dependencies_with_their_results():
    flow = awa.Workflow("diamond")
    top = flow.add(Node(name="top"))
    left = flow.add(Node(name="left"), after=[top])
    right = flow.add(Node(name="right"), after=[top])
    bottom = flow.add(Node(name="bottom"), after=[left, right], name="bottom")
    jobs = flow.enqueue()
    assert [j.id for j in jobs] == [s.job.id for s in (top, left, right, bottom)]
    assert [j.state for j in jobs] == ["available", "blocked", "blocked", "blocked"]
    assert {j.workflow_id for j in jobs} == {flow.id}
    order = run_all()
    assert order[0] == jobs[0].id and order[-1] == jobs[3].id and len(order) == 4
    last = Job.objects.get(id=jobs[3].id)
    # job.dependencies() gives the rows in `after` order, each with its result.
    assert last.result == {
        "name": "bottom",
        "after": [{"name": "left", "after": [{"name": "top", "after": []}]},
                  {"name": "right", "after": [{"name": "top", "after": []}]}],
    }  # fmt: skip
    assert [d.id for d in last.dependencies()] == [jobs[1].id, jobs[2].id]
    assert last.metadata["awa_workflow"] == {
        "id": str(flow.id),
        "name": "diamond",
        "step": "bottom",
    }
    assert all(runs(j) == 1 for j in jobs)
    status = awa.workflow_status(flow.id)
    assert status.finished and status.state == "completed" and status.name == "diamond"
    assert (
        status.counts["completed"] == 4
        and [j.id for j in status.jobs] == order[:1] + sorted(order[1:3]) + order[3:]
    )


@db
def test_a_chain_of_fifty_runs_in_order():
    flow = awa.Workflow("chain")
    step = flow.add(Node(name="0"))
    for i in range(1, 50):
        step = flow.add(Node(name=str(i)), after=[step])
    jobs = flow.enqueue()
    assert sum(j.state == JobState.BLOCKED for j in jobs) == 49
    assert run_all() == [j.id for j in jobs]


@db
def test_a_fan_out_releases_every_dependent_in_the_one_transaction():
    flow = awa.Workflow()
    root = flow.add(Node(name="root"))
    for i in range(200):
        flow.add(Node(name=f"leaf{i}"), after=[root])
    jobs = flow.enqueue()
    run_next()
    assert Job.objects.filter(id__in=[j.id for j in jobs[1:]], state="available").count() == 200


@db
def test_a_batch_completing_every_dependency_of_a_job_releases_it_and_no_job_with_one_left():
    """A worker's batch of completed outcomes releases the jobs all of whose
    dependencies it completed in one statement; a job with a dependency still
    running (or not yet claimed) stays blocked, whatever the batch held."""
    from django_awa.execute import completed

    flow = awa.Workflow()
    a, b, c, d = (flow.add(Node(name=n)) for n in "abcd")
    both = flow.add(Node(name="both"), after=[a, b])
    three = flow.add(Node(name="three"), after=[a, b, c])
    pending = flow.add(Node(name="pending"), after=[d, a])
    finished = flow.add(Node(name="finished"), after=[a, b], requires="finished")
    jobs = flow.enqueue()
    claimed = {job.id: job for job in claim("flow", 3, "default")}
    assert set(claimed) == {a.job.id, b.job.id, c.job.id}
    finalize([completed(claimed[a.job.id]), completed(claimed[b.job.id])], "default")
    assert [state(s.job.id) for s in (both, three, pending, finished)] == [
        "available", "blocked", "blocked", "available",
    ]  # fmt: skip
    finalize([completed(claimed[c.job.id])], "default")
    assert state(three.job.id) == JobState.AVAILABLE
    assert state(pending.job.id) == JobState.BLOCKED
    run_all()
    # a, b and c were finalized above without running their handler.
    assert all(runs(j) == 1 for j in jobs[3:]) and state(finished.job.id) == JobState.COMPLETED


@db
def test_a_step_with_a_future_run_at_is_scheduled_when_released():
    later = timezone.now() + dt.timedelta(hours=1)
    flow = awa.Workflow()
    first = flow.add(Node(name="first"))
    flow.add(awa.EnqueueRequest(Node(name="later"), run_at=later), after=[first])
    jobs = flow.enqueue()
    run_next()
    assert state(jobs[1]) == JobState.SCHEDULED


# -- outcomes that cancel, and requires="finished" -------------------------------


@db
def test_a_failed_dependency_cancels_its_dependents_transitively_with_their_followups():
    flow = awa.Workflow()
    bad = flow.add(Node(name="bad", action="terminal"))
    child = flow.add(Node(name="child"), after=[bad])
    grandchild = flow.add(Node(name="grandchild"), after=[child])
    report = flow.add(Node(name="report"), after=[grandchild], requires="finished")
    jobs = flow.enqueue()
    run_next()  # bad fails for good: child and grandchild are cancelled with it
    rows = {j.id: Job.objects.get(id=j.id) for j in jobs}
    c, g = rows[jobs[1].id], rows[jobs[2].id]
    assert (c.state, g.state) == ("cancelled", "cancelled")
    assert c.errors[-1]["error"] == f"cancelled: dependency {jobs[0].id} (node) failed"
    assert g.errors[-1]["error"] == f"cancelled: dependency {jobs[1].id} (node) cancelled"
    assert c.finalized_at is not None
    # Each cancelled dependent's own on_cancelled follow-ups, in that transaction.
    notes = sorted(e.args["note"] for e in Job.objects.filter(kind="echo"))
    assert notes == [
        f"node-cancelled:child:dependency {jobs[0].id} (node) failed",
        f"node-cancelled:grandchild:dependency {jobs[1].id} (node) cancelled",
    ]
    # requires="finished": the report runs once its dependency is finished at all.
    assert rows[jobs[3].id].state == JobState.AVAILABLE
    assert run_all() == [jobs[3].id]
    assert runs(child.job) == 0 and runs(grandchild.job) == 0 and runs(report.job) == 1
    assert awa.workflow_status(flow.id).state == "failed"


@db
def test_a_dependency_failing_after_its_retries_cancels_only_then():
    flow = awa.Workflow()
    flaky = flow.add(awa.EnqueueRequest(Node(name="flaky", action="raise"), max_attempts=2))
    after = flow.add(Node(name="after"), after=[flaky])
    jobs = flow.enqueue()
    run_next()
    assert state(jobs[0]) == JobState.RETRYABLE and state(jobs[1]) == JobState.BLOCKED
    make_due(jobs[0])
    run_next()
    assert state(jobs[0]) == JobState.FAILED and state(jobs[1]) == JobState.CANCELLED
    assert runs(after.job) == 0


@db
def test_handler_cancel_and_awa_cancel_cascade_and_finished_dependents_run():
    flow = awa.Workflow()
    selfcancel = flow.add(Node(name="self", action="cancel"))
    waiting = flow.add(Node(name="waiting"))
    a = flow.add(Node(name="a"), after=[selfcancel])
    b = flow.add(Node(name="b"), after=[waiting])
    batch = flow.add(Node(name="batch"), after=[selfcancel, waiting], requires="finished")
    jobs = flow.enqueue()
    run_next()  # "self" returns awa.Cancel
    assert state(a.job) == JobState.CANCELLED and state(batch.job) == JobState.BLOCKED
    awa.cancel(jobs[1].id, "operator")  # an available job, cancelled by an operator
    assert state(b.job) == JobState.CANCELLED
    assert Job.objects.get(id=b.job.id).errors[-1]["error"] == (
        f"cancelled: dependency {jobs[1].id} (node) cancelled"
    )
    assert state(batch.job) == JobState.AVAILABLE
    # Cancelling a blocked job itself cascades to its own dependents.
    flow2 = awa.Workflow()
    first = flow2.add(Node(name="first"))
    middle = flow2.add(Node(name="middle"), after=[first])
    last = flow2.add(Node(name="last"), after=[middle])
    flow2.enqueue()
    awa.cancel(middle.job.id)
    assert state(last.job) == JobState.CANCELLED and state(first.job) == JobState.AVAILABLE


@db
def test_retrying_a_failed_dependency_reopens_the_dependents_its_failure_cancelled():
    flow = awa.Workflow()
    bad = flow.add(Node(name="bad", action="terminal"))
    child = flow.add(Node(name="child"), after=[bad])
    grandchild = flow.add(Node(name="grandchild"), after=[child])
    flow.enqueue()
    run_next()
    assert state(grandchild.job) == JobState.CANCELLED
    # The handler now succeeds (its args say so), and the operator retries it.
    Job.objects.filter(id=bad.job.id).update(args={"name": "bad", "action": "ok"})
    awa.retry(bad.job.id)
    assert state(child.job) == JobState.BLOCKED and state(grandchild.job) == JobState.BLOCKED
    assert run_all() == [bad.job.id, child.job.id, grandchild.job.id]
    # Retrying a cascade-cancelled job whose dependency is still failed cancels it again.
    flow2 = awa.Workflow()
    bad2 = flow2.add(Node(name="bad2", action="terminal"))
    child2 = flow2.add(Node(name="child2"), after=[bad2])
    flow2.enqueue()
    run_next()
    assert awa.retry(child2.job.id).state == JobState.CANCELLED


def _failed_with_a_finished_dependent() -> tuple[Job, Job]:
    """A job failed for good, and its requires="finished" dependent, released by it."""
    bad = awa.enqueue(Node(name="bad", action="terminal"))
    report = awa.enqueue(Node(name="report"), after=[bad], requires="finished")
    run_next()
    return bad, report


@db
def test_reopening_a_dependency_blocks_again_its_finished_dependents_that_have_not_run():
    # awa.cancel(a) cancels b, which releases c (requires="finished"); awa.retry(a)
    # reopens b: c, not started, waits for it again, and d (on c) stays blocked.
    flow = awa.Workflow()
    a = flow.add(Node(name="a"))
    b = flow.add(Node(name="b"), after=[a])
    c = flow.add(Node(name="c"), after=[b], requires="finished")
    d = flow.add(Node(name="d"), after=[c], requires="finished")
    flow.enqueue()
    awa.cancel(a.job.id)
    assert state(b.job) == JobState.CANCELLED and state(c.job) == JobState.AVAILABLE
    awa.retry(a.job.id)
    assert [state(s.job) for s in (a, b, c, d)] == ["available", "blocked", "blocked", "blocked"]
    assert run_all() == [a.job.id, b.job.id, c.job.id, d.job.id]
    # A finished dependency retried itself: its dependent not yet started waits again.
    bad, report = _failed_with_a_finished_dependent()
    assert state(report) == JobState.AVAILABLE
    Job.objects.filter(id=bad.id).update(args={"name": "bad", "action": "ok"})
    awa.retry(bad.id)
    assert state(report) == JobState.BLOCKED
    assert run_all() == [bad.id, report.id] and runs(report) == 1
    # A retried job cancelled again at once (its dependency still failed) is
    # finished again: its dependent stays released.
    failed = awa.enqueue(Node(name="failed", action="terminal"))
    middle = awa.enqueue(Node(name="middle"), after=[failed])
    last = awa.enqueue(Node(name="last"), after=[middle], requires="finished")
    run_next()
    assert state(middle) == JobState.CANCELLED and state(last) == JobState.AVAILABLE
    assert awa.retry(middle.id).state == JobState.CANCELLED
    assert state(last) == JobState.AVAILABLE
    assert run_all() == [last.id]
    # One claimed but given back before its handler began has not run either.
    bad, report = _failed_with_a_finished_dependent()
    (claimed,) = claim("flow", 1, "default")
    finalize([unstarted(claimed)], "default")
    assert Job.objects.filter(id=report.id, state="available", attempt=1).exists()
    awa.retry(bad.id)
    assert state(report) == JobState.BLOCKED


@db
def test_reopening_a_dependency_leaves_finished_dependents_that_ran_or_run():
    flow = awa.Workflow()
    a = flow.add(Node(name="a"))
    b = flow.add(Node(name="b"), after=[a])
    running = flow.add(Node(name="running"), after=[b], requires="finished")
    ran = flow.add(Node(name="ran"), after=[b], requires="finished")
    after_ran = flow.add(Node(name="after_ran"), after=[ran], requires="finished")
    flow.enqueue()
    awa.cancel(a.job.id)
    (claimed,) = claim("flow", 1, "default")
    assert claimed.id == running.job.id
    assert run_next()[0].job.id == ran.job.id
    assert state(after_ran.job) == JobState.AVAILABLE
    awa.retry(a.job.id)
    assert state(b.job) == JobState.BLOCKED
    # As the README says: those that already ran (or run) stay as they are;
    # after_ran's own dependency (ran) is finished, so it stays available too.
    assert state(ran.job) == JobState.COMPLETED and state(running.job) == JobState.RUNNING
    assert state(after_ran.job) == JobState.AVAILABLE
    finalize([run_attempt(Attempt(job=claimed, alias="default"))], "default")
    assert run_all() == [a.job.id, b.job.id, after_ran.job.id]


@db
def test_a_bulk_retry_blocks_again_the_finished_dependents_of_what_it_reopens():
    flow = awa.Workflow()
    a = flow.add(Node(name="a"))
    b = flow.add(Node(name="b"), after=[a])
    c = flow.add(Node(name="c"), after=[b], requires="finished")
    flow.enqueue()
    awa.cancel(a.job.id)
    assert state(c.job) == JobState.AVAILABLE
    jobs = Job.objects.filter(id=a.job.id)
    result = bulk.run(
        jobs, bulk.Operation.RETRY, up_to=bulk.preview(jobs, bulk.Operation.RETRY).up_to
    )
    assert result.changed == 1 and result.dependents == 1
    assert state(b.job) == JobState.BLOCKED and state(c.job) == JobState.BLOCKED
    assert run_all() == [a.job.id, b.job.id, c.job.id]


@db
def test_an_atomic_dependency_releases_its_dependent_in_its_own_transaction():
    from tests.testapp.jobs import AtomicNode

    first = awa.enqueue(AtomicNode(name="one"))
    second = awa.enqueue(Node(name="two"), after=[first])
    assert second.state == JobState.BLOCKED
    run_next()
    assert Job.objects.get(id=first.id).result == {"atomic": "one"}
    assert state(second) == JobState.AVAILABLE


@db
def test_a_job_that_gained_a_dependent_while_it_ran_settles_it_when_it_completes():
    # Claimed without dependents, its completion goes to the one statement that is its
    # own transaction, which leaves out a job with dependents: written again, in the
    # transaction that releases its dependent (finalize._again_with_dependents).
    from tests.testapp.jobs import Echo

    first = awa.enqueue(Echo(n=1))
    (claimed,) = claim("echo", 1, "default")
    assert not claimed.has_dependents
    second = awa.enqueue(Echo(n=2), after=[first])
    assert second.state == JobState.BLOCKED

    assert [r.job.id for r in finalize([completed(claimed)], "default")] == [first.id]
    assert state(first) == JobState.COMPLETED
    assert state(second) == JobState.AVAILABLE


# -- dependencies on jobs already enqueued or finished ----------------------------


@db
def test_dependencies_on_existing_jobs_count_at_once_when_finished_even_archived():
    done = awa.enqueue(Node(name="done"))
    run_next()
    # Maintenance moves the finished row into awa_job_done.
    Maintenance("default").archive()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM ONLY awa_job_done WHERE id = %s", [done.id])
        assert cursor.fetchone()[0] == 1
    ready = awa.enqueue(Node(name="ready"), after=[done])
    assert ready.state == JobState.AVAILABLE
    failed = awa.enqueue(Node(name="bad", action="terminal"))
    run_all()
    assert state(ready) == JobState.COMPLETED and state(failed) == JobState.FAILED
    doomed = awa.enqueue(Node(name="doomed"), after=[failed.id])
    assert doomed.state == JobState.CANCELLED
    assert doomed.errors[-1]["error"] == f"cancelled: dependency {failed.id} (node) failed"
    running = awa.enqueue(Node(name="later"))
    waits = awa.enqueue_many([awa.EnqueueRequest(Node(name="w"), after=[running])])
    assert state(waits[0]) == JobState.BLOCKED
    assert Job.objects.get(id=running.id).has_dependents
    run_all()
    assert state(waits[0]) == JobState.COMPLETED


@db
def test_a_followup_given_after_joins_the_workflow_of_its_trigger():
    flow = awa.Workflow("spawner")
    spawn = flow.add(Node(name="spawn"))
    flow.enqueue()
    run_next()
    (child,) = Job.objects.filter(kind="node", args__name="spawn-child")
    assert child.workflow_id == flow.id and child.state == JobState.AVAILABLE
    assert child.trigger_id == spawn.job.id
    assert [d.id for d in child.dependencies()] == [spawn.job.id]
    assert len(awa.workflow_status(flow.id).jobs) == 2


@db
def test_a_callback_resolution_releases_and_cancels_dependents():
    parked = awa.enqueue(Node(name="parked", action="park"))
    after = awa.enqueue(Node(name="after"), after=[parked])
    run_next()
    row = Job.objects.get(id=parked.id)
    assert row.state == JobState.WAITING_EXTERNAL and state(after) == JobState.BLOCKED
    awa.complete_external(row.callback_id, {"ok": True})
    assert state(after) == JobState.AVAILABLE
    parked2 = awa.enqueue(Node(name="parked2", action="park"))
    after2 = awa.enqueue(Node(name="after2"), after=[parked2])
    run_all()
    awa.fail_external(Job.objects.get(id=parked2.id).callback_id, "declined")
    assert state(after2) == JobState.CANCELLED


@db
def test_a_rescue_that_exhausts_a_dependency_cancels_its_dependents():
    stale = timezone.now() - dt.timedelta(hours=1)
    last = awa.enqueue(awa.EnqueueRequest(Node(name="last"), max_attempts=1))
    more = awa.enqueue(Node(name="more"))
    waits_last = awa.enqueue(Node(name="w1"), after=[last])
    waits_more = awa.enqueue(Node(name="w2"), after=[more])
    Job.objects.filter(id__in=[last.id, more.id]).update(
        state=JobState.RUNNING, attempt=1, heartbeat_at=stale, attempted_at=stale
    )
    Maintenance("default").rescue()
    assert state(last) == JobState.FAILED and state(waits_last) == JobState.CANCELLED
    # Rescued to retryable is no outcome: its dependent still waits.
    assert state(more) == JobState.RETRYABLE and state(waits_more) == JobState.BLOCKED


# -- bad input: nothing written ------------------------------------------------------


def _counts() -> tuple[int, int]:
    return Job.objects.count(), Dependency.objects.count()


@db
def test_cycles_and_bad_references_are_refused_naming_them_with_nothing_written():
    existing = awa.enqueue(Node(name="existing"))
    before = _counts()
    flagged = Job.objects.get(id=existing.id).has_dependents

    cyclic = awa.Workflow("loop")
    cyclic.add(Node(name="a"), after=["c"], name="a")
    cyclic.add(Node(name="b"), after=["a"], name="b")
    cyclic.add(Node(name="c"), after=["b", existing], name="c")
    with pytest.raises(awa.ValidationError, match=r"has a cycle: .*'a'.* -> .*'b'.* -> .*'c'"):
        cyclic.enqueue()

    other = awa.Workflow("other")
    foreign = other.add(Node(name="foreign"))
    mine = awa.Workflow("mine")
    mine.add(Node(name="x"), after=[foreign])
    with pytest.raises(awa.ValidationError, match="a step of another workflow"):
        mine.enqueue()

    unknown = awa.Workflow()
    unknown.add(Node(name="x"), after=[existing.id, 987654321])
    with pytest.raises(awa.ValidationError, match="job id 987654321, which does not exist"):
        unknown.enqueue()
    with pytest.raises(awa.ValidationError, match="job id 987654321"):
        awa.enqueue(Node(name="y"), after=[987654321])

    named = awa.Workflow()
    named.add(Node(name="x"), after=["nope"])
    with pytest.raises(awa.ValidationError, match="a step 'nope', which is not in this workflow"):
        named.enqueue()

    elsewhere = Job(id=existing.id, kind="node")
    elsewhere._state.db = "replica"
    with pytest.raises(awa.ValidationError, match="database 'replica'"):
        awa.enqueue(Node(name="z"), after=[elsewhere])
    remote = awa.Workflow()
    remote.add(Node(name="z"), after=[elsewhere])
    with pytest.raises(awa.ValidationError, match="database 'replica'"):
        remote.enqueue()

    with pytest.raises(awa.ValidationError, match="requires must be one of"):
        awa.enqueue(Node(name="z"), after=[existing], requires="done")
    bad_requires = awa.Workflow()
    bad_requires.add(Node(name="z"), after=[existing], requires="eventually")
    with pytest.raises(awa.ValidationError, match="'eventually'"):
        bad_requires.enqueue()
    with pytest.raises(awa.ValidationError, match="after takes Job rows or job ids"):
        awa.enqueue(Node(name="z"), after=[1.5])

    assert _counts() == before
    assert Job.objects.get(id=existing.id).has_dependents == flagged


@db
def test_a_step_given_to_enqueue_is_refused_saying_to_give_its_job():
    # The error said after takes "(or a Workflow's steps)", of the step it refused.
    flow = awa.Workflow("done")
    step = flow.add(Node(name="step"))
    flow.enqueue()
    before = _counts()
    with pytest.raises(
        awa.ValidationError, match=r"after names <Step 0 .*Workflow.add\(after=.*\(step\.job,"
    ):
        awa.enqueue(Node(name="next"), after=[step])
    with pytest.raises(awa.ValidationError, match=r"enqueue_many item 0: .*\(step\.job,"):
        awa.enqueue_many([awa.EnqueueRequest(Node(name="next"), after=[step])])
    assert _counts() == before
    assert awa.enqueue(Node(name="next"), after=[step.job]).state == JobState.BLOCKED


@db
def test_a_unique_clash_in_a_workflow_writes_none_of_it():
    unique = awa.Unique(by_args=True)
    holder = awa.enqueue(Node(name="held"), unique=unique)
    before = _counts()
    flow = awa.Workflow()
    first = flow.add(Node(name="fresh"))
    flow.add(awa.EnqueueRequest(Node(name="held"), unique=unique), after=[first])
    with pytest.raises(awa.UniqueConflict, match=f"held by job {holder.id}; nothing of") as clash:
        flow.enqueue()
    assert clash.value.conflicting_id == holder.id
    assert _counts() == before
    # One job given after=: the same, naming the holder.
    with pytest.raises(awa.UniqueConflict) as clash:
        awa.enqueue(Node(name="held"), unique=unique, after=[holder])
    assert clash.value.conflicting_id == holder.id


@db
def test_two_steps_with_one_unique_key_are_refused_naming_the_step_not_a_rolled_back_job():
    # The second step's key was held by the first, inserted by the same
    # statement: the error named that step's id as the holding job, a job that
    # no longer existed once the clash rolled the workflow back.
    unique = awa.Unique(by_args=True)
    flow = awa.Workflow("twins")
    first = flow.add(awa.EnqueueRequest(Node(name="twin"), unique=unique))
    flow.add(awa.EnqueueRequest(Node(name="twin"), unique=unique), after=[first])
    with pytest.raises(
        awa.UniqueConflict,
        match=r"Step 1 .*same unique key as <Step 0 'node' of <Workflow twins .*enqueued with it; "
        r"nothing of <Workflow twins",
    ) as clash:
        flow.enqueue()
    assert clash.value.conflicting_id is None
    other = awa.Workflow("other")
    other.add(awa.EnqueueRequest(Node(name="twin"), unique=unique))
    again = awa.Workflow("twins")
    again.add(awa.EnqueueRequest(Node(name="twin"), unique=unique))
    with pytest.raises(awa.UniqueConflict, match=r"as <Step 0 'node' of <Workflow other "):
        awa.Workflow.enqueue_many([other, again])
    assert _counts() == (0, 0)


@db
def test_a_dependent_whose_unique_states_leave_out_blocked_holds_its_key_while_it_waits():
    # states= copied from SPEC §3's list, without "blocked": the dependent would
    # take its key only when its dependency's outcome released it, and a clash
    # there failed that outcome. It holds the key while it waits instead, so the
    # clash shows when it is enqueued.
    unique = awa.Unique(states=("scheduled", "available", "running", "retryable", "completed"))
    later = timezone.now() + dt.timedelta(hours=1)
    held = awa.enqueue(Node(name="mail"), unique=unique, run_at=later)
    first = awa.enqueue(Node(name="charge"))
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(Node(name="mail"), unique=unique, after=[first])
    Job.objects.filter(id=held.id).delete()
    waiting = awa.enqueue(Node(name="mail"), unique=unique, after=[first])
    assert waiting.state == JobState.BLOCKED and "blocked" in waiting.unique_states
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(Node(name="mail"), unique=unique, run_at=later)
    assert run_all() == [first.id, waiting.id]
    assert state(first) == JobState.COMPLETED


@db
def test_a_retry_refused_for_a_dependents_unique_key_says_so():
    unique = awa.Unique(by_args=True)
    bad = awa.enqueue(Node(name="bad", action="terminal"))
    child = awa.enqueue(Node(name="child"), unique=unique, after=[bad])
    run_next()
    assert state(child) == JobState.CANCELLED
    # Cancelled, the child no longer holds its key: another job takes it.
    awa.enqueue(Node(name="child"), unique=unique)
    with pytest.raises(awa.UniqueConflict, match=r"a job that waits for it.*has a unique key"):
        awa.retry(bad.id)
    assert state(bad) == JobState.FAILED


@db
def test_a_step_waiting_for_a_later_step_of_its_own_sequence_is_refused():
    def member(name: str) -> awa.EnqueueRequest:
        return awa.EnqueueRequest(Node(name=name), sequence="account-1")

    flow = awa.Workflow("deadlocked")
    flow.add(member("first"), after=["middle"])
    flow.add(Node(name="middle"), name="middle", after=["second"])
    flow.add(member("second"), name="second")
    with pytest.raises(awa.ValidationError, match="comes after it in sequence 'account-1'"):
        flow.enqueue()
    assert not Job.objects.exists()
    # The other way round is the sequence's own order: both run.
    flow = awa.Workflow("in order")
    first = flow.add(member("first"))
    flow.add(member("second"), after=[first])
    flow.enqueue()
    assert len(run_all()) == 2


@db
def test_an_after_id_no_job_can_have_is_refused_as_unknown():
    with pytest.raises(awa.ValidationError, match=f"after names job id {2**63}, which does not"):
        awa.enqueue(Node(name="x"), after=[2**63])
    assert not Job.objects.exists()


@db
def test_an_unknown_after_id_names_the_item_or_step_that_gave_it():
    # enqueue_many promises to name a bad item's index; a step's error names it.
    existing = awa.enqueue(Node(name="existing"))
    with pytest.raises(
        awa.ValidationError, match=r"^enqueue_many item 1: after names job id 987654321, which"
    ):
        awa.enqueue_many(
            [
                awa.EnqueueRequest(Node(name="a"), after=[existing]),
                awa.EnqueueRequest(Node(name="b"), after=[987654321]),
            ]
        )
    flow = awa.Workflow("named")
    flow.add(Node(name="a"))
    flow.add(Node(name="b"), after=[existing, 987654321])
    with pytest.raises(
        awa.ValidationError,
        match=r"^<Workflow named \(2 steps\)>: <Step 1 'node' .*>: after names job id 987654321",
    ):
        flow.enqueue()
    assert Job.objects.count() == 1


def _next_job_id() -> int:
    """The id the next job drawn will get (nothing else draws ids in these tests)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(pg_sequence_last_value("
            "pg_get_serial_sequence('awa_job', 'id')::regclass), 0) + 1"
        )
        return cursor.fetchone()[0]


@db
def test_an_after_id_equal_to_an_id_drawn_for_the_new_jobs_is_refused_as_unknown():
    # An id that names no job (of another database, a model's pk given by
    # mistake) may equal the id the enqueue draws for a new job: it was taken
    # for that job, a self-edge the database refused with an IntegrityError,
    # or, in a workflow, an edge to a sibling no one named: a cycle, every step
    # blocked for ever.
    existing = awa.enqueue(Node(name="existing"))
    before = _counts()
    flagged = Job.objects.get(id=existing.id).has_dependents
    flow = awa.Workflow("looped by an id")
    first = flow.add(Node(name="first"), after=[existing, _next_job_id() + 1])
    flow.add(Node(name="second"), after=[first])
    with pytest.raises(
        awa.ValidationError,
        match=rf"'node' of .*after names job id {_next_job_id() + 1}, which does not exist",
    ):
        flow.enqueue()
    with pytest.raises(awa.ValidationError, match=f"job id {_next_job_id()}, which does not"):
        awa.enqueue(Node(name="alone"), after=[existing, _next_job_id()])
    with pytest.raises(awa.ValidationError, match=f"job id {_next_job_id() + 1}, which does"):
        awa.enqueue_many(
            [awa.EnqueueRequest(Node(name=f"m{i}"), after=[_next_job_id() + 1]) for i in range(2)]
        )
    assert _counts() == before
    assert Job.objects.get(id=existing.id).has_dependents == flagged


def _order_flow(n: int, *, before: Job | None = None) -> awa.Workflow:
    """A diamond: ``charge``, then ``pack`` and ``invoice``, then ``ship`` (after
    ``before`` too, when given)."""
    flow = awa.Workflow(f"order {n}")
    charge = flow.add(Node(name=f"charge{n}"))
    pack = flow.add(Node(name=f"pack{n}"), after=[charge])
    invoice = flow.add(Node(name=f"invoice{n}"), after=[charge])
    flow.add(Node(name=f"ship{n}"), after=[pack, invoice, *([before] if before else [])])
    return flow


@db
def test_enqueue_many_writes_each_workflow_as_enqueue_does_and_runs_them():
    existing = awa.enqueue(Node(name="existing"))
    flows = [_order_flow(0), _order_flow(1, before=existing), awa.Workflow("single")]
    flows[2].add(Node(name="alone"), requires="finished")
    rows = awa.Workflow.enqueue_many(iter(flows))
    # Each workflow's rows in add() order, in the order the workflows came.
    assert [[j.args["name"] for j in jobs] for jobs in rows] == [
        ["charge0", "pack0", "invoice0", "ship0"],
        ["charge1", "pack1", "invoice1", "ship1"],
        ["alone"],
    ]
    for flow, jobs in zip(flows, rows, strict=True):
        assert flow.jobs == jobs and [s.job for s in flow.steps] == jobs
        assert {j.workflow_id for j in jobs} == {flow.id}
        assert all(j.metadata["awa_workflow"]["name"] == flow.name for j in jobs)
    assert [j.state for j in rows[0]] == ["available", "blocked", "blocked", "blocked"]
    assert [j.state for j in rows[2]] == ["available"]
    ship1 = rows[1][3]
    assert [d.id for d in ship1.dependencies()] == [rows[1][1].id, rows[1][2].id, existing.id]
    assert Job.objects.get(id=existing.id).has_dependents

    order = run_all()
    assert len(order) == 10 and all(runs(j) == 1 for jobs in rows for j in jobs)
    position = {job_id: n for n, job_id in enumerate(order)}
    for jobs in rows[:2]:
        charge, pack, invoice, ship = (position[j.id] for j in jobs)
        assert charge < pack < ship and charge < invoice < ship
    assert position[existing.id] < position[ship1.id]
    assert all(awa.workflow_status(flow.id).state == "completed" for flow in flows)
    assert awa.Workflow.enqueue_many([]) == []


@db
def test_enqueue_many_costs_the_same_statements_for_two_workflows_as_for_fifty():
    from django.test.utils import CaptureQueriesContext

    def statements(n: int) -> int:
        flows = [_order_flow(i) for i in range(n)]
        with CaptureQueriesContext(connection) as queries:
            awa.Workflow.enqueue_many(flows)
        assert Job.objects.filter(workflow_id__in=[f.id for f in flows]).count() == 4 * n
        return len(queries)

    few, many = statements(2), statements(50)
    assert few == many, (few, many)
    assert many <= 20, many


@db
def test_enqueue_many_refuses_bad_input_with_nothing_written():
    unique = awa.Unique(by_args=True)
    awa.enqueue(Node(name="held"), unique=unique)
    done = awa.Workflow("done")
    done.add(Node(name="done"))
    done.enqueue()
    before = _counts()

    good = _order_flow(0)
    cyclic = awa.Workflow("loop")
    cyclic.add(Node(name="a"), after=["b"], name="a")
    cyclic.add(Node(name="b"), after=["a"], name="b")
    empty = awa.Workflow("empty")
    clash = awa.Workflow("clash")
    clash.add(Node(name="fresh"))
    clash.add(awa.EnqueueRequest(Node(name="held"), unique=unique))
    unknown = awa.Workflow("unknown")
    unknown.add(Node(name="x"), after=[987654321])
    cases: list[tuple[Any, type[Exception], str]] = [
        ([good, cyclic], awa.ValidationError, r"<Workflow loop .*has a cycle"),
        ([good, empty], awa.ValidationError, "has no steps"),
        ([good, done], awa.ValidationError, "is already enqueued"),
        ([good, good], awa.ValidationError, "is given twice; nothing was enqueued"),
        ([good, "order 1"], awa.ValidationError, "takes Workflow objects, got str"),
        (good, awa.ValidationError, "takes a list of workflows"),
        ("flows", awa.ValidationError, "takes a list of workflows"),
        ([good, unknown], awa.ValidationError, "job id 987654321, which does not exist"),
        (
            [good, clash],
            awa.UniqueConflict,
            r"<Step 1 'node' of <Workflow clash.* nor of the 1 other workflow was",
        ),
    ]
    for flows, error, message in cases:
        with pytest.raises(error, match=message):
            awa.Workflow.enqueue_many(flows)
        # Nothing written, and the caller's transaction is still usable.
        assert _counts() == before, message
        assert good.jobs is None
    # The good workflow, refused with the others, is enqueued later as it is.
    assert [j.args["name"] for j in awa.Workflow.enqueue_many([good])[0]] == [
        "charge0", "pack0", "invoice0", "ship0",
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_aenqueue_many_joins_the_transaction_of_its_caller():
    from asgiref.sync import async_to_sync

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        rows = async_to_sync(awa.Workflow.aenqueue_many)([_order_flow(0), _order_flow(1)])
        assert [len(jobs) for jobs in rows] == [4, 4]
        raise Boom
    assert _counts() == (0, 0)
    with transaction.atomic():
        kept = async_to_sync(awa.Workflow.aenqueue_many)([_order_flow(2)])
    assert Job.objects.filter(id__in=[j.id for j in kept[0]]).count() == 4


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_workflow_leaves_no_job_and_no_edge():
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        flow = awa.Workflow("rolled back")
        a = flow.add(Node(name="a"))
        flow.add(Node(name="b"), after=[a])
        flow.enqueue()
        raise Boom
    assert _counts() == (0, 0)
    assert awa.workflow_status(flow.id).jobs == []


@db
def test_workflow_status_counts_and_a_bad_id():
    flow = awa.Workflow("counted")
    a = flow.add(Node(name="a"))
    flow.add(Node(name="b"), after=[a])
    flow.enqueue()
    status = awa.workflow_status(str(flow.id))
    assert status.counts["available"] == 1 and status.counts["blocked"] == 1
    assert not status.finished and status.state == "running"
    unknown = awa.workflow_status(uuid.uuid4())
    # Not "running": a loop waiting for it to finish would wait for ever.
    assert unknown.jobs == [] and unknown.state == "unknown" and not unknown.finished
    with pytest.raises(awa.ValidationError, match="not a workflow id"):
        awa.workflow_status("nope")


@pytest.mark.django_db(transaction=True)
def test_aenqueue_joins_the_transaction_of_its_caller():
    from asgiref.sync import async_to_sync

    class Boom(Exception):
        pass

    flow = awa.Workflow("async")
    a = flow.add(Node(name="a"))
    flow.add(Node(name="b"), after=[a])
    with pytest.raises(Boom), transaction.atomic():
        jobs = async_to_sync(flow.aenqueue)()
        assert [j.state for j in jobs] == ["available", "blocked"]
        raise Boom
    assert _counts() == (0, 0)
    kept = awa.Workflow("async kept")
    kept.add(Node(name="a"))
    with transaction.atomic():
        async_to_sync(kept.aenqueue)()
    assert len(awa.workflow_status(kept.id).jobs) == 1


@pytest.mark.django_db(transaction=True)
def test_aenqueue_takes_dependencies_as_enqueue_does():
    from asgiref.sync import async_to_sync

    first = awa.enqueue(Node(name="first"))
    then = async_to_sync(awa.aenqueue)(Node(name="then"), after=[first], requires="finished")
    assert then.state == JobState.BLOCKED
    assert list(
        Dependency.objects.filter(job_id=then.id).values_list("depends_on_id", "requires")
    ) == [(first.id, "finished")]
    assert run_all() == [first.id, then.id]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_last_two_members_finishing_at_once_promote_their_callback_exactly_once():
    """Two threads (two connections, two transactions under READ COMMITTED) write
    the outcomes of a fan-in's last two members at the same instant, 40 times."""
    import threading

    from django.db import connections

    from django_awa.execute import completed

    callbacks = []
    pairs = []
    for i in range(40):
        flow = awa.Workflow(f"pair{i}")
        a, b = flow.add(Node(name="a")), flow.add(Node(name="b"))
        flow.add(Node(name="callback"), after=[a, b])
        jobs = flow.enqueue()
        callbacks.append(jobs[2].id)
    claimed = {job.id: job for job in claim("flow", 80, "default")}
    for i in range(40):
        members = sorted(
            j.id
            for j in claimed.values()
            if j.workflow_id == Job.objects.get(id=callbacks[i]).workflow_id
        )
        pairs.append([claimed[m] for m in members])
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def finish(side: int) -> None:
        try:
            for pair in pairs:
                barrier.wait(timeout=10)
                finalize([completed(pair[side])], "default")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=finish, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    states = list(Job.objects.filter(id__in=callbacks).values_list("state", flat=True))
    assert states == ["available"] * 40


@db
def test_pruning_a_finished_job_removes_its_own_dependency_edges():
    first = awa.enqueue(Node(name="first"))
    second = awa.enqueue(Node(name="second"), after=[first])
    run_all()
    assert Dependency.objects.filter(job_id=second.id).count() == 1
    long_ago = timezone.now() - dt.timedelta(days=3650)
    Job.objects.filter(id__in=[first.id, second.id]).update(finalized_at=long_ago)
    assert Maintenance("default").prune() == 2
    assert Dependency.objects.count() == 0


# -- deleting a dependency ---------------------------------------------------------


@db
def test_deleting_an_unfinished_dependency_cancels_its_completed_dependents_in_that_transaction():
    flow = awa.Workflow()
    doomed = flow.add(Node(name="doomed"))
    other = flow.add(Node(name="other"))
    child = flow.add(Node(name="child"), after=[doomed])
    grandchild = flow.add(Node(name="grandchild"), after=[child])
    batch = flow.add(Node(name="batch"), after=[doomed, other], requires="finished")
    jobs = flow.enqueue()
    deleted, _ = Job.objects.filter(id=doomed.job.id).delete()
    assert deleted == 1
    # requires="completed": cancelled (and its dependents with it), with the
    # on_cancelled follow-ups; requires="finished": the deletion counts as finished.
    c, g = Job.objects.get(id=child.job.id), Job.objects.get(id=grandchild.job.id)
    assert (c.state, g.state) == (JobState.CANCELLED, JobState.CANCELLED)
    assert c.errors[-1]["error"] == f"cancelled: dependency {jobs[0].id} deleted"
    assert g.errors[-1]["error"] == f"cancelled: dependency {jobs[2].id} (node) cancelled"
    notes = sorted(e.args["note"] for e in Job.objects.filter(kind="echo"))
    assert notes == [
        f"node-cancelled:child:dependency {jobs[0].id} deleted",
        f"node-cancelled:grandchild:dependency {jobs[2].id} (node) cancelled",
    ]
    assert state(batch.job) == JobState.BLOCKED  # it waits for "other" still
    assert run_all() == [other.job.id, batch.job.id]
    assert awa.workflow_status(flow.id).finished


@db
def test_deleted_jobs_take_their_own_dependency_edges_with_them():
    # Pruning removed a job's own edges, deleting it (ORM, the admin's discard)
    # did not: discarding a cancelled workflow left its edges for ever.
    first = awa.enqueue(Node(name="first"))
    waiting = awa.enqueue(Node(name="waiting"), after=[first])
    flow = _order_flow(1)
    flow.enqueue()
    Job.objects.filter(id=waiting.id).delete()
    assert not Dependency.objects.filter(job_id=waiting.id).exists()
    jobs = Job.objects.filter(workflow_id=flow.id)
    preview = bulk.preview(jobs, bulk.Operation.DISCARD)
    result = bulk.run(jobs, bulk.Operation.DISCARD, up_to=preview.up_to)
    assert result.changed == 4
    assert not Dependency.objects.exists()
    assert run_all() == [first.id]


@db
def test_a_job_deleted_alone_settles_its_dependents_too():
    first = awa.enqueue(Node(name="first"))
    report = awa.enqueue(Node(name="report"), after=[first], requires="finished")
    Job.objects.get(id=first.id).delete()
    assert state(report) == JobState.AVAILABLE


@db
def test_a_deleted_or_pruned_completed_dependency_stays_met():
    done = awa.enqueue(Node(name="done"))
    pruned = awa.enqueue(Node(name="pruned"))
    run_all()
    slow = awa.enqueue(Node(name="slow"))
    after = awa.enqueue(Node(name="after"), after=[done, pruned, slow])
    Job.objects.filter(id=done.id).delete()
    Job.objects.filter(id=pruned.id).update(finalized_at=timezone.now() - dt.timedelta(days=3650))
    assert Maintenance("default").prune() == 1
    assert state(after) == JobState.BLOCKED
    assert [d.id for d in Job.objects.get(id=after.id).dependencies()] == [slow.id]
    assert run_all() == [slow.id, after.id]


@db
def test_a_retried_dependent_of_a_pruned_or_deleted_completed_dependency_runs_again():
    # A completed dependency pruned after COMPLETED_RETENTION (a day), or
    # deleted, took with it only the edges of dependents that were blocked:
    # retrying a failed dependent (kept a week), or the dependency that had
    # cancelled one, made it wait for its dependencies again, and the one gone
    # counted as deleted before it finished: cancelled at once, never run.
    charge = awa.enqueue(Node(name="charge"))
    stock = awa.enqueue(Node(name="stock"))
    ship = awa.enqueue(Node(name="ship", action="terminal"), after=[charge])
    pack = awa.enqueue(Node(name="pack"), after=[charge, stock])
    awa.cancel(stock.id)
    assert state(pack) == JobState.CANCELLED
    receipt = awa.enqueue(Node(name="receipt"))
    mail = awa.enqueue(Node(name="mail", action="terminal"), after=[receipt])
    assert run_all() == [charge.id, ship.id, receipt.id, mail.id]
    assert (state(ship), state(mail)) == (JobState.FAILED, JobState.FAILED)
    long_ago = timezone.now() - dt.timedelta(days=2)
    Job.objects.filter(id=charge.id).update(finalized_at=long_ago)
    assert Maintenance("default").prune() == 1
    Job.objects.filter(id=receipt.id).delete()

    assert awa.retry(ship.id).state == JobState.AVAILABLE
    assert awa.retry(mail.id).state == JobState.AVAILABLE
    awa.retry(stock.id)
    assert state(pack) == JobState.BLOCKED  # waits for stock again, not for charge
    assert sorted(run_all()) == sorted([ship.id, mail.id, stock.id, pack.id])
    assert (runs(ship), runs(mail), state(pack)) == (2, 2, JobState.COMPLETED)


@db
def test_a_dependency_deleted_by_raw_sql_is_settled_by_maintenance():
    gone = awa.enqueue(Node(name="gone"))
    waiting = awa.enqueue(Node(name="waiting"), after=[gone])
    finished = awa.enqueue(Node(name="finished"), after=[gone], requires="finished")
    other = awa.enqueue(Node(name="other"))
    both = awa.enqueue(Node(name="both"), after=[gone, other])
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM awa_job WHERE id = %s", [gone.id])
    # Left waiting for a row that will never finish...
    assert {state(waiting), state(finished), state(both)} == {JobState.BLOCKED}
    # ...which another dependency's outcome does not take for met...
    assert run_all() == [other.id]
    assert state(both) == JobState.BLOCKED
    # ...and maintenance settles them by the rule.
    assert Maintenance("default").settle_orphans() == 3
    assert (state(waiting), state(finished), state(both)) == (
        JobState.CANCELLED,
        JobState.AVAILABLE,
        JobState.CANCELLED,
    )
    assert Job.objects.get(id=both.id).errors[-1]["error"] == (
        f"cancelled: dependency {gone.id} deleted"
    )
    assert Maintenance("default").settle_orphans() == 0


@db
def test_maintenance_pages_through_blocked_jobs_past_batches_without_an_orphan(monkeypatch):
    from django_awa import maintenance

    monkeypatch.setattr(maintenance, "BATCH", 2)
    live = awa.enqueue(Node(name="live"))
    waiting = [awa.enqueue(Node(name=f"w{i}"), after=[live]) for i in range(3)]
    gone = awa.enqueue(Node(name="gone"))
    orphans = [awa.enqueue(Node(name=f"o{i}"), after=[gone]) for i in range(2)]
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM awa_job WHERE id = %s", [gone.id])
    # The first batch of two blocked jobs holds no orphan; the next ones do.
    assert Maintenance("default").settle_orphans() == 2
    assert [state(j) for j in orphans] == [JobState.CANCELLED] * 2
    assert [state(j) for j in waiting] == [JobState.BLOCKED] * 3


# -- planning ----------------------------------------------------------------------


def _setting(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting(%s)", [name])
        return cursor.fetchone()[0]


@db
def test_settling_plans_by_index_and_gives_the_callers_transaction_its_settings_back():
    dep = awa.enqueue(Node(name="dep"))
    awa.enqueue(Node(name="after"), after=[dep])
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL jit = off")  # the caller's own choice, kept
    before = (_setting("enable_seqscan"), _setting("jit"))
    assert before == ("on", "off")
    awa.cancel(dep.id)  # settles its dependent in this transaction
    assert (_setting("enable_seqscan"), _setting("jit")) == before
